"""Quantised KV pages (`sampling.kv_quant`, cache dtype int8 / float8_e4m3fn): the quantiser
against numpy, the KV write, every decode attention backend that reads a quantised pool (blockwise,
reference, the Pallas GPU kernel interpreted) and the chunked prefill against a float64 numpy
softmax over the dequantised pages; which backend "auto" picks per platform; the engine's pools
and scales split per shard on a mesh as on one device; preemption and recompute giving the
uninterrupted run's tokens; and the compiled CPU decode step reading the pool as stored, with no
convert of a whole pool to a wider type.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models.config import ModelConfig
from models.sharding import (
    DEFAULT_RULES,
    abstract_model,
    init_params,
    make_mesh,
    state_shardings,
)
from sampling import kv_quant
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.episodes import generate_all
from sampling.kv_quant import QuantPages
from sampling.lowering import lower_generate
from sampling.paged_attention import (
    paged_attention,
    paged_prefill_attention,
    resolve_backend,
    write_kv,
)
from tests.conftest import random_prompts
from tests.sampling.test_paged_attention import _cache, _lengths, _numpy_attention

DTYPES = ("int8", "float8_e4m3fn")


def _np_quantize(x, dtype):
    """numpy reference of `kv_quant.quantize`: bf16 scale absmax / QMAX, then x / scale."""
    x = np.asarray(x, np.float64)
    q = 127.0 if dtype == "int8" else 448.0
    scale = (np.abs(x).max(-1) / q).astype(np.float32).astype(ml_dtypes.bfloat16)
    s = scale.astype(np.float64)[..., None]
    y = np.clip(np.divide(x, s, out=np.zeros_like(x), where=s > 0), -q, q)
    if dtype == "int8":
        return np.round(y).astype(np.int8), scale
    return y.astype(np.float32).astype(ml_dtypes.float8_e4m3fn), scale


def _np_dequantize(values, scales):
    return values.astype(np.float64) * scales.astype(np.float64)[..., None]


def _quant_cache(seed, n, k, lengths, dtype):
    q, kp, vp, lengths, table = _cache(seed, n, k, lengths)
    kp, vp = (kv_quant.pack(*_np_quantize(x, dtype)) for x in (kp, 3 * vp))
    return q, kp, vp, lengths, table


def _deq(pages):
    values, scales = pages.logical()
    return _np_dequantize(np.asarray(values), np.asarray(scales))


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_numpy_and_bounds_the_error(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 16)).astype(np.float32) * rng.uniform(0.01, 30, (3, 5, 1))
    x[1, 2] = 0.0  # a zero row: scale 0, reads back as zeros
    values, scales = kv_quant.quantize(jnp.asarray(x), dtype)
    want_v, want_s = _np_quantize(x, dtype)
    assert values.dtype == jnp.dtype(dtype) and scales.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(scales), want_s)
    np.testing.assert_array_equal(np.asarray(values).astype(np.float32), want_v.astype(np.float32))
    back = _np_dequantize(np.asarray(values), np.asarray(scales))
    amax = np.abs(x).max(-1, keepdims=True)
    # int8: half a step (amax / 127) plus the bf16 scale's rounding; e4m3: 3 mantissa bits.
    bound = amax * (0.5 / 127 + 2**-8) if dtype == "int8" else np.abs(x) * 2**-4 + amax * 2**-9
    assert np.all(np.abs(back - x) <= bound * (1 + 1e-6) + 1e-30)
    assert np.all(back[1, 2] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_stores_values_and_scales_at_the_positions(dtype):
    kh, p, s, h, b, t = 2, 6, 4, 8, 2, 3
    rng = np.random.default_rng(1)
    k = rng.standard_normal((b, t, kh, h)).astype(np.float32)
    pool = kv_quant.zeros((kh, p, s, h), dtype)
    table = np.array([[3, 1], [5, 2]], np.int32)
    positions = np.array([[0, 5, -1], [2, 3, 4]], np.int32)  # -1: padding, not written
    kp, vp = jax.jit(write_kv)(pool, pool, k, 2 * k, table, positions)
    want_v, want_s = _np_quantize(np.transpose(k, (2, 0, 1, 3)), dtype)  # [K,B,T,H]
    for pages, factor in ((kp, 1), (vp, 2)):
        values, scales = pages.logical()
        got_v, got_s = np.asarray(values).astype(np.float32), np.asarray(scales)
        written = np.zeros((p, s), bool)
        for i in range(b):
            for j in range(t):
                pos = positions[i, j]
                if pos < 0:
                    continue
                page, slot = table[i, pos // s], pos % s
                written[page, slot] = True
                np.testing.assert_array_equal(got_s[:, page, slot] / factor, want_s[:, i, j])
                np.testing.assert_array_equal(got_v[:, page, slot], want_v[:, i, j])
        assert np.all(got_s[:, ~written] == 0) and np.all(got_v[:, ~written] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["reference", "blockwise", "pallas_gpu"])
def test_decode_attention_reads_quantised_pages(backend, dtype):
    """Every backend that takes a quantised pool equals float64 attention over its
    dequantised pages (q [B,N,H] with N/K = 4)."""
    q, kp, vp, lengths, table = _quant_cache(2, 8, 2, _lengths(2), dtype)
    got = paged_attention(q, kp, vp, lengths, table, backend=backend, interpret=True)
    want = _numpy_attention(q, _deq(kp), _deq(vp), lengths, table)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cascade_and_chunked_prefill_read_quantised_pages(dtype):
    q, kp, vp, lengths, table = _quant_cache(3, 8, 2, [13, 13, 13, 13], dtype)
    table[1:, :2] = table[0, :2]  # 8 prompt tokens on two shared pages, group of 4
    want = _numpy_attention(q, _deq(kp), _deq(vp), lengths, table)
    shared = np.full(4, 8, np.int32)
    got = paged_attention(q, kp, vp, lengths, table, "blockwise", group=4, shared_len=shared)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)
    # Prefill: row 0's queries at positions 5..12 attend causally over the quantised pages.
    rng = np.random.default_rng(4)
    qt = rng.standard_normal((1, 8, 8, q.shape[-1])).astype(np.float32)
    positions = np.arange(5, 13, dtype=np.int32)[None]
    got = paged_prefill_attention(qt, kp, vp, positions, table[:1], keys_per_block=8)
    for i, pos in enumerate(positions[0]):
        want = _numpy_attention(qt[:, i], _deq(kp), _deq(vp), np.array([pos + 1]), table[:1])
        np.testing.assert_allclose(np.asarray(got[:, i]), want, atol=2e-5, rtol=0)


def test_auto_routes_quantised_caches_where_kernels_read_them():
    pick = lambda dtype, platform: resolve_backend(
        "auto", dtype=dtype, head_dim=128, page_size=16, platform=platform
    )
    for dtype in DTYPES:
        assert pick(dtype, "tpu") == "blockwise"  # the TPU kernel cannot (module docstring)
        assert pick(dtype, "cuda") == "pallas_gpu"  # the GPU kernel takes scales
        assert pick(dtype, "cpu") == "blockwise"  # the C++ kernel reads f32 pages only
    assert pick("bfloat16", "tpu") == "pallas_tpu"
    q, kp, vp, lengths, table = _quant_cache(5, 2, 2, [3], "int8")
    with pytest.raises(ValueError, match="pallas_tpu.*cannot read a int8 KV cache"):
        paged_attention(q, kp, vp, lengths, table, backend="pallas_tpu")
    with pytest.raises(ValueError, match="cache_dtype='int4'"):
        EngineConfig(cache_dtype="int4").validate()
    for backend in ("pallas_tpu", "cpu_kernel"):
        with pytest.raises(ValueError, match=f"backend='{backend}' cannot read a int8 KV cache"):
            EngineConfig(cache_dtype="int8", backend=backend).validate()


CFG = ModelConfig(
    family="llama",
    vocab_size=64,
    d_model=64,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
ECFG = EngineConfig(
    num_slots=8,
    page_size=4,
    num_pages=64,
    max_prompt_len=20,
    max_new_tokens=6,
    steps_per_call=3,
    interpret=True,
    backend="blockwise",
)


def _generate(mesh, params, graphdef, **changes):
    engine = Engine(CFG, graphdef, dataclasses.replace(ECFG, **changes), SamplingParams(0.0), mesh)
    prompts = random_prompts([5, 18, 3, 11], CFG.vocab_size)
    state, results = generate_all(engine, params, engine.init_state(), prompts, num_samples=2)
    tokens = [[c.tokens for c in r] for r in results]
    return engine, state, tokens, np.array([c.logprobs for r in results for c in r])


@pytest.mark.parametrize(
    "dtype", ["int8", pytest.param("float8_e4m3fn", marks=pytest.mark.slow)]
)  # 10 s each
def test_engine_on_a_mesh_matches_one_device_with_per_shard_scales(dtype):
    """(2,2,2) mesh: the pool's values and scales split over tensor (KV heads) and data x fsdp
    (pages), each device its own block; greedy tokens, log-probs and the pools as on one
    device."""
    graphdef, host = init_params(CFG, make_mesh({}, devices=jax.devices()[:1]), seed=4)
    _, _, tokens1, logprobs1 = _generate(None, host, graphdef, cache_dtype=dtype)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    params = jax.device_put(host, state_shardings(abstract_model(CFG)[1], mesh, DEFAULT_RULES))
    engine, state, tokens, logprobs = _generate(mesh, params, graphdef, cache_dtype=dtype)
    assert tokens == tokens1
    np.testing.assert_allclose(logprobs, logprobs1, atol=1e-5)
    spec = engine.state_shardings()
    assert spec.k_pages[0].values.spec[:2] == ("tensor", ("data", "fsdp"))
    assert spec.k_pages[0].scales.spec[:2] == ("tensor", ("data", "fsdp"))
    for pages in state.k_pages + state.v_pages:
        assert isinstance(pages, QuantPages) and pages.dtype == jnp.dtype(dtype)
        assert np.count_nonzero(np.asarray(pages.logical()[1], np.float32)) > 0
        for x in (pages.values, pages.scales):
            blocks = [tuple((s.start, s.stop) for s in d.index) for d in x.addressable_shards]
            assert len(set(blocks)) == len(blocks) == 8  # per-shard pools: no replica


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_decode_step_reads_the_pool_as_stored(dtype):
    """XLA:CPU's compiled decode step (one device, blockwise): each layer's k and v pages are
    gathered a block of page rows at a time as stored (s8, or fp8 as its u8 bits: XLA:CPU has
    no fp8 gather), and no convert takes anything of a scale pool's size (K*P*page_size, 1/H
    of a pool) or more to another type: only gathered blocks and new rows are converted."""
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(CFG, mesh, seed=4)
    # A pool of 1,024 pages: its scales (8,192) outnumber a gathered block's values (2,048).
    ecfg = dataclasses.replace(ECFG, cache_dtype=dtype, num_pages=1024)
    engine = Engine(CFG, graphdef, ecfg, SamplingParams(0.0))
    hlo = lower_generate(engine, params).compile().as_text()
    stored = {"int8": "s8", "float8_e4m3fn": "u8"}[dtype]
    block = rf"= {stored}\[\d+,{ecfg.page_size * CFG.head_dim}\]\{{1,0\}} gather\("
    assert len(re.findall(block, hlo)) == 2 * CFG.num_layers  # k and v, every layer
    scale_pool = CFG.num_kv_heads * ecfg.num_pages * ecfg.page_size
    converts = re.findall(r"= \w+\[([\d,]*)\]\{[\d,]*\} convert\(", hlo)
    sizes = [int(np.prod([int(d) for d in c.split(",")])) for c in converts if c]
    assert sizes and max(sizes) < scale_pool, sorted(sizes)[-3:]


@pytest.mark.slow  # 2 x 50-100 s: the preemption workload, twice per dtype
@pytest.mark.parametrize("dtype", DTYPES)
def test_preempted_and_recomputed_episodes_match_the_uninterrupted_run(dtype):
    """tests/sampling/test_preemption.py's workload (multi-turn G = 2 episodes, T=1) with a
    quantised cache: half the budgets' pool, sequences preempted and recomputed by a chunked
    prefill, gives the tokens of one run that reserves every budget, log-probs within 1e-5: the
    prompt's own attention reads its k, v as stored (`kv_quant.as_stored`), as decoding and the
    recompute do, and scales are written with their values wherever pages are."""
    from tests.sampling import test_preemption as tp

    one = init_params(tp.CFG, make_mesh({}, devices=jax.devices()[:1]), seed=5)
    engine, params = tp._engine(one, {}, 1.0, cache_dtype=dtype)
    want = tp._run(engine, (params,))
    assert engine.preemptions == 0
    per_shard = tp.SLOTS * tp.FULL // 2
    engine, params = tp._engine(
        one, {}, 1.0, cache_dtype=dtype, reserve="demand", num_pages=per_shard + 1
    )
    tp._close(tp._run(engine, (params,)), want)
    assert engine.preemptions > 0 and engine.recomputed_tokens > 0


def _real_engine(name, mesh_name, platform, dtype):
    """tests/sampling/test_tpu_export.py's real config `name` (its widths, heads, pool and
    mesh; 2 layers) with cache dtype `dtype` and the backend "auto" picks on `platform`."""
    from launch.validate import engine_config, sampling_params
    from tests.sampling.test_tpu_export import _setup

    c, cfg, eos, graphdef, mesh, rules, _, params = _setup(name, mesh_name)
    ecfg = dataclasses.replace(engine_config(c, eos), cache_dtype=dtype)
    backend = resolve_backend(
        "auto", mesh.size > 1, dtype, cfg.head_dim, ecfg.page_size, platform=platform
    )
    ecfg = dataclasses.replace(ecfg, backend=backend)
    engine = Engine(cfg, graphdef, ecfg, sampling_params(c), mesh=mesh, rules=rules)
    engine.pages.set_group(c.rl.num_generations)  # the cascade, as a GRPO rollout decodes
    return engine, params, mesh


@pytest.mark.slow  # 16 lowerings of real widths: about 4 s each
@pytest.mark.parametrize("mesh_name", ["1-device", "config-mesh"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-0.6b"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantised_decode_step_lowers_for_tpu_and_cuda(dtype, name, platform, mesh_name):
    """The decode step of Qwen2.5-0.5B (head_dim 64) and Qwen3-0.6B (head_dim 128) with an int8
    / fp8 cache lowers for TPU (blockwise: the Mosaic kernel cannot take the scales) and CUDA
    (the Pallas Triton kernel with its k/v_scales_pages), on one device and the config's
    8-device mesh (inside a shard_map), taking each layer's pool as stored with its bf16
    scales, and copying no pool."""
    from tests.sampling.test_tpu_export import pool_copies

    engine, params, mesh = _real_engine(name, mesh_name, platform, dtype)
    assert engine.backend == ("pallas_gpu" if platform == "cuda" else "blockwise")
    lowered = lower_generate(engine, params, platforms=(platform,))
    text = lowered.as_text()
    assert f"mhlo.num_partitions = {mesh.size}" in text
    assert ("__gpu$xla.gpu.triton" in text) == (platform == "cuda")
    assert ("manual" in text) == (mesh.size > 1)
    cfg, e = engine.cfg, engine.ecfg
    pool = (cfg.num_kv_heads, e.num_pages, e.page_size, cfg.head_dim)
    state = lowered.args_info[0][1]
    for pages in (*state.k_pages, *state.v_pages):
        stored = {"int8": jnp.int8, "float8_e4m3fn": jnp.uint8}[dtype]  # kv_quant: bits
        assert (pages.values.shape, pages.values.dtype) == (pool, stored)
        assert (pages.scales.shape, pages.scales.dtype) == (pool[:3], jnp.uint16)
        assert pages.values.donated and pages.scales.donated
    assert pool_copies(text, pool[1:]) == []
    assert pool_copies(text, (e.num_pages // engine.num_shards, *pool[2:])) == []


@pytest.mark.parametrize(
    "mesh_shape", [{}, {"data": 2, "fsdp": 2, "tensor": 2}], ids=["one", "mesh"]
)
def test_page_copies_move_the_scales_with_the_values(mesh_shape):
    """`steps.update`'s page copies (a shared prompt's partial last page given to each sample,
    `sampling.engine.Plan`) on a quantised pool: the destination pages get the source's values and
    scales, on one device and per shard on a mesh (shard-local ids), nothing else changes."""
    from sampling import steps

    mesh = make_mesh(mesh_shape, devices=None if mesh_shape else jax.devices()[:1])
    ecfg = dataclasses.replace(ECFG, cache_dtype="int8", num_pages=32)
    engine = Engine(CFG, None, ecfg, SamplingParams(0.0), mesh=mesh if mesh_shape else None)
    state = engine.init_state()
    rng = np.random.default_rng(6)
    pool = (CFG.num_kv_heads, ecfg.num_pages, ecfg.page_size, CFG.head_dim)
    k = rng.integers(-127, 128, pool).astype(np.int8)
    ks = rng.uniform(0.5, 2, pool[:3]).astype(ml_dtypes.bfloat16)
    put = lambda x, like: jax.device_put(x, like.sharding)
    layer = kv_quant.pack(put(k, state.k_pages[0].values), put(ks, state.k_pages[0].scales))
    state = state.replace(k_pages=(layer, *state.k_pages[1:]))
    s = engine.num_shards
    local = ecfg.num_pages // s
    src = np.array([[3, 5] for _ in range(s)], np.int32).reshape(-1)  # shard-local ids
    dst = np.array([[6, 7] for _ in range(s)], np.int32).reshape(-1)
    b = ecfg.num_slots
    zeros = np.zeros(b, np.int32)
    off = np.zeros(b, bool)
    args = (off, off, zeros, zeros, zeros, zeros, zeros, zeros, zeros, src, dst, engine.layout)
    new = steps.update(state, *args)
    want_k, want_s = k.copy(), ks.copy()
    for i in range(s):
        want_k[:, i * local + dst[2 * i : 2 * i + 2]] = k[:, i * local + src[2 * i : 2 * i + 2]]
        want_s[:, i * local + dst[2 * i : 2 * i + 2]] = ks[:, i * local + src[2 * i : 2 * i + 2]]
    values, scales = new.k_pages[0].logical()
    np.testing.assert_array_equal(np.asarray(values), want_k)
    np.testing.assert_array_equal(np.asarray(scales, np.float32), want_s.astype(np.float32))
