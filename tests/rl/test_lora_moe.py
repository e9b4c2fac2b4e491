"""LoRA on a mixture of experts (issue 52 item 6): adapters on the attention projections of a
tiny Qwen3-MoE, the experts and the router frozen, the reference the base with the adapters off;
adapters on the experts are refused at start-up, naming the field."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from launch.validate import UsageError, check_lora_targets
from models import lora
from models.config import ModelConfig
from models.sharding import (
    DEFAULT_RULES,
    base_graphdef,
    flatten,
    init_params,
    make_mesh,
    state_shardings,
)
from rl.learner import Learner, LearnerConfig, batch_sharding
from rl.losses import LossConfig
from tests.rl.test_learner import _batch

# Layers 0 and 2 with experts (8, top-2), layer 1 dense: adapters on q, k, v, o of all three.
CFG = ModelConfig(
    family="qwen3_moe",
    vocab_size=64,
    d_model=32,
    d_ff=40,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
    num_experts=8,
    experts_per_token=2,
    expert_d_ff=24,
    norm_topk_prob=True,
    moe_layers=(0, 2),
    lora_rank=4,
    lora_alpha=8.0,
    lora_targets=lora.ATTENTION,
)
CONFIG = LearnerConfig(learning_rate=1e-2, loss=LossConfig(kl_coef=0.1))


@pytest.mark.slow  # 16 s on the loaded 2-core host (the partitioned step's compile)
def test_one_step_trains_the_adapters_only():
    """expert=2 x fsdp=2 x tensor=2: one learner step moves every adapter (A and B) and nothing
    else; the experts, the router and the rest of the base are bitwise unchanged, and the
    reference log-probs are the base model's (the adapters off) on the same arrays."""
    mesh = make_mesh({"expert": 2, "fsdp": 2, "tensor": 2})
    graphdef, params = init_params(CFG, mesh, DEFAULT_RULES, seed=0)
    adapters, base = lora.split(params)
    adapters = jax.tree.map(lambda x: x + 0.05 * jnp.ones_like(x), adapters)  # B != 0
    params = nnx.merge_state(adapters, base)
    names = set(flatten(adapters))
    assert names == {
        f"blocks.{i}.attn.{p}_lora.lora_{ab}"
        for i in range(CFG.num_layers)
        for p in lora.ATTENTION
        for ab in "ab"
    }
    shardings = state_shardings(params, mesh, DEFAULT_RULES)
    learner = Learner(CONFIG, graphdef, shardings, base_graphdef(CFG), DEFAULT_RULES)
    batch = jax.device_put(_batch(rows=8), batch_sharding(mesh, DEFAULT_RULES))
    base_before = {k: np.asarray(v) for k, v in flatten(lora.base(params)).items()}
    moe = {k for k in base_before if k.startswith(("blocks.0.mlp.", "blocks.2.mlp."))}
    assert moe == {f"blocks.{i}.mlp.{w}" for i in (0, 2) for w in ("router", "gate", "up", "down")}

    plain = Learner(CONFIG, base_graphdef(CFG), learner.split(shardings)[1], rules=DEFAULT_RULES)
    ref = learner.reference_logprobs(params, None, batch)
    np.testing.assert_array_equal(ref, plain.logprobs(lora.base(params), batch, "full"))
    assert (
        np.abs(np.asarray(ref) - np.asarray(learner.logprobs(params, batch, "full"))).max() > 1e-4
    )

    state = learner.init_state(jax.tree.map(jnp.copy, params))
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert n_opt == 2 * sum(x.size for x in jax.tree.leaves(adapters))  # AdamW, adapters only
    state, metrics = learner.step(state, batch.replace(ref_logp=ref))
    assert float(metrics["skipped"]) == 0
    after = flatten(state.params)
    for k, v in base_before.items():  # experts, router, attention, norms, embedding: frozen
        np.testing.assert_array_equal(after[k], v, err_msg=k)
    before = flatten(params)
    for k in names:
        assert np.abs(np.asarray(after[k]) - np.asarray(before[k])).max() > 0, k


@pytest.mark.parametrize("targets", [("q", "gate"), ("up",), lora.TARGETS])
def test_adapters_on_experts_are_refused(targets):
    c = ml_collections.ConfigDict(
        {"model": {"lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": targets}}}
    )
    with pytest.raises(UsageError) as e:
        check_lora_targets(c, CFG)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"config.model.lora.targets={targets!r}")
    assert "experts" in msg
    check_lora_targets(
        c,
        dataclasses.replace(
            CFG, family="qwen3", num_experts=0, experts_per_token=0, expert_d_ff=0, moe_layers=()
        ),
    )
    c.model.lora.targets = lora.ATTENTION
    check_lora_targets(c, CFG)
    c.model.lora.targets, c.model.lora.rank = targets, 0
    check_lora_targets(c, CFG)  # LoRA off: targets unused
