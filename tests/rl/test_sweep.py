"""A dead run's sandbox roots (workspaces, and as root their tmpfs mounts) are removed when the next
Sandbox starts (rl/sandbox_sweep.py); a live owner's, and anything without our marker, are not."""

import os
import subprocess
import sys
import tempfile

import pytest

from rl import sandbox_sweep
from rl.sandbox import Sandbox
from tests.conftest import ROOT

pytestmark = pytest.mark.filterwarnings("ignore:sandbox without bubblewrap")

# A trainer mid-episode: a workspace (as root a tmpfs mounted on it, as rl.envs.repo_sandbox's
# mount_tmpfs does: importing rl.envs would cost seconds of jax), then it waits on stdin for ever;
# the test kills it with SIGKILL.
CHILD = """
import ctypes, sys, warnings
warnings.simplefilter("ignore")
from rl.sandbox import Sandbox
sb = Sandbox(1, isolation="rlimits")
ws = sb.workspace()
mounted = ctypes.CDLL(None).mount(b"tmpfs", ws.path.encode(), b"tmpfs", 6, b"size=1m") == 0
open(ws.path + "/note", "w").write("x")
print(ws.path, mounted, flush=True)
sys.stdin.read()
"""


def _mounted(path: str) -> bool:
    return bool(sandbox_sweep.mounts_under(path))


def test_a_killed_runs_workspaces_and_mounts_are_swept_a_live_ones_are_not():
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        ws, mounted = child.stdout.readline().split()
        root = os.path.dirname(ws)
        assert mounted == str(os.geteuid() == 0) and _mounted(ws) == (mounted == "True")
        Sandbox(1, isolation="rlimits").close()  # sweeps: the owner lives
        assert os.path.exists(os.path.join(ws, "note")) and _mounted(ws) == (mounted == "True")
    finally:
        child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()
    assert os.path.isdir(ws)  # left behind by the kill, mount and all
    Sandbox(1, isolation="rlimits").close()
    assert not os.path.exists(root) and not _mounted(root)


def test_only_our_markers_of_dead_owners_are_swept():
    tmp = tempfile.gettempdir()
    reused = tempfile.mkdtemp(prefix=sandbox_sweep.PREFIX, dir=tmp)  # our pid, another start
    with open(os.path.join(reused, sandbox_sweep.MARKER), "w") as f:
        f.write(f"{os.getpid()} 1 {sandbox_sweep._boot_id()}\n")
    foreign = tempfile.mkdtemp(prefix=sandbox_sweep.PREFIX, dir=tmp)  # no marker: not ours
    live = tempfile.mkdtemp(prefix=sandbox_sweep.PREFIX, dir=tmp)
    sandbox_sweep.mark(live)
    try:
        swept = sandbox_sweep.sweep(tmp)
        assert reused in swept and not os.path.exists(reused)  # a reused pid does not fool it
        assert os.path.isdir(foreign) and os.path.isdir(live) and {foreign, live}.isdisjoint(swept)
    finally:
        for d in (reused, foreign, live):
            if os.path.exists(d):
                sandbox_sweep.rmtree(d)
