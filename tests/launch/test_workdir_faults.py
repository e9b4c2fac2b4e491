"""Faults of the disk and the workdir (launch/train.py, rl/checkpoint.py, launch/workdir_lock.py,
launch/logger.py): a checkpoint that cannot be written stops the run in one line and the same
command resumes it exactly; a second run in a workdir in use is refused; after a kill -9 and a
resume metrics.jsonl, TensorBoard and W&B hold every step once.

The full disk is a real one: a tmpfs mounted for the test (root only: skipped otherwise), filled
with a ballast file so that one checkpoint fits and the next does not."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

import pytest

from tests.conftest import ROOT, train_here, train_metrics
from tests.launch.test_train import TINY

pytestmark = pytest.mark.slow  # training runs, killed and resumed

STEPS = 12  # checkpoint_every=3 (TINY)


def _args(workdir, *extra):
    return [f"--workdir={workdir}", f"--config.num_steps={STEPS}", *TINY, *extra]


def _cmd(workdir, *extra):
    return [sys.executable, "-m", "launch.train", *_args(workdir, *extra)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight") / "run"
    assert train_here(_args(workdir)) == 0
    return workdir


def _summary(workdir):
    return json.load(open(os.path.join(workdir, "summary.json")))


@pytest.fixture
def small_disk():
    """A 64 MiB tmpfs, unmounted after the test."""
    top = tempfile.mkdtemp(prefix="small_disk_")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", top], capture_output=True
    )
    if mounted.returncode:
        os.rmdir(top)
        pytest.skip(f"cannot mount a tmpfs here (root only): {mounted.stderr.decode().strip()}")
    try:
        yield top
    finally:
        subprocess.run(["umount", "--lazy", top], check=True)
        os.rmdir(top)


def _fill(top: str, room: int) -> str:
    """A ballast file that leaves `room` bytes free on the file system of `top`."""
    path = os.path.join(top, "ballast")
    st = os.statvfs(top)
    with open(path, "wb") as f:
        f.truncate(0)
        f.write(b"\0" * max(st.f_bavail * st.f_frsize - room, 0))
    return path


def _checkpoint_bytes(workdir) -> int:
    step = os.path.join(workdir, "checkpoints", str(STEPS))
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(step) for f in fs)


def _lines(text: str) -> list[str]:
    """The lines of a run's stderr but its progress-bar frames."""
    lines = text.replace("\r", "\n").splitlines()
    return [x for x in lines if x.strip() and not x.startswith("grpo:")]


def test_a_full_disk_stops_the_run_within_a_step_and_it_resumes_exactly(
    straight, small_disk, capfd
):
    """Room for one checkpoint and a half: step 3's is written, step 6's fails in orbax's
    background write (ENOSPC). The run stops in step 7 (the step after the save; its end waits
    for the save) with exit code 4 and one line naming the checkpoint, the reason and the last
    complete checkpoint; no traceback, no half-written checkpoint left. With the ballast gone,
    the same command resumes from step 3 and ends bitwise equal to the straight run, every step
    logged once."""
    workdir = os.path.join(small_disk, "run")
    ballast = _fill(small_disk, int(1.5 * _checkpoint_bytes(straight)))
    capfd.readouterr()
    assert train_here(_args(workdir)) == 4
    out, err = capfd.readouterr()
    errors = [x for x in _lines(err) if x.startswith("error:")]
    assert errors == [
        f"error: checkpoint 6 could not be written to {workdir}/checkpoints: No space left on "
        "device (the last complete checkpoint is step 3; free the space, or make the workdir "
        "writable, and run the same command to resume)"
    ], err[-3000:]
    assert "Traceback" not in out + err and "Exception" not in err
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]
    # step 7 ran (its end waits for step 6's save), but it is not logged: the run resumes at 3
    assert max(train_metrics(workdir)) == 6

    os.remove(ballast)
    assert train_here(_args(workdir)) == 0
    assert "resumed from step 3" in capfd.readouterr().err
    assert _summary(workdir)["params_fingerprint"] == _summary(straight)["params_fingerprint"]
    assert train_metrics(workdir) == train_metrics(straight)
    steps = Counter(json.loads(x)["step"] for x in open(os.path.join(workdir, "metrics.jsonl")))
    assert steps == Counter(json.loads(x)["step"] for x in open(straight / "metrics.jsonl"))


def test_a_final_save_that_fails_stops_in_one_line(small_disk, straight, capfd):
    """checkpoint_every=0 (only the last step saves) and no room for that save: exit code 4,
    one line, 'the last complete checkpoint is none', no traceback."""
    workdir = os.path.join(small_disk, "run")
    _fill(small_disk, int(0.5 * _checkpoint_bytes(straight)))
    capfd.readouterr()
    argv = _args(workdir, "--config.num_steps=2", "--config.checkpoint_every=0")
    assert train_here(argv) == 4
    out, err = capfd.readouterr()
    assert [x for x in _lines(err) if x.startswith("error:")] == [
        f"error: checkpoint 2 could not be written to {workdir}/checkpoints: No space left on "
        "device (the last complete checkpoint is none; free the space, or make the workdir "
        "writable, and run the same command to resume)"
    ], err[-3000:]
    assert "Traceback" not in out + err
    assert os.listdir(os.path.join(workdir, "checkpoints")) == []


def _wait_for(predicate, proc, what: str, limit: float = 300.0) -> None:
    start = time.monotonic()
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() - start < limit, f"no {what} after {limit} s"
        time.sleep(0.05)  # polling files another process writes; nothing is timed


def _logged_steps(workdir) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    return open(path).read().count('"loss"') if os.path.exists(path) else 0


def _snapshot(top) -> dict:
    out = {}
    for root, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(root, name)
            data = None if os.path.isdir(path) else open(path, "rb").read()
            out[path] = (data, os.stat(path).st_mtime_ns)
    return out


def test_a_second_run_in_a_workdir_in_use_is_refused(tmp_path):
    """The first run (a subprocess) holds the workdir; while it is stopped (SIGSTOP, so that
    its own writes do not move the files) a second one of the same command exits 2 in one
    line naming the first's pid, and changes no file. After the first is killed with kill -9
    the second starts and resumes."""
    workdir = tmp_path / "run"
    first = subprocess.Popen(
        _cmd(workdir, "--config.num_steps=1000"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(lambda: os.path.isdir(workdir / "checkpoints" / "3"), first, "checkpoint 3")
        first.send_signal(signal.SIGSTOP)
        before = _snapshot(workdir)
        start = time.monotonic()
        second = subprocess.run(
            _cmd(workdir), cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        took = time.monotonic() - start
        assert second.returncode == 2, second.stderr[-3000:]
        host = os.uname().nodename
        lines = _lines(second.stderr)
        assert len(lines) == 1 and lines[0].startswith(
            f"error: {workdir} is in use by another run (pid {first.pid} on host {host}, since "
        ), second.stderr
        assert lines[0].endswith("wait for it to end, stop it, or use another --workdir")
        assert _snapshot(workdir) == before
        print(f"refused in {took:.1f} s (the interpreter and jax's import included)")
        assert took < 60
    finally:
        first.kill()
        first.wait()
    again = subprocess.run(
        _cmd(workdir, "--config.num_steps=4"), cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step" in again.stderr


def _tb_counts(workdir) -> Counter:
    """(step, tag) -> how many scalar events the TensorBoard files hold."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out: Counter = Counter()
    events = os.path.join(workdir, "tensorboard")
    for name in sorted(os.listdir(events)):
        for event in EventFileLoader(os.path.join(events, name)).Load():
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "scalars":
                    out[(event.step, v.tag)] += 1
    return out


def _wandb_counts(workdir) -> tuple[Counter, dict]:
    """(step, key) -> how many history points all the offline runs of the workdir hold, and
    {step: {key: value}}."""
    counts, values = Counter(), {}
    exe = os.path.join(os.path.dirname(sys.executable), "wandb")
    top = os.path.join(workdir, "wandb")
    for run in sorted(r for r in os.listdir(top) if r.startswith("offline-run-")):
        out = subprocess.run(
            [exe, "leet", "inspect", "--json", os.path.join(top, run)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        for line in out.splitlines():
            record = json.loads(line)
            if record.get("type") == "history":
                item = record["history"]["item"]
                for k, v in item.items():
                    if not k.startswith("_"):
                        counts[(item["_step"], k)] += 1
                        values.setdefault(item["_step"], {})[k] = v
    return counts, values


def test_kill9_then_resume_logs_every_step_once(tmp_path, straight):
    """kill -9 after step 4 is logged (checkpoint 3 committed), then the same command: the
    resumed run computes steps 4.. again; metrics.jsonl, the TensorBoard files and the W&B
    offline history (both W&B run directories together) hold every record once, with the
    straight run's values."""
    pytest.importorskip("wandb")
    workdir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    # evaluations at steps 3, 6, 9 (and 0, 12): W&B merges a step's two records into one row
    argv = _cmd(workdir, "--config.log.wandb=True", "--config.eval_every=3")
    # Its own session: the kill takes the run and its W&B service process (wandb-core) at once,
    # as a lost machine does. (A kill of the trainer alone leaves wandb-core holding the run id
    # for a while: the resume waits for it, launch/logger.py.)
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_for(lambda: _logged_steps(workdir) >= 5, proc, "step 5")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    logged = _logged_steps(workdir)
    assert logged < STEPS
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from step" in out.stderr
    print(f"killed with {logged} steps logged; {out.stderr.split('resumed from')[1][:12]}")

    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    kinds = Counter((r["step"], "loss" in r) for r in rows)
    evals = [(s, False) for s in (0, 3, 6, 9, 12)]
    assert kinds == Counter([(s, True) for s in range(1, STEPS + 1)] + evals)
    assert train_metrics(workdir) == train_metrics(straight)  # (evaluation changes no step)
    tb = _tb_counts(workdir)
    assert set(tb.values()) == {1}
    assert tb.keys() == {(r["step"], k) for r in rows for k in r if k != "step"}
    counts, values = _wandb_counts(workdir)
    assert set(counts.values()) == {1}, [k for k, n in counts.items() if n > 1][:5]
    assert counts.keys() == tb.keys()
    for step, row in train_metrics(straight).items():
        for key, value in row.items():
            assert values[step][key] == pytest.approx(value, rel=1e-6, abs=0), (step, key)
    shutil.rmtree(workdir / "wandb")


def _unwritable(tmp_path):
    """(make unwritable, make writable again, the error's reason) for directories: as root
    `chattr +i` (the mode bits stop no root; not even root may create a file in an immutable
    directory, as on a file system remounted read-only, which Linux refuses while files are open
    for writing), else `chmod a-w`. Skips where a probe directory so treated still takes a file
    (no CAP_LINUX_IMMUTABLE in a container; a file system that ignores mode bits)."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None:
            pytest.skip("needs chattr (e2fsprogs) as root")
        attr = lambda flag: (
            lambda *ps: subprocess.run(
                ["chattr", flag, *map(str, ps)], check=True, capture_output=True, text=True
            )
        )
        lock, unlock, reason = attr("+i"), attr("-i"), "Operation not permitted"
    else:
        mode = lambda bits: lambda *paths: [os.chmod(p, bits) for p in paths]
        lock, unlock, reason = mode(0o555), mode(0o755), "Permission denied"
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        lock(probe)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"chattr +i failed here: {e.stderr.strip() or e}")
    try:
        (probe / "file").touch()
    except OSError:
        return lock, unlock, reason
    finally:
        unlock(probe)
    pytest.skip(f"a directory made unwritable here ({reason!r} expected) still takes a file")


def test_a_workdir_made_unwritable_stops_the_run_and_it_resumes_exactly(straight, tmp_path, capfd):
    """Once checkpoint 3 is committed, the workdir and its checkpoints/ become unwritable
    (`_unwritable`). The save of step 6 fails: exit code 4, one line, no traceback. Writable
    again, the same command resumes from step 3 and ends bitwise equal to the straight run."""
    import threading

    lock, unlock, reason = _unwritable(tmp_path)
    workdir = tmp_path / "run"
    ckpts = workdir / "checkpoints"
    done = threading.Event()

    def freeze():
        while not done.is_set() and not (ckpts / "3").is_dir():
            time.sleep(0.01)  # polling the run's directory; nothing is timed
        if not done.is_set():
            lock(ckpts, workdir)

    watcher = threading.Thread(target=freeze)
    watcher.start()
    capfd.readouterr()
    try:
        rc = train_here(_args(workdir))
    finally:
        done.set()
        watcher.join()
        unlock(*(p for p in (ckpts, workdir) if p.exists()))  # a run may stop before either
    out, err = capfd.readouterr()
    assert rc == 4, err[-3000:]
    errors = [x for x in _lines(err) if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: checkpoint 6 could not be written to {ckpts}: {reason}"
    ), err[-3000:]
    assert errors[0].endswith(
        "(the last complete checkpoint is step 3; free the space, or make the workdir writable, "
        "and run the same command to resume)"
    )
    assert "Traceback" not in out + err
    assert train_here(_args(workdir)) == 0
    assert "resumed from step 3" in capfd.readouterr().err
    assert _summary(workdir)["params_fingerprint"] == _summary(straight)["params_fingerprint"]
    assert train_metrics(workdir) == train_metrics(straight)
