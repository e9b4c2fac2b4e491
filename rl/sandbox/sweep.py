"""What a dead run's sandboxes left behind, found and removed when a new `Sandbox` starts.

A trainer killed with SIGKILL never reaches `Sandbox.close()`: its sandbox root
(`$TMPDIR/sandbox-*`) stays with every episode's workspace in it, and as root the `repo`
environment's workspaces stay mounted tmpfs (memory, not disk, until unmounted). So each root
carries an owner marker (`MARKER`: the creating pid, that process's start time from
/proc/<pid>/stat, the boot id and the pid namespace), and every new `Sandbox` first calls
`sweep()`: each `sandbox-*` entry of the temp dir whose owner is known to be dead has the mounts
strictly inside it detached (umount2 MNT_DETACH, deepest first) and is deleted. Two processes
sweeping at once: the marker's flock decides which one removes a root.

The temp dir is shared with every user (and, in the uid and rlimits modes, with the programs the
sandbox runs), so an entry is trusted only when it is a real directory (not a symlink) owned by
our euid holding a regular-file marker (opened O_NOFOLLOW) owned by our euid, that this module
wrote in this pid namespace (another container sharing /tmp sees other pids). Anything else is
not ours and never touched. An owner is dead only when that is established: the marker's boot is
over, or its pid runs no more / runs another process (a pid alone could have been reused: the
start time must match); where the boot id or the owner's /proc/<pid>/stat cannot be read the
root is kept. Nothing outside the root being removed is ever unmounted or chmod'ed, and a root
the sweep cannot remove is left with one warning: a sweep never fails a `Sandbox()`.

Processes a dead run left in the uid mode are killed when their uid is leased again
(rl.sandbox.workspace); bubblewrap mode: `--die-with-parent` ends them with the trainer.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import shutil
import stat
import sys
import tempfile
import warnings

MARKER = ".jax-grpo-owner"
PREFIX = "sandbox-"
_MNT_DETACH = 2
_UNKNOWN = "-"  # a marker field its writer could not read
_libc = ctypes.CDLL(None, use_errno=True)
_warned = False


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); "" when there is no such process,
    None when it cannot be told (/proc unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]  # fields 3.. follow the comm's ")"
    except (FileNotFoundError, ProcessLookupError):
        return ""
    except (OSError, IndexError):
        return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _boot_id() -> str:
    return _read("/proc/sys/kernel/random/boot_id")


def _pid_namespace() -> str:
    """This process's pid namespace ("pid:[4026531836]"); "" when it cannot be read."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def mark(root: str) -> None:
    """Writes this process's owner marker into the sandbox root `root`."""
    pid, tmp = os.getpid(), os.path.join(root, MARKER + ".new")
    fields = (_start_time(pid), _boot_id(), _pid_namespace())
    with open(tmp, "w") as f:
        f.write(" ".join([str(pid), *(x or _UNKNOWN for x in fields)]) + "\n")
    os.rename(tmp, os.path.join(root, MARKER))  # a sweeper never reads it half written


def _dead(owner: str) -> bool:
    """Whether the marker text `owner` is ours and names an owner known to be gone. Not a marker
    of this module, another pid namespace's, or one whose owner's liveness cannot be
    established (unreadable boot id or /proc): False, so the root is kept."""
    fields = owner.split()
    if len(fields) != 4 or not fields[0].isdigit() or _UNKNOWN in fields:
        return False  # not a marker this module wrote, or written where it could not tell
    pid, start, boot, namespace = fields
    here_boot, here_namespace = _boot_id(), _pid_namespace()
    if not here_boot or not here_namespace or namespace != here_namespace:
        return False  # cannot judge here, or another container's pids
    if boot != here_boot:
        return True  # written before this boot
    now = _start_time(int(pid))
    return now is not None and now != start  # gone, or the pid now runs another process


def mounts_under(path: str) -> list[str]:
    """Mount points at or under the absolute path `path`, as given (symlinks are not resolved:
    a symlink's target is not under it), in this mount namespace, deepest first."""
    path, found = os.path.abspath(path), []
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


def _chmod_dir(path: str) -> None:
    """chmod 0700 of the directory `path` itself, never of what a symlink there points to (an
    O_PATH descriptor opens even a directory we may not read; chmod through /proc/self/fd)."""
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
    finally:
        os.close(fd)


def rmtree(path: str) -> None:
    """shutil.rmtree that also removes directories a program made unreadable or unwritable
    (non-root case), making writable only directories inside `path` (and `path` itself), never
    its parent; a symlink `path` is refused (OSError)."""
    top, retried = os.path.abspath(path), set()
    inside = lambda p: p == top or p.startswith(top + "/")
    kw = {"onexc" if sys.version_info >= (3, 12) else "onerror": None}

    def retry(func, p, exc):
        if not os.path.lexists(p):  # removed meanwhile (another sweeper)
            return
        p = os.path.abspath(p)
        parent, real_dir = os.path.dirname(p), os.path.isdir(p) and not os.path.islink(p)
        if p in retried or not (inside(parent) or (p == top and real_dir)):
            raise exc if isinstance(exc, BaseException) else exc[1]
        retried.add(p)
        if inside(parent):
            _chmod_dir(parent)
        if real_dir:
            _chmod_dir(p)
            if func is not os.rmdir:  # it could not be opened or listed: its walk starts anew
                shutil.rmtree(p, **kw)
                return
        func(p)

    kw = dict.fromkeys(kw, retry)
    shutil.rmtree(path, **kw)


def _sweep_root(root: str) -> bool:
    """Removes the sandbox root `root` (an absolute path, not resolved) when it is ours and its
    owner is dead; whether it did."""
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False  # a symlink, a file, another user's
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(os.path.join(root, MARKER), flags)
    except OSError:  # no marker (not ours), a symlink, or gone meanwhile
        return False
    with open(fd, closefd=True) as f:  # held while the root goes
        m = os.fstat(fd)
        if not stat.S_ISREG(m.st_mode) or m.st_uid != os.geteuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process is sweeping it
            return False
        if not _dead(f.read(256)) or not os.path.lexists(root):
            return False
        for point in mounts_under(root):
            if point != root:  # strictly inside: the workspaces' tmpfs
                unmount(point, detach=True)
        try:
            rmtree(root)
        except FileNotFoundError:
            pass
    return True


def sweep(tmp: str | None = None) -> list[str]:
    """Removes the sandbox roots under `tmp` (default: the temp dir) whose owner is dead, their
    mounts first; returns them. Never raises: a root it cannot remove is kept, with a warning
    (once per process)."""
    global _warned
    tmp, swept = os.path.realpath(tmp or tempfile.gettempdir()), []
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(PREFIX)]
    except OSError:
        return swept
    for name in names:
        root = os.path.join(tmp, name)  # the entry itself, not what a symlink names
        try:
            if _sweep_root(root):
                swept.append(root)
        except OSError as e:
            if not _warned:
                _warned = True
                warnings.warn(f"sandbox sweep: {root} left in place ({e})", RuntimeWarning, 2)
    return swept
