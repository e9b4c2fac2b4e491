"""`python -m launch.train`: resume checks, the non-finite guard, exact resume (the bad-input
catalogue is tests/launch/test_bad_inputs.py)."""

import json
import signal
import subprocess
import sys
import time

from launch.build import load_run
from launch.cli import config_json, parse_args
from launch.train import FLAGS, main
from rl.checkpoint import fingerprint
from tests.conftest import ROOT, train_metrics

EIGHT = ["--config.mesh.data=8"]  # the in-process tests run on the 8 fake devices


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(tmp_path, capsys):
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "4").mkdir(parents=True)
    assert main(EIGHT + ["--config.num_steps=2", "--workdir", str(workdir)]) == 2
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
        # 2 groups per step; before step 1 the start-up check (launch.validate.check_rewards)
        # calls it once per split and the evaluation once
        calls.append(1)
        out = exact(prompts, completions, **fields)
        return [float("nan")] * len(out) if len(calls) > 7 else out

    monkeypatch.setitem(rewards.REWARDS, "arithmetic_exact", turns_nan)
    workdir = tmp_path / "run"
    args = EIGHT + ["--config.data.prompts_per_step=2", "--config.data.eval.num=8",
                    "--config.eval.pass_k=0", "--config.eval_every=0", "--config.checkpoint_every=1",
                    "--config.max_nonfinite_steps=2", f"--workdir={workdir}"]  # fmt: skip
    assert main(args) == 3
    out, err = capsys.readouterr()
    assert "step 3: 1 optimizer step(s) with a non-finite loss or gradient skipped" in out
    assert err.strip().splitlines()[-1] == (
        "error: step 4: loss or gradient not finite in 2 steps in a row (max_nonfinite_steps=2); "
        f"stopped (last checkpoint: step 3 in {workdir})"
    )
    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl") if '"loss"' in x]
    assert [r["skipped"] for r in rows] == [0.0, 0.0, 1.0, 1.0]
    run, step = load_run(str(workdir))
    good = fingerprint(run.state.params)
    assert step == 3 and good == fingerprint(load_run(str(workdir), 2)[0].state.params)


TINY = [
    "--config.data.prompts_per_step=4", "--config.rl.num_generations=4", "--config.rl.kl_coef=0.04",
    "--config.data.eval.num=8", "--config.eval.pass_k=2", "--config.eval.pass_n=2",
    "--config.eval_every=0", "--config.checkpoint_every=3", "--config.sampling.num_slots=16",
    "--config.sampling.num_pages=64", "--config.rl.dynamic_sampling=True",
    "--config.sampling.release_kv_between_phases=False",
]  # fmt: skip


def _train(workdir, steps):
    cmd = [
        sys.executable,
        "-m",
        "launch.train",
        "--workdir",
        str(workdir),
        f"--config.num_steps={steps}",
    ]
    out = subprocess.run(cmd + TINY, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _train_until_sigterm(workdir, steps):
    """Starts a run of `steps` steps and sends it SIGTERM once step 2 is logged; returns the step
    it saved and stopped at."""
    cmd = [sys.executable, "-m", "launch.train", "--workdir", str(workdir),
           f"--config.num_steps={steps}"]  # fmt: skip
    proc = subprocess.Popen(cmd + TINY, cwd=ROOT, stderr=subprocess.PIPE, text=True)
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


def test_resume_is_exact(tmp_path):
    """6 steps straight == a run stopped by SIGTERM (a preemption notice) after the step it was
    in, saving it, then a new process that resumes and runs the rest (with DAPO dynamic sampling
    and a decode state kept across rollouts, the paths with the most state)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(straight, 6)
    stopped = _train_until_sigterm(split, 6)
    assert 2 <= stopped < 6
    resumed = _train(split, 6)
    assert f"resumed from step {stopped}" in resumed.stderr
    a, b = json.load(open(straight / "summary.json")), json.load(open(split / "summary.json"))
    assert a["params_fingerprint"] == b["params_fingerprint"]
    assert (
        a["accuracy_before"] == b["accuracy_before"] and a["accuracy_after"] == b["accuracy_after"]
    )
    assert train_metrics(straight) == train_metrics(split)
    assert sorted(train_metrics(split)) == [1, 2, 3, 4, 5, 6]
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
    assert step == 6 and run.mesh.size == 8 and run.ref_params is None
    assert fingerprint(run.state.params) == a["params_fingerprint"]


def test_resume_refuses_a_changed_config(tmp_path, capsys):
    workdir = tmp_path / "run"
    workdir.mkdir()
    config, _, _ = parse_args(EIGHT, FLAGS)
    (workdir / "config.json").write_text(json.dumps(config_json(config)))
    assert main(EIGHT + ["--workdir", str(workdir), "--config.optim.learning_rate=0.1"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume with a changed config (optim.learning_rate: 0.0002 -> 0.1)" in err
