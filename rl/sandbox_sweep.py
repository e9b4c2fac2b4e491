"""What a dead run's sandboxes left behind, found and removed when a new `Sandbox` starts.

A trainer killed with SIGKILL never reaches `Sandbox.close()`: its sandbox root
(`$TMPDIR/sandbox-*`) stays with every episode's workspace in it, and as root the `repo`
environment's workspaces stay mounted tmpfs (memory, not disk, until unmounted). So each root
carries an owner marker (`MARKER`: the creating pid, that process's start time from
/proc/<pid>/stat, and the boot id), and every new `Sandbox` first calls `sweep()`: each
`sandbox-*` directory of the temp dir whose marker names a process that no longer runs (a pid
alone could have been reused: the start time must match too) has its mounts detached
(umount2 MNT_DETACH, deepest first) and is deleted. A directory without our marker is never
touched, nor one whose owner lives. Two processes sweeping at once: the marker's flock decides
which one removes a root.

Processes a dead run left in the uid mode keep running until their CPU limit ends them (bubblewrap
mode: `--die-with-parent` ends them with the trainer); their workspace is removed all the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import shutil
import sys
import tempfile

MARKER = ".jax-grpo-owner"
PREFIX = "sandbox-"
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def _start_time(pid: int) -> str:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); "" when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]  # fields 3.. follow the comm's ")"
    except (OSError, IndexError):
        return ""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def mark(root: str) -> None:
    """Writes this process's owner marker into the sandbox root `root`."""
    pid, tmp = os.getpid(), os.path.join(root, MARKER + ".new")
    with open(tmp, "w") as f:
        f.write(f"{pid} {_start_time(pid)} {_boot_id()}\n")
    os.rename(tmp, os.path.join(root, MARKER))  # a sweeper never reads it half written


def _alive(owner: str) -> bool:
    try:
        pid, start, boot = owner.split()
    except ValueError:
        return False  # not a marker this module wrote
    return boot == _boot_id() and _start_time(int(pid)) == start


def mounts_under(path: str) -> list[str]:
    """Mount points at or under `path` (this mount namespace), deepest first."""
    path, found = os.path.realpath(path), []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
            if point == path or point.startswith(path + "/"):
                found.append(point)
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def unmount(path: str, detach: bool = False) -> None:
    """umount2(path): a plain unmount, else (busy, or `detach`) a lazy detach."""
    if detach or _libc.umount2(path.encode(), 0) != 0:
        _libc.umount2(path.encode(), _MNT_DETACH)


def rmtree(path: str) -> None:
    """shutil.rmtree that also removes directories a program made unwritable (non-root case)."""

    def retry(func, p, _):
        if not os.path.lexists(p):  # removed meanwhile (another sweeper)
            return
        os.chmod(os.path.dirname(p), 0o700)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, 0o700)
        func(p)

    shutil.rmtree(path, **{"onexc" if sys.version_info >= (3, 12) else "onerror": retry})


def sweep(tmp: str | None = None) -> list[str]:
    """Removes the sandbox roots under `tmp` (default: the temp dir) whose owner is dead, their
    mounts first; returns them."""
    tmp, swept = tmp or tempfile.gettempdir(), []
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(PREFIX)]
    except OSError:
        return swept
    for name in names:
        root = os.path.join(tmp, name)
        try:
            f = open(os.path.join(root, MARKER))  # noqa: SIM115 (held while the root goes)
        except OSError:  # not ours (no marker), or gone meanwhile
            continue
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # another process is sweeping it
                continue
            if _alive(f.read()) or not os.path.lexists(root):
                continue
            for point in mounts_under(root):
                unmount(point, detach=True)
            with contextlib.suppress(FileNotFoundError):
                rmtree(root)
            swept.append(root)
    return swept
