"""The sandbox side of the `repo` environment: per-episode workspaces holding a repository copy,
and running the three programs in them (a shell command, a file edit, the graded test run; their
source is `rl/envs/repo_programs.py`).

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
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import tarfile

from rl.envs.repo_programs import (  # noqa: F401  (re-exported: rl.envs.repo runs them from here)
    BASH,
    EDITOR,
    GRADE,
    READY,
    RESULT,
)
from rl.sandbox import Limits, RunResult, Sandbox, Workspace

WORKDIR = "/testbed"  # where the repository lies as the model sees it (bubblewrap mode)


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


class RepoSandbox(Sandbox):
    """A Sandbox whose bubblewrap runs see the workspace at WORKDIR and `site` read-only."""

    def __init__(self, workers: int, limits: Limits, site: str, use_bwrap: bool | None = None):
        self.site = site  # before the probe run, which goes through _command
        super().__init__(workers, limits, use_bwrap)

    def root(self, ws: Workspace) -> str:
        """The workspace's path as its programs see it."""
        return WORKDIR if self._bwrap else ws.path

    def shown_root(self) -> str:
        """Where the repository lies, for the prompt (workspaces differ without bubblewrap)."""
        return WORKDIR if self._bwrap else "your working directory"

    def _command(self, ws: Workspace, main: str) -> list[str]:
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
        """Runs one of the programs (rl.envs.repo_programs) with `args`; its result dict, with
        `_run` the RunResult and `_started` whether it got past READY (no result: it died)."""
        root = self.root(ws)
        env = {"PATH": f"{extra_path}:/usr/local/bin:/usr/bin:/bin".lstrip(":"), "HOME": root,
               "TMPDIR": root, "LANG": "C.UTF-8", "PYTHONPATH": f"{root}:{self.site}",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "0"}  # fmt: skip
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
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def mount_tmpfs(ws: Workspace, size: int) -> bool:
    """Mounts a tmpfs of `size` bytes on the (empty) workspace; False where we may not."""
    uid = ws.uid if ws.uid >= 0 else os.getuid()
    opts = f"size={size},mode=0700,uid={uid},gid={uid}".encode()
    flags = _MS_NOSUID | _MS_NODEV
    return _libc.mount(b"tmpfs", ws.path.encode(), b"tmpfs", flags, opts) == 0


def unmount(path: str) -> None:
    if _libc.umount2(path.encode(), 0) != 0:
        _libc.umount2(path.encode(), _MNT_DETACH)


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
