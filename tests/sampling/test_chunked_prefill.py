"""Chunked prefill over the pages (`EngineConfig.prefill_chunk`, `sampling.steps.prefill`):
prompts and multi-turn observations prefilled a few tokens at a time, each chunk attending over
the pages where they lie, give the unchunked path's (prefill_chunk = 0, dense attention over a
gathered history) KV cache within f32 rounding, the same tokens (greedy and temperature 1) and
log-probs within 1e-5; on one device and on a (2,2,2) mesh with the pages split over `tensor`.
And the prefill's temporaries stay flat as the prompt grows: no [T,T] or [T,S] scores.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.sharding import init_params, make_mesh
from sampling.distribution import SamplingParams
from sampling.engine import Engine
from sampling.episodes import generate_all
from sampling.lowering import extend_length, lower_prefill, prefill_lengths
from sampling.paged_attention import paged_prefill_attention, write_kv
from tests.conftest import CFG, ECFG, random_prompts
from tests.sampling.test_episodes import _scripted

# Prompts up to 23 tokens (bucket 32): chunks of 8 tokens are 4 chunks, one page each; the
# odd lengths end inside a chunk and inside a page.
PCFG = dataclasses.replace(ECFG, max_new_tokens=24, num_pages=160, backend="blockwise")
PROMPTS = random_prompts([5, 23, 17, 9], seed=11)


def _engine(graphdef, chunk, temperature, mesh=None, ecfg=PCFG):
    ecfg = dataclasses.replace(ecfg, prefill_chunk=chunk)
    return Engine(CFG, graphdef, ecfg, SamplingParams(temperature), mesh=mesh)


def test_paged_prefill_attention_equals_dense_over_the_history():
    """The attention itself: queries at arbitrary cache positions, padding queries, GQA, a page
    table in random order, against dense attention over each row's gathered history."""
    rng = np.random.default_rng(0)
    b, t, n, kh, h, page_size, pages_per_seq = 3, 7, 4, 2, 8, 4, 6
    num_pages = 1 + b * pages_per_seq
    table = 1 + rng.permutation(b * pages_per_seq).reshape(b, pages_per_seq).astype(np.int32)
    starts = np.array([0, 9, 16], np.int32)  # cached tokens before the chunk
    lengths = np.array([7, 3, 5], np.int32)  # real tokens in the chunk
    hist = 24  # every row's history, written first
    k_all = rng.normal(size=(b, hist, kh, h)).astype(np.float32)
    v_all = rng.normal(size=(b, hist, kh, h)).astype(np.float32)
    zeros = jnp.zeros((kh, num_pages, page_size, h), jnp.float32)
    kp, vp = write_kv(zeros, zeros, k_all, v_all, table, np.tile(np.arange(hist), (b, 1)))
    positions = np.where(np.arange(t) < lengths[:, None], starts[:, None] + np.arange(t), -1)
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    got = paged_prefill_attention(q, kp, vp, positions, table, keys_per_block=8)
    for i in range(b):
        for j in range(lengths[i]):
            p = positions[i, j]
            s = np.einsum("KRH,SKH->KRS", q[i, j].reshape(kh, n // kh, h), k_all[i, : p + 1])
            w = np.exp(s / np.sqrt(h) - (s / np.sqrt(h)).max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            want = np.einsum("KRS,SKH->KRH", w, v_all[i, : p + 1]).reshape(n, h)
            np.testing.assert_allclose(got[i, j], want, atol=1e-5, rtol=1e-5)
        assert not np.asarray(got[i, lengths[i] :]).any()  # padding queries: zeros


def _prefilled_pages(graphdef, params, chunk, mesh=None):
    engine = _engine(graphdef, chunk, 0.0, mesh)
    state, prefixes = engine.prefill_many(params, engine.init_state(), PROMPTS)
    return [x.pages for x in prefixes], jax.device_get((state.k_pages, state.v_pages))


@pytest.mark.parametrize(
    "on_mesh", [pytest.param(False, marks=pytest.mark.slow), True], ids=["one_device", "mesh"]
)
def test_chunked_prefill_writes_the_unchunked_cache(on_mesh, tiny):
    graphdef, params = tiny
    mesh = None
    if on_mesh:
        mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
        graphdef, params = init_params(CFG, mesh, seed=3)
    pages, want = _prefilled_pages(graphdef, params, 0, mesh)
    pages_chunked, got = _prefilled_pages(graphdef, params, 8, mesh)
    assert pages == pages_chunked
    used = np.concatenate(pages)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(g[:, used], w[:, used], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_chunked_prefill_then_decoding_equals_unchunked(tiny, temperature):
    graphdef, params = tiny
    out = {}
    for chunk in (0, 8):
        engine = _engine(graphdef, chunk, temperature)
        _, results = generate_all(engine, params, engine.init_state(), PROMPTS, 2, seed=5)
        out[chunk] = [c for r in results for c in r]
    for want, got in zip(out[0], out[8]):
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_chunked_observation_prefill_equals_unchunked(tiny):
    """Multi-turn episodes: observations (2-5 tokens after a cached history) prefilled in chunks
    of 2 over the pages give the unchunked path's episodes, at temperature 1."""
    graphdef, params = tiny
    out = {}
    for chunk in (0, 2):
        engine = _engine(graphdef, chunk, 1.0)
        _, episodes = generate_all(
            engine, params, engine.init_state(), PROMPTS, 2, seed=7, respond=_scripted({}),
            max_turn_tokens=3,
        )  # fmt: skip
        out[chunk] = [e for r in episodes for e in r]
    assert sum(e.turns for e in out[0]) == 3 * len(out[0])  # two observations per episode
    for want, got in zip(out[0], out[2]):
        assert (got.tokens, got.observation) == (want.tokens, want.observation)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def _prefill_temp(length, chunk, resume=False):
    ecfg = dataclasses.replace(
        PCFG, max_prompt_len=length, max_new_tokens=16, num_pages=4 * length // 8, num_slots=2
    )
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(CFG, mesh, seed=0)
    engine = _engine(graphdef, chunk, 0.0, ecfg=ecfg)
    lowered = lower_prefill(engine, params, rows=1, length=length, resume=resume)
    return lowered.compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    "resume", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["prompt", "observation"]
)
def test_chunked_prefill_memory_is_flat_in_the_prompt_length(resume):
    """XLA's memory analysis: unchunked, the temporaries of a 2048-token prefill hold [T,T] or
    [T,S] f32 scores (4 heads x 2048^2 x 4 B = 64 MiB); in chunks of 128 they are about those
    of a 512-token prefill, and far below that."""
    dense = _prefill_temp(2048, 0, resume)
    long, short = _prefill_temp(2048, 128, resume), _prefill_temp(512, 128, resume)
    print(f"prefill temp: unchunked 2048 {dense / 2**20:.1f} MiB, chunked 2048 "
          f"{long / 2**20:.2f} MiB, chunked 512 {short / 2**20:.2f} MiB")  # fmt: skip
    assert dense > 4 * 2048**2 * 4
    assert long < 1.5 * short
    assert long * 20 < dense


def test_a_short_observation_is_prefilled_at_its_own_length(tiny):
    """A resume's rows (after cached tokens) shorter than a chunk run as one chunk of their own
    bucket: the program of a 16-token observation holds no 512-token array (it was padded to
    a whole chunk: 32x its FLOPs, and on XLA:CPU a bigger program whose fusions rounded the
    bf16 residual stream otherwise than the learner's pass). Rows longer than a chunk still go
    a chunk at a time."""
    graphdef, _ = tiny
    _, shapes = init_params(CFG, make_mesh({}, devices=jax.devices()[:1]))
    ecfg = dataclasses.replace(PCFG, max_prompt_len=1024, max_new_tokens=8, num_pages=1200)
    engine = _engine(graphdef, 512, 0.0, ecfg=ecfg)
    short = lower_prefill(engine, shapes, rows=2, length=16, resume=True).as_text()
    long = lower_prefill(engine, shapes, rows=2, length=1024, resume=True).as_text()
    hidden = lambda t: f"<2x{t}x{CFG.d_model}x"  # a layer's activations [n, chunk, D]
    assert hidden(16) in short and hidden(512) not in short
    assert hidden(512) in long  # the 1024-token rows, a 512-token chunk at a time


def test_prefill_lengths_are_the_longest_dense_and_the_longest_chunked():
    """What --dry_run compiles of the prefill: the longest prompt bucket that takes the dense
    path (at most one chunk) and, when prompts are longer than a chunk, the longest."""
    lengths = lambda prompt, chunk: prefill_lengths(
        dataclasses.replace(PCFG, max_prompt_len=prompt, prefill_chunk=chunk)
    )
    assert lengths(4097, 512) == (512, 4096)  # the last prompt token is not cached: 4096
    assert lengths(4098, 512) == (512, 8192)
    assert lengths(4096, 300) == (256, 4096)  # buckets are powers of two
    assert lengths(300, 512) == (512,)  # every prompt fits a chunk
    assert lengths(4096, 0) == (4096,)  # unchunked: one dense pass
    assert lengths(64, 8) == (64,)  # no bucket (at least 16) fits a chunk of 8
    # and a history prefilled again after cached tokens (restore, refresh): prompt + budget
    extend = lambda prompt, new: extend_length(
        dataclasses.replace(PCFG, max_prompt_len=prompt, max_new_tokens=new)
    )
    assert extend(4096, 28672) == 32768 and extend(4096, 28674) == 65536


def test_chunked_prefill_memory_is_flat_in_depth():
    """16 rows of 512 tokens in chunks of 128, 2 layers against 8: a layer adds less than one
    online-softmax accumulator ([16,2,256,8] f32, 256 KiB). Each layer's attention loop used to
    start from a zero carry that XLA shared between layers and copied for each loop, all copies
    made at once at the start (`sampling.paged_attention._online_softmax`): 332 KiB a layer."""

    def temp(layers):
        cfg = dataclasses.replace(CFG, num_layers=layers)
        ecfg = dataclasses.replace(
            PCFG, max_prompt_len=512, num_pages=2048, num_slots=16, prefill_chunk=128
        )
        graphdef, params = init_params(cfg, make_mesh({}, devices=jax.devices()[:1]), seed=0)
        engine = Engine(cfg, graphdef, ecfg, SamplingParams(0.0))
        lowered = lower_prefill(engine, params, rows=16, length=512)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    acc = 16 * 2 * 256 * 8 * 4  # rows x kv heads x (chunk x query heads per kv head) x H, f32
    two, eight = temp(2), temp(8)
    assert eight - two < acc, (two, eight)


@pytest.mark.parametrize("compute, cache", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_prefill_returns_the_compute_dtype_over_a_cache_of_another(compute, cache):
    """A prompt, then an observation continuing it (`starts`), through the prefill hook with a
    cache of another dtype than the model computes in: every path returns q's dtype (the dense
    paths returned the cache's, and a bf16 model's o-projection and residual then ran in f32
    over an f32 cache), and the continued dense path (prefill_chunk = 0) equals the paged one."""
    from sampling.state import PagedPrefill

    b, t, t2, n, kh, h, page_size, pages_per_seq = 2, 8, 5, 4, 2, 16, 4, 4
    rng = np.random.default_rng(1)
    x = lambda *shape: jnp.asarray(rng.normal(size=shape), compute)
    pages = lambda: (jnp.zeros((kh, b * pages_per_seq + 1, page_size, h), cache),)
    table = jnp.arange(b * pages_per_seq, dtype=jnp.int32).reshape(b, pages_per_seq)
    hook = PagedPrefill(pages(), pages(), table, jnp.ones((b, t), bool))
    out, hook = hook.attend(0, x(b, t, n, h), x(b, t, kh, h), x(b, t, kh, h))
    assert out.dtype == jnp.dtype(compute)
    q, k, v = x(b, t2, n, h), x(b, t2, kh, h), x(b, t2, kh, h)
    valid, starts = jnp.ones((b, t2), bool), jnp.full((b,), t, jnp.int32)
    outs = {}
    for paged in (False, True):
        step = PagedPrefill(hook.k_pages, hook.v_pages, table, valid, starts, paged)
        outs[paged] = step.attend(0, q, k, v)[0]
        assert outs[paged].dtype == jnp.dtype(compute), paged
    tol = 1e-5 if compute == "float32" else 1e-2
    np.testing.assert_allclose(*(np.asarray(o, np.float32) for o in outs.values()), atol=tol)
