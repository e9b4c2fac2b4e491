"""The CPU repository demo (configs/repo_fix.py) runs end to end: edit / test-output / submit
episodes through env `repo_fix`, their metrics, and held-out evaluation of greedy episodes with
the fix rate after a failed first attempt."""

import json

import pytest

from tests.conftest import ROOT, train_here

pytestmark = pytest.mark.slow  # a training step of the repository demo


def test_repo_fix_config_trains_a_step(tmp_path):
    workdir = tmp_path / "run"
    # One of the 8 fake devices (tests.conftest.train_here): the demo's episodes, not the mesh,
    # are under test; 8 slots hold the step's 2 x 4 episodes and the 8 held-out ones (the demo's
    # 9 pages of 8 tokens each, + the null page).
    args = [
        f"--config={ROOT}/configs/repo_fix.py", "--config.num_steps=1",
        "--config.data.prompts_per_step=2", "--config.rl.num_generations=4",
        "--config.sampling.num_slots=8", "--config.sampling.num_pages=80",
        "--config.data.eval.num=8", f"--workdir={workdir}",
    ]  # fmt: skip
    assert train_here(args) == 0
    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 1 and all(0 < r["episode/turns"] <= 3 for r in steps)
    assert all(0 <= r["episode/first_try_fix_rate"] <= 1 for r in steps)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert len(evals) == 2  # before step 0 and at the end
    for r in evals:
        assert 0 <= r["eval/accuracy"] <= 1 and r["eval/tool_call_rate"] > 0.5
        assert 0 <= r["eval/second_try_fix_rate"] <= 1 and r["eval/fail_to_pass_frac"] <= 1
