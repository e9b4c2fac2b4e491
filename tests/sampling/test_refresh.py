"""`Engine.refresh` (partial rollouts' `rl.refresh_kv_on_update`): a sequence parked under one set
of parameters and resumed with refresh under another continues exactly as if its whole history
had been prefilled from scratch under the new ones, and siblings sharing their prompt's full pages
recompute the prompt once."""

import dataclasses

import numpy as np
import pytest

from models.sharding import init_params
from sampling.distribution import SamplingParams
from sampling.engine import Engine
from sampling.episodes import EpisodeLoop
from tests.conftest import CFG, ECFG, random_prompts

PAGE, G = 4, 2
RCFG = dataclasses.replace(ECFG, page_size=PAGE, max_new_tokens=16, steps_per_call=2)
PROMPTS = random_prompts([9, 14], seed=5)  # 8 and 13 tokens cached: 2 and 3 full pages shared


def _carry(graphdef, params_a, params_b, refresh: bool):
    """Greedy, G samples per prompt: 3 decode calls under params_a, parked mid-turn, then the rest
    under params_b. Returns (completions [prompt][sample], tokens the refresh recomputed)."""
    engine = Engine(CFG, graphdef, RCFG, SamplingParams(0.0))
    loop = EpisodeLoop(engine, G)
    keys = loop.add(PROMPTS, max_new_tokens=16)
    passes = []

    def three_calls():
        passes.append(None)
        return len(passes) > 3

    state = loop.run(params_a, engine.init_state(), version=0, until=three_calls)
    assert not loop.idle and len(loop.ready) == len(PROMPTS) * G  # every episode parked mid-turn
    refreshed, call = [], engine.refresh

    def spy(params, state, items, fresh=None):
        before = engine.prefill_tokens
        state = call(params, state, items, fresh)
        refreshed.append(engine.prefill_tokens - before)
        return state

    engine.refresh = spy
    loop.run(params_b, state, version=1, refresh=refresh)
    assert loop.idle and engine.allocator.num_used == 0
    return [loop.results[k] for k in keys], sum(refreshed)


@pytest.fixture(scope="module")
def both(tiny, one_device_mesh):
    graphdef, params_a = tiny
    params_b = init_params(CFG, one_device_mesh, seed=4)[1]
    return graphdef, params_a, params_b


def _reference(graphdef, params, prompt, drawn, n):
    """Greedy continuation of prompt + drawn under params, the whole history prefilled."""
    engine = Engine(CFG, graphdef, dataclasses.replace(RCFG, max_prompt_len=48),
                    SamplingParams(0.0))  # fmt: skip
    _, out = engine.generate_all(params, engine.init_state(), [prompt + drawn], 1, n)
    return out[0][0]


def test_refresh_equals_prefilling_the_history_and_computes_a_shared_prompt_once(both):
    graphdef, params_a, params_b = both
    results, refreshed = _carry(graphdef, params_a, params_b, refresh=True)
    want_tokens, naive = 0, 0
    for prompt, group in zip(PROMPTS, results):
        shared = (len(prompt) - 1) // PAGE * PAGE  # the prompt's full pages, shared by the G
        want_tokens += shared
        for c in group:
            versions = np.asarray(c.versions)
            assert 0 < (versions == 0).sum() < len(versions)  # drawn under both parameter sets
            old, new = (versions == 0).sum(), (versions == 1).sum()
            cached = len(prompt) + old - 1  # the history the pages held when parked
            want_tokens += cached - shared
            naive += cached
            ref = _reference(graphdef, params_b, prompt, c.tokens[:old], new)
            assert c.tokens[old:] == ref.tokens
            np.testing.assert_allclose(c.logprobs[old:], ref.logprobs, atol=1e-5, rtol=0)
    assert refreshed == want_tokens < naive


def test_without_refresh_the_old_kv_is_kept(both):
    """The control: the same schedule keeping the KV of params_a continues differently, so the
    reference above does tell a refreshed cache from a kept one."""
    graphdef, params_a, params_b = both
    results, refreshed = _carry(graphdef, params_a, params_b, refresh=False)
    assert refreshed == 0
    worst = 0.0
    for prompt, group in zip(PROMPTS, results):
        for c in group:
            old = int((np.asarray(c.versions) == 0).sum())
            ref = _reference(graphdef, params_b, prompt, c.tokens[:old], len(c.tokens) - old)
            n = min(len(ref.logprobs), len(c.tokens) - old)
            same = next((j for j in range(n) if c.tokens[old + j] != ref.tokens[j]), n)
            if same:
                diff = np.abs(np.subtract(c.logprobs[old : old + same], ref.logprobs[:same]))
                worst = max(worst, float(diff.max()))
            else:
                worst = np.inf  # the first token already differs
    assert worst > 1e-3
