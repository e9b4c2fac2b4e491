"""The sandbox side of the `repo` environment: per-episode workspaces holding a repository copy,
and running the three programs in them (a shell command, a file edit, the graded test run; their
source is `rl/envs/repo/programs.py`).

Every tool call is a fresh `rl.sandbox` process in the episode's workspace, so it gets the
sandbox's limits, namespaces and clean-up (every process the call left is killed when it ends).
What differs from `code_tests`:

- `RepoSandbox` (bubblewrap mode) shows the workspace at a fixed path, `/testbed` (R2E-Gym's), so
  observations are the same on every host and process, and binds the trainer's site-packages
  read-only beside it (pytest for the tests and for the model's own `python -m pytest`).
- The workspace is its own tmpfs of `env.workspace_bytes` when we may mount (root): filling it
  fails with ENOSPC inside, and the host's disk never sees it. Otherwise its size is measured
  after each call (`disk_usage`) and the environment ends an episode over the limit.
- The file editor runs inside the sandbox too: no host-side code ever opens a path the model
  chose (a symlink in the workspace cannot point a root-owned process at the host's files).
- Each program writes `READY` before it does anything the model controls and its result last;
  a run without `READY` means the sandbox could not start (an infrastructure error), a run that
  died after it was the model's doing.
- At construction the sandbox must import pytest from `site` (`_PYTEST_PROBE`, once per process,
  mode and site): in the uid mode a venv under a private home (/root is 0700) is unreadable to
  the workspace uids, and every graded run would fail. The refusal is one RuntimeError line
  naming the directory the uid cannot read and the fixes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import tarfile
import threading

from rl.envs.repo.programs import (  # noqa: F401  (re-exported: rl.envs.repo.env runs them from here)
    BASH,
    EDITOR,
    GRADE,
    READY,
    RESULT,
)
from rl.sandbox import Limits, RunResult, Sandbox, Workspace
from rl.sandbox.sweep import unmount  # noqa: F401  (rl.envs.repo.env unmounts workspaces with it)

WORKDIR = "/testbed"  # where the repository lies as the model sees it (bubblewrap mode)
# Imports pytest as the graded run does (site first on sys.path); says which directory on the way
# to `site` the sandbox's uid cannot read when it fails.
_PYTEST_PROBE = """
import os, sys
site = %r
sys.path[:0] = [site]
try:
    import pytest
except BaseException as e:
    parts, uid = site.split("/"), os.getuid()
    bad = [d for d in ("/".join(parts[:i]) or "/" for i in range(1, len(parts) + 1))
           if not os.access(d, os.R_OK | os.X_OK)]
    print(f"uid {uid} cannot read {bad[0]}: permission denied" if bad else
          f"uid {uid}: import pytest failed: {type(e).__name__}: {e}")
    sys.exit(1)
print("ok")
"""
_pytest_probed: dict[tuple, str] = {}  # (mode, python, site) -> "" or why pytest cannot load
_probe_lock = threading.Lock()


def site_packages() -> str:
    """The directory holding the trainer's pytest (bound read-only into the sandbox)."""
    spec = importlib.util.find_spec("pytest")
    if spec is None or not spec.origin:
        raise RuntimeError("the repo environment runs tests with pytest: pip install pytest")
    return os.path.dirname(os.path.dirname(spec.origin))


def last_phase(stdout: str) -> tuple[str, float] | None:
    """The graded run's last `PHASE` line: (restore | start | collect | configure | test | run,
    the time.monotonic() at which it began)."""
    _, found, tail = stdout.rpartition("\x00PHASE ")
    try:
        name, at = tail.split("\n", 1)[0].split()
        return (name, float(at)) if found else None
    except ValueError:
        return None


def _pytest_fix(mode: str, why: str) -> str:
    """The fix of the pytest probe's failure `why` in sandbox mode `mode`: bubblewrap mounts the
    site itself (its parents need no permission), the uid mode reads it through the host's path,
    and a pytest missing from the site is missing in every mode."""
    readable = "put the virtual environment where any user can read it (python -m venv /opt/venv)"
    if "permission denied" not in why:
        return "install pytest in the trainer's environment (pip install pytest)"
    if mode == "uid":
        return f"install bubblewrap (apt-get install bubblewrap) or {readable}"
    return f"make that directory readable by any user (chmod o+rx) or {readable}"


class RepoSandbox(Sandbox):
    """A Sandbox whose bubblewrap runs see the workspace at WORKDIR and `site` read-only."""

    def __init__(self, workers: int, limits: Limits, site: str, isolation: str = "auto"):
        self.site = site  # before the probe run, which goes through _command
        super().__init__(workers, limits, isolation)
        with _probe_lock:
            key = (self.mode, self._python, site)
            if key not in _pytest_probed:
                r = self._probe_run(_PYTEST_PROBE % site)
                out = " ".join((r.stdout + r.stderr).split())[-300:]
                _pytest_probed[key] = "" if r.stdout == "ok\n" else out or r.reason
        if why := _pytest_probed[key]:
            self.close()
            raise RuntimeError(
                f"the repo environment's sandbox (mode {self.mode!r}) cannot import pytest from "
                f"{site}: {why}; {_pytest_fix(self.mode, why)}"
            )

    def root(self, ws: Workspace) -> str:
        """The workspace's path as its programs see it (an image's workdir in an image's view)."""
        if (view := getattr(ws, "view", None)) is not None:
            return view.workdir
        return WORKDIR if self._bwrap else ws.path

    def shown_root(self) -> str:
        """Where the repository lies, for the prompt (workspaces differ without bubblewrap)."""
        return WORKDIR if self._bwrap else "your working directory"

    def _command(self, ws: Workspace, main: str) -> list[str]:
        if (view := getattr(ws, "view", None)) is not None:  # an image task (repo_images.View)
            return view.command(self, main)
        cmd = super()._command(ws, main)
        if not self._bwrap:
            return cmd
        i = cmd.index("--bind")
        assert cmd[i + 1 : i + 3] == [ws.path, ws.path], cmd
        cmd[i + 2] = WORKDIR
        cmd[cmd.index("--chdir") + 1] = WORKDIR
        extra, parts = [], self.site.split("/")
        for k in range(2, len(parts)):  # parents bwrap would make 0700 (see rl.sandbox)
            if (d := "/".join(parts[:k])) not in cmd:
                extra += ["--dir", d]
        if self.site not in cmd:
            extra += ["--ro-bind", self.site, self.site]
        j = cmd.index("--proc")
        return cmd[:j] + extra + cmd[j:]

    def program(self, script: str, ws: Workspace, args: dict, extra_path: str = "") -> dict:
        """Runs one of the programs (rl.envs.repo.programs) with `args`; its result dict, with
        `_run` the RunResult and `_started` whether it got past READY (no result: it died)."""
        root = self.root(ws)
        path = ":".join(filter(None, (self.bin, extra_path, "/usr/local/bin:/usr/bin:/bin")))
        env = {
            "PATH": path,
            "HOME": root,
            "TMPDIR": root,
            "LANG": "C.UTF-8",
            "PYTHONPATH": f"{root}:{self.site}",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONHASHSEED": "0",
        }
        if (view := getattr(ws, "view", None)) is not None:
            env = view.env(env)  # the image's PATH and env; its own site-packages
        r: RunResult = self.run(script, ws, stdin=json.dumps({**args, "root": root, "env": env}))
        out = {"_run": r, "_started": r.stdout.startswith(READY)}
        _, found, tail = r.stdout.rpartition(RESULT)
        if found and out["_started"]:
            try:
                out.update(json.loads(tail))
            except ValueError:
                pass
        return out


_libc = ctypes.CDLL(None, use_errno=True)
_MS_NOSUID, _MS_NODEV = 2, 4


def mount_tmpfs(ws: Workspace, size: int) -> bool:
    """Mounts a tmpfs of `size` bytes on the (empty) workspace; False where we may not."""
    uid = ws.uid if ws.uid >= 0 else os.getuid()
    opts = f"size={size},mode=0700,uid={uid},gid={uid}".encode()
    flags = _MS_NOSUID | _MS_NODEV
    return _libc.mount(b"tmpfs", ws.path.encode(), b"tmpfs", flags, opts) == 0


def copy_repo(src: str, ws: Workspace) -> None:
    """The repository (a directory or a .tar.gz snapshot) into the empty workspace, owned by its
    uid. Runs as the trainer on trusted input: the snapshot comes from the data, not the model."""
    if os.path.isdir(src):
        shutil.copytree(src, ws.path, symlinks=True, dirs_exist_ok=True)
    elif src.endswith((".tar.gz", ".tgz")):
        with tarfile.open(src) as tar:
            tar.extractall(ws.path, filter="data")
    else:
        raise FileNotFoundError(f"repo {src!r} is neither a directory nor a .tar.gz")
    if ws.uid >= 0:
        for d, dirs, files in os.walk(ws.path):
            for name in dirs + files:
                os.lchown(os.path.join(d, name), ws.uid, ws.uid)


def disk_usage(path: str) -> int:
    """Bytes the files under `path` take (lstat: no link is followed)."""
    total = 0
    for d, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(d, name)).st_blocks * 512
            except OSError:
                pass
    return total
