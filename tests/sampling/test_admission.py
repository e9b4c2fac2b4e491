"""Groups admitted sample by sample (`sampling.episodes.EpisodeLoop._admit`): a G-sample request
goes in as soon as one slot is free, its prompt prefilled once, the samples that do not fit yet
inserted as slots free up (the prefix kept live between inserts), with per-sample budgets, the
worst-case pages of the samples not inserted promised at the engine, and the same tokens as each
request decoded alone."""

import dataclasses

import pytest

from sampling.distribution import SamplingParams
from sampling.engine import Engine
from sampling.episodes import EpisodeLoop
from sampling.page_allocator import group_pages
from tests.conftest import CFG, ECFG, random_prompts

SAMPLED = SamplingParams(temperature=1.0)
PROMPTS = random_prompts([13, 9, 17, 5], seed=11)  # 12, 8, 16, 4 cached: partial last pages too
BUDGETS = [[3, 12, 7, 5], [12, 2, 9, 4], [6, 6, 11, 1], [8, 3, 10, 12]]


def _alone(graphdef, params, prompt, budgets, rid):
    """Each request decoded alone in an engine with a slot for every sample (whole-group insert),
    at the largest budget: the reference's tokens, of which sample k's first budgets[k] count."""
    engine = Engine(CFG, graphdef, ECFG, SAMPLED)
    _, out = engine.generate_all(params, engine.init_state(), [prompt], len(budgets),
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
    state, out = engine.generate_all(params, engine.init_state(), PROMPTS, 4, BUDGETS, seed=5,
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
    assert engine.allocator.num_used == 0 and engine.promised == {}


def test_a_stop_gives_back_the_prefix_and_promises_the_pages_of_the_samples_left(tiny):
    """`run(until=...)` with a group partly inserted: its prefix is freed, the pages its samples
    left may take are promised (a loop on the same engine cannot admit into them), and the next
    run prefills the prompt again and ends with the tokens of one uninterrupted run."""
    graphdef, params = tiny
    page, cached = ECFG.page_size, len(PROMPTS[1]) - 1
    need = [group_pages(len(p), b, page, 4) for p, b in zip(PROMPTS[:2], BUDGETS[:2])]
    # A pool of exactly what the two groups and request 1's prompt prefilled twice take.
    ecfg = dataclasses.replace(ECFG, num_slots=6, num_pages=1 + sum(need) + cached // page)
    engine = Engine(CFG, graphdef, ecfg, SAMPLED)
    loop = EpisodeLoop(engine, 4)
    loop.add(PROMPTS[:2], BUDGETS[:2], request_ids=[10, 11])
    state = loop.run(params, engine.init_state(), seed=5, until=lambda: loop._open is not None)
    assert loop._open == (1, 2, None)  # samples 0 and 1 of request 1 parked, 2 and 3 not in
    promised = group_pages(len(PROMPTS[1]), BUDGETS[1][2:], page, 2)
    assert engine.promised == {loop: promised}
    # Free: the pages of samples 0 of request 0 and 1 of request 1 (budgets 3 and 2: ended).
    assert [i for i, r in loop.results.items() for c in r if c is not None] == [0, 1]
    assert engine.allocator.num_free - engine._reserved() == 2
    other = EpisodeLoop(engine, 1)  # 4 pages: free were the promise not counted
    other.add([PROMPTS[2]], [ECFG.max_new_tokens])
    assert group_pages(len(PROMPTS[2]), ECFG.max_new_tokens, page, 1) == 4 <= 2 + promised
    with pytest.raises(ValueError, match="needs a free slot and 4 KV pages; 6 slots and 2 pages"):
        other.run(params, state)
    before = engine.prefill_tokens
    state = loop.run(params, state, seed=5)
    assert engine.prefill_tokens - before == cached  # the prompt again, not the histories
    engine2 = Engine(CFG, graphdef, ecfg, SAMPLED)
    _, want = engine2.generate_all(params, engine2.init_state(), PROMPTS[:2], 4, BUDGETS[:2],
                                   seed=5, request_ids=[10, 11])  # fmt: skip
    for i in range(2):
        assert [c.tokens for c in loop.results[i]] == [c.tokens for c in want[i]]
        assert [c.logprobs for c in loop.results[i]] == [c.logprobs for c in want[i]]
    assert engine.allocator.num_used == 0 and engine.promised == {}


def test_per_sample_budgets_are_checked():
    with pytest.raises(ValueError, match="max_new_tokens of a request has 2 entries for 4 slots"):
        from sampling.requests import check_requests

        check_requests(ECFG, PROMPTS[:1], 4, [[3, 4]], None)
    assert group_pages(17, [1, 9], 8, 2) == 2 + (3 - 2) + (4 - 2)
    assert group_pages(17, [9, 9], 8, 2) == group_pages(17, 9, 8, 2)
