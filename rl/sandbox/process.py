"""Runs model-written Python in a fresh, limited process: the code sandbox of rewards and tools.

    sb = Sandbox(workers=8, limits=Limits(wall_s=5.0), isolation="auto")  # auto | bwrap | rlimits
    r = sb.run("print(1 + 1)")            # RunResult: stdout, stderr, returncode, seconds,
    r.ok, r.reason                        #   timed_out, output_truncated, reason; blocking
    fut = sb.submit(code, workspace=None, stdin="")  # Future[RunResult] from the bounded pool
    with sb.workspace() as ws:            # an episode's directory: cwd and HOME of its runs,
        sb.run(code1, ws); sb.run(code2, ws)  # kept across them, deleted on close
    sb.close()

Each run is a new interpreter (`-s -S`: standard library only, workspace on PYTHONPATH, environment
rebuilt from scratch so no secret of the parent reaches it) behind a trusted bootstrap run as
`python -I -S -c _BOOT` (isolated: nothing in the workspace can shadow its imports). The bootstrap
drops to the workspace's uid when we are root, sets the rlimits (CPU, address space, file size, no
core, RLIMIT_NPROC = the tasks it sees + `processes`) and execs the program; a `preexec_fn` would do
the same but is unsafe in a threaded parent. A run ends when the program exits, at `wall_s`
("timeout") or when stdout or stderr passes `output_bytes` ("output_limit": pipes are read as they
fill and never hold more); then its process group, and every process it left, is SIGKILLed.

Root ignores RLIMIT_NPROC and may signal or write anything, so as root every workspace leases its
own uid (`rl.sandbox.workspace`) and serialises its runs; when the uid is leased and after each
run every live process of that uid is killed.

With bubblewrap (probed once per process) the program also gets new pid, net, ipc, uts and cgroup
namespaces (the parent is invisible; no network, not even loopback; --die-with-parent takes the
whole pid namespace down with the outer bwrap) and a new root holding only read-only /usr, /etc,
/lib*, the interpreter's prefix, a new /proc and /dev, and the workspace read-write. As root bwrap
runs privileged, without a user namespace: one would map the child to real root, exempt from
RLIMIT_NPROC. Otherwise it runs with --unshare-user, where RLIMIT_NPROC counts per namespace.

`isolation` fails closed: "auto" (the default) and "bwrap" both require bubblewrap and raise a
one-line RuntimeError (`refusal`: why the probe failed, the install command, the setting that
accepts the weak mode) where it does not work; only "rlimits" runs without it (the uid mode as
root, else rlimits alone), with a warning once. docs/sandbox.md says what each mode loses.

`python` and `python3` are first on every run's PATH (the sandbox's bin/, links to the interpreter
the runs use), in every mode. Each sandbox root carries an owner marker, and a new Sandbox first
removes the roots (and their tmpfs mounts) of runs that died without closing theirs
(`rl.sandbox.sweep`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref

from rl.sandbox import sweep as sandbox_sweep
from rl.sandbox.workspace import Workspace, _sweep

ISOLATIONS = ("auto", "bwrap", "rlimits")
BWRAP = "bwrap"  # looked up on PATH (a test hides it by renaming)
_OLD_BWRAP_FIELD = {None: "auto", True: "bwrap", False: "rlimits"}  # env.sandbox_bwrap's values
_BOOT = r"""
import os, resource as r, sys
uid, cpu, mem, fsize, procs = map(int, sys.argv[1:6])
if uid >= 0:
    os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
n, me = 0, '\nUid:\t%d\t' % os.getuid()
for p in os.listdir('/proc'):
    try:
        s = open('/proc/%s/status' % p).read() if p.isdigit() else ''
    except OSError:
        continue
    if me in s:
        n += int(s.split('\nThreads:\t')[1].split()[0])
for k, v in ((r.RLIMIT_CPU, cpu), (r.RLIMIT_AS, mem), (r.RLIMIT_FSIZE, fsize),
             (r.RLIMIT_NPROC, n + procs), (r.RLIMIT_CORE, 0)):
    r.setrlimit(k, (v, v + 1 if k == r.RLIMIT_CPU else v))
os.execv(sys.argv[6], [sys.argv[6], '-s', '-S', sys.argv[7]])
"""


RUNS = [0]  # programs this process started in a sandbox (rl.envs: the "sandbox_runs" counter)
_RUNS_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0  # wall-clock seconds of a run, interpreter start included
    cpu_s: int = 5  # RLIMIT_CPU seconds (SIGXCPU, then SIGKILL one second later)
    memory_bytes: int = 1 << 30  # RLIMIT_AS: address space of each process
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file the program may write
    output_bytes: int = 64 << 10  # cap on each of stdout and stderr; passing it kills the run
    processes: int = 0  # processes/threads the program may start (0: fork fails)


def boot_command(python: str, uid: int, limits: Limits, main: str) -> list[str]:
    """The trusted bootstrap's command: `python -I -S -c _BOOT` drops to `uid` (when >= 0), sets
    `limits`' rlimits and execs `python -s -S main` (what a run starts, inside bwrap if any)."""
    lim = limits
    boot = [python, "-I", "-S", "-c", _BOOT, str(uid), str(lim.cpu_s), str(lim.memory_bytes)]
    return boot + [str(lim.file_bytes), str(lim.processes), python, main]


@dataclasses.dataclass
class RunResult:
    stdout: str
    stderr: str
    returncode: int | None  # negative: killed by that signal
    seconds: float
    timed_out: bool
    output_truncated: bool
    reason: str  # what ended it: ok|error|timeout|cpu_limit|output_limit|signal (see docstring)

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


_warned: set[str] = set()
_probed: dict[bool, str] = {}  # running as root -> "" if bwrap works, else why not
_lock = threading.Lock()


def isolation_of(env) -> str:
    """config.env's isolation (a ConfigDict or dict): `isolation`, or, in a config saved before
    it existed, what its `sandbox_bwrap` meant (None: "auto", True: "bwrap", False: "rlimits")."""
    if env.get("isolation") is not None:
        return env["isolation"]
    return _OLD_BWRAP_FIELD.get(env.get("sandbox_bwrap"), "auto")


def weak_mode() -> str:
    """The mode without bubblewrap: "uid" as root, else "rlimits"."""
    return "uid" if os.geteuid() == 0 else "rlimits"


def refusal(isolation: str, why: str) -> str:
    """The one line a sandbox that needs bubblewrap gives where it does not work (`why`)."""
    return (
        f"bubblewrap does not work here ({why}), and isolation={isolation!r} refuses the only "
        f"mode left, the weak {weak_mode()!r} one (no network, pid or mount namespaces): install "
        "bubblewrap (apt-get install bubblewrap) or accept the weak mode with "
        "--config.env.isolation=rlimits (Sandbox(isolation='rlimits'); docs/sandbox.md)"
    )


def _warn_once(msg: str) -> None:
    with _lock:
        new, _ = msg not in _warned, _warned.add(msg)
    if new:
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _world_executable(path: str) -> bool:
    parts = os.path.realpath(path).split("/")
    paths = ["/".join(parts[:i]) or "/" for i in range(1, len(parts) + 1)]
    return all(os.path.exists(p) and os.stat(p).st_mode & stat.S_IXOTH for p in paths)


class Sandbox:
    """Runs code under `limits` on a pool of `workers` threads, each waiting on one process."""

    def __init__(self, workers: int = 8, limits: Limits | None = None, isolation: str = "auto"):
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation={isolation!r}: expected one of {ISOLATIONS}")
        self.limits, self.as_root, self.isolation = limits or Limits(), os.geteuid() == 0, isolation
        sandbox_sweep.sweep()  # what runs that died before closing their sandboxes left
        self._root = tempfile.mkdtemp(prefix=sandbox_sweep.PREFIX)
        os.chmod(self._root, 0o711)  # the workspaces' uids may traverse it, not list it
        sandbox_sweep.mark(self._root)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sandbox")
        self._workspaces: weakref.WeakSet[Workspace] = weakref.WeakSet()
        self._python = os.path.realpath(sys.executable)
        # mode: "bwrap" | "uid" (rlimits + a uid per workspace) | "rlimits"
        self._bwrap, self.mode = None, weak_mode()
        if isolation == "rlimits" and self.as_root:  # the workspace uids run the interpreter
            ok = [p for p in (self._python, "/usr/bin/python3") if _world_executable(p)]
            if not ok:
                self.close()
                raise RuntimeError("isolation='rlimits' as root: no python3 that any uid may run")
            self._python = os.path.realpath(ok[0])
        self.bin = os.path.join(self._root, "bin")  # `python`, `python3`: first on runs' PATH
        os.mkdir(self.bin, 0o755)
        for name in ("python", "python3"):
            os.symlink(self._python, os.path.join(self.bin, name))
        if isolation == "rlimits":
            _warn_once(
                f"sandbox without bubblewrap (isolation='rlimits'): mode {self.mode!r}, no "
                "network/pid/mount namespaces; see docs/sandbox.md"
            )
            return
        self._bwrap, self.mode = shutil.which(BWRAP), "bwrap"
        if why := self._probe():
            self.close()
            raise RuntimeError(refusal(isolation, why))

    def _probe(self) -> str:
        if not self._bwrap:
            return f"{BWRAP} is not installed: not found on PATH"
        if self.as_root not in _probed:
            r = self._probe_run("print('ok')")
            # Remembered, even a timeout: every sandbox of the process runs in the same mode.
            err = " ".join(r.stderr.split())[-300:]  # one line
            why = f"bwrap failed to start in this container: {r.reason}: {err}"
            _probed[self.as_root] = "" if r.stdout == "ok\n" else why
        return _probed[self.as_root]

    def _probe_run(self, code: str) -> RunResult:
        """Runs a start-up probe with generous limits: a slow start (a cold or loaded machine)
        must not count as a failure."""
        limits, self.limits = (
            self.limits,
            dataclasses.replace(
                self.limits, wall_s=max(self.limits.wall_s, 60.0), cpu_s=max(self.limits.cpu_s, 30)
            ),
        )
        try:
            return self.run(code)
        finally:
            self.limits = limits

    @property
    def interpreter(self) -> str:
        """The python runs start (a real path; `bin/python` links to it)."""
        return self._python

    @property
    def bwrap(self) -> str | None:
        """bubblewrap's path in mode "bwrap", else None."""
        return self._bwrap

    def workspace(self) -> Workspace:
        ws = Workspace(self._root, self.as_root)
        self._workspaces.add(ws)
        return ws

    def submit(self, code: str, workspace: Workspace | None = None, stdin: str = ""):
        """Runs `code` on the bounded pool: a Future[RunResult]."""
        return self._pool.submit(self._run, code, workspace, stdin)

    def run(self, code: str, workspace: Workspace | None = None, stdin: str = "") -> RunResult:
        """Runs `code` (in a fresh workspace deleted afterwards when None) and waits for it."""
        return self.submit(code, workspace, stdin).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for ws in list(self._workspaces):
            ws.close()
        sandbox_sweep.rmtree(self._root)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, code: str, ws: Workspace | None, stdin: str) -> RunResult:
        with _RUNS_LOCK:
            RUNS[0] += 1
        own = ws is None
        ws = ws or Workspace(self._root, self.as_root)
        try:
            with ws.lock:
                if ws.closed:
                    raise ValueError(f"workspace {ws.path} is closed")
                return self._spawn(code, ws, stdin)
        finally:
            if own:
                ws.close()

    def _command(self, ws: Workspace, main: str) -> list[str]:
        py = self._python
        boot = boot_command(py, ws.uid, self.limits, main)
        if not self._bwrap:
            return boot
        cmd = [self._bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net"]
        cmd += ["--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        cmd += [] if self.as_root else ["--unshare-user"]
        system = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")
        for d in system:
            if os.path.islink(d):
                cmd += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                cmd += ["--ro-bind", d, d]
        made, binds = (
            set(system),
            [("--bind", ws.path), ("--ro-bind", main), ("--ro-bind", self.bin)],
        )
        prefix = os.path.dirname(os.path.dirname(py))  # the interpreter's bin/.. with its stdlib
        if prefix != "/" and not any(prefix == d or prefix.startswith(d + "/") for d in system):
            binds.insert(0, ("--ro-bind", prefix))
        for flag, path in binds:
            parts = path.split("/")
            for i in range(2, len(parts)):  # bwrap would make missing parents 0700
                if (d := "/".join(parts[:i])) not in made:
                    cmd += ["--dir", d]
                    made.add(d)
            cmd += [flag, path, path]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--chdir", ws.path, "--"]
        return cmd + boot

    def _spawn(self, code: str, ws: Workspace, stdin: str) -> RunResult:
        t0, deadline = time.monotonic(), time.monotonic() + self.limits.wall_s
        fd, main = tempfile.mkstemp(suffix=".py", prefix="main-", dir=self._root)
        with os.fdopen(fd, "w") as f:
            f.write(code)
        os.chmod(main, 0o644)
        env = dict(
            PATH=f"{self.bin}:/usr/local/bin:/usr/bin:/bin",
            HOME=ws.path,
            TMPDIR=ws.path,
            LANG="C.UTF-8",
        )
        env.update(PYTHONPATH=ws.path, PYTHONHASHSEED="0", PYTHONSAFEPATH="1")
        env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
        try:
            with tempfile.TemporaryFile(dir=self._root) as stdin_file:
                stdin_file.write(stdin.encode())
                stdin_file.seek(0)
                kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ws.path, env=env)
                proc = subprocess.Popen(
                    self._command(ws, main), stdin=stdin_file, start_new_session=True, **kw
                )
            kill = lambda: self._kill(proc, ws.uid, main)
            with proc:  # closes the pipes and reaps it
                try:
                    out, err, truncated = self._collect(proc, deadline, kill)
                    if truncated:
                        kill()
                    rc = proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    rc = None
                finally:
                    kill()  # also whatever the program left behind
        finally:
            os.unlink(main)
        if self._bwrap and rc is not None and rc > 128:
            rc = -(rc - 128)  # bwrap reports a child killed by signal s as 128 + s
        timed_out = rc is None and not truncated
        if truncated or timed_out:
            reason = "output_limit" if truncated else "timeout"
        elif rc == 0:
            reason = "ok"
        else:
            reason = "cpu_limit" if rc == -signal.SIGXCPU else "signal" if rc < 0 else "error"
        text = lambda b: b.decode("utf-8", "replace")
        seconds = time.monotonic() - t0
        return RunResult(text(out), text(err), rc, seconds, timed_out, truncated, reason)

    def _collect(self, proc: subprocess.Popen, deadline: float, kill) -> tuple[bytes, bytes, bool]:
        """Reads stdout and stderr until both close, the deadline, or one passes the cap."""
        cap, bufs = self.limits.output_bytes, {}
        with selectors.DefaultSelector() as sel:
            for pipe in (proc.stdout, proc.stderr):
                os.set_blocking(pipe.fileno(), False)
                sel.register(pipe, selectors.EVENT_READ)
                bufs[pipe] = bytearray()
            while sel.get_map() and (left := deadline - time.monotonic()) > 0:
                for key, _ in sel.select(min(left, 0.1)):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buf, room = bufs[key.fileobj], cap - len(bufs[key.fileobj])
                    buf += chunk[:room]
                    if len(chunk) > room:
                        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), True
                if proc.poll() is not None:
                    kill()  # the program is done: so are its children
        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), False

    @staticmethod
    def _kill(proc: subprocess.Popen, uid: int, main: str) -> None:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        _sweep(uid, main)
