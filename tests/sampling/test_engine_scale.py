"""Sampler engine at scale: mesh parity with no parameter copy, paged memory on skewed lengths,
continuous batching of 100 requests equal to their solo runs.

Models are tiny (fp32) so that the tests measure the engine's bookkeeping, not FLOPs; the 8-device
mesh test is the slowest (two `steps.generate` compiles on 8 fake devices, cached on reruns).
"""

import dataclasses
import gc

import jax
import numpy as np
import pytest

from models.config import ModelConfig
from models.sharding import init_params, make_mesh
from sampling import steps as steps_lib
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.episodes import generate_all
from tests.conftest import CFG, random_prompts

SMALL = ModelConfig(
    family="llama", vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=4,
    num_kv_heads=2, head_dim=8,
)  # fmt: skip


def _pointers(params):
    return [
        (s.device, s.data.unsafe_buffer_pointer())
        for x in jax.tree.leaves(params)
        for s in x.addressable_shards
    ]


def _shardings_equal(compiled, own):
    """compiled[i] == own[i] for every leaf; None in `compiled` is an input the program does not
    use (prefill never reads lm_head), which jit prunes: nothing is transferred for it either."""
    compiled = jax.tree.leaves(compiled, is_leaf=lambda x: x is None)
    own = jax.tree.leaves(own, is_leaf=lambda x: x is None)  # a field left None (routes) on both
    return len(compiled) == len(own) and all(
        x is None or x.is_equivalent_to(y, len(y.spec)) for x, y in zip(compiled, own)
    )


@pytest.mark.parametrize(
    "temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0], ids=["greedy", "t1"]
)
def test_mesh_generation_matches_single_device_without_param_copy(temperature):
    # CFG (tests/conftest.py) shards every parameter dimension and the KV heads on this mesh.
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, params = init_params(CFG, mesh, seed=3)
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    assert any(len(set(s.spec) - {None}) for s in jax.tree.leaves(param_shardings))
    ecfg = EngineConfig(
        num_slots=8, page_size=8, num_pages=64, max_prompt_len=17, max_new_tokens=8,
        steps_per_call=4, backend="reference", weights_layout="training",  # the zero-copy path
    )  # fmt: skip
    sampling = SamplingParams(temperature)
    # Prompt lengths 1..17 keep every prefill in the 16-token bucket (one compile); G = 2 samples
    # exercise the shared prompt pages and the copied partial page on the mesh.
    prompts = random_prompts([3, 9, 17, 1, 12], CFG.vocab_size)

    # Reference: the same values on one device, engine without a mesh.
    single = jax.device_put(params, jax.devices()[0])
    alone = Engine(CFG, graphdef, ecfg, sampling)
    _, want = generate_all(alone, single, alone.init_state(), prompts, num_samples=2, seed=5)
    del single

    engine = Engine(CFG, graphdef, ecfg, sampling, mesh=mesh)
    state = engine.init_state()
    pointers = _pointers(params)
    gc.collect()
    before = {id(x) for x in jax.live_arrays()}
    state, got = generate_all(engine, params, state, prompts, num_samples=2, seed=5)
    # (c) of the no-copy checks below: no device buffer created by the call outlives it but the
    # returned state's (single-device views of its shards, made by device_get, share its buffers).
    gc.collect()
    new = [x for x in jax.live_arrays() if id(x) not in before]
    assert set(_pointers(new)) <= set(_pointers(state)), [(x.shape, x.dtype) for x in new]
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            assert a.tokens == b.tokens
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    if temperature:
        assert len({tuple(c.tokens) for c in got[0]}) > 1  # the samples really are random

    # No parameter copy; with (c) above, three checks, each robust on its own:
    # (a) the training arrays are untouched (not donated, not deleted) and keep their buffers;
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))
    assert _pointers(params) == pointers
    # (b) the compiled programs take the parameters in their own shardings, so calling them
    #     moves no parameter bytes (a mismatch would make jit reshard, i.e. copy, per call);
    lowered_args = [
        (steps_lib.generate, (graphdef, params, state, sampling, 4, (), "reference",
                                jax.random.key(0), engine.layout, engine.pages.group)),
        # One prefill row per shard: rows come laid out by shard (`Engine._prefill_pages`).
        (steps_lib.prefill, (graphdef, params, state, np.zeros((4, 16), np.int32),
                               np.array([3, 0, 0, 0], np.int32),
                               np.zeros((4, ecfg.pages_per_seq), np.int32), engine.layout)),
    ]  # fmt: skip
    for fn, args in lowered_args:
        in_shardings = fn.lower(*args).compile().input_shardings[0]
        assert _shardings_equal(in_shardings[0], param_shardings), fn
    # The decode state lives on the mesh in its declared layout: KV heads over `tensor`, slots
    # and pages (a pool per shard) over (data, fsdp); the donated updates kept it.
    assert _shardings_equal(jax.tree.map(lambda x: x.sharding, state), engine.state_shardings())
    assert engine.num_shards == 4
    assert all(s.spec[:2] == ("tensor", ("data", "fsdp")) for s in engine.state_shardings().k_pages)
    assert engine.allocator.num_used == 0


def test_skewed_lengths_use_few_pages():
    """Long-tailed prompt lengths 8..512: the pool in use peaks far below a dense cache."""
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(SMALL, mesh, seed=0)
    max_new, num_slots, page_size = 8, 8, 16
    rng = np.random.default_rng(0)
    # 40 requests: 28 short (8..32), 8 medium (33..128), 3 long (129..256), 1 at the maximum.
    lengths = np.concatenate(
        [rng.integers(8, 33, 28), rng.integers(33, 129, 8), rng.integers(129, 257, 3), [512]]
    )
    rng.shuffle(lengths)
    ecfg = EngineConfig(
        num_slots=num_slots, page_size=page_size, max_prompt_len=512, max_new_tokens=max_new,
        num_pages=1, steps_per_call=max_new, backend="reference",
    )  # fmt: skip
    dense = num_slots * ecfg.pages_per_seq  # a [slots, max_len] cache, in pages
    # A pool as large as the dense cache, so admission is never page-limited and the peak is
    # what continuous batching with paging actually needs.
    ecfg = dataclasses.replace(ecfg, num_pages=dense + 1)
    engine = Engine(SMALL, graphdef, ecfg, SamplingParams(0.0))
    _, results = generate_all(
        engine, params, engine.init_state(), random_prompts(lengths, SMALL.vocab_size)
    )
    assert all(r[0].length == max_new for r in results)
    ratio = engine.allocator.peak_used / dense
    print(f"peak pages {engine.allocator.peak_used} / dense {dense} = {ratio:.3f}")
    assert ratio < 0.5
    assert engine.allocator.num_used == 0


@pytest.mark.slow  # at scale; test_engine.py's test_continuous_batching_matches_alone is the fast one
def test_100_requests_in_16_slots_match_solo_runs():
    """Continuous batching with mixed prompt lengths, per-request max_new and stop ids."""
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(SMALL, mesh, seed=1)
    stop_ids = (1, 2, 3, 4)
    ecfg = EngineConfig(
        num_slots=16, page_size=8, num_pages=128, max_prompt_len=40, max_new_tokens=16,
        steps_per_call=4, stop_ids=stop_ids, backend="reference",
    )  # fmt: skip
    rng = np.random.default_rng(2)
    n = 100
    prompts = random_prompts(rng.integers(1, 41, n), SMALL.vocab_size, seed=3)
    max_new = rng.integers(1, 17, n).tolist()
    engine = Engine(SMALL, graphdef, ecfg, SamplingParams(0.0))
    busy, finished = [], []
    dispatch = engine.dispatch

    def counting_dispatch(*args, **kw):  # busy slots during each decode call
        busy.append(ecfg.num_slots - len(engine.pages.free_slots))
        return dispatch(*args, **kw)

    engine.dispatch = counting_dispatch

    def on_finish(i, g, completion):
        finished.append(1)

    state, batched = generate_all(
        engine, params, engine.init_state(), prompts, max_new_tokens=max_new, on_finish=on_finish
    )
    assert all(r[0] is not None for r in batched) and sum(finished) == n
    assert engine.allocator.num_used == 0
    assert max(busy) == ecfg.num_slots  # all 16 slots were in use at once
    reasons = {r[0].finish_reason for r in batched}
    assert reasons == {"stop", "length"}, reasons
    for r, m in zip(batched, max_new):
        c = r[0]
        assert c.length == len(c.tokens) == len(c.logprobs) <= m
        assert c.finish_reason == "stop" or c.length == m
        assert all(t not in stop_ids for t in c.tokens[:-1])

    # Solo reruns through the same engine reuse the compiled decode loop (fixed state shapes)
    # and add at most one single-prompt prefill per length bucket (16/32/64), which keeps 100
    # reruns to a few seconds.
    sizes = [f._cache_size() for f in (steps_lib.prefill, steps_lib.generate)]
    for i, p in enumerate(prompts):
        state, solo = generate_all(
            engine, params, state, [p], max_new_tokens=[max_new[i]], request_ids=[i]
        )
        assert solo[0][0].tokens == batched[i][0].tokens, i
        np.testing.assert_allclose(solo[0][0].logprobs, batched[i][0].logprobs, atol=1e-6)
    assert steps_lib.generate._cache_size() == sizes[1]
    assert steps_lib.prefill._cache_size() <= sizes[0] + 3
