"""A dead run's sandbox roots (workspaces, and as root their tmpfs mounts) are removed when the next
Sandbox starts (rl/sandbox/sweep.py); a live owner's, and anything without our marker, are not."""

import os
import subprocess
import sys
import tempfile

import pytest

from rl.sandbox import Sandbox
from rl.sandbox import sweep as sandbox_sweep
from tests.conftest import ROOT

pytestmark = pytest.mark.filterwarnings("ignore:sandbox without bubblewrap")

# A trainer mid-episode: a workspace (as root a tmpfs mounted on it, as rl.envs.repo.sandbox's
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
        f.write(f"{os.getpid()} 1 {sandbox_sweep._boot_id()} {sandbox_sweep._pid_namespace()}\n")
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


def _dead_marker(root, text=None):
    """A marker naming our pid with another start time: an owner known to be dead."""
    text = text or f"{os.getpid()} 1 {sandbox_sweep._boot_id()} {sandbox_sweep._pid_namespace()}\n"
    with open(os.path.join(root, sandbox_sweep.MARKER), "w") as f:
        f.write(text)


def test_a_planted_symlink_or_anothers_root_is_never_touched(tmp_path, recwarn):
    """What any local user (or a program in the weak modes) can plant in a shared temp dir: a
    `sandbox-*` symlink to a directory holding a dead-owner marker (and, as root, a mount), a
    marker that is a symlink, another uid's root or marker, an unparsable marker, a marker of
    another pid namespace. None is swept, unmounted, or chmod'ed; the temp dir keeps its mode."""
    tmp, victim = tmp_path / "tmp", tmp_path / "victim"
    tmp.mkdir(mode=0o1777)
    tmp.chmod(0o1777)
    (victim / "mnt").mkdir(parents=True)
    _dead_marker(victim)
    mounted = (
        os.geteuid() == 0
        and not subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(victim / "mnt")]
        ).returncode
    )
    try:
        (tmp / "sandbox-link").symlink_to(victim)
        (tmp / "sandbox-marker-link").mkdir()
        (tmp / "sandbox-marker-link" / sandbox_sweep.MARKER).symlink_to(
            victim / sandbox_sweep.MARKER
        )
        for name, text in [("garbled", "not a marker\n"), ("old", f"{os.getpid()} 1 x\n"),
                           ("other-ns", f"{os.getpid()} 1 {sandbox_sweep._boot_id()} pid:[1]\n")]:  # fmt: skip
            (tmp / f"sandbox-{name}").mkdir()
            _dead_marker(tmp / f"sandbox-{name}", text)
        if os.geteuid() == 0:  # another uid's root, and another uid's marker in ours
            for name, path in [("theirs", "."), ("their-marker", sandbox_sweep.MARKER)]:
                (tmp / f"sandbox-{name}").mkdir()
                _dead_marker(tmp / f"sandbox-{name}")
                os.chown(tmp / f"sandbox-{name}" / path, 12345, 12345)
        before = sorted(os.listdir(tmp))
        assert sandbox_sweep.sweep(str(tmp)) == [] and sorted(os.listdir(tmp)) == before
        assert (victim / sandbox_sweep.MARKER).exists() and (tmp.stat().st_mode & 0o7777) == 0o1777
        assert _mounted(str(victim / "mnt")) == mounted
        (tmp / "sandbox-dead").mkdir()  # and a genuine dead root beside them still goes
        _dead_marker(tmp / "sandbox-dead")
        assert sandbox_sweep.sweep(str(tmp)) == [str(tmp / "sandbox-dead")]
    finally:
        if mounted:
            sandbox_sweep.unmount(str(victim / "mnt"))
    assert not recwarn.list


def test_an_owner_whose_liveness_cannot_be_read_is_kept(tmp_path, monkeypatch):
    root = tmp_path / "sandbox-x"
    root.mkdir()
    _dead_marker(root)
    monkeypatch.setattr(sandbox_sweep, "_start_time", lambda pid: None)  # /proc unreadable
    assert sandbox_sweep.sweep(str(tmp_path)) == []
    monkeypatch.undo()
    monkeypatch.setattr(sandbox_sweep, "_boot_id", lambda: "")
    assert sandbox_sweep.sweep(str(tmp_path)) == [] and root.is_dir()
    monkeypatch.undo()
    assert sandbox_sweep.sweep(str(tmp_path)) == [str(root)]


def test_a_root_the_sweep_cannot_remove_warns_once_and_sandbox_starts(tmp_path, monkeypatch):
    for name in ("sandbox-a", "sandbox-b"):
        (tmp_path / name).mkdir()
        _dead_marker(tmp_path / name)

    def refuse(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(sandbox_sweep, "rmtree", refuse)
    monkeypatch.setattr(sandbox_sweep, "_warned", False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="sandbox sweep: .*sandbox-. left in place") as w:
        assert sandbox_sweep.sweep() == []
        sb = Sandbox(1, isolation="rlimits")  # sweeps again, silently, and starts
    monkeypatch.undo()
    sb.close()
    assert len([x for x in w if "sandbox sweep" in str(x.message)]) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid mode needs root")
def test_a_leased_uid_has_no_orphan_of_a_killed_run(tmp_path, monkeypatch):
    """A run killed with SIGKILL releases its uid leases (flock) but not its programs: the next
    workspace leasing that uid kills them before it runs anything."""
    from rl.sandbox import workspace as sandbox_workspace

    tmp_path.chmod(0o711)
    first = sandbox_workspace.Workspace(str(tmp_path), as_root=True)
    first.close()
    uid = first.uid
    orphan = subprocess.Popen(["sleep", "60"], user=uid, group=uid)  # the killed run's program
    try:
        monkeypatch.setattr(sandbox_workspace.random, "randrange", lambda n: uid - 40000)
        ws = sandbox_workspace.Workspace(str(tmp_path), as_root=True)
        assert ws.uid == uid and orphan.wait(timeout=5) == -9
        ws.close()
    finally:
        orphan.kill()
        orphan.wait()


def test_rmtree_removes_what_a_program_locked_and_nothing_beside_it(tmp_path):
    """Directories a program made 0 or 0500 (what stops a non-root owner) are removed; a symlink
    is refused, and neither its target nor the parent's mode changes."""
    top = tmp_path / "top"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "f").write_text("x")
    (top / "g").write_text("x")
    for d, mode in ((top / "a" / "b", 0o500), (top / "a", 0), (top, 0o500)):
        d.chmod(mode)
    sandbox_sweep.rmtree(str(top))
    assert not top.exists()
    (tmp_path / "target").mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(tmp_path / "target")
    tmp_path.chmod(0o755)
    with pytest.raises(OSError, match="symbolic link"):
        sandbox_sweep.rmtree(str(tmp_path / "link"))
    assert (tmp_path / "target").is_dir() and (tmp_path.stat().st_mode & 0o777) == 0o755
