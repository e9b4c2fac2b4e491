"""`Engine.refresh` (partial rollouts' `rl.refresh_kv_on_update`): a sequence parked under one set
of parameters and resumed with refresh under another draws every later token as if its whole
history had been computed under the new ones (teacher forcing over the whole sequence is the
reference), siblings sharing their prompt's full pages recompute the prompt once, and refreshing
in one call, or one sequence at a time sharing the set of fresh pages, writes the pages that
refreshing each sequence alone from position 0 writes."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from models.sharding import init_params
from rl.logprobs import token_logprobs
from sampling.distribution import SamplingParams
from sampling.engine import Engine
from sampling.episodes import EpisodeLoop
from tests.conftest import CFG, ECFG, random_prompts

PAGE, G, T = 4, 2, 32
RCFG = dataclasses.replace(ECFG, page_size=PAGE, max_new_tokens=16, steps_per_call=2)
PROMPTS = random_prompts([9, 14], seed=5)  # 8 and 13 tokens cached: 2 and 3 full pages shared
SAMPLING = SamplingParams(1.0)  # sampled: the siblings of a prompt differ after it

_teacher_forced = jax.jit(
    lambda graphdef, *a: token_logprobs(nnx.merge(graphdef, a[0]), *a[1:], SAMPLING)[0],
    static_argnums=0,
)


@pytest.fixture(scope="module")
def versions(tiny, one_device_mesh):
    """graphdef and three parameter sets: versions 0, 1, 2."""
    graphdef, params = tiny
    more = [init_params(CFG, one_device_mesh, seed=s)[1] for s in (4, 5)]
    return graphdef, [params, *more]


def _calls(n):
    """An `until` that holds once n decode calls were dispatched (checked before each)."""
    passes = []
    return lambda: passes.append(None) or len(passes) > n


def _parked(graphdef, params):
    """An engine and loop whose G samples per prompt decoded 3 calls, then parked mid-turn."""
    engine = Engine(CFG, graphdef, RCFG, SAMPLING)
    loop = EpisodeLoop(engine, G)
    keys = loop.add(PROMPTS, max_new_tokens=16)
    state = loop.run(params, engine.init_state(), seed=0, version=0, until=_calls(3))
    assert len(loop.ready) == len(PROMPTS) * G  # every episode parked mid-turn
    return engine, loop, keys, state


def _run(graphdef, params, refresh: bool):
    """Versions 0, 1, 2: parked after runs 0 and 1, the rest in run 2, refreshing or not at each
    resume. Returns (completions [prompt][sample], tokens the refreshes recomputed per run)."""
    engine, loop, keys, state = _parked(graphdef, params[0])
    refreshed, call = [], engine.refresh
    # The tokens the refresh queues for the round's prefill (`sampling.engine.Plan`).
    queued = lambda: sum(len(r.tokens) for b in engine.plan.batches["refresh"] for r in b.rows)

    def spy(params, state, items, fresh=None):
        before = queued()
        state = call(params, state, items, fresh)
        refreshed[-1] += queued() - before
        return state

    engine.refresh = spy
    for v, until in ((1, _calls(2)), (2, None)):
        refreshed.append(0)
        state = loop.run(params[v], state, seed=v, version=v, until=until, refresh=refresh)
    assert loop.idle and engine.allocator.num_used == 0
    return [loop.results[k] for k in keys], refreshed


def _reference(graphdef, params, prompt, c, v):
    """[(sampler log-prob, teacher-forced log-prob under params)] of the tokens version v drew."""
    seq = prompt + c.tokens
    tokens = np.zeros((1, T), np.int32)
    tokens[0, : len(seq)] = seq
    positions = np.arange(T, dtype=np.int32)[None]
    valid = np.arange(T)[None] < len(seq)
    lp = np.asarray(_teacher_forced(graphdef, params, tokens, positions, valid))[0]
    at = [j for j, x in enumerate(c.versions) if x == v]
    return np.asarray(c.logprobs)[at], lp[[len(prompt) - 1 + j for j in at]]


def test_refreshed_episodes_draw_as_under_the_new_parameters(versions):
    graphdef, params = versions
    results, refreshed = _run(graphdef, params, refresh=True)
    want = [0, 0]  # per refreshing run: the shared prompt once, then each sibling's own tokens
    naive = 0
    for prompt, group in zip(PROMPTS, results):
        assert len({tuple(c.tokens) for c in group}) == G  # the siblings differ
        shared = (len(prompt) - 1) // PAGE * PAGE
        for c in group:
            assert set(c.versions) == {0, 1, 2}  # drawn under all three
            for v in (1, 2):
                cached = len(prompt) + sum(x < v for x in c.versions) - 1  # history when parked
                want[v - 1] += cached - shared + (c is group[0]) * shared
                naive += cached
                got, ref = _reference(graphdef, params[v], prompt, c, v)
                np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0, err_msg=f"version {v}")
    assert refreshed == want and sum(want) < naive  # the set of fresh pages is per run


def test_without_refresh_the_old_kv_is_kept(versions):
    """The control: keeping the KV of older parameters, later tokens are not drawn as under the
    new parameters alone, so the reference above does tell a refreshed cache from a kept one."""
    graphdef, params = versions
    results, refreshed = _run(graphdef, params, refresh=False)
    assert refreshed == [0, 0]
    worst = max(
        np.abs(np.subtract(*_reference(graphdef, params[2], p, c, 2))).max()
        for p, group in zip(PROMPTS, results)
        for c in group
    )
    assert worst > 1e-3


def test_one_call_or_one_at_a_time_writes_what_each_alone_writes(versions):
    """The pages after refreshing every parked sequence in one call (siblings deferred within
    it), and one sequence per call sharing `fresh` (a sibling resumed earlier in the run), equal
    those after refreshing each sequence alone from position 0 with its own empty set."""
    graphdef, params = versions
    engine, loop, _, state = _parked(graphdef, params[0])
    items = [(ep.parked, loop.history(ep)) for ep, _ in loop.ready]
    host = jax.device_get(state)
    pages = sorted({q for p, _ in items for q in p.pages[: -(-p.cached_len // PAGE)]})

    def kv(groups):
        s = jax.device_put(host)
        for group, fresh in groups:
            s = engine.refresh(params[1], s, group, fresh)
        return np.stack([np.asarray(x)[:, pages] for x in (*s.k_pages, *s.v_pages)])

    shared = set()
    alone = kv([([it], set()) for it in items])
    np.testing.assert_allclose(kv([(items, set())]), alone, atol=1e-6, rtol=0)
    np.testing.assert_allclose(kv([([it], shared) for it in items]), alone, atol=1e-6, rtol=0)
    assert shared  # the prompts' full pages, marked fresh by the first sibling
    kept = np.stack([np.asarray(x)[:, pages] for x in (*host.k_pages, *host.v_pages)])
    assert np.abs(kept - alone).max() > 1e-3  # the refresh did rewrite them
