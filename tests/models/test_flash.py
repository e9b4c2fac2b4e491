"""Blockwise (flash) attention (models/flash.py) against the dense reference: outputs and
dq/dk/dv for packed rows, GQA, padding, rows of length 1, lengths that are not block multiples and
blocks smaller than T; a whole tiny model's logits and parameter gradients; and the lowered
program of a long row holds no [T,T] array, forward or backward."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.attention import (
    BlockwiseCausal,
    DenseCausal,
    SegmentCausal,
    causal_hook,
    causal_mask,
    dense_attention,
    resolve_attention,
)
from models.config import ModelConfig
from models.flash import blockwise_attention
from models.sharding import abstract_model, flatten, init_params, make_mesh

# (name, segment ids per row, N, K, block_q, block_k); T = row length.
CASES = [
    ("packed_padded", [[0] * 2 + [1] * 9 + [2] * 3 + [3] * 20 + [4] * 3, [1] * 30 + [0] * 7],
     4, 2, 8, 5),
    ("gqa_k1", [[1] * 20 + [2] * 17, [1] * 37], 4, 1, 16, 8),
    ("length_1_rows", [[1], [0]], 4, 2, 128, 128),
    ("length_1_segments", [[1, 2, 3, 0, 4, 5, 5], [1, 1, 2, 3, 3, 3, 4]], 2, 2, 2, 3),
    ("bq_lt_bk", [[1] * 16 + [2] * 19, [1] * 35], 4, 2, 4, 16),
]  # fmt: skip
H = 8


def _inputs(seg, n, k, seed=0):
    seg = jnp.asarray(seg, jnp.int32)  # [B,T]
    b, t = seg.shape
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, H))
    kk = jax.random.normal(keys[1], (b, t, k, H))
    v = jax.random.normal(keys[2], (b, t, k, H))
    real = (seg > 0)[:, :, None, None]
    w = jax.random.normal(keys[3], (b, t, n, H)) * real  # padding queries' outputs unused
    return seg, q, kk, v, w, real


def _out_and_grads(attn, w, q, k, v):
    """attention output and the gradients of sum(w * output) w.r.t. q, k, v."""
    f = lambda q, k, v: jnp.sum(w * attn(q, k, v))
    return attn(q, k, v), jax.grad(f, (0, 1, 2))(q, k, v)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_blockwise_equals_dense(case):
    """Also: a padding query's output is 0 and sends no gradient (blockwise gets weights on
    padding outputs too, dense does not: the gradients still agree)."""
    _, seg, n, k, bq, bk = case
    seg, q, kk, v, w, real = _inputs(seg, n, k)
    noise = jax.random.normal(jax.random.key(9), w.shape) * ~real
    dense = lambda q, k, v: dense_attention(q, k, v, causal_mask(seg))
    block = lambda q, k, v: blockwise_attention(q, k, v, seg, bq, bk)
    out_d, grads_d = jax.jit(_out_and_grads, static_argnums=0)(dense, w, q, kk, v)
    out_b, grads_b = jax.jit(_out_and_grads, static_argnums=0)(block, w + noise, q, kk, v)
    assert out_b.shape == q.shape and out_b.dtype == q.dtype
    np.testing.assert_allclose(out_b * real, out_d * real, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(out_b * ~real, 0.0)
    for name, gb, gd in zip("qkv", grads_b, grads_d):
        np.testing.assert_allclose(gb, gd, atol=1e-5, rtol=0, err_msg=f"d{name}")
    np.testing.assert_array_equal(grads_b[0] * ~real, 0.0)


def test_auto_resolution_and_config_validation():
    assert resolve_attention("auto", 512, "cpu") == "dense"
    assert resolve_attention("auto", 513, "cpu") == "blockwise"
    assert resolve_attention("auto", 16, "gpu") == "blockwise"  # head_dim unknown
    assert resolve_attention("auto", 16, "gpu", 64) == "pallas_gpu"
    assert resolve_attention("auto", 16, "cuda", 80) == "blockwise"  # not a power of two
    assert resolve_attention("auto", 16, "tpu", 64) == "splash"
    assert resolve_attention("auto", 16, "tpu", 96) == "blockwise"
    assert resolve_attention("auto", 16, "rocm", 8) == "blockwise"  # Triton tiles >= 16
    assert resolve_attention("dense", 10**6, "tpu") == "dense"
    seg = jnp.ones((1, 200), jnp.int32)
    assert isinstance(causal_hook(seg, "dense"), DenseCausal)
    hook = causal_hook(seg[:, :16] > 0, "blockwise")  # bool valid: one sequence per row
    assert isinstance(hook, BlockwiseCausal) and hook.segments.dtype == jnp.int32
    for attention in ("auto", "splash", "pallas_gpu"):
        hook = causal_hook(seg > 0, attention)
        assert isinstance(hook, SegmentCausal) and hook.attention == attention
        assert hook.segments.dtype == jnp.int32
    with pytest.raises(ValueError, match=r"^ModelConfig.attention='flash': expected one of"):
        dataclasses.replace(CFG, attention="flash")


CFG = ModelConfig(
    family="qwen3", vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=4,
    num_kv_heads=2, head_dim=8, qk_norm=True, attention="dense",
)  # fmt: skip


def _packed_batch(t, rows=4, seed=0):
    """Packed rows of t tokens: several sequences each (one of length 1), some padding."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, t), np.int32)
    pos = np.zeros((rows, t), np.int32)
    layouts = [[t // 2, 1, t // 4, t - t // 2 - 1 - t // 4], [t // 3, t // 2], [t], [1, t - 9]]
    for r in range(rows):
        start = 0
        for s, n in enumerate(layouts[r % len(layouts)], 1):
            seg[r, start : start + n], pos[r, start : start + n] = s, np.arange(n)
            start += n
    tokens = rng.integers(1, CFG.vocab_size, (rows, t)).astype(np.int32) * (seg > 0)
    return tokens, pos, seg


def test_whole_model_blockwise_equals_dense():
    """Logits and every parameter's gradient (of a loss over a packed batch's logits, rows of 150
    tokens: two blocks of 128, padded inside), with the blockwise model rematerialised (its custom
    VJP inside jax.checkpoint), parameters and rows sharded on the (2, 2, 2) mesh of 8 CPU
    devices."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    tokens, pos, seg = jax.device_put(_packed_batch(150), rows)
    real = (seg > 0)[..., None]
    w = jax.random.normal(jax.random.key(3), (*tokens.shape, CFG.vocab_size)) * real / real.sum()
    graphdef, params = init_params(CFG, mesh, seed=0)
    blockwise = dataclasses.replace(CFG, attention="blockwise", remat=True)

    hooks = []

    def grads(graphdef):
        def loss(params):
            logits, attend = nnx.merge(graphdef, params)(tokens, pos, seg)
            hooks.append(type(attend))
            return jnp.sum(w * logits), logits

        return jax.jit(jax.grad(loss, has_aux=True))(params)

    g_dense, logits_dense = grads(graphdef)
    g_block, logits_block = grads(abstract_model(blockwise)[0])
    assert hooks == [DenseCausal, BlockwiseCausal]
    np.testing.assert_allclose(logits_block * real, logits_dense * real, atol=1e-5, rtol=0)
    flat_d, flat_b = flatten(g_dense), flatten(g_block)
    assert flat_d.keys() == flat_b.keys() and len(flat_d) > 10
    for name, gd in flat_d.items():
        assert float(jnp.abs(gd).max()) > 0, name
        np.testing.assert_allclose(flat_b[name], gd, atol=1e-5, rtol=0, err_msg=name)
        assert flat_b[name].sharding.is_equivalent_to(gd.sharding, gd.ndim), name


def _shapes(text):
    """Array shapes in StableHLO (tensor<2x3xf32>) or HLO (f32[2,3]) text."""
    mlir = [s.split("x")[:-1] for s in re.findall(r"tensor<([0-9x]+[a-z][a-z0-9]*)>", text)]
    hlo = [s.split(",") for s in re.findall(r"\b[a-z]+[0-9]*\[([0-9,]+)\]", text)]
    return [tuple(int(d) for d in s) for s in mlir + hlo if all(s)]


def test_long_row_has_no_t_by_t_array():
    b, t, n, k = 1, 2048, 4, 2
    q = jax.ShapeDtypeStruct((b, t, n, H), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, t, k, H), jnp.float32)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)
    block = lambda q, k, v, s: blockwise_attention(q, k, v, s, 128, 128)
    dense = lambda q, k, v, s: dense_attention(q, k, v, causal_mask(s))

    def lowered(attn, grad):
        f = lambda q, k, v, s: jnp.sum(attn(q, k, v, s))
        return jax.jit(jax.grad(f, (0, 1, 2)) if grad else f).lower(q, kv, kv, seg)

    square = lambda shape: sum(d >= t for d in shape) >= 2
    for grad in (False, True):
        low = lowered(block, grad)
        for text in (low.as_text(), low.compile().as_text()):
            shapes = _shapes(text)
            assert any(s[1:2] == (t,) for s in shapes)  # the parser sees the [B,T,...] arrays
            assert not [s for s in shapes if square(s)], grad
        assert any(square(s) for s in _shapes(lowered(dense, grad).as_text()))  # the detector
    temp = lambda attn: lowered(attn, True).compile().memory_analysis().temp_size_in_bytes
    assert temp(block) * 10 < temp(dense)


def test_bf16_scores_stay_f32_in_dense_and_blockwise():
    """With bf16 q, k, v the dense path's scores and its P @ V are f32 inside, as the blockwise
    path's and the paged decode's are: large scores (|s| ~ 30, where bf16's step is 0.125, a 13 %
    change of a probability) are not rounded before the softmax. The learner's attention on CPU
    and the sampler's prefill (sampling/state.py) are this dense path; the decode step that
    continues that prefill is f32 inside (sampling/paged_attention.py)."""
    seg, q, kk, v, _, real = _inputs([[1] * 24 + [2] * 9, [1] * 33], 4, 2, seed=3)
    q, kk, v = (x.astype(jnp.bfloat16) for x in (q * 6.0, kk * 3.0, v))
    mask = causal_mask(seg)  # [B,T,S]
    exact = dense_attention(*(x.astype(jnp.float32) for x in (q, kk, v)), mask)
    seen = jnp.einsum("BTNH,BSNH->BNTS", q[:, :, ::2], kk) * H**-0.5 * mask[:, None]
    assert float(jnp.abs(seen).max()) > 30  # scaled scores a query attends to
    ulp = lambda x: jnp.abs(x.astype(jnp.float32)) * 2.0**-7 + 1e-6  # one bf16 step, at least
    for name, out in (
        ("dense", dense_attention(q, kk, v, mask)),
        ("blockwise", blockwise_attention(q, kk, v, seg, 8, 8)),
    ):
        assert out.dtype == jnp.bfloat16, name
        err = jnp.abs(out.astype(jnp.float32) - exact) * real
        assert bool((err <= ulp(exact)).all()), (name, float(err.max()))
