"""Long exact resume: 2N steps straight equal N steps, a resume, and N more, with the options that
carry the most state (μ = 2 passes, 2 minibatches, DAPO dynamic sampling with refill rounds, a KL
reference, evaluation during the run); and every record of an epoch is drawn exactly once, none
skipped, none repeated, across the resume. N = 6 here (checkpoints and evaluations every 3 steps,
an epoch of 16 records: the resume lands mid-epoch after two checkpoints, and the run crosses
three epochs); `LONG_RESUME_N=50 pytest tests/launch/test_long_resume.py` runs the long version."""

import collections
import json
import os

import pytest

from launch.cli import parse_args
from rl.data import PromptStream
from rl.sources import load_records
from tests.conftest import train_here, train_metrics

# three training runs of 6-12 steps, in this process on one device (tests.conftest.train_here: the
# run a one-device subprocess makes); their time goes to running the steps (μ = 2 x 2
# minibatches, refill rounds), so they compile optimized (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.optimized]

N = int(os.environ.get("LONG_RESUME_N", 6))
RECORDS = 16  # one epoch: 4 steps of 4 prompts, fewer with refill rounds
ARGS = [
    "--config.data.prompts_per_step=4", "--config.rl.num_generations=4",
    f"--config.data.train.num={RECORDS}", "--config.rl.num_iterations=2",
    "--config.rl.minibatches=2", "--config.rl.dynamic_sampling=True",
    "--config.rl.dynamic_sampling_max_tries=3", "--config.rl.kl_coef=0.04",
    "--config.eval_every=3", "--config.data.eval.num=8", "--config.eval.pass_k=0",
    "--config.checkpoint_every=3", "--config.sampling.num_slots=32",
]  # fmt: skip


TAKE = PromptStream.take_shards


def _run(workdir, steps, drawn, monkeypatch):
    def recording(self, counts, mine):
        out = TAKE(self, counts, mine)
        drawn.extend((r["prompt"], r["answer"]) for part in out for r in part or [])
        return out

    monkeypatch.setattr(PromptStream, "take_shards", recording)
    assert train_here(ARGS + [f"--config.num_steps={steps}", f"--workdir={workdir}"]) == 0


def _evals(workdir):
    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    return {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}


def test_long_resume_is_exact_and_uses_every_record_once_per_epoch(tmp_path, monkeypatch):
    straight, split = tmp_path / "straight", tmp_path / "split"
    drawn_straight, drawn_split = [], []
    _run(straight, 2 * N, drawn_straight, monkeypatch)
    _run(split, N, drawn_split, monkeypatch)
    assert len(drawn_split) % RECORDS, "the resume would start at an epoch boundary"
    _run(split, 2 * N, drawn_split, monkeypatch)
    a, b = json.load(open(straight / "summary.json")), json.load(open(split / "summary.json"))
    assert a["params_fingerprint"] == b["params_fingerprint"]
    assert train_metrics(straight) == train_metrics(split)  # loss, KL, reward, grad norm, ...
    assert sorted(train_metrics(split)) == list(range(1, 2 * N + 1))
    assert _evals(straight) == _evals(split) and len(_evals(split)) >= 2 * N // 3
    assert drawn_straight == drawn_split  # the same records in the same order across the resume
    config = parse_args(ARGS, {})[0]
    epoch = collections.Counter((r["prompt"], r["answer"]) for r in load_records(config.data.train))
    full = len(drawn_split) // RECORDS
    assert full >= 3  # three whole epochs drawn, the resume in the middle of one
    for e in range(full):
        chunk = drawn_split[e * RECORDS : (e + 1) * RECORDS]
        assert collections.Counter(chunk) == epoch, f"epoch {e}: a record skipped or repeated"
