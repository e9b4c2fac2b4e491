"""The learner with LoRA (models/lora.py): gradients of the adapters against the chain rule
through the full model's weight gradients, only adapters updated and holding optimizer state,
the reference with the adapters off, and checkpoints of the adapters alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import lora
from models.sharding import (
    DEFAULT_RULES,
    base_graphdef,
    flatten,
    init_params,
    make_mesh,
    state_shardings,
)
from rl.checkpoint import Checkpointer
from rl.learner import Learner, LearnerConfig, batch_sharding
from rl.losses import LossConfig
from tests.rl.test_learner import CFG, _batch

LCFG = dataclasses.replace(CFG, lora_rank=4, lora_alpha=8.0)
CONFIG = LearnerConfig(learning_rate=1e-2, loss=LossConfig(kl_coef=0.1))


@pytest.fixture(scope="module")
def setup():
    """(mesh, LoRA learner, its params with non-zero adapters, a sharded batch) on 2 x 2 x 2."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, params = init_params(LCFG, mesh, DEFAULT_RULES, seed=0)
    adapters, base = lora.split(params)
    adapters = jax.tree.map(lambda x: x + 0.05 * jnp.ones_like(x), adapters)  # B != 0
    params = nnx.merge_state(adapters, base)
    shardings = state_shardings(params, mesh, DEFAULT_RULES)
    learner = Learner(CONFIG, graphdef, shardings, base_graphdef(LCFG))
    batch = jax.device_put(_batch(), batch_sharding(mesh, DEFAULT_RULES))
    return mesh, learner, params, batch


def test_adapter_gradients_follow_the_chain_rule(setup):
    """W_eff = W + s A B, so dL/dA = s G B^T and dL/dB = s A^T G, G = dL/dW_eff: the full
    learner's gradient on the folded weights (an independent path: no adapters in it)."""
    mesh, learner, params, batch = setup
    grads = flatten(learner.grads(params, batch)[0])
    folded = lora.merge(LCFG, params)
    full = Learner(CONFIG, base_graphdef(LCFG), state_shardings(folded, mesh, DEFAULT_RULES))
    g_full = flatten(full.grads(folded, batch)[0])
    assert set(grads) == set(flatten(lora.split(params)[0]))  # gradients of the adapters only
    p, s = flatten(params), LCFG.lora_alpha / LCFG.lora_rank
    for i in range(LCFG.num_layers):
        for name in lora.TARGETS:
            where = f"blocks.{i}.{'attn' if name in lora.ATTENTION else 'mlp'}.{name}"
            a, b = np.asarray(p[f"{where}_lora.lora_a"]), np.asarray(p[f"{where}_lora.lora_b"])
            g = np.asarray(g_full[where]).reshape(a.shape[0], b.shape[1])
            np.testing.assert_allclose(
                grads[f"{where}_lora.lora_a"], s * g @ b.T, rtol=3e-4, atol=1e-5
            )
            np.testing.assert_allclose(
                grads[f"{where}_lora.lora_b"], s * a.T @ g, rtol=3e-4, atol=1e-5
            )


def test_only_adapters_train_and_the_reference_is_the_base(setup, tmp_path):
    mesh, learner, params, batch = setup
    base_before = {k: np.asarray(v) for k, v in flatten(lora.base(params)).items()}
    # Reference = adapters off: the plain model on the same base arrays.
    plain = Learner(CONFIG, base_graphdef(LCFG), learner.split(learner.param_shardings)[1])
    ref = learner.reference_logprobs(params, None, batch)
    np.testing.assert_array_equal(ref, plain.logprobs(lora.base(params), batch, "full"))
    assert (
        np.abs(np.asarray(ref) - np.asarray(learner.logprobs(params, batch, "full"))).max() > 1e-4
    )
    state = learner.init_state(jax.tree.map(jnp.copy, params))
    n_adapter = sum(x.size for x in jax.tree.leaves(lora.split(params)[0]))
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert n_opt == 2 * n_adapter  # AdamW's two moments, of the adapters only
    state, metrics = learner.step(state, batch.replace(ref_logp=ref))
    assert float(metrics["skipped"]) == 0
    after = flatten(state.params)
    for k, v in base_before.items():
        np.testing.assert_array_equal(after[k], v)  # the base is frozen, bitwise
    moved = [k for k, v in flatten(lora.split(state.params)[0]).items()
             if np.abs(np.asarray(v) - np.asarray(flatten(params)[k])).max() > 0]  # fmt: skip
    assert len(moved) == 2 * len(lora.TARGETS) * LCFG.num_layers
    # A checkpoint holds the adapters, their optimizer state and the step; restoring it into a
    # state with other adapters gives back exactly this one.
    saved = learner.checkpointed(state)
    assert set(flatten(saved.params)) == set(flatten(lora.split(params)[0]))
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(1, saved, {"step": 1})
    other = learner.init_state(jax.tree.map(jnp.copy, params))
    restored_saved, _ = ckpt.restore(learner.checkpointed(other), 1)
    ckpt.close()
    restored = learner.restored(other, restored_saved)
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(x, y)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
