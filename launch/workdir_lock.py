"""One run per workdir: `launch.train` holds an exclusive OS lock on `<workdir>/run.lock`.

Two commands typed into one workdir (another terminal, a scheduler's retry) would otherwise both
resume from the same checkpoint and interleave their checkpoints and logs. The lock is
`fcntl.flock` on the file: the kernel releases it when the process ends, however it ends, so a
run killed with kill -9 leaves no stale lock behind, and the next command simply takes it. The
file holds the holder's pid, host and start time, which a refused run names.

In a multi-process run process 0 takes the lock and every process stops when it cannot (its
answer broadcast, as launch.pin's). `launch.eval` and `launch.export` only read a workdir and take
no lock. flock is advisory and, on NFS, emulated by the server's byte-range locks: it holds
between runs that take it, on one host or several sharing the file system.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket

from launch.cli import UsageError

LOCK_FILE = "run.lock"


class WorkdirLock:
    """Held from `acquire` to the end of the process (or `release`)."""

    def __init__(self, workdir: str):
        self.workdir, self.path = workdir, os.path.join(workdir, LOCK_FILE)
        self.fd: int | None = None
        self.made_dir = self.made_file = False
        self.made: list[str] = []
        self.dir_times = (0, 0)

    def acquire(self) -> None:
        """Takes the lock, creating the workdir if need be; a UsageError of one line naming
        the holder when another process holds it (nothing is written then)."""
        self.made_dir = not os.path.isdir(self.workdir)
        self.made = []  # the directories made here, the workdir first
        up = os.path.abspath(self.workdir)
        while not os.path.lexists(up):
            self.made.append(up)
            up = os.path.dirname(up)
        try:
            os.makedirs(self.workdir, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--workdir {self.workdir}: {e.strerror}") from None
        self.made_file = not os.path.exists(self.path)
        if self.made_file and not self.made_dir:  # (put back by release's undo)
            st = os.stat(self.workdir)
            self.dir_times = (st.st_atime_ns, st.st_mtime_ns)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(
                f"--workdir {self.workdir}: cannot write {self.path}: {e.strerror}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UsageError(
                f"{self.workdir} is in use by another run ({holder}); wait for it to end, stop "
                "it, or use another --workdir"
            ) from None
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(record) + "\n").encode())
        except OSError as e:  # a full disk: said before the run is built
            self.release(undo=True)
            raise UsageError(
                f"--workdir {self.workdir}: cannot write {self.path}: {e.strerror}"
            ) from None

    def release(self, undo: bool = False) -> None:
        """Lets the lock go; with `undo`, removes what `acquire` created (a run that stops
        before it writes anything leaves the workdir as it found it)."""
        if self.fd is None:
            return
        if undo and self.made_file:
            os.unlink(self.path)
            if not self.made_dir:
                os.utime(self.workdir, ns=self.dir_times)
        os.close(self.fd)
        self.fd = None
        for path in self.made if undo else ():  # the workdir, then the parents made for it
            try:
                os.rmdir(path)
            except OSError:  # something else was written there meanwhile: left as it is
                break


def _holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {record['pid']} on host {record['host']}, since {record['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid not yet written"
