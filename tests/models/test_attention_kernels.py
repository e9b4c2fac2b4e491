"""The learner's Pallas attention kernels (models/attention_kernels.py) against the dense
reference: splash (TPU) and the Triton flash attention (pallas_gpu), both in Pallas interpret mode
on CPU. Outputs and dq/dk/dv for packed rows with segment ids, GQA, padding, lengths that are not
block multiples and head_dim 64, in f32 and bf16; a tiny model with cfg.attention set to each
kernel on the (2, 2, 2) mesh (through the shard_map) against the dense model; and a small model's
forward + backward lowered with `jax.export` for TPU (splash) and CUDA (pallas_gpu) from this CPU
host, on one device and on 8, and "auto" choosing per lowering platform.

Lowering runs the Pallas TPU (Mosaic) and Triton lowerings without the chips; Mosaic and Triton
compile the kernels only when XLA compiles the module on a TPU or GPU, so what they would reject
at compile time is not seen here (tests/sampling/test_tpu_export.py says the same for decode).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import attention_kernels
from models.attention import SegmentCausal, causal_mask, dense_attention, lowering_for
from models.config import ModelConfig
from models.sharding import (
    abstract_model,
    flatten,
    init_params,
    make_mesh,
    state_shardings,
    with_shardings,
)

KERNELS = ("splash", "pallas_gpu")
TRITON = "__gpu$xla.gpu.triton"  # the custom call of a Pallas Triton kernel

# (name, segment ids per row, N, K, H): T = row length, never a multiple of 128 here.
CASES = [
    ("packed_padded", [[0] * 3 + [1] * 40 + [2] * 1 + [3] * 50 + [0] * 6, [1] * 70 + [0] * 30],
     4, 2, 16),
    ("gqa_r4_k1", [[1] * 60 + [2] * 40, [1] * 100], 4, 1, 8),
    ("head_dim_64", [[1] * 130 + [2] * 20 + [0] * 50, [0] * 10 + [1] * 190], 4, 2, 64),
]  # fmt: skip


def _inputs(seg, n, k, h, dtype=jnp.float32, seed=0):
    seg = jnp.asarray(seg, jnp.int32)  # [B,T]
    b, t = seg.shape
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h)).astype(dtype)
    kk = jax.random.normal(keys[1], (b, t, k, h)).astype(dtype)
    v = jax.random.normal(keys[2], (b, t, k, h)).astype(dtype)
    real = (seg > 0)[:, :, None, None]
    w = jax.random.normal(keys[3], (b, t, n, h)) * real  # padding outputs are never read
    return seg, q, kk, v, w, real


def _out_and_grads(attn, w, q, k, v):
    """attention output and the gradients of sum(w * output) w.r.t. q, k, v."""
    f = lambda q, k, v: jnp.sum(w * attn(q, k, v).astype(jnp.float32))
    return attn(q, k, v), jax.grad(f, (0, 1, 2))(q, k, v)


def _compare(kernel, seg, q, k, v, w, real):
    """Max abs errors (output, dq, dk, dv) of the kernel against dense on the same inputs (dense
    in f32: the reference), over real query rows, each relative to the reference's max abs."""
    dense = lambda q, k, v: dense_attention(q, k, v, causal_mask(seg))
    kern = lambda q, k, v: attention_kernels.kernel_attention(q, k, v, seg, kernel)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out_d, grads_d = jax.jit(_out_and_grads, static_argnums=0)(dense, w, *f32)
    with attention_kernels.interpret():
        out_k, grads_k = jax.jit(_out_and_grads, static_argnums=0)(kern, w, q, k, v)
    assert out_k.shape == q.shape and out_k.dtype == q.dtype
    assert [g.dtype for g in grads_k] == [q.dtype] * 3
    err = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))
    return [err(out_k * real, out_d * real)] + [err(a, b) for a, b in zip(grads_k, grads_d)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_equals_dense(kernel, case):
    name, seg, n, k, h = case
    seg, q, kk, v, w, real = _inputs(seg, n, k, h)
    errors = _compare(kernel, seg, q, kk, v, w, real)
    assert max(errors) < 1e-5, errors


@pytest.mark.slow  # moved out of the fast tier (pytest -m 'not slow' < 5 min cold)
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_equals_dense_bf16(kernel):
    """bf16 q, k, v (what accelerators run), head_dim 64 and 7 query heads per KV head (the
    Qwen2.5-0.5B shape): within bf16 rounding of the f32 dense result on the same inputs."""
    seg = [[1] * 90 + [2] * 60 + [0] * 7, [1] * 157]
    seg, q, kk, v, w, real = _inputs(seg, 14, 2, 64, jnp.bfloat16)
    errors = _compare(kernel, seg, q, kk, v, w, real)
    assert max(errors) < 1e-2, errors  # bf16 has 8 bits of mantissa: 2**-8 = 0.4% a rounding


CFG = ModelConfig(
    family="qwen2", vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, qkv_bias=True, attention="dense",
)  # fmt: skip


def _packed_batch(t, rows=4, seed=0):
    """Packed rows of t tokens: several sequences each (one of length 1), some padding."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, t), np.int32)
    pos = np.zeros((rows, t), np.int32)
    layouts = [[t // 2, 1, t // 4], [t // 3, t // 2], [t], [1, t - 9]]
    for r in range(rows):
        start = 0
        for s, n in enumerate(layouts[r % len(layouts)], 1):
            seg[r, start : start + n], pos[r, start : start + n] = s, np.arange(n)
            start += n
    tokens = rng.integers(1, CFG.vocab_size, (rows, t)).astype(np.int32) * (seg > 0)
    return tokens, pos, seg


@pytest.mark.slow  # moved out of the fast tier (pytest -m 'not slow' < 5 min cold)
@pytest.mark.parametrize("kernel", KERNELS)
def test_model_on_mesh_equals_dense(kernel):
    """A 2-layer model with cfg.attention = kernel, its parameters and rows sharded on the
    (2, 2, 2) mesh: logits and every parameter's gradient equal the dense model's, and the
    kernel runs inside a shard_map (rows over data x fsdp, heads over tensor)."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    tokens, pos, seg = jax.device_put(_packed_batch(70), rows)
    real = (seg > 0)[..., None]
    w = jax.random.normal(jax.random.key(3), (*tokens.shape, CFG.vocab_size)) * real / real.sum()
    graphdef, params = init_params(CFG, mesh, seed=0)
    hooks = []

    def grads(graphdef):
        def loss(params):
            logits, attend = nnx.merge(graphdef, params)(tokens, pos, seg)
            hooks.append(attend)
            return jnp.sum(w * logits), logits

        f = jax.jit(jax.grad(loss, has_aux=True))
        return f(params), f.lower(params).as_text()

    (g_dense, logits_dense), _ = grads(graphdef)
    with attention_kernels.interpret():
        cfg = dataclasses.replace(CFG, attention=kernel)
        (g_kern, logits_kern), text = grads(abstract_model(cfg)[0])
    assert isinstance(hooks[-1], SegmentCausal) and hooks[-1].attention == kernel
    assert "manual" in text  # the shard_map
    assert attention_kernels.mesh_axes(mesh, 4, 2) == (("data", "fsdp"), ("tensor",))
    np.testing.assert_allclose(logits_kern * real, logits_dense * real, atol=2e-5, rtol=0)
    flat_d, flat_k = flatten(g_dense), flatten(g_kern)
    assert flat_d.keys() == flat_k.keys() and len(flat_d) > 10
    for name, gd in flat_d.items():
        assert float(jnp.abs(gd).max()) > 0, name
        np.testing.assert_allclose(flat_k[name], gd, atol=2e-5, rtol=0, err_msg=name)


def test_context_mesh_when_inputs_carry_none():
    """Unsharded (numpy) inputs under `jax.set_mesh`: their avals have no mesh, the context
    has one, and the kernel still runs in a shard_map over it."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    seg, q, k, v, _, real = _inputs([[1] * 30 + [2] * 10, [1] * 40] * 2, 4, 2, 16)
    q, k, v, seg = (np.asarray(x) for x in (q, k, v, seg))
    f = jax.jit(lambda *a: attention_kernels.kernel_attention(*a, "splash"))
    with jax.set_mesh(mesh), attention_kernels.interpret():
        assert "manual" in f.lower(q, k, v, seg).as_text()
        out = f(q, k, v, seg)
    ref = dense_attention(q, k, v, causal_mask(seg))
    np.testing.assert_allclose(out * real, ref * real, atol=1e-5, rtol=0)


def test_mesh_axes_fall_back_where_shapes_do_not_divide():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert attention_kernels.mesh_axes(mesh, 8, 1) == (("data", "fsdp", "tensor"), ())
    assert attention_kernels.mesh_axes(mesh, 2, 2) == (("data",), ("tensor",))
    assert attention_kernels.mesh_axes(make_mesh({"fsdp": 8}), 16, 2) == (("fsdp",), ())


# Export: a small model of the Qwen2.5-0.5B head shape (14 query heads, 2 KV heads, head_dim 64),
# bf16 compute, remat, rows of 200 tokens (padded to 256 inside the kernels).
EXPORT_CFG = ModelConfig(
    family="qwen2", vocab_size=256, d_model=128, d_ff=256, num_layers=2, num_heads=14,
    num_kv_heads=2, head_dim=64, qkv_bias=True, dtype="bfloat16", remat=True,
)  # fmt: skip
PLATFORM = {"splash": "tpu", "pallas_gpu": "cuda"}
CALL = {"tpu": "tpu_custom_call", "cuda": TRITON}
RULES = (
    ("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"),
    ("kv_heads", "tensor"), ("head_dim", None), ("norm", None), ("batch", ("data", "fsdp")),
)  # fmt: skip


def _export(attention, platform, mesh_name):
    """jax.export of the loss gradient of EXPORT_CFG with `attention`, for `platform`."""
    cfg = dataclasses.replace(EXPORT_CFG, attention=attention)
    graphdef, shapes = abstract_model(cfg)
    one = mesh_name == "1-device"
    mesh = make_mesh({} if one else {"data": 2, "fsdp": 2, "tensor": 2},
                     devices=jax.devices()[:1] if one else None)  # fmt: skip
    params = with_shardings(shapes, state_shardings(shapes, mesh, RULES))
    row = lambda dtype: jax.ShapeDtypeStruct(
        (8, 200), dtype, sharding=NamedSharding(mesh, P(("data", "fsdp")))
    )

    def grads(params, tokens, positions, segments):
        def loss(params):
            logits, _ = nnx.merge(graphdef, params)(tokens, positions, segments)
            return jnp.mean(logits)

        return jax.grad(loss)(params)

    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)] if platform == "cuda" else []
    export = jax.export.export(jax.jit(grads), platforms=[platform], disabled_checks=checks)
    with lowering_for([platform]):
        exported = export(params, row(jnp.int32), row(jnp.int32), row(jnp.int32))
    assert exported.nr_devices == mesh.size
    return exported.mlir_module()


@pytest.mark.parametrize("mesh_name", ("1-device", "2x2x2"))
@pytest.mark.parametrize("kernel", KERNELS)
def test_model_with_kernel_exports(kernel, mesh_name):
    platform = PLATFORM[kernel]
    text = _export(kernel, platform, mesh_name)
    # Forward, dq and dkv kernels (splash), forward and fused backward (Triton), per layer.
    assert text.count(CALL[platform]) >= (3 if kernel == "splash" else 2)
    assert ("manual" in text) == (mesh_name == "2x2x2")  # the shard_map


def test_auto_picks_the_kernel_of_the_lowering_platform():
    """From this CPU host "auto" defers its choice to lowering (lax.platform_dependent): the
    module lowered for TPU holds splash, for CUDA the Triton kernel, for CPU neither."""
    texts = {p: _export("auto", p, "2x2x2") for p in ("tpu", "cuda", "cpu")}
    assert CALL["tpu"] in texts["tpu"] and TRITON not in texts["tpu"]
    assert TRITON in texts["cuda"] and CALL["tpu"] not in texts["cuda"]
    assert not any(c in texts["cpu"] for c in CALL.values())


def test_auto_on_a_cpu_trace_traces_cpus_choice_only():
    """Outside `lowering_for`, a CPU trace of "auto" holds CPU's choice alone (no kernel traced,
    no platform switch); inside it the switch is there, and the jit cache keeps the two apart."""
    q = jnp.ones((1, 16, 4, 16), jnp.float32)
    kv = jnp.ones((1, 16, 2, 16), jnp.float32)
    seg = jnp.ones((1, 16), jnp.int32)
    f = jax.jit(lambda q, k, v, s: SegmentCausal(s).attend(0, q, k, v)[0])
    plain = str(f.trace(q, kv, kv, seg).jaxpr)
    with lowering_for(("tpu", "cuda")):
        lowered = str(f.trace(q, kv, kv, seg).jaxpr)
    assert "platform_index" not in plain and "pallas_call" not in plain
    assert "platform_index" in lowered and "pallas_call" in lowered
    assert "platform_index" not in str(f.trace(q, kv, kv, seg).jaxpr)  # not a stale cache entry
    want = dense_attention(q, kv, kv, causal_mask(seg))
    np.testing.assert_allclose(f(q, kv, kv, seg), want, rtol=1e-6, atol=1e-6)
