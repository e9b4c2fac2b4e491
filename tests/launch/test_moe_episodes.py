"""A mixture of experts trained on multi-turn tool episodes (issue 52 item 5): the CPU tool demo
(configs/calc_tool.py, the calculator) on a random tiny Qwen3-MoE that writes the calculator's
characters. Every MoE run records the sampler's experts (`launch.validate.records_routes`), the
observations' too, so with replay off the learner logs `rollout/route_mismatch` on tool episodes
and with partial rollouts, as on single-turn runs: in f32 with the sampler's own parameters it is
0 (a record shifted by a token, or an observation's taken from another pass, would not be); with
replay on the learner routes by the record and logs no mismatch. The runs are in this process
(tests.conftest.train_here, one device)."""

import json
import shutil

import jax
import pytest

from models.config import ModelConfig
from models.hf import save_hf
from models.hf_config import config_from_hf, generation_ids
from models.sharding import init_params, make_mesh
from tests.conftest import ROOT, train_here

pytestmark = pytest.mark.slow  # three short training runs

CALC = f"{ROOT}/configs/assets/calc_sft"
ARGS = [
    f"--config={ROOT}/configs/calc_tool.py", "--config.num_steps=2", "--config.eval_every=0",
    "--config.checkpoint_every=0", "--config.data.prompts_per_step=4",
    "--config.rl.num_generations=4", "--config.data.eval.num=4",
]  # fmt: skip


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A random 2-layer Qwen3-MoE (4 experts, top-2) with calc_sft's vocabulary and tokenizer."""
    out = tmp_path_factory.mktemp("moe_calc")
    base = config_from_hf(CALC)
    cfg = ModelConfig(
        family="qwen3_moe", vocab_size=base.vocab_size, d_model=32, d_ff=48, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, tie_embeddings=True,
        max_position_embeddings=base.max_position_embeddings, num_experts=4,
        experts_per_token=2, expert_d_ff=24, norm_topk_prob=True, moe_layers=(0, 1),
    )  # fmt: skip
    _, params = init_params(cfg, make_mesh({}, devices=jax.devices()[:1]), seed=0)
    save_hf(str(out), cfg, params, generation_ids(CALC))
    shutil.copy(f"{CALC}/char_tokenizer.json", out)
    return out


def _rows(workdir):
    return [json.loads(x) for x in open(workdir / "metrics.jsonl") if '"loss"' in x]


@pytest.mark.parametrize("partial", (False, True))
def test_tool_episodes_log_route_mismatch_without_replay(moe, tmp_path, partial):
    argv = [f"--workdir={tmp_path}", *ARGS, f"--config.model.hf_checkpoint={moe}"]
    more = ["--config.rl.partial_rollouts=True", "--config.rl.is_correction=tis"] if partial else []
    assert train_here([*argv, *more]) == 0
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert sum(r["episode/tool_calls"] for r in rows) > 0  # observations were fed and recorded
    for r in rows:
        assert 0.0 <= r["rollout/route_mismatch_layers"] <= r["rollout/route_mismatch"] <= 1.0
    # The learner's parameters are the sampler's (mu = 1): the same experts. With partial
    # rollouts later steps also train episodes sampled under earlier parameters.
    checked = rows if not partial else rows[:1]
    assert all(r["rollout/route_mismatch"] == 0.0 for r in checked), rows


def test_tool_episodes_train_on_the_replayed_routes(moe, tmp_path):
    argv = [f"--workdir={tmp_path}", *ARGS, f"--config.model.hf_checkpoint={moe}"]
    assert train_here([*argv, "--config.rl.routing_replay=rollout"]) == 0
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert not any("rollout/route_mismatch" in r for r in rows)
    assert all(r["router/entropy"] > 0 for r in rows)
