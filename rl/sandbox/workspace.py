"""An episode's sandbox workspace: a directory that is the cwd and HOME of its runs and, when the
trainer is root, a uid of its own.

Root ignores RLIMIT_NPROC and may signal or write anything, so as root every workspace leases its
own uid in [40000, 60000) (a flock'ed file per uid under /tmp/sandbox-uids: no two processes on a
host share one), chowns its directory to it, and its runs drop to it (rl.sandbox's bootstrap).
`_sweep` kills every live process of a uid (found in /proc/*/status, which setsid() or a
non-dumpable process cannot hide from) right after the uid is leased (a trainer killed with
SIGKILL released its leases but not its runs' orphans: no workspace shares a uid with one), after
each run and when the workspace closes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import tempfile
import threading
import time

from rl.sandbox.sweep import rmtree

_UID_FIRST, _UID_COUNT = 40000, 20000


def _lease_uid() -> tuple[int, object]:
    """A uid no other workspace (of any process on this host) holds, and the file locked for it."""
    lock_dir = "/tmp/sandbox-uids"  # fixed, not $TMPDIR: every process on the host must agree
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    start = random.randrange(_UID_COUNT)
    for i in range(_UID_COUNT):
        uid = _UID_FIRST + (start + i) % _UID_COUNT
        f = open(path := os.path.join(lock_dir, str(uid)), "a")  # held while the lease lasts
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:  # not unlinked meanwhile
                return uid, f
        except OSError:  # held by another workspace, or unlinked by its release
            pass
        f.close()
    raise RuntimeError(f"all {_UID_COUNT} sandbox uids are in use")


def _live(uid: int, main: str) -> list[int]:
    """Live (not zombie) processes of real uid `uid` when >= 0, else whose command line has `main`."""
    pids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/status") as f:
                status = f.read()
            with open(f"/proc/{p}/cmdline") as f:
                mine = f"\nUid:\t{uid}\t" in status if uid >= 0 else f"\0{main}\0" in f.read()
        except OSError:
            continue
        if mine and "\nState:\tZ" not in status:
            pids.append(int(p))
    return pids


def _sweep(uid: int, main: str) -> None:
    for _ in range(50):
        if not (pids := _live(uid, main)):
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)


class Workspace:
    """A directory owned by one episode: the cwd and HOME of its runs, deleted by close()."""

    def __init__(self, root: str, as_root: bool):
        self.path = tempfile.mkdtemp(prefix="ws-", dir=root)
        self.uid, self._lease, self.lock, self.closed = -1, None, threading.Lock(), False
        if as_root:
            self.uid, self._lease = _lease_uid()
            _sweep(self.uid, "")  # what a killed run left running under this uid
            os.chown(self.path, self.uid, self.uid)

    def close(self) -> None:
        with self.lock:  # waits for a run in progress
            if self.closed:
                return
            self.closed = True
            if self.uid >= 0:
                _sweep(self.uid, "")
                os.unlink(self._lease.name)  # while still locked: see _lease_uid
                self._lease.close()
            rmtree(self.path)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
