"""`python -m launch.bench replay` on a checkpoint: the MoE demo's warm start in bf16."""

import json
import os

import pytest

from launch.bench.replay import main
from tests.conftest import ROOT

ASSETS = os.path.join(ROOT, "configs", "assets")


@pytest.mark.slow  # a sampler and three learner passes compiled (~9 s of CPU)
def test_replay_bench_on_a_trained_checkpoint(tmp_path, capsys):
    """With replay every recorded token's experts are the sampler's (no mismatch), decode replay
    leaves at most the prompt's, and a dense checkpoint is refused in one line."""
    out = tmp_path / "r.json"
    argv = ["--hf_checkpoint", os.path.join(ASSETS, "arithmetic_moe_sft"), "--num_prompts", "8",
            "--new_tokens", "4", "--seeds", "0", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["setting"]: r for r in result["rows"]}
    replayed = rows["replay"]["kl_k3"]  # 0 where the replayed log-probs are the sampler's
    assert result["kl_falls"] == {"0": rows["off"]["kl_k3"] / replayed if replayed else None}
    assert set(rows) == {"off", "own routes", "decode replay", "replay"}
    assert rows["own routes"]["route_mismatch"] == rows["off"]["route_mismatch"]
    assert rows["replay"]["route_mismatch"] == 0.0
    assert rows["decode replay"]["route_mismatch"] <= rows["off"]["route_mismatch"]
    assert all(r["kl_k3"] >= 0 and r["max_abs_r"] < 20 for r in rows.values())
    assert "| 0 | replay | 0.0000 | 0.0000 |" in capsys.readouterr().out
    dense = os.path.join(ASSETS, "arithmetic_sft")
    with pytest.raises(SystemExit, match="a dense model"):
        main(["--hf_checkpoint", dense, "--seeds", "0", "--output", str(out)])


def test_bf16_sampler_and_learner_round_at_the_same_points(tmp_path):
    """The random tiny MoE in bf16, 8 prompts x 8 tokens, 4 seeds: the sampler-vs-learner KL
    (k3 over the sampled tokens), replay off and on, has a median under 1e-7 over the seeds. q
    and k stay f32 from their projection through q/k norm and rope, and the router's and the
    vocabulary's logits are f32 dots (`models.transformer`, `models.moe`, `rl.logprobs`): each
    was rounded to bf16 where one program's XLA kept the round trip and another's dropped it
    (excess precision). Before, under the tests' XLA options: 2.0e-6 - 2.7e-6 on every seed;
    now 4.9e-15, 6.2e-15, 4.9e-9 and 6.5e-7 (seed 0: one token 9e-3 apart, the attention's
    summation order)."""
    out = tmp_path / "r.json"
    argv = ["--num_prompts", "8", "--new_tokens", "8", "--seeds", "0,1,2,3", "--no-dense_twin",
            "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    for setting in ("off", "replay"):
        kl = sorted(r["kl_k3"] for r in rows if r["setting"] == setting)
        assert len(kl) == 4 and (kl[1] + kl[2]) / 2 < 1e-7, (setting, kl)
    assert not any(r["setting"] == "dense twin" for r in rows)


def test_replay_bench_refuses_a_top_k_above_the_experts():
    """The random model's routing shape is checked, in one line, before anything is built."""
    from launch.cli import UsageError

    with pytest.raises(UsageError, match="^--experts_per_token 8 > --num_experts 4$"):
        main(["--num_experts", "4", "--experts_per_token", "8"])
    with pytest.raises(UsageError, match="^--num_experts: shape the random model; --hf_checkpoint"):
        main(["--hf_checkpoint", os.path.join(ASSETS, "arithmetic_moe_sft"), "--num_experts", "4"])


@pytest.mark.slow  # a sampler and four learner passes compiled
def test_replay_bench_with_qwen3_30b_a3b_routing(tmp_path):
    """128 experts, top-8 (int8 route records, ids up to 127): without replay some tokens'
    experts in the learner's pass differ from the sampler's, with it none (read from the pass's
    own record, so a replay that did not reach the routers would show), and the KL falls. 16
    prompts x 16 tokens: since the sampler and the learner round alike (the test above), 4 x 8
    flipped no route."""
    out = tmp_path / "r.json"
    argv = ["--num_experts", "128", "--experts_per_token", "8", "--num_prompts", "16",
            "--new_tokens", "16", "--seeds", "0", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["setting"]: r for r in result["rows"]}
    assert "num_experts=128" in result["model"] and "experts_per_token=8" in result["model"]
    assert rows["off"]["route_mismatch"] > 0 and rows["replay"]["route_mismatch"] == 0.0
    assert rows["replay"]["kl_k3"] < rows["off"]["kl_k3"]
    # The dense twin's row (the mixture with nothing routed) and the replayed KL over its.
    twin = rows["dense twin"]
    assert twin["route_mismatch"] == 0.0 and twin["kl_k3"] >= 0
    want = rows["replay"]["kl_k3"] / twin["kl_k3"] if twin["kl_k3"] else None
    assert result["kl_replay_over_dense_twin"] == {"0": want}


def test_the_dense_twin_is_the_mixture_routed_to_its_first_k_experts_at_equal_gates():
    """`twin_model`: with the mixture's routers zeroed (equal gates, 1/k each once normalised)
    and every token replayed to experts 0..k-1, the mixture's f32 log-probs are the twin's
    (within 1e-5): same weights elsewhere, each MoE block the dense block of those experts."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from launch.bench import replay
    from rl.logprobs import token_logprobs
    from sampling.distribution import SamplingParams

    cfg = dataclasses.replace(replay.CFG, dtype="float32")
    cfg, graphdef, params, prompts, stops = replay.random_model(0, 4, cfg)
    zero = lambda p, x: jnp.zeros_like(x) if "['router']" in jax.tree_util.keystr(p) else x
    params = jax.tree_util.tree_map_with_path(zero, params)
    twin = replay.twin_model((cfg, graphdef, params, prompts, stops))
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), ids.shape)
    valid = np.arange(width) < np.array([len(p) for p in prompts])[:, None]
    k, layers = cfg.experts_per_token, cfg.num_moe_layers
    routes = np.broadcast_to(np.arange(k, dtype=np.int8), (*ids.shape, layers, k))

    def logp(graphdef, params, routes):
        model = nnx.merge(graphdef, params)
        return token_logprobs(model, ids, pos, valid, SamplingParams(1.0), routes=routes).logp

    moe = np.asarray(logp(graphdef, params, routes))
    dense = np.asarray(logp(twin[1], twin[2], None))
    assert twin[0].num_experts == 0 and twin[0].d_ff == k * cfg.expert_d_ff
    np.testing.assert_allclose(dense, moe, atol=1e-5)
    other = np.asarray(logp(graphdef, params, routes + k))  # experts k..2k-1: not the twin
    assert np.abs(other - moe)[valid[:, 1:]].max() > 1e-3
