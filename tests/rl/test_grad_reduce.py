"""The weights' gradients in `grad_reduce_dtype` (`models.transformer.weight_grads_in`), and what
every backend receives of a bf16 model's train step on an FSDP mesh: the partitioned program
(before XLA:CPU's own passes, `launch.estimate`) gathers every weight, the unembedding included,
in bf16, and sums every weight gradient across devices in the configured dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch import estimate
from launch.bench import hlo
from launch.dry_run import abstract_batch
from models import transformer
from models.config import ModelConfig
from models.sharding import (
    DEFAULT_RULES,
    abstract_model,
    flatten,
    make_mesh,
    state_shardings,
    with_shardings,
)
from rl.learner import Learner, LearnerConfig, batch_sharding
from rl.losses import LossConfig

# Untied, so that lm_head and the embedding are two arrays; qkv biases and qk-norm scales, so
# that every kind of parameter has a gradient.
CFG = ModelConfig(
    family="qwen3",
    vocab_size=256,
    d_model=64,
    d_ff=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qkv_bias=True,
    qk_norm=True,
    tie_embeddings=False,
    dtype="bfloat16",
    remat=True,
    attention="blockwise",
)


def _rand(shape, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def test_weight_gradients_are_f32_sums_of_the_bf16_products():
    """With float32, a weight's, a bias's and a norm scale's gradient is the f32 sum of the bf16
    products (512-term sums of exact products); in the compute dtype it is rounded to bf16. The
    forward pass is the same either way."""
    x, ct = _rand((4, 128, 16), jnp.bfloat16, 0), _rand((4, 128, 8), jnp.bfloat16, 1)
    w, b, s = (
        _rand((16, 8), jnp.float32, 2),
        _rand((8,), jnp.float32, 3),
        _rand((16,), jnp.float32, 4),
    )
    y = _rand((4, 128, 8), jnp.bfloat16, 5)
    dot = lambda a, c: jnp.sum(a.astype(jnp.float32) * c.astype(jnp.float32))
    losses = {  # each parameter's use, its loss and the f64 sum of the bf16 products
        "matmul": (
            lambda w: dot(transformer._matmul("BTD,DF->BTF", x, w), ct),
            w,
            np.einsum("btd,btf->df", *(np.asarray(a, np.float64) for a in (x, ct))),
        ),
        "bias": (
            lambda b: dot(transformer._add(y, b), ct),
            b,
            np.asarray(ct, np.float64).sum((0, 1)),
        ),
        "scale": (
            lambda s: dot(transformer._scale(s, x), x),
            s,
            (np.asarray(x, np.float64) ** 2).sum((0, 1)),
        ),
    }
    for name, (loss, p, ref) in losses.items():
        plain = jax.grad(loss)(p)  # outside the context: the compute dtype
        with transformer.weight_grads_in("float32"):
            f32, inside = jax.grad(loss)(p), loss(p)
        assert inside == loss(p), name
        scale = np.abs(ref).max()
        np.testing.assert_allclose(
            np.asarray(f32, np.float64), ref, atol=3e-6 * scale, err_msg=name
        )
        err = np.abs(np.asarray(plain, np.float64) - ref).max() / scale  # rounded to bf16
        assert err > 1e-4, (name, err)


def _step(grad_reduce_dtype):
    mesh = make_mesh({"fsdp": 8}, devices=jax.devices()[:8])
    graphdef, shapes = abstract_model(CFG)
    shardings = state_shardings(shapes, mesh, DEFAULT_RULES)
    params = with_shardings(shapes, shardings)
    cfg = LearnerConfig(
        loss=LossConfig(kl_coef=0.04), grad_reduce_dtype=grad_reduce_dtype, logprob_chunk=32
    )
    learner = Learner(cfg, graphdef, shardings)
    batch = abstract_batch(8, 64, batch_sharding(mesh, DEFAULT_RULES), ref_logp=True)
    return estimate.compile(learner.lower_step(params, batch)), params


@pytest.mark.parametrize("grad_reduce_dtype, dtype", [("float32", "f32"), ("bfloat16", "bf16")])
def test_partitioned_step_gathers_bf16_and_reduces_in_the_configured_dtype(
    grad_reduce_dtype, dtype
):
    est, params = _step(grad_reduce_dtype)
    named = flatten(params)
    # the sharded matrices; the embedding is looked up in its shards, never gathered
    weights = {
        n: tuple(x.shape)
        for n, x in named.items()
        if x.ndim >= 2 and x.sharding.shard_shape(x.shape) != x.shape and n != "embed"
    }
    shapes = {tuple(x.shape) for x in named.values()}
    shapes |= {tuple(x.sharding.shard_shape(x.shape)) for x in named.values()}
    items = hlo.collectives(est.partitioned)
    gathers = [c for c in items if c.kind == "all-gather" and c.shapes[0][1] in weights.values()]
    # every weight matrix gathered, each in bf16: lm_head [D,V] and a layer's MLP [D,F] too
    assert {c.shapes[0][1] for c in gathers} == set(weights.values()), sorted(weights)
    assert {c.shapes[0][0] for c in gathers} == {"bf16"}, [(c.name, c.shapes) for c in gathers]
    assert (CFG.d_model, CFG.vocab_size) in {c.shapes[0][1] for c in gathers}
    # every parameter's gradient summed across the devices, in the configured dtype
    grads = estimate.gradient_reductions(est.partitioned, shapes)
    assert {d for c in grads for d, _ in c.shapes} == {dtype}, [(c.name, c.shapes) for c in grads]
    # each one's full gradient (as autodiff lays it out), but the embedding's: its lookup's
    # gradient is added into its shards
    reduced = {tuple(sorted(dims)) for c in grads for _, dims in c.shapes}
    full = {tuple(sorted(x.shape)) for n, x in named.items() if n != "embed"}
    assert full <= reduced, full - reduced
    by = estimate.by_dtype(grads)
    assert by[dtype]["count"] == len(grads) >= len(weights)
