"""The sandbox against a catalogue of hostile programs, plus workspaces, the pool and the weak mode.

Every catalogue program is run as a completion through `run_tests` (the `python_tests` reward's path)
and must score 0 (the noisy correct solution 1) while leaving this process, its files, its
environment and its listening socket untouched, and no process behind. The table of what stopped
each program, for a closing note:

    python -m tests.rl.test_sandbox [--no-bwrap]   (--no-bwrap: isolation="rlimits")
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import warnings

import pytest

from rl.envs.code_rewards import extract_code, run_tests
from rl.sandbox import Limits, Sandbox
from rl.sandbox.workspace import _live
from tests.conftest import sandbox_isolation

LIMITS = Limits(wall_s=2.0, cpu_s=1, processes=4)  # a few processes, to see fork bombs contained
SECRET = "hunter2-do-not-leak"
TESTS = "assert solve(3) == 9\n"

CATALOGUE = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "fork_bomb_setsid": (
        "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
        "    except OSError:\n        pass\n"
    ),
    "infinite_loop": "while True:\n    pass\n",
    "alloc_10gb": "x = bytearray(10 * (1 << 30))\n",
    "write_outside": "open({outside!r}, 'w').write('pwned')\n",
    "write_16mb_plus": "with open('big', 'wb') as f:\n    for _ in range(64):\n        f.write(b'x' * (1 << 20))\n",
    "read_secret": (
        "import os\nfound = os.environ.get('SANDBOX_TEST_SECRET', '')\n"
        "for pid in os.listdir('/proc'):\n    try:\n"
        "        found += open(f'/proc/{{pid}}/environ').read()\n    except OSError:\n        pass\n"
        "print(found)\n"
    ),
    "socket_localhost": (
        "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "s.sendall(b'pwned')\n"
    ),
    "kill_parent": (
        "import os, signal\nfor pid in (os.getppid(), {parent}, -1):\n    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(e)\n"
    ),
    "stdout_100mb": "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n",
    "deep_recursion": (
        "import sys\nsys.setrecursionlimit(1 << 30)\ndef f(n):\n    return f(n + 1)\nf(0)\n"
    ),
    "delete_parent_files": (
        "import os, shutil\nfor p in ({canary!r}, os.path.dirname(os.getcwd())):\n"
        "    for rm in (os.remove, shutil.rmtree):\n        try:\n            rm(p)\n"
        "        except OSError as e:\n            print(e)\n"
    ),
    "ignore_sigterm_sleep": (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    ),
    "exit_0_before_tests": "def solve(x):\n    return 0\nimport sys\nsys.exit(0)\n",
    "os_exit_0": "import os\ndef solve(x):\n    return 0\nos._exit(0)\n",
    "noisy_correct": (
        "import sys\ndef solve(x):\n    return x * x\nfor i in range(1000):\n    print('noise', i)\n"
        "print('debug noise', file=sys.stderr)\n"
    ),
}
# Programs that run until the sandbox kills them at wall_s (or at cpu_s): contained whenever
# they are killed, so they get a 1 s wall (the others keep LIMITS: a correct one must finish).
RUNS_TO_THE_WALL = {"fork_bomb_setsid", "infinite_loop", "deep_recursion", "ignore_sigterm_sleep"}
NEEDS_NAMESPACES = {  # what the weak mode (isolation="rlimits") cannot stop (docs/sandbox.md)
    "socket_localhost": {"uid", "rlimits"},
    "write_outside": {"rlimits"},
    "read_secret": {"rlimits"},
    "kill_parent": {"rlimits"},
    "delete_parent_files": {"rlimits"},
}


def run_hostile(name: str, sb: Sandbox, tmp: str) -> dict:
    """Runs one catalogue program in a hostile-looking world and checks that world afterwards."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    outside = os.path.join(tmp, f"outside-{name}.txt")
    old_secret = os.environ.get("SANDBOX_TEST_SECRET")
    os.environ["SANDBOX_TEST_SECRET"] = SECRET
    try:
        with sb.workspace() as ws:
            canary = os.path.join(os.path.dirname(ws.path), f"canary-{name}")
            with open(canary, "w") as f:
                f.write("still here")
            env = dict(os.environ)
            code = CATALOGUE[name].format(
                outside=outside, port=listener.getsockname()[1], parent=os.getpid(), canary=canary
            )
            r = run_tests(extract_code(f"```python\n{code}```"), TESTS, sb, ws)
            leftovers = _live(ws.uid, "") if ws.uid >= 0 else []
            try:
                listener.accept()[0].close()
                connected = True
            except BlockingIOError:
                connected = False
            with open(canary) as f:
                canary_ok = f.read() == "still here"
            os.remove(canary)
            return dict(
                result=r,
                score=float(r.ok),
                environ_ok=dict(os.environ) == env,
                canary_ok=canary_ok,
                outside_written=os.path.exists(outside),
                secret_seen=SECRET in r.stdout + r.stderr,
                connected=connected,
                leftovers=leftovers,
            )
    finally:
        listener.close()
        if old_secret is None:
            os.environ.pop("SANDBOX_TEST_SECRET", None)
        else:
            os.environ["SANDBOX_TEST_SECRET"] = old_secret


@pytest.fixture(scope="module", params=["auto", "rlimits"], ids=["auto", "no_bwrap"])
def sb(request):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-bubblewrap warning has its own test
        try:
            s = Sandbox(workers=2, limits=LIMITS, isolation=request.param)
        except RuntimeError as e:  # auto without working bubblewrap refuses (test_isolation)
            pytest.skip(f"bubblewrap does not work here: the no_bwrap cases cover this ({e})")
    with s:
        yield s


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_hostile_program_is_contained(name, sb, tmp_path, monkeypatch):
    if sb.mode in NEEDS_NAMESPACES.get(name, ()):
        pytest.skip(f"sandbox mode {sb.mode!r} (no bubblewrap) cannot contain {name}")
    limits = dataclasses.replace(LIMITS, wall_s=1.0) if name in RUNS_TO_THE_WALL else LIMITS
    monkeypatch.setattr(sb, "limits", limits)
    out = run_hostile(name, sb, str(tmp_path))
    r = out["result"]
    print(f"{name}: stopped by {r.reason} after {r.seconds:.2f} s")
    assert out["score"] == (1.0 if name == "noisy_correct" else 0.0), r
    assert out["environ_ok"] and out["canary_ok"]
    assert not out["outside_written"] and not out["secret_seen"] and not out["connected"]
    assert out["leftovers"] == []
    assert r.seconds < limits.wall_s + 1.5
    assert len(r.stdout) <= LIMITS.output_bytes


def test_no_new_processes_by_default():
    with Sandbox(workers=1, limits=Limits(wall_s=5), isolation=sandbox_isolation()) as s:
        r = s.run("import os\nos.fork()\n")
    assert r.reason == "error" and "BlockingIOError" in r.stderr, r


def test_workspace_persists_across_runs_and_is_deleted_on_close(sb):
    ws = sb.workspace()
    assert sb.run("open('note.txt', 'w').write('from run 1')", ws).ok
    r = sb.run("import os\nprint(open('note.txt').read(), os.getcwd() == os.environ['HOME'])", ws)
    assert r.ok and r.stdout == "from run 1 True\n", r
    assert os.path.isdir(ws.path)
    ws.close()
    assert not os.path.exists(ws.path)
    with pytest.raises(ValueError, match="closed"):
        sb.run("pass", ws)


def test_runs_see_a_scrubbed_environment_and_stdin(sb, monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", SECRET)
    r = sb.run("import os, sys\nprint(sorted(os.environ))\nprint(sys.stdin.read())", stdin="hello")
    assert r.ok and SECRET not in r.stdout and "hello" in r.stdout, r
    assert "SANDBOX_TEST_SECRET" not in r.stdout


def test_pool_bounds_parallelism():
    """Eight 0.5 s runs on four workers: at most four run at once, and more than one (each run
    reports when it started and ended, so a slow machine does not change the count)."""
    program = "import time\nprint(time.time())\ntime.sleep(0.5)\nprint(time.time())"
    with Sandbox(workers=4, limits=Limits(wall_s=30), isolation=sandbox_isolation()) as s:
        futures = [s.submit(program) for _ in range(8)]
        runs = [f.result() for f in futures]
    assert all(r.ok for r in runs), runs
    spans = [tuple(map(float, r.stdout.split())) for r in runs]
    running = [sum(a <= t < b for a, b in spans) for t, _ in spans]  # at each run's start
    assert 2 <= max(running) <= 4, spans


def test_python_and_python3_are_first_on_the_path(sb):
    """In every mode: `python` and `python3` resolve in the sandbox's own bin/ (first on PATH)
    to an interpreter the run may execute."""
    r = sb.run(
        "import os, shutil\nfor name in ('python', 'python3'):\n    p = shutil.which(name)\n"
        "    print(os.path.dirname(p) == os.environ['PATH'].split(':')[0], "
        "os.access(os.path.realpath(p), os.X_OK))"
    )
    assert r.ok and r.stdout == "True True\nTrue True\n", r


def test_without_bwrap_warns_once_and_still_limits(monkeypatch):
    from rl.sandbox import process as sandbox

    monkeypatch.setattr(sandbox, "_warned", set())
    with pytest.warns(RuntimeWarning, match="without bubblewrap") as record:
        a, b = Sandbox(workers=1, isolation="rlimits"), Sandbox(workers=1, isolation="rlimits")
    assert len([w for w in record if "bubblewrap" in str(w.message)]) == 1
    with a, b:
        assert a.mode in ("uid", "rlimits")
        assert a.run("print(7 * 6)").stdout == "42\n"
        assert a.run("x = bytearray(10 * (1 << 30))").reason == "error"


def catalogue_table(isolation: str = "auto") -> str:
    """A markdown table: each catalogue program, what stopped it, and how long it ran."""
    rows = ["| program | stopped by | exit status | seconds | score | last line of stderr |"]
    rows.append("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp, Sandbox(2, LIMITS, isolation) as s:
        rows.insert(0, f"sandbox mode: {s.mode}; limits: {LIMITS}\n")
        for name in CATALOGUE:
            r = run_hostile(name, s, tmp)["result"]
            last = (r.stderr.strip().splitlines() or [""])[-1][:70].replace("|", "/")
            rows.append(
                f"| {name} | {r.reason} | {r.returncode} | {r.seconds:.2f} | {r.ok:d} | {last} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":  # --no-bwrap: the table of the weak mode (isolation="rlimits")
    import sys

    print(catalogue_table("rlimits" if "--no-bwrap" in sys.argv else "auto"))
