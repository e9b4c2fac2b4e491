"""A run whose episodes are all masked by infrastructure errors trains on nothing: launch.train
stops after `env.max_masked_steps` such steps in a row, in one line naming the most frequent
error and how many episodes it masked, exit code 3, no traceback, saving nothing new."""

import json
import os

import pytest

from rl.environment import register_env
from rl.envs.calculator import CalculatorEnv
from tests.conftest import train_here

pytestmark = pytest.mark.slow  # training runs of the tool demo


@register_env("test_calculator_no_sandbox")
class NoSandbox(CalculatorEnv):
    """The calculator, whose episodes all end as a sandbox that never started (masked)."""

    def masked(self, episode):
        episode.infra_error = "sandbox did not start: timeout after 30 s"
        return True


def _args(workdir, *extra):
    return [
        "--config=configs/calc_tool.py",
        f"--workdir={workdir}",
        "--config.data.prompts_per_step=4",
        "--config.sampling.num_slots=32",
        "--config.sampling.num_pages=129",
        "--config.data.eval.num=8",
        "--config.eval_every=0",
        "--config.checkpoint_every=1",
        *extra,
    ]


def test_a_run_whose_episodes_are_all_masked_stops(tmp_path, capsys, monkeypatch):
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)
    workdir = tmp_path / "run"
    argv = _args(
        workdir,
        "--config.num_steps=6",
        "--config.env.name=test_calculator_no_sandbox",
        "--config.env.max_masked_steps=2",
    )
    assert train_here(argv) == 3
    err = capsys.readouterr().err
    errors = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("error:")]
    assert errors == [
        "error: step 2: 32 of 32 episodes masked by infrastructure errors, 2 step(s) in a row "
        "(env.max_masked_fraction=1.0, env.max_masked_steps=2): the run trains on nothing; the "
        "most frequent error (32 episodes): sandbox did not start: timeout after 30 s; stopped "
        f"(last checkpoint: step 1 in {workdir})"
    ], err[-3000:]
    assert "Traceback" not in err
    # step 1 was saved (one masked step so far), step 2 was not
    assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]
    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    assert [r["episode/masked_frac"] for r in rows if "loss" in r] == [1.0, 1.0]
