"""Engine API misuse: every mistake raises a clear error or rolls back, never corrupts the host
bookkeeping (allocator refcounts, page table, slot lists) silently.

The engine shapes are tests/conftest.py's CFG and ECFG, as in tests/sampling/test_engine.py, so
compiles are shared.
"""

import itertools

import jax
import numpy as np
import pytest

from sampling import steps as steps_module
from sampling.distribution import SamplingParams
from sampling.engine import Engine
from sampling.episodes import generate_all
from sampling.pages import OutOfPagesError, PageAllocator
from sampling.requests import group_pages
from tests.conftest import CFG, ECFG, random_prompts


def _engine(graphdef):
    return Engine(CFG, graphdef, ECFG, SamplingParams(1.0))


def _host(engine):
    """A copy of the engine's host bookkeeping (its page book's)."""
    book, a = engine.pages, engine.allocator
    return (
        a.num_used,
        [a.refcount(p) for p in range(a.num_pages)],
        book.table.array.copy(),
        sorted(book.free_slots),
        {s: (book.length(s), book.cap(s)) for s in book.busy_slots()},
        book.promised(),
    )


def _assert_same(before, after):
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)


def _assert_empty(engine):
    book = engine.pages
    assert engine.allocator.num_used == 0
    assert sorted(book.free_slots) == list(range(ECFG.num_slots))
    assert book.busy_slots() == [] and book.parked == [] and book.promised() == 0
    assert not book.table.array.any()


def test_group_pages_is_the_peak_of_a_group():
    """The formula against the allocator: prefill, fork, every sample grown to its cap."""
    for plen, max_new, ps, g in itertools.product([1, 2, 8, 9, 17], [1, 7, 8], [4, 8], [1, 3]):
        a = PageAllocator(200)
        cached = plen - 1
        rows, _ = a.fork_for_group(a.alloc(-(-cached // ps)), cached, ps, g)
        for r in rows:
            r += a.alloc(-(-(cached + max_new) // ps) - len(r))
        assert a.peak_used == group_pages(plen, max_new, ps, g), (plen, max_new, ps, g)
    with pytest.raises(ValueError, match="prompt_len=0"):
        group_pages(0, 4, 8, 2)


def test_prefix_inserts_once(tiny):
    graphdef, params = tiny
    engine = _engine(graphdef)
    state, prefix = engine.prefill(params, engine.init_state(), random_prompts([21])[0])
    state = engine.bulk_insert(state, prefix, [0, 1], request_id=0, max_new=4)
    full = prefix.pages[:2]  # 20 cached tokens: 2 full pages + 1 partial
    assert [engine.allocator.refcount(p) for p in full] == [2, 2]
    before = _host(engine)
    with pytest.raises(ValueError, match="already inserted"):
        engine.bulk_insert(state, prefix, [2, 3], request_id=1, max_new=4)
    _assert_same(before, _host(engine))
    state = engine.free_slots_of(state, [0, 1])
    _assert_empty(engine)

    # A prefix from before init_state: its pages were forgotten with the old state.
    state, stale = engine.prefill(params, state, random_prompts([9])[0])
    state = engine.init_state()
    with pytest.raises(ValueError, match="since its last init_state"):
        engine.bulk_insert(state, stale, [0, 1], request_id=0, max_new=4)
    _assert_empty(engine)
    # ... and one from another engine.
    other = _engine(graphdef)
    _, foreign = other.prefill(params, other.init_state(), random_prompts([9])[0])
    with pytest.raises(ValueError, match="not prefilled by this engine"):
        engine.bulk_insert(state, foreign, [0, 1], request_id=0, max_new=4)
    _assert_empty(engine)


def test_bulk_insert_checks_slots(tiny):
    graphdef, params = tiny
    engine = _engine(graphdef)
    state, (a, b) = engine.prefill_many(params, engine.init_state(), random_prompts([21, 9]))
    state = engine.bulk_insert(state, a, [0, 1], request_id=0, max_new=4)
    before = _host(engine)
    for slots, match in [
        ([1, 2], r"slot\(s\) \[1\] busy"),
        ([2, 8], r"slot\(s\) \[8\] out of range"),
        ([-1, 2], r"slot\(s\) \[-1\] out of range"),
        ([3, 3], r"slot\(s\) \[3\] given more than once"),
        ([], "at least one slot"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.bulk_insert(state, b, slots, request_id=1, max_new=4)
        _assert_same(before, _host(engine))
        assert not b.consumed
    with pytest.raises(ValueError, match=r"slot\(s\) \[8\] out of range"):
        engine.free_slots_of(state, [2, 8])
    _assert_same(before, _host(engine))
    assert sorted(engine.pages.free_slots) == list(range(2, 8))  # inserted slots are no longer free
    state = engine.bulk_insert(state, b, [2, 3], request_id=1, max_new=4)
    for s in [0, 1, 2, 3, 3]:  # freeing an idle slot again is a no-op
        state = engine.free_resource(state, s)
    _assert_empty(engine)


def test_prefill_many_rolls_back(tiny, monkeypatch):
    graphdef, params = tiny
    engine = _engine(graphdef)
    state = engine.init_state()
    held = engine.allocator.alloc(engine.allocator.num_free - 5)
    before = _host(engine)
    # 16 cached tokens = 2 pages each: the first two prompts fit in the 5 free pages, not the third.
    with pytest.raises(OutOfPagesError) as err:
        engine.prefill_many(params, state, random_prompts([17, 17, 17]))
    _assert_same(before, _host(engine))
    assert "needs 6 KV pages but only 5" in str(err.value)

    def broken(*args):
        raise RuntimeError("device failure")

    monkeypatch.setattr(steps_module, "prefill", broken)
    with pytest.raises(RuntimeError, match="device failure"):
        engine.prefill_many(params, state, random_prompts([17, 9]))
    _assert_same(before, _host(engine))
    engine.allocator.free(held)
    assert engine.allocator.num_used == 0


class Boom(Exception):
    pass


PROMPTS = random_prompts([6, 9, 12, 5, 17], seed=4)
MAX_NEW = [4, 4, 12, 12, 8]  # groups 0, 1 finish after the first generate call, 2, 3 run on


def _run(engine, params, state, **kw):
    return generate_all(engine, params, state, PROMPTS, 2, MAX_NEW, seed=5, **kw)


def test_generate_all_cleans_up_after_on_finish_raises(tiny):
    graphdef, params = tiny
    engine = _engine(graphdef)
    calls = []

    def on_finish(i, k, completion):
        calls.append((i, k))
        if len(calls) == 3:
            raise Boom

    with pytest.raises(Boom):
        _run(engine, params, engine.init_state(), on_finish=on_finish)
    _assert_empty(engine)
    _, again = _run(engine, params, engine.init_state())
    fresh = _engine(graphdef)
    _, want = _run(fresh, params, fresh.init_state())
    assert [[c.tokens for c in r] for r in again] == [[c.tokens for c in r] for r in want]
    assert [[c.logprobs for c in r] for r in again] == [[c.logprobs for c in r] for r in want]
    _assert_empty(engine)


def test_generate_all_cleans_up_after_insert_raises(tiny):
    """Fails between prefill and insert: prefixes prefilled but not yet inserted are freed."""
    graphdef, params = tiny
    engine = _engine(graphdef)
    insert, count = engine.bulk_insert, []

    def bulk_insert(*args, **kwargs):
        count.append(1)
        if len(count) == 3:
            raise Boom
        return insert(*args, **kwargs)

    engine.bulk_insert = bulk_insert
    with pytest.raises(Boom):
        _run(engine, params, engine.init_state())
    _assert_empty(engine)


def test_generate_all_checks_arguments_first(tiny):
    graphdef, params = tiny
    engine = _engine(graphdef)
    with pytest.raises(ValueError, match="request_ids has 2 entries for 5 prompts"):
        _run(engine, params, None, request_ids=[0, 1])
    with pytest.raises(ValueError, match="prompt of 25 tokens"):
        generate_all(engine, params, None, [[1] * 5, [1] * 25])
    with pytest.raises(ValueError, match="num_samples=0"):
        generate_all(engine, params, None, [[1] * 5], num_samples=0)
    _assert_empty(engine)


def test_init_state_resets_host_bookkeeping(tiny):
    graphdef, params = tiny
    engine = _engine(graphdef)
    state, prefix = engine.prefill(params, engine.init_state(), random_prompts([21])[0])
    engine.bulk_insert(state, prefix, [4, 5], request_id=0, max_new=4)
    engine.init_state()
    _assert_empty(engine)
    assert engine.pages.worst_case_pages(21, 12, 8) == group_pages(21, 12, ECFG.page_size, 8)


def test_a_stale_ticket_is_refused_and_a_late_one_leaves_the_next_sequence_alone(tiny):
    """A decode call collected after the slot was freed and given a new sequence must not touch
    the new one (its length bound, its pages); one dispatched before init_state is refused."""
    graphdef, params = tiny
    engine = _engine(graphdef)
    short, long = random_prompts([5, 24])
    state, p = engine.prefill(params, engine.init_state(), short)
    state = engine.insert(state, p, 0, request_id=0, max_new=2)
    state, late = engine.dispatch(params, state, jax.random.key(0))
    state = engine.free_resource(state, 0)
    state, p = engine.prefill(params, state, long)
    state = engine.insert(state, p, 0, request_id=1, max_new=12)
    before = _host(engine)
    assert engine.collect(late).slots == []  # slot 0 holds another sequence now
    _assert_same(before, _host(engine))
    state, stale = engine.dispatch(params, state, jax.random.key(0))
    state = engine.init_state()
    with pytest.raises(ValueError, match="before this engine's last init_state"):
        engine.collect(stale)
