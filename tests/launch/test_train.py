"""`python -m launch.train`: resume checks, the non-finite guard, exact resume (the bad-input
catalogue is tests/launch/test_bad_inputs.py).

Runs that are not signalled run in this process on one of its 8 fake devices
(tests.conftest.train_here), the run a one-device subprocess makes; those that are killed or sent
SIGTERM are subprocesses. test_resume_is_exact compares the two: the straight run here, the stopped
and resumed runs as subprocesses of the same command, with the same fingerprint and metrics."""

import json
import random
import signal
import subprocess
import sys
import time

import jax
import pytest

from launch.build import load_run
from launch.cli import config_json, parse_args
from launch.train import FLAGS
from models.sharding import on_devices
from rl.checkpoint import fingerprint
from tests.conftest import ROOT, train_here, train_metrics

pytestmark = pytest.mark.slow  # training runs, killed and resumed

# The runs' shapes: every run of this file has them (the non-finite one too), so that the
# in-process runs share their traces (the first traces, the others reuse).
TINY = [
    "--config.data.prompts_per_step=4", "--config.rl.num_generations=4", "--config.rl.kl_coef=0.04",
    "--config.data.eval.num=8", "--config.eval.pass_k=2", "--config.eval.pass_n=2",
    "--config.eval_every=0", "--config.checkpoint_every=3", "--config.sampling.num_slots=32",
    "--config.sampling.num_pages=128", "--config.rl.dynamic_sampling=True",
    "--config.sampling.release_kv_between_phases=False",
]  # fmt: skip


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(tmp_path, capsys):
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "4").mkdir(parents=True)
    assert train_here(["--config.num_steps=2", "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert "config.num_steps=2 is below step 4 of the checkpoint" in err


def test_non_finite_steps_are_skipped_then_the_run_stops(tmp_path, capsys, monkeypatch):
    """A reward that turns NaN at step 3: steps 3 and 4 are skipped (counted and logged, the
    parameters unchanged), then with max_nonfinite_steps=2 the run stops with one line and exit
    code 3 before saving step 4. The latest checkpoint (step 3, the skipped step) holds exactly
    the parameters of step 2, the last good update."""
    from rl import rewards

    exact, calls = rewards.REWARDS["arithmetic_exact"], []

    def turns_nan(prompts, completions, **fields):
        # 4 groups per step (TINY, without dynamic sampling's replacements); before step 1 the
        # start-up check (launch.validate.check_rewards) calls it once per split and the
        # evaluation once per held-out group (8 records, pass_k=0: greedy only; rl/groups.py)
        calls.append(1)
        out = exact(prompts, completions, **fields)
        return [float("nan")] * len(out) if len(calls) > 2 + 8 + 2 * 4 else out

    monkeypatch.setitem(rewards.REWARDS, "arithmetic_exact", turns_nan)
    workdir = tmp_path / "run"
    args = [*TINY, "--config.rl.dynamic_sampling=False", "--config.eval.pass_k=0",
            "--config.checkpoint_every=1", "--config.max_nonfinite_steps=2",
            f"--workdir={workdir}"]  # fmt: skip
    assert train_here(args) == 3
    out, err = capsys.readouterr()
    assert "step 3: 1 optimizer step(s) with a non-finite loss or gradient skipped" in out
    assert err.strip().splitlines()[-1] == (
        "error: step 4: loss or gradient not finite in 2 steps in a row (max_nonfinite_steps=2); "
        f"stopped (last checkpoint: step 3 in {workdir})"
    )
    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl") if '"loss"' in x]
    assert [r["skipped"] for r in rows] == [0.0, 0.0, 1.0, 1.0]
    with on_devices(jax.devices()[:1]):  # read as the run ran, on one device (its traces)
        run, step = load_run(str(workdir))
        good = fingerprint(run.state.params)
        assert step == 3 and good == fingerprint(load_run(str(workdir), 2)[0].state.params)
        # a run saved before this round's fields (routing replay, the router's loss, the trust
        # region, partial rollouts, the gradients' reduce dtype) is still read by launch.eval
        config = json.loads((workdir / "config.json").read_text())
        for section, fields in OLDER_RUN.items():
            for name in fields:
                del config[section][name]
        (workdir / "config.json").write_text(json.dumps(config))
        assert fingerprint(load_run(str(workdir))[0].state.params) == good


# Fields a run saved before this round lacks (launch.resume_compat.with_saved_defaults).
OLDER_RUN = {
    "rl": ("routing_replay", "router_aux_loss_coef", "trust_region", "partial_rollouts"),
    "optim": ("grad_reduce_dtype",),
}


# A step takes ~0.3 s once compiled. Five kills advance the killed run by about one committed step
# each (they wait for a commit, or land in start-up): 12 steps leave room for all of them to land
# mid-run (30 before: the extra steps cost three runs ~18 steps each and tested nothing more).
STEPS = 12


def _args(workdir, *extra):
    return [f"--workdir={workdir}", f"--config.num_steps={STEPS}", *TINY, *extra]


def _cmd(workdir, *extra):
    return [sys.executable, "-m", "launch.train", *_args(workdir, *extra)]


def _train(workdir, *extra):
    """The run as a one-device subprocess (`python -m launch.train`)."""
    out = subprocess.run(_cmd(workdir, *extra), cwd=ROOT, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run of STEPS steps in this process (train_here), the reference of the
    interrupted ones."""
    workdir = tmp_path_factory.mktemp("straight")
    assert train_here(_args(workdir)) == 0
    return workdir


def _train_until_sigterm(workdir):
    """Starts the run and sends it SIGTERM once step 2 is logged; returns the step it saved and
    stopped at."""
    proc = subprocess.Popen(_cmd(workdir), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    metrics = workdir / "metrics.jsonl"
    while proc.poll() is None:
        rows = open(metrics).read().count('"loss"') if metrics.exists() else 0
        if rows >= 2:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)  # polling a file another process writes; nothing is timed
    err = proc.communicate(timeout=600)[1]
    assert proc.returncode == 0, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("SIGTERM received: stopped after step ") and "resume" in line, line
    return int(line.split("after step ")[1].split()[0])


def test_resume_is_exact(tmp_path, straight):
    """A run stopped by SIGTERM (a preemption notice) after the step it was in, saving it, then
    a new process that resumes and runs the rest == the straight run (with DAPO dynamic sampling
    and a decode state kept across rollouts, the paths with the most state). The straight run
    ran in this process (train_here), the stopped and resumed ones are one-device subprocesses of
    the same command: their equal fingerprint and metrics are also the check that train_here
    makes the run a subprocess makes."""
    split = tmp_path / "split"
    stopped = _train_until_sigterm(split)
    assert 2 <= stopped < STEPS
    resumed = _train(split)
    assert f"resumed from step {stopped}" in resumed.stderr
    a, b = json.load(open(straight / "summary.json")), json.load(open(split / "summary.json"))
    # train_here == subprocess: the same fingerprint and per-step metrics
    assert a["params_fingerprint"] == b["params_fingerprint"]
    assert (
        a["accuracy_before"] == b["accuracy_before"] and a["accuracy_after"] == b["accuracy_after"]
    )
    assert train_metrics(straight) == train_metrics(split)
    assert sorted(train_metrics(split)) == list(range(1, STEPS + 1))
    for name in (
        "config.json",
        "metrics.jsonl",
        "samples.jsonl",
        "summary.json",
        "tensorboard",
        "checkpoints",
    ):
        assert (straight / name).exists(), name
    keys = {"accuracy_before", "accuracy_after", "steps", "wall_seconds", "rollout_tokens_per_s",
            "learn_tokens_per_s", "rollout_seconds", "learn_seconds", "params_fingerprint"}  # fmt: skip
    assert keys <= set(a)
    # launch.eval / launch.export read the 1-device run on this process's 8 devices (resharded).
    run, step = load_run(str(straight))
    assert step == STEPS and run.mesh.size == 8 and run.ref_params is None
    assert fingerprint(run.state.params) == a["params_fingerprint"]


def _checkpoints(workdir) -> list[str]:
    try:  # the run being watched creates the directory
        return [p.name for p in (workdir / "checkpoints").iterdir()]
    except FileNotFoundError:
        return []


def _latest(workdir) -> int:
    """The latest committed checkpoint step (0 if none)."""
    return max((int(n) for n in _checkpoints(workdir) if n.isdigit()), default=0)


def _saving(workdir) -> bool:
    """Whether an asynchronous save is under way (orbax writes into a temporary directory)."""
    return any(not n.isdigit() for n in _checkpoints(workdir))


def _run_and_kill(workdir, kill_when, log) -> None:
    """Starts the run and SIGKILLs it once kill_when(seconds since start, whether a step was
    committed since start) holds; a run that committed a step resumed from the latest one."""
    before = _latest(workdir)
    with open(log, "w") as err:
        proc = subprocess.Popen(_cmd(workdir, "--config.checkpoint_every=1"), cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
        start = time.monotonic()
        while proc.poll() is None and not kill_when(
            time.monotonic() - start, _latest(workdir) > before
        ):
            time.sleep(0.01)  # polling files another process writes; nothing is timed
        assert proc.poll() is None, f"the run ended before its kill: {open(log).read()[-3000:]}"
        proc.kill()
        proc.wait()
    if before and _latest(workdir) > before:
        assert f"resumed from step {before}" in open(log).read()
    print(f"killed at {time.monotonic() - start:.2f} s: committed {before} -> {_latest(workdir)}, "
          f"an unfinished save left: {_saving(workdir)}")  # fmt: skip


def test_kill9_anywhere_then_resume_is_exact(tmp_path, straight):
    """kill -9 at five moments, each followed by a restart of the same command: during an
    asynchronous checkpoint save, right after a save committed (the next step's rollout, most of
    a step), during start-up or restore, and twice at a seeded random moment of the step after
    the first new commit. Each restart resumes from the latest committed checkpoint (an
    unfinished save is ignored), and the last run ends bitwise equal to the straight one."""
    killed, rng = tmp_path / "killed", random.Random(0)
    start_up = rng.uniform(1.0, 4.0)
    new_commit_at = []

    def after_new_commit(delay):
        def when(t, new):
            if new and not new_commit_at:
                new_commit_at.append(t)
            return bool(new_commit_at) and t >= new_commit_at[0] + delay

        new_commit_at.clear()
        return when

    moments = [
        ("during an asynchronous save", lambda t, new: _saving(killed)),
        ("in the rollout after a commit", after_new_commit(0.05)),
        ("during start-up", lambda t, new: t >= start_up),
        ("at a random moment of a step", after_new_commit(rng.uniform(0.0, 0.5))),
        ("at a random moment of a step", after_new_commit(rng.uniform(0.0, 0.5))),
    ]
    for i, (_, when) in enumerate(moments):
        new_commit_at.clear()
        _run_and_kill(killed, when, tmp_path / f"kill{i}.log")
    assert _latest(killed) < STEPS
    assert train_here(_args(killed, "--config.checkpoint_every=1")) == 0  # the last restart, here
    a = json.load(open(straight / "summary.json"))
    b = json.load(open(killed / "summary.json"))
    assert a["params_fingerprint"] == b["params_fingerprint"]
    assert train_metrics(straight) == train_metrics(killed)


def test_resume_refuses_a_changed_config(tmp_path, capsys):
    workdir = tmp_path / "run"
    workdir.mkdir()
    config, _, _ = parse_args([], FLAGS)
    (workdir / "config.json").write_text(json.dumps(config_json(config)))
    assert train_here(["--workdir", str(workdir), "--config.optim.learning_rate=0.1"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume with a changed config (optim.learning_rate: 0.0002 -> 0.1)" in err
