"""Groups admitted sample by sample (`sampling.episodes.EpisodeLoop._admit`): a G-sample request
goes in as soon as one slot is free, its prompt prefilled once, the samples that do not fit yet
inserted as slots free up (the prefix kept live between inserts), with per-sample budgets, the
worst-case pages of the samples not inserted promised at the engine, and the same tokens as each
request decoded alone. Under reserve="budget", whose promises (each sample's worst case) these
tests count: "demand" promises only a first call's pages (tests/sampling/test_preemption.py)."""

import dataclasses

import jax
import pytest

from sampling.distribution import SamplingParams
from sampling.engine import Engine
from sampling.episodes import EpisodeLoop, generate_all
from sampling.requests import group_pages
from tests.conftest import CFG, random_prompts
from tests.conftest import ECFG as BASE

ECFG = dataclasses.replace(BASE, reserve="budget")

SAMPLED = SamplingParams(temperature=1.0)
PROMPTS = random_prompts([13, 9, 17, 5], seed=11)  # 12, 8, 16, 4 cached: partial last pages too
BUDGETS = [[3, 12, 7, 5], [12, 2, 9, 4], [6, 6, 11, 1], [8, 3, 10, 12]]


def _alone(graphdef, params, prompt, budgets, rid):
    """Each request decoded alone in an engine with a slot for every sample (whole-group insert),
    at the largest budget: the reference's tokens, of which sample k's first budgets[k] count."""
    engine = Engine(CFG, graphdef, ECFG, SAMPLED)
    _, out = generate_all(engine, params, engine.init_state(), [prompt], len(budgets),
                                 max(budgets), seed=5, request_ids=[rid])  # fmt: skip
    return out[0]


def _record_inserts(engine):
    calls, insert = [], engine.bulk_insert

    def bulk_insert(state, prefix, slots, *args, **kwargs):
        calls.append((tuple(kwargs.get("samples", range(len(slots)))), kwargs.get("keep", False)))
        return insert(state, prefix, slots, *args, **kwargs)

    engine.bulk_insert = bulk_insert
    return calls


def test_a_group_goes_in_sample_by_sample_with_the_tokens_of_each_request_alone(tiny):
    graphdef, params = tiny
    engine = Engine(CFG, graphdef, dataclasses.replace(ECFG, num_slots=6), SAMPLED)
    calls = _record_inserts(engine)
    state, out = generate_all(engine, params, engine.init_state(), PROMPTS, 4, BUDGETS, seed=5,
                                     request_ids=[10, 11, 12, 13])  # fmt: skip
    # Request 1 starts in the 2 slots request 0 left: split, the prompt prefilled once.
    assert calls[:2] == [((0, 1, 2, 3), False), ((0, 1), True)]
    assert any(keep for _, keep in calls)
    assert sorted(k for ks, _ in calls for k in ks) == sorted(list(range(4)) * 4)
    assert engine.prefill_tokens == sum(len(p) - 1 for p in PROMPTS)
    for i, (prompt, budgets) in enumerate(zip(PROMPTS, BUDGETS)):
        ref = _alone(graphdef, params, prompt, budgets, 10 + i)
        for k, b in enumerate(budgets):
            assert out[i][k].length == b  # no stop ids: each sample's own budget
            assert out[i][k].tokens == ref[k].tokens[:b], (i, k)
            assert out[i][k].logprobs == ref[k].logprobs[:b], (i, k)
    assert engine.allocator.num_used == 0 and engine.pages.promises() == {}


def _stopped_with_a_group_open(graphdef, params):
    """Requests 0 and 1 (G 4) in 6 slots, a pool of exactly their worst-case pages, run until
    request 1 is partly inserted: samples 0 and 1 of request 1 in, 2 and 3 not."""
    page = ECFG.page_size
    need = [group_pages(len(p), b, page, 4) for p, b in zip(PROMPTS[:2], BUDGETS[:2])]
    ecfg = dataclasses.replace(ECFG, num_slots=6, num_pages=1 + sum(need))
    engine = Engine(CFG, graphdef, ecfg, SAMPLED)
    loop = EpisodeLoop(engine, 4)
    loop.add(PROMPTS[:2], BUDGETS[:2], request_ids=[10, 11])
    state = loop.run(params, engine.init_state(), seed=5, until=lambda: bool(loop.open_groups()))
    return engine, loop, state


def test_a_stop_keeps_the_prefix_and_promises_the_pages_of_the_samples_left(tiny):
    """The open group keeps its prefix across the stop, the pages its samples left may take are
    promised (a loop on the same engine cannot admit into them, the pool never overcommits),
    and the next run ends with the tokens of one uninterrupted run."""
    graphdef, params = tiny
    engine, loop, state = _stopped_with_a_group_open(graphdef, params)
    ((key, k0, prefix, kv),) = loop.open_groups().values()
    assert (key, k0, kv) == (1, 2, 0) and not prefix.consumed
    page, cached = ECFG.page_size, len(PROMPTS[1]) - 1
    own = group_pages(len(PROMPTS[1]), BUDGETS[1][2:], page, 2) - cached // page
    assert engine.pages.promises() == {(loop, 0): (0, own - (cached % page > 0))}
    assert engine.pages.promised() == engine.pages.promised(0) == 3
    # Free: the pages of samples 0 of request 0 and 1 of request 1 (budgets 3 and 2: ended).
    assert [i for i, r in loop.results.items() for c in r if c is not None] == [0, 1]
    assert engine.allocator.num_free - engine.pages.reserved() == 2
    other = EpisodeLoop(engine, 1)  # 4 pages: free were the promise not counted
    other.add([PROMPTS[2]], [ECFG.max_new_tokens])
    assert group_pages(len(PROMPTS[2]), ECFG.max_new_tokens, page, 1) == 4 <= 2 + 3
    with pytest.raises(ValueError, match="needs a free slot and 4 KV pages; 6 slots and 2 pages"):
        other.run(params, state)
    before = engine.prefill_tokens
    state = loop.run(params, state, seed=5, version=1)
    assert engine.prefill_tokens == before  # nothing prefilled again
    assert loop.admitted == {0: 0, 1: 0}  # admitted at sample 0
    engine2 = Engine(CFG, graphdef, engine.ecfg, SAMPLED)
    _, want = generate_all(engine2, params, engine2.init_state(), PROMPTS[:2], 4, BUDGETS[:2],
                                   seed=5, request_ids=[10, 11])  # fmt: skip
    for i in range(2):
        assert [c.tokens for c in loop.results[i]] == [c.tokens for c in want[i]]
        assert [c.logprobs for c in loop.results[i]] == [c.logprobs for c in want[i]]
    assert engine.allocator.num_used == 0 and engine.pages.promises() == {}


@pytest.mark.parametrize("refresh", [True, False])
def test_refresh_recomputes_the_open_groups_prompt_under_the_new_parameters(tiny, refresh):
    """Samples 2 and 3 of request 1 start after the stop, under new parameters: with refresh
    their tokens are those of the request decoded alone under the new parameters; without, the
    prompt's KV is the old parameters' and they differ."""
    graphdef, params = tiny
    engine, loop, state = _stopped_with_a_group_open(graphdef, params)
    new = jax.tree.map(lambda x: x * 1.25, params)
    state = loop.run(new, state, seed=5, version=1, refresh=refresh)
    ref = _alone(graphdef, new, PROMPTS[1], BUDGETS[1], 11)
    for k in (2, 3):
        got, b = loop.results[1][k], BUDGETS[1][k]
        same = got.tokens == ref[k].tokens[:b] and got.logprobs == ref[k].logprobs[:b]
        assert same == refresh, k
    assert engine.allocator.num_used == 0 and engine.pages.promises() == {}


def test_an_error_with_a_group_open_leaves_nothing_held(tiny):
    graphdef, params = tiny
    engine = Engine(CFG, graphdef, dataclasses.replace(ECFG, num_slots=6), SAMPLED)
    loop, dispatch, calls = EpisodeLoop(engine, 4), engine.dispatch, []

    def failing(*args, **kwargs):
        calls.append(loop.open_groups())
        if len(calls) == 2:
            raise RuntimeError("boom")
        return dispatch(*args, **kwargs)

    engine.dispatch = failing
    loop.add(PROMPTS[:2], BUDGETS[:2])
    with pytest.raises(RuntimeError, match="boom"):
        loop.run(params, engine.init_state(), seed=5)
    assert calls[1]  # request 1 was open
    assert engine.pages.promises() == {} and engine.allocator.num_used == 0
    assert sorted(engine.pages.free_slots) == list(range(6)) and engine.pages.busy_slots() == []


def test_per_sample_budgets_are_checked():
    with pytest.raises(ValueError, match="max_new_tokens of a request has 2 entries, need 4"):
        from sampling.requests import check_requests

        check_requests(ECFG, PROMPTS[:1], 4, [[3, 4]], None)
    assert group_pages(17, [1, 9], 8, 2) == 2 + (3 - 2) + (4 - 2)
    assert group_pages(17, [9, 9], 8, 2) == group_pages(17, 9, 8, 2)


def test_inserts_and_releases_change_the_slots_given_and_no_other(tiny, monkeypatch):
    """Split groups insert and free any count of slots: each round's changes are one
    `steps.update` of every slot (one shape, one compile, whatever the count), and only the
    slots given change."""
    from sampling import steps

    graphdef, params = tiny
    sizes = []
    update = steps.update

    def recorded(state, put, off, *args):
        sizes.append((int(put.sum()), int(off.sum()), len(put)))
        return update(state, put, off, *args)

    monkeypatch.setattr(steps, "update", recorded)
    engine = Engine(CFG, graphdef, ECFG, SAMPLED)  # 8 slots: slot 7 is the last
    state, prefix = engine.prefill(params, engine.init_state(), PROMPTS[0])
    state = engine.bulk_insert(state, prefix, [7, 1, 4], 3, [5, 6, 7], samples=[0, 1, 2],
                               keep=True)  # fmt: skip
    state = engine.bulk_insert(state, prefix, [0, 2, 3, 5, 6], 3, 4, samples=[3, 4, 5, 6, 7])
    lengths, sample, max_new = jax.device_get((state.lengths, state.sample_id, state.max_new))
    cached = len(PROMPTS[0]) - 1
    assert lengths.tolist() == [cached] * 8
    assert sample.tolist() == [3, 1, 4, 5, 2, 6, 7, 0]
    assert max_new.tolist() == [4, 6, 4, 4, 7, 4, 4, 5]
    state = engine.free_slots_of(state, [7, 0, 3])
    active = [s not in (7, 0, 3) for s in range(8)]
    assert jax.device_get(state.active).tolist() == active
    assert sizes == [(3, 0, 8), (5, 0, 8), (0, 3, 8)]  # every slot's arrays, the given ones set
