"""Decode weights in int8 and fp8 (`EngineConfig.weights_dtype`, `models.quant`): the quantised
einsum against a numpy reference (per-output-channel weight scales, per-token activation
scales, int32 / f32 accumulation), which leaves the decode copy quantises and how it is laid
out, greedy decoding against the f32 sampler's, and the decode step lowered for TPU and CUDA
with the int8 x int8 -> int32 (fp8 x fp8 -> f32) dots in its module. Tiny shapes; the bench
shapes' figures are `launch.bench quant`'s (docs/performance.md)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models import quant
from models.sharding import init_params, make_mesh
from sampling.distribution import SamplingParams
from sampling.engine import Engine
from sampling.episodes import generate_all
from sampling.lowering import lower_generate
from tests.conftest import CFG, ECFG, random_prompts

BOUND = {"int8": 127.0, "float8_e4m3fn": 448.0}  # absmax maps to it (models.quant.CALIBRATION)


def _np_quantize(x, dtype, axes):
    """numpy reference: absmax over `axes` / the type's bound (the absmax entry stored exactly);
    int8 rounded half to even and clipped, fp8 by ml_dtypes' rounding."""
    scale = np.abs(x).max(axis=axes, keepdims=True) / BOUND[dtype]
    y = x / scale
    if dtype == "int8":
        return np.clip(np.round(y), -127, 127).astype(np.int8), scale
    return y.astype(ml_dtypes.float8_e4m3fn), scale


def _check_quantized(q, x, dtype, axes):
    """q (a QArray) is x quantised over `axes` as `_np_quantize` does: its scale to f32
    rounding, its values exactly but at int8's rounding ties (x / scale = k + 0.5 to an ulp,
    and XLA's division is not numpy's), one step apart there."""
    ref, scale = _np_quantize(x, dtype, axes)
    np.testing.assert_allclose(np.asarray(q.scale), scale, rtol=1e-6)
    got = np.asarray(q.qvalue).astype(np.float32)
    ties = np.abs(np.abs(x / scale) % 1 - 0.5) < 1e-4
    assert np.all((got == ref.astype(np.float32)) | (ties & (np.abs(got - ref) <= 1)))


@pytest.mark.parametrize("dtype", quant.DTYPES)
@pytest.mark.parametrize(
    "spec, x_shape, w_shape, contract",
    [
        ("BTD,DNH->BTNH", (3, 2, 32), (32, 4, 8), 1),  # q / k / v
        ("BTNH,NHD->BTD", (3, 2, 4, 8), (4, 8, 32), 2),  # o: two contracting axes
        ("BTF,FD->BTD", (3, 2, 64), (64, 32), 1),  # down
    ],
)
def test_einsum_equals_numpy(dtype, spec, x_shape, w_shape, contract):
    import qwix

    rng = np.random.default_rng(0)
    x = rng.normal(size=x_shape).astype(np.float32)
    w = rng.normal(size=w_shape).astype(np.float32)
    qw = quant.quantize(jnp.asarray(w), dtype, contract)
    assert qw.qvalue.dtype == jnp.dtype(dtype) and qw.scale.dtype == jnp.float32
    assert qw.scale.shape == (1,) * contract + w_shape[contract:]  # per output channel
    _check_quantized(qw, w, dtype, tuple(range(contract)))
    # Activations per token: absmax over the axes the einsum contracts (B and T kept).
    tokens = tuple(i for i, a in enumerate(spec.split(",")[0]) if a not in "BT")
    cal = quant.CALIBRATION[dtype]
    qx = qwix.quantize(
        jnp.asarray(x), jnp.dtype(dtype), channelwise_axes=(0, 1), calibration_method=cal
    )
    _check_quantized(qx, x, dtype, tokens)
    # The product: integers (int8) or fp8 values multiplied exactly, then both scales.
    as64 = lambda q: np.asarray(q.qvalue).astype(np.float64)
    out = spec.split("->")[1]
    ref = np.einsum(spec, as64(qx), as64(qw))
    ref = ref * np.asarray(qx.scale).reshape(x_shape[:2] + (1,) * (len(out) - 2))
    ref = ref * np.asarray(qw.scale).reshape(w_shape[contract:])
    got = jax.jit(quant.einsum, static_argnums=0)(spec, jnp.asarray(x), qw)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    # ... and close to the f32 product: the error of 8-bit weights and activations.
    exact = np.einsum(spec, x, w)
    tol = {"int8": 0.03, "float8_e4m3fn": 0.1}[dtype]
    assert np.abs(np.asarray(got) - exact).max() < tol * np.abs(exact).max()
    # bf16 activations: the product in bf16, or in f32 where asked (a bf16 model's q and k,
    # rounded after their bias, norm and rope, as the unquantised model rounds them).
    xb = jnp.asarray(x, jnp.bfloat16)
    wide = jax.jit(quant.einsum, static_argnums=(0, 3))(spec, xb, qw, jnp.float32)
    narrow = jax.jit(quant.einsum, static_argnums=0)(spec, xb, qw)
    assert wide.dtype == jnp.float32 and narrow.dtype == jnp.bfloat16
    assert (np.asarray(wide) != np.asarray(wide.astype(jnp.bfloat16), np.float32)).mean() > 0.9
    np.testing.assert_array_equal(np.asarray(narrow), np.asarray(wide.astype(jnp.bfloat16)))


def test_decode_copy_quantizes_the_projections_only(tiny):
    graphdef, params = tiny
    bf16 = dataclasses.replace(CFG, dtype="bfloat16")
    ecfg = dataclasses.replace(ECFG, weights_dtype="int8", weights_layout="training")
    copy = Engine(bf16, graphdef, ecfg, SamplingParams(0.0)).decode_params(params)
    layer = copy["blocks"][0]
    for name in ("q", "k", "v", "o"):
        assert quant.quantized(layer["attn"][name].get_value())
    for name in ("gate", "up", "down"):
        assert quant.quantized(layer["mlp"][name].get_value())
    assert layer["attn"]["o"].get_value().scale.shape == (1, 1, CFG.d_model)
    kept = [
        layer["attn"]["q_bias"],
        layer["attn_norm"]["scale"],
        copy["embed"],
        copy["lm_head"],
        copy["final_norm"]["scale"],
    ]
    assert all(v.get_value().dtype == jnp.bfloat16 for v in kept)  # the compute dtype
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))  # masters untouched


def _run(engine, params):
    prompts = random_prompts([5, 17, 9], CFG.vocab_size, seed=2)
    _, results = generate_all(engine, params, engine.init_state(), prompts, num_samples=2, seed=1)
    return [c.tokens for r in results for c in r], [c.logprobs for r in results for c in r]


@pytest.mark.parametrize(
    "layout, dtype, tol", [("tensor", "int8", 3e-3), ("training", "float8_e4m3fn", 3e-2)]
)
def test_greedy_decoding_matches_f32_on_the_mesh(layout, dtype, tol):
    """On the (2,2,2) mesh, the quantised copy laid out as `layout`, sharded like the decode
    copy it replaces (values as the weights, scales less the contracting axes): greedy tokens
    equal the f32 sampler's, log-probs within 8-bit error."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, params = init_params(CFG, mesh, seed=5)
    base = dataclasses.replace(ECFG, backend="reference", weights_layout=layout)
    tokens, logprobs = _run(Engine(CFG, graphdef, base, SamplingParams(0.0), mesh), params)
    ecfg = dataclasses.replace(base, weights_dtype=dtype)
    engine = Engine(CFG, graphdef, ecfg, SamplingParams(0.0), mesh)
    copy = engine.decode_params(params)
    q = copy["blocks"][0]["attn"]["q"].get_value()
    spec = params["blocks"][0]["attn"]["q"].get_value().sharding.spec
    if layout == "tensor":
        spec = engine.decode_shardings(params)["blocks"][0]["attn"]["q"].get_value().spec
    assert q.qvalue.sharding.is_equivalent_to(jax.NamedSharding(mesh, spec), 3)
    assert q.scale.sharding.spec[0] is None
    abstract = engine.abstract_decode_params(jax.tree.map(jax.typeof, params))
    got = jax.tree.map(lambda x: (x.shape, x.dtype), copy)
    assert got == jax.tree.map(lambda x: (x.shape, x.dtype), abstract)
    t, lp = _run(engine, params)
    assert t == tokens
    assert max(np.abs(np.subtract(a, b)).max() for a, b in zip(lp, logprobs)) < tol


@pytest.mark.parametrize(
    "weights, cache",
    [
        ("int8", "float32"),
        pytest.param("float8_e4m3fn", "float32", marks=pytest.mark.slow),
        pytest.param("", "int8", marks=pytest.mark.slow),
        ("", "float8_e4m3fn"),
    ],
)
def test_sampler_log_probs_equal_the_float64_fake_quant_reference(weights, cache):
    """The quantised sampler (f32 compute, one device) against a float64 numpy forward pass
    that quantises the same weights, activations and KV by the scheme and reads them back
    (launch.bench.quant.reference_logprobs): the log-probs of the drawn tokens agree to f32
    rounding, where the scheme itself moves them 100x more. A value an f32 ulp from a rounding
    boundary may round the other way (one step of one entry), so a few tokens differ more."""
    from launch.bench.quant import k3, reference_logprobs

    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(CFG, mesh, seed=5)
    prompts = random_prompts([5, 17, 9, 12], CFG.vocab_size, seed=2)
    ecfg = dataclasses.replace(ECFG, backend="blockwise", cache_dtype=cache, weights_dtype=weights)
    engine = Engine(CFG, graphdef, ecfg, SamplingParams(1.0))
    _, results = generate_all(engine, params, engine.init_state(), prompts, 2, 12, seed=1)
    tokens = [c.tokens for r in results for c in r]
    assert all(len(t) == 12 for t in tokens)  # no stop ids: every sample is 12 tokens
    got = np.array([c.logprobs for r in results for c in r], np.float64)
    twice = [p for p in prompts for _ in range(2)]
    kv = "" if cache == "float32" else cache
    ref = reference_logprobs(CFG, params, twice, tokens, weights, kv)
    exact = reference_logprobs(CFG, params, twice, tokens)
    diff, effect = np.abs(got - ref), np.abs(ref - exact)
    assert np.median(diff) < 1e-6 and np.mean(diff < 1e-5) > 0.95, (np.median(diff), diff.max())
    assert diff.max() < 0.2 * effect.max() and np.median(effect) > 100 * np.median(diff)
    assert k3(exact - got) == pytest.approx(k3(exact - ref), rel=0.05)


DOT = re.compile(r"stablehlo\.dot_general.*\((tensor<[^)]*)\)\s*->\s*tensor<([^>]*)>")


def _dots(text):
    """(operand types, result type) of every dot_general of a StableHLO module."""
    return [(m.group(1), m.group(2)) for m in DOT.finditer(text)]


@pytest.mark.parametrize("dtype, platform", [("int8", "tpu"), ("float8_e4m3fn", "cuda")])
def test_decode_step_lowers_with_quantized_dots(dtype, platform):
    """The decode step (bf16 compute) on the (2,2,2) mesh lowered for TPU with int8 weights and
    CUDA with fp8 ones (the slow test below lowers a real config's, both dtypes for both): 7
    projections per layer dot in int8 -> i32 (fp8 -> f32); the logits projection stays bf16 (its
    logits accumulated in f32, `Transformer.logits`)."""
    bf16 = dataclasses.replace(CFG, dtype="bfloat16")
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, params = init_params(bf16, mesh, seed=5)
    ecfg = dataclasses.replace(ECFG, backend="blockwise", weights_dtype=dtype)
    engine = Engine(bf16, graphdef, ecfg, SamplingParams(1.0), mesh)
    text = lower_generate(engine, jax.tree.map(jax.typeof, params), (platform,)).as_text()
    assert "mhlo.num_partitions = 8" in text
    q = {"int8": "xi8>", "float8_e4m3fn": "xf8E4M3FN>"}[dtype]
    acc = {"int8": "i32", "float8_e4m3fn": "f32"}[dtype]
    dots = _dots(text)
    quantized = [(a, r) for a, r in dots if a.count(q) == 2]
    assert len(quantized) == 7 * CFG.num_layers
    assert all(r.endswith(acc) for _, r in quantized)
    logits = [(a, r) for a, r in dots if r.endswith(f"x{CFG.vocab_size}xf32")]
    assert logits and all(a.count("bf16") == 2 for a, _ in logits)  # bf16 operands, f32 sums


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_real_config_decode_step_lowers_with_quantized_dots(platform):
    """configs/qwen2_5_0_5b_gsm8k.py's decode step (Qwen2.5-0.5B shape, 2 of its layers, its
    8-device mesh and the backend "auto" picks there) with int8 and with fp8 decode weights,
    lowered for `platform`: every projection dots in the quantised type, the pools are read
    in place (tests/sampling/test_tpu_export.py's check)."""
    from tests.sampling.test_tpu_export import _engine, check_pool_read_in_place

    engine, params, mesh = _engine(
        "qwen2.5-0.5b", "config-mesh", "gpu" if platform == "cuda" else platform
    )
    for dtype in quant.DTYPES:
        ecfg = dataclasses.replace(engine.ecfg, weights_dtype=dtype)
        e = Engine(engine.cfg, engine.graphdef, ecfg, engine.sampling, mesh, engine.layout[1])
        e.pages.set_group(engine.cascade_group())
        lowered = lower_generate(e, params, (platform,))
        q = {"int8": "xi8>", "float8_e4m3fn": "xf8E4M3FN>"}[dtype]
        quantized = [a for a, _ in _dots(lowered.as_text()) if a.count(q) == 2]
        assert len(quantized) == 7 * e.cfg.num_layers
        check_pool_read_in_place(e, lowered)


def test_mixture_keeps_router_and_experts_in_the_compute_dtype():
    """A Qwen3-MoE model's int8 decode copy (abstract: nothing allocated) quantises its
    attention projections (and a dense layer's MLP) only: the router [D,E] and the experts
    [E,D,F] stay in the compute dtype (the names gate / up / down at rank 3 are not the dense
    MLP's)."""
    from models.sharding import abstract_model
    from tests.models.test_moe import CFG as MOE

    cfg = dataclasses.replace(MOE, num_layers=2, moe_layers=(1,), dtype="bfloat16")
    graphdef, shapes = abstract_model(cfg)
    ecfg = dataclasses.replace(ECFG, backend="reference", weights_dtype="int8")
    copy = Engine(cfg, graphdef, ecfg, SamplingParams(0.0)).abstract_decode_params(shapes)
    dense, moe = copy["blocks"][0], copy["blocks"][1]
    assert moe["attn"]["q"].get_value().qvalue.dtype == jnp.int8
    assert dense["mlp"]["gate"].get_value().qvalue.dtype == jnp.int8
    for name in ("router", "gate", "up", "down"):
        assert moe["mlp"][name].get_value().dtype == jnp.bfloat16


def test_quantised_q_and_k_stay_f32_until_rounded_once(tiny, monkeypatch):
    """A bf16 model's q and k products (`models.transformer._matmul` with out=f32) on a
    quantised decode copy are the f32 products, not bf16 values widened: rounded once, after
    bias, q/k norm and rope, as the unquantised model rounds them. And `launch.bench quant`'s
    rows that compute in bf16 run the model's graph in bf16 (the graphdef holds the compute
    dtype): every projection's input is bf16 there."""
    from launch.bench import quant as bench
    from models import transformer

    graphdef, params = tiny
    w = params["blocks"][0]["attn"]["q"].get_value()
    qw = quant.quantize(w, "int8", 1)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, w.shape[0])), jnp.bfloat16)
    wide = jax.jit(lambda x: transformer._matmul("BTD,DNH->BTNH", x, qw, jnp.float32))(x)
    assert wide.dtype == jnp.float32
    assert (np.asarray(wide) != np.asarray(wide.astype(jnp.bfloat16), np.float32)).mean() > 0.9
    seen = set()
    matmul = transformer._matmul

    def spy(spec, x, p, out=None):
        seen.add(jnp.dtype(x.dtype).name)
        return matmul(spec, x, p, out)

    monkeypatch.setattr(transformer, "_matmul", spy)
    prompts = random_prompts([4, 6])
    bench.sample(CFG, graphdef, params, "both_int8", prompts, 2, 0.0, "auto")
    assert seen == {"bfloat16"}, seen
