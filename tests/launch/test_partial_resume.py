"""Partial rollouts survive kill -9: a run whose steps carry episodes across learner steps, killed
mid-run and restarted with the same command, ends bitwise equal to the uninterrupted run
(checkpoint steps drain their carried episodes, so a saved state holds none), with DAPO's
dynamic sampling replacing zero-variance groups as they complete. The uninterrupted run and the
restart run in this process (tests.conftest.train_here, one device: the run of a one-device
subprocess); the killed run is a subprocess. And the same of a mixture of experts in bf16 with
routing replay and preemption (issue 52), all three runs subprocesses."""

import json
import random
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, train_here, train_metrics

pytestmark = pytest.mark.slow  # three training runs, one killed (a subprocess) and resumed

# Two checkpoint cycles: the kill lands in the second, after step 4 committed (16 steps before:
# carried episodes, off-policy tokens and replacements all show within the first 8).
STEPS = 8
ARGS = [
    f"--config.num_steps={STEPS}", "--config.data.prompts_per_step=4",
    "--config.rl.num_generations=4", "--config.rl.partial_rollouts=True",
    "--config.rl.extra_groups=4", "--config.rl.max_staleness=2", "--config.rl.is_correction=tis",
    "--config.sampling.num_slots=8", "--config.sampling.steps_per_call=1",
    "--config.sampling.temperature=1.5", "--config.checkpoint_every=4", "--config.eval_every=0",
    "--config.data.eval.num=8", "--config.eval.pass_k=0", "--config.rl.kl_coef=0.04",
    "--config.rl.dynamic_sampling=True",  # zero-variance groups replaced mid-rollout
]  # fmt: skip


# Issue 52 must-show 3: the tiny MoE demo in bf16 (where routes flip between sampler and learner)
# with routing replay and partial rollouts, on a pool of 24 KV pages of 2 tokens for 8 slots, so
# that sequences are preempted and recomputed (page_size 2: a new page every other token). Two
# checkpoint cycles of 3 steps: step 4 preempts, steps 1, 2, 4 and 5 carry episodes.
MOE_STEPS = 6
MOE_ARGS = [
    f"--config={ROOT}/configs/moe_tiny.py",
    f"--config.num_steps={MOE_STEPS}",
    "--config.model.dtype=bfloat16",
    "--config.rl.routing_replay=rollout",
    "--config.data.prompts_per_step=4",
    "--config.rl.num_generations=4",
    "--config.rl.partial_rollouts=True",
    "--config.rl.extra_groups=4",
    "--config.rl.max_staleness=2",
    "--config.rl.is_correction=tis",
    "--config.sampling.num_slots=8",
    "--config.sampling.steps_per_call=1",
    "--config.sampling.page_size=2",
    "--config.sampling.num_pages=25",
    "--config.sampling.temperature=1.5",
    "--config.checkpoint_every=3",
    "--config.eval_every=0",
    "--config.data.eval.num=8",
    "--config.eval.pass_k=0",
    "--config.rl.kl_coef=0.04",
]


def _cmd(workdir, args=ARGS):
    return [sys.executable, "-m", "launch.train", f"--workdir={workdir}", *args]


def _latest(workdir) -> int:
    try:  # the run being watched creates the directory
        return max((int(p.name) for p in (workdir / "checkpoints").iterdir()
                    if p.name.isdigit()), default=0)  # fmt: skip
    except FileNotFoundError:
        return 0


def _kill_after_commit(workdir, delay: float, log, args=ARGS) -> None:
    """Starts the run and SIGKILLs it `delay` s after it commits a new checkpoint."""
    before = _latest(workdir)
    with open(log, "w") as err:
        proc = subprocess.Popen(
            _cmd(workdir, args), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err
        )
        while proc.poll() is None and _latest(workdir) == before:
            time.sleep(0.01)  # polling files another process writes; nothing is timed
        time.sleep(delay)  # a moment within the next steps, seeded; nothing is timed
        assert proc.poll() is None, f"the run ended before its kill: {open(log).read()[-3000:]}"
        proc.kill()
        proc.wait()


def test_partial_rollouts_kill9_then_resume_is_exact(tmp_path, capsys):
    straight, killed, rng = tmp_path / "straight", tmp_path / "killed", random.Random(0)
    assert train_here([f"--workdir={straight}", *ARGS]) == 0
    rows = [json.loads(x) for x in open(straight / "metrics.jsonl") if '"loss"' in x]
    assert any(r["rollout/carried_episodes"] > 0 for r in rows)  # episodes parked mid-decode
    assert any(r["rollout/offpolicy_token_frac"] > 0 for r in rows)  # ... and trained later
    assert all(r["rollout/staleness_max"] <= 2 for r in rows)
    assert any(r["dynamic_sampling_replacements"] > 0 for r in rows)
    _kill_after_commit(killed, rng.uniform(0.0, 0.3), tmp_path / "kill.log")
    assert 0 < _latest(killed) < STEPS
    capsys.readouterr()  # the restart's own output, below
    code, err = train_here([f"--workdir={killed}", *ARGS]), capsys.readouterr().err
    assert code == 0 and "resumed from step" in err, err[-3000:]
    a = json.load(open(straight / "summary.json"))
    b = json.load(open(killed / "summary.json"))
    assert a["params_fingerprint"] == b["params_fingerprint"]
    assert train_metrics(straight) == train_metrics(killed)


def _train_sub(workdir, args) -> str:
    """The run as a one-device subprocess; its stderr."""
    proc = subprocess.run(
        _cmd(workdir, args), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_moe_routing_replay_partial_rollouts_kill9_then_resume_is_exact(tmp_path):
    """Routing replay with partial rollouts and preemption: each episode's recorded routes are
    carried across steps and recomputes (sampling.episodes) into the learner's rows, and the run
    killed after its step-3 checkpoint and resumed ends bitwise as the uninterrupted one. Every
    run is a one-device subprocess: an MoE run in this process (8 fake CPU devices, one used)
    differs from it in the last bits of the experts' gradients from step 2 on, in f32 too
    (XLA:CPU's matmuls round otherwise in a process of 8 CPU devices: README, routing replay)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _train_sub(straight, MOE_ARGS)
    rows = [json.loads(x) for x in open(straight / "metrics.jsonl") if '"loss"' in x]
    assert sum(r["rollout/preemptions"] for r in rows) > 0  # sequences preempted, recomputed
    assert sum(r["rollout/recomputed_tokens"] for r in rows) > 0
    assert any(r["rollout/carried_episodes"] > 0 for r in rows)  # episodes parked mid-decode
    assert any(r["rollout/offpolicy_token_frac"] > 0 for r in rows)  # ... and trained later
    assert "rollout/route_mismatch" not in rows[0]  # replayed: the learner compares nothing
    _kill_after_commit(killed, random.Random(1).uniform(0.0, 0.3), tmp_path / "kill.log", MOE_ARGS)
    saved = _latest(killed)
    assert 0 < saved < MOE_STEPS
    err = _train_sub(killed, MOE_ARGS)
    assert f"resumed from step {saved} " in err, err[-3000:]
    a = json.load(open(straight / "summary.json"))
    b = json.load(open(killed / "summary.json"))
    print(
        "params_fingerprint straight", a["params_fingerprint"], "resumed", b["params_fingerprint"]
    )
    assert a["params_fingerprint"] == b["params_fingerprint"]
    assert train_metrics(straight) == train_metrics(killed)
