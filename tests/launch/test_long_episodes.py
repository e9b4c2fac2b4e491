"""End to end at 4k tokens: `launch.train` with the CPU demo's tiny model, prompts of 300 to 4,007
tokens (so episodes up to 4,071 tokens), blockwise learner attention and chunked prefill, trains
a step with finite metrics and a non-zero gradient, two sequences packed per learner row on
average. (One step, for the suite's time: a second rollout under the updated weights and a second
optimizer step on the same row shapes are not checked here at 4k tokens.)"""

import json
import math

import numpy as np
import pytest

from launch.train import main

# A training run at 4k tokens. Its time goes to running the 4k-token programs, not to compiling
# them, so it compiles optimized (tests/conftest.py; cold cache: 91 s of CPU at -O0 -> 40 s).
pytestmark = [pytest.mark.slow, pytest.mark.optimized]


LENGTHS = (300, 500, 700, 900, 1100, 1300, 1500, 4000)  # filler digits before the task


def _records(lengths, seed=0):
    """Arithmetic tasks after a long run of digits: 'd...d*12+34=' with answer '46'."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        filler = "".join(map(str, rng.integers(0, 10, n)))
        a, b = rng.integers(10, 100, 2)
        out.append({"prompt": f"{filler}*{a}+{b}=", "answer": str(a + b)})
    return out


def test_4k_token_episodes_train_blockwise_and_packed(tmp_path, monkeypatch):
    from rl import rewards

    # The warm start never answers after 4k digits: a reward with variance (the completion's
    # length) so that the advantages, the loss and the gradient are not all zero.
    lengths = lambda prompts, completions, **_: [float(len(c)) for c in completions]
    monkeypatch.setitem(rewards.REWARDS, "arithmetic_exact", lengths)
    data, held_out = tmp_path / "long.jsonl", tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records(LENGTHS)))
    held_out.write_text(json.dumps(_records([10])[0]) + "\n")  # evaluation is not the point
    workdir = tmp_path / "run"
    args = [
        "--config.mesh.data=8", "--config.model.attention=blockwise",
        "--config.data.train.type=jsonl", f"--config.data.train.path={data}",
        "--config.data.eval.type=jsonl", f"--config.data.eval.path={held_out}",
        "--config.data.prompts_per_step=8", "--config.rl.num_generations=2",
        "--config.sampling.max_prompt_len=4032", "--config.sampling.max_new_tokens=64",
        "--config.sampling.num_slots=16", "--config.sampling.page_size=16",
        "--config.sampling.num_pages=4200", "--config.sampling.steps_per_call=16",
        "--config.sampling.prefill_chunk=512", "--config.eval_every=0", "--config.eval.pass_k=0",
        "--config.num_steps=1", "--config.checkpoint_every=1", f"--workdir={workdir}",
    ]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1]
    for r in steps:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["grad_norm"] > 0 and r["adv_std"] > 0, r
        # All 8 prompts x 2 samples, 300-4,071 tokens each (20.6k in all), in rows of
        # 4,096 tokens: each of the 8 data shards packs its own group, into as many rows as
        # the shard that needs most (2 here: a pair longer than a row): 16 rows.
        assert r["learn/rows"] == 16 and r["rollout/length_max"] <= 64, r
