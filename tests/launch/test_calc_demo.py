"""The CPU tool demo (configs/calc_tool.py) runs end to end: multi-turn episodes with calculator
calls, their metrics, and held-out evaluation of greedy episodes with the tool-call rate."""

import json

import pytest

from tests.conftest import ROOT, train_here

pytestmark = pytest.mark.slow  # a training step of the tool-use demo


def test_calc_tool_config_trains_a_step(tmp_path):
    workdir = tmp_path / "run"
    args = [
        f"--config={ROOT}/configs/calc_tool.py", "--config.num_steps=1",
        "--config.data.prompts_per_step=4", "--config.sampling.num_slots=32",  # the 4 groups of G = 8
        "--config.sampling.num_pages=129",  # 32 episodes x 4 pages of 8 tokens, + the null page
        "--config.data.eval.num=8", f"--workdir={workdir}",
    ]  # fmt: skip
    assert train_here(args) == 0  # in this process, on one device
    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 1 and all(0 < r["episode/turns"] <= 3 for r in steps)
    assert all(r["episode/prefill_tokens"] <= r["episode/reprefill_tokens"] for r in steps)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals and all(0 <= r["eval/tool_call_rate"] <= 1 for r in evals)
