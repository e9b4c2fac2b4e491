"""The Pallas kernels inside shard_map (`sampling.partitioned`) on a (2,2,2) mesh of 8 CPU
devices: greedy generation through the TPU kernel (TPU interpret mode) and the GPU kernel
(interpret mode) gives the reference backend's tokens and log-probs and the same KV pool, which
no two devices hold a copy of: each holds its KV heads of its shard's pages. And the compiled
decode step copies no pool.

The model is tiny (2 layers, 2 KV heads over `tensor`, 8 slots over data x fsdp) because
interpret mode runs the kernels op by op.

And the prefill on fsdp=8 in the training layout computes each shard's rows only.
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

from models.config import ModelConfig
from models.sharding import init_params, make_mesh
from sampling import cpu_attention
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.episodes import generate_all
from sampling.lowering import lower_generate, lower_prefill
from tests.conftest import random_prompts
from tests.sampling.test_tpu_export import pool_copies

CFG = ModelConfig(
    family="llama", vocab_size=64, d_model=64, d_ff=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16,
)  # fmt: skip
ECFG = EngineConfig(
    num_slots=8, page_size=16, num_pages=32, max_prompt_len=20, max_new_tokens=6,
    steps_per_call=3, interpret=True,
)  # fmt: skip


def _generate(mesh, params, graphdef, backend, cache_dtype):
    ecfg = dataclasses.replace(ECFG, backend=backend, cache_dtype=cache_dtype)
    engine = Engine(CFG, graphdef, ecfg, SamplingParams(0.0), mesh=mesh)
    prompts = random_prompts([5, 18, 3, 11], CFG.vocab_size)
    state, results = generate_all(engine, params, engine.init_state(), prompts, num_samples=2)
    tokens = [[c.tokens for c in r] for r in results]
    logprobs = np.array([c.logprobs for r in results for c in r])
    return engine, state, tokens, logprobs


def _blocks(x) -> list:
    """The index blocks the devices hold of x, one entry per device."""
    return [tuple((s.start, s.stop) for s in shard.index) for shard in x.addressable_shards]


@pytest.mark.parametrize(
    "backend,cache_dtype",
    # the TPU kernel's interpret mode is the slower one: full suite only (fast tier < 5 min)
    [("pallas_gpu", "float32"), pytest.param("pallas_tpu", "bfloat16", marks=pytest.mark.slow)],
    ids=["gpu", "tpu"],
)
def test_kernels_in_shard_map_match_the_reference(backend, cache_dtype):
    """The TPU kernel rounds K and V to bf16: it is compared on a bf16 cache, which the reference
    reads exactly (the bf16-rounded reference of tests/sampling/test_paged_attention.py)."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, params = init_params(CFG, mesh, seed=4)
    engine, state, tokens, logprobs = _generate(mesh, params, graphdef, backend, cache_dtype)
    assert engine.backend == backend
    _, want_state, want_tokens, want_logprobs = _generate(
        mesh, params, graphdef, "reference", cache_dtype
    )
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
    spec = engine.state_shardings()
    assert spec.k_pages[0].spec[:2] == ("tensor", ("data", "fsdp"))
    assert spec.lengths.spec[0] == ("data", "fsdp")
    for got, want in zip(state.k_pages + state.v_pages, want_state.k_pages + want_state.v_pages):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
        assert len(set(_blocks(got))) == len(_blocks(got)) == 8  # per-shard pools: no replica
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-6
        )
    # The kernel runs inside a shard_map: the lowered decode step has a manual computation.
    text = lower_generate(engine, params).as_text()
    assert "manual" in text


@pytest.mark.parametrize(
    "backend,mesh_shape",
    [("blockwise", None), ("cpu_kernel", None), ("blockwise", (2, 2, 2))],
    ids=["blockwise", "cpu_kernel", "blockwise-mesh"],
)
def test_compiled_decode_step_copies_no_pool(backend, mesh_shape):
    """What XLA:CPU compiles for a decode call holds no slice, dynamic-slice or copy of a
    layer's pool (nor of the loop's carried pools): the pages are read and written in place."""
    if backend == "cpu_kernel" and not cpu_attention.available():
        pytest.skip("no C++ compiler")
    if mesh_shape:
        mesh = make_mesh(dict(zip(("data", "fsdp", "tensor"), mesh_shape)))
    else:
        mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(CFG, mesh, seed=4)
    engine = Engine(
        CFG, graphdef, dataclasses.replace(ECFG, backend=backend), SamplingParams(1.0), mesh=mesh
    )
    text = lower_generate(engine, params).compile().as_text()
    pool = (ECFG.num_pages // engine.num_shards, ECFG.page_size, CFG.head_dim)  # a device's
    assert pool_copies(text, pool) == []


def test_prefill_in_the_training_layout_computes_each_shards_rows_only():
    """fsdp=8, `weights_layout="training"`: the weights' D is split over fsdp, as the
    embedding's. The compiled prefill's matmuls take one shard's rows (2 rows of 32 tokens a
    call: 64), the weights gathered, where they took every shard's (16 x 32 = 512: the
    embedded tokens kept the table's split over D); and its tokens and log-probs are the one
    device's."""
    cfg = dataclasses.replace(CFG, d_ff=96)
    ecfg = dataclasses.replace(
        ECFG, num_slots=16, num_pages=64, max_prompt_len=33, weights_layout="training",
        backend="reference", interpret=False,
    )  # fmt: skip
    mesh = make_mesh({"fsdp": 8})
    graphdef, params = init_params(cfg, mesh, seed=4)
    engine = Engine(cfg, graphdef, ecfg, SamplingParams(0.0), mesh=mesh)
    text = lower_prefill(engine, params, rows=2).compile().as_text()
    dots = re.findall(r"= \w+\[(\d+)[\d,]*\]\{[^}]*\} dot\(", text)
    assert dots and max(map(int, dots)) == 2 * 32, sorted(set(dots))
    prompts = random_prompts([5, 32, 3, 11], cfg.vocab_size)
    one = make_mesh({}, devices=jax.devices()[:1])
    single = Engine(cfg, graphdef, ecfg, SamplingParams(0.0), mesh=one)
    out = []
    for e, p in ((engine, params), (single, jax.device_put(params, jax.devices()[0]))):
        _, results = generate_all(e, p, e.init_state(), prompts, num_samples=2)
        out.append(
            ([c.tokens for r in results for c in r], [c.logprobs for r in results for c in r])
        )
    assert out[0][0] == out[1][0]
    np.testing.assert_allclose(np.array(out[0][1]), np.array(out[1][1]), atol=1e-5)
