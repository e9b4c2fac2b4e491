"""The page book (`sampling.pages.PageBook`) alone, through its public API, with no device: what
admission, growth, parking, resume, preemption and release do to slots, pages and reservations,
and that every refused call leaves the book as it was."""

import dataclasses

import numpy as np
import pytest

from sampling.pages import NULL_PAGE, OutOfPagesError, PageBook
from sampling.requests import EngineConfig, group_pages

# 8 slots, pages of 4 tokens, 32 pages (31 usable) per shard of one.
ECFG = EngineConfig(
    num_slots=8,
    page_size=4,
    num_pages=32,
    max_prompt_len=16,
    max_new_tokens=12,
    steps_per_call=4,
    reserve="budget",
)
DEMAND = dataclasses.replace(ECFG, reserve="demand", kv_watermark=0.1)


def _snapshot(book: PageBook):
    """Everything a caller can see of a book."""
    return (
        [[a.refcount(p) for p in range(1, a.num_pages)] for a in book.pools],
        book.table.array.tolist(),
        book.free_slots,
        [(s, book.length(s), book.cap(s), book.ids(s)) for s in book.busy_slots()],
        [(p.pages, p.cached_len, p.evicted) for p in book.parked],
        book.promises(),
    )


def _inserted(book, prompt_len=10, slots=(0, 1), max_new=6, reserve=0, request_id=3):
    """A prompt of prompt_len tokens prefilled and inserted into `slots` (of one shard)."""
    (prefix,) = book.open_prefixes([[1] * prompt_len], shards=[book.shard_of(slots[0])])
    book.insert(prefix, list(slots), request_id, max_new, reserve)
    return prefix


def test_a_fresh_book_is_empty_and_each_shard_holds_its_own_slots_and_pool():
    book = PageBook(dataclasses.replace(ECFG, num_slots=8, num_pages=32), 2, local_shards=[1])
    assert book.slots_per_shard == 4 and book.pages_per_shard == 16
    assert book.free_slots == [4, 5, 6, 7]  # only this process's shard
    assert [book.shard_of(s) for s in range(8)] == [0] * 4 + [1] * 4
    assert book.free_on(0) == [] and book.free_on(1) == [4, 5, 6, 7]
    assert book.allocator.num_pages == 32 and book.allocator.num_used == 0
    assert book.busy_slots() == [] and book.parked == [] and book.reserved() == 0
    with pytest.raises(ValueError, match="must divide by the 3 batch shards"):
        PageBook(ECFG, 3)


def test_open_prefixes_places_on_the_roomiest_shard_all_or_nothing():
    book = PageBook(ECFG, 2)  # 15 usable pages per shard
    a, b, c = book.open_prefixes([[1] * 9, [1] * 5, [1] * 5])  # 2, 1, 1 pages
    assert (a.shard, b.shard, c.shard) == (0, 1, 1)  # ties by index, then the most room
    assert (a.cached_len, a.last_token, len(a.pages)) == (8, 1, 2) and book.live(a)
    assert [p.num_used for p in book.pools] == [2, 2]
    before = _snapshot(book)
    with pytest.raises(OutOfPagesError, match="needs 16 KV pages on shard 0 but only 13 of 15"):
        book.open_prefixes([[1] * 16] * 4, shards=[0, 0, 0, 0])
    with pytest.raises(ValueError, match="prompt of 17 tokens"):
        book.open_prefixes([[1] * 3, [1] * 17])
    assert _snapshot(book) == before  # nothing allocated by a refused call
    book.close_prefix(a)
    assert a.consumed and not book.live(a) and book.pools[0].num_used == 0
    book.close_prefix(a)  # a no-op the second time
    assert book.pools[0].num_used == 0


def test_insert_shares_full_pages_and_copies_the_partial_one():
    book = PageBook(ECFG)
    book.set_group(4)
    (prefix,) = book.open_prefixes([[1] * 11])  # 10 cached: 2 full pages + a partial one
    max_new, samples, copies, shared = book.insert(prefix, [4, 5, 6, 7], 9, 6, reserve=[6, 8, 6, 6])
    assert max_new.tolist() == [6] * 4 and samples.tolist() == [0, 1, 2, 3]
    assert shared == 8  # an aligned block of the group: its full pages are read once
    full, last = prefix.pages[:2], prefix.pages[2]
    assert [book.allocator.refcount(p) for p in full] == [4, 4]
    assert len(copies) == 3 and all(src == last for src, _ in copies)
    rows = [book.table.row(s) for s in (4, 5, 6, 7)]
    assert all(r[:2] == full for r in rows) and len({r[2] for r in rows}) == 4
    assert prefix.consumed and book.busy_slots() == [4, 5, 6, 7]
    assert [book.cap(s) for s in (4, 5, 6, 7)] == [16, 18, 16, 16]  # 10 + max(max_new, reserve)
    assert [book.length(s) for s in (4, 5, 6, 7)] == [10] * 4
    assert [book.ids(s) for s in (4, 5)] == [(9, 0), (9, 1)]
    assert book.free_slots == [0, 1, 2, 3]
    # Not aligned, or not a whole group: no shared length.
    (p2,) = book.open_prefixes([[1] * 11])
    assert book.insert(p2, [1, 2], 10, 6, keep=True)[3] == 0
    assert book.live(p2)  # kept for the request's later samples
    with pytest.raises(ValueError, match="set_group with busy slots"):
        book.set_group(1)


def test_refused_inserts_change_nothing():
    book = PageBook(ECFG, 2)
    (prefix,) = book.open_prefixes([[1] * 7], shards=[0])
    book.insert(prefix, [0], 1, 4, keep=True)
    before = _snapshot(book)
    for slots, match in [
        ([0], "busy"),
        ([4], "not on the prefix's shard 0"),
        ([1, 1], "given more than once"),
        ([9], "out of range"),
        ([], "at least one slot"),
    ]:
        with pytest.raises(ValueError, match=match):
            book.insert(prefix, slots, 1, 4, keep=True)
        assert _snapshot(book) == before
    with pytest.raises(ValueError, match="max_new_tokens=13"):
        book.insert(prefix, [1], 1, 13)
    book.insert(prefix, [1], 1, 4)
    with pytest.raises(ValueError, match="already inserted"):
        book.insert(prefix, [2], 1, 4)
    (stale,) = book.open_prefixes([[1] * 7])
    book.reset()
    assert book.allocator.num_used == 0 and book.free_slots == list(range(8))
    with pytest.raises(ValueError, match="not prefilled by this engine since its last"):
        book.insert(stale, [0], 1, 4)


def test_take_slots_keeps_whole_blocks_for_groups():
    book = PageBook(ECFG)
    book.set_group(4)
    _inserted(book, slots=[1])  # block 0..3 is partly used
    assert book.take_slots(4) == [4, 5, 6, 7]  # a whole block for a whole group
    assert book.take_slots(2) == [0, 2]  # a part goes where a block is already broken
    assert PageBook(ECFG).take_slots(3) == [0, 1, 2]  # group 1: the first free ones


def test_grow_gives_each_busy_slot_its_next_call_and_settle_puts_back_what_it_did_not_use():
    book = PageBook(ECFG)
    _inserted(book, prompt_len=10, slots=[0, 1], max_new=6)  # 9 cached, caps 15
    assert book.growth() == {0: (13, 1), 1: (13, 1)}  # 3 pages at 9 tokens, 4 at 13
    first = book.grow(4)
    assert first == {0: (1, 13), 1: (1, 13)}  # (serial: one sequence so far, bound)
    assert [len(book.table.row(s)) for s in (0, 1)] == [4, 4]
    second = book.grow(4)  # a second call in flight: bounded by the cap
    assert [book.length(s) for s in (0, 1)] == [15, 15] and second[0] == (1, 15)
    # The first call ran: slot 0 wrote 2 tokens and stopped, slot 1 all 4.
    lengths, active = np.array([11, 13] + [0] * 6), np.array([False, True] + [False] * 6)
    assert book.settle(first, lengths, active) == [0, 1]
    assert book.length(0) == 11  # exact: finished
    assert book.length(1) == 15  # 13 exact + the second call's 2 (its bound)
    # The second call's read of slot 0 predates its settling: left alone.
    lengths2, active2 = np.array([15, 15] + [0] * 6), np.array([True, False] + [False] * 6)
    assert book.settle(second, lengths2, active2) == [1]
    assert book.length(0) == 11 and book.length(1) == 15
    book.release([0])
    assert book.settle(second, lengths2, active2) == []  # freed since
    assert book.free_slots[-1] == 0 and not book.is_busy(0)
    assert book.table.row(0) == [] and (book.table.array[0] == NULL_PAGE).all()
    book.release([0])  # a no-op on an idle slot
    assert book.free_slots.count(0) == 1


def test_budget_reserves_the_worst_case_and_demand_only_promises():
    book = PageBook(ECFG)
    _inserted(book, prompt_len=10, slots=[0, 1], max_new=6)  # 3 pages each at cap 15 -> 4
    held = book.allocator.num_used
    assert held == 2 + 2  # 2 shared full pages, the partial one and its copy
    assert book.reserved() == 2  # one more page each, up to their caps
    assert book.room(0) == 31 - held - 2
    assert book.headroom(0) == book.room(0) - 2  # the next call takes those pages
    assert book.admission_pages(10, 6, 2) == group_pages(10, 6, 4, 2) == 6
    book.promise("loop", 0, 5)
    assert book.reserved(0) == 7 and book.promised() == 5 and book.promises() == {"loop": (0, 5)}
    book.promise("loop", 0, None)
    assert book.reserved() == 2 and book.promises() == {}
    assert book.watermark == 0

    demand = PageBook(DEMAND)
    _inserted(demand, prompt_len=10, slots=[0, 1], max_new=6)
    assert demand.reserved() == 0  # caps are not reserved: a shard may run out (preemption)
    assert demand.watermark == 4  # ceil(0.1 * 31)
    assert demand.admission_pages(10, 12, 2) == group_pages(10, 4, 4, 2)  # the first call only


def test_shortfall_names_the_shard_that_cannot_grow():
    book = PageBook(dataclasses.replace(DEMAND, num_pages=12), 2)  # 5 usable pages per shard
    _inserted(book, prompt_len=13, slots=[4], max_new=12)  # shard 1: 3 pages
    (filler,) = book.open_prefixes([[1] * 9], shards=[1])  # 2 more: shard 1 full
    assert book.shortfall() == {1: 1}  # its slot's next call needs a fourth page
    assert book.headroom(1) == -1 and book.headroom(0) == 5
    with pytest.raises(OutOfPagesError):
        book.grow(4)  # what the engine's dispatch would meet: the loop preempts first
    book.close_prefix(filler)
    assert book.shortfall() == {} and book.headroom(1) >= 0


def test_park_resume_keeps_pages_and_reservation():
    book = PageBook(ECFG)
    _inserted(book, prompt_len=10, slots=[2], max_new=6, reserve=12, request_id=7)  # cap 21
    ticket = book.grow(4)
    book.settle(ticket, np.array([0, 0, 11, 0, 0, 0, 0, 0]), np.zeros(8, bool))  # 2 tokens, done
    (p,) = book.park([2], [42])
    assert (p.cached_len, p.last_token, p.cap, p.request_id, p.sample_id) == (11, 42, 21, 7, 0)
    assert len(p.pages) == 4 and book.is_parked(p) and not book.is_busy(2)  # grown a page ahead
    assert book.free_slots[-1] == 2 and book.allocator.num_used == 4
    assert book.reserved() == 6 - 4  # its cap's pages stay reserved while it waits
    before = _snapshot(book)
    with pytest.raises(ValueError, match="idle: nothing to park"):
        book.park([2], [1])
    with pytest.raises(ValueError, match="exceed the sequence's reserved 10 tokens"):
        book.grow_parked([(p, [5] * 7, 1, 4)])
    assert _snapshot(book) == before
    _inserted(book, prompt_len=3, slots=[0], max_new=2)
    before = _snapshot(book)
    with pytest.raises(ValueError, match="busy: free_resource them first"):
        book.grow_parked([(p, [5, 6], 0, 4)])
    assert _snapshot(book) == before
    seqs = book.grow_parked([(p, [5, 6, 7, 8, 9, 10], 1, 4)])
    assert seqs == [[42, 5, 6, 7, 8, 9, 10]] and len(p.pages) == 5  # 17 cached: a fifth page
    book.unpark(p, 1, 17)
    assert not book.is_parked(p) and book.is_busy(1) and book.ids(1) == (7, 0)
    assert book.length(1) == 17 and book.cap(1) == 21 and book.table.row(1) == p.pages
    with pytest.raises(ValueError, match="not a parked sequence of this engine"):
        book.grow_parked([(p, [5], 3, 1)])


def test_a_parked_sequence_resumes_on_its_own_shard_only():
    book = PageBook(ECFG, 2)
    (prefix,) = book.open_prefixes([[1] * 5], shards=[1])
    book.insert(prefix, [5], 0, 4)
    (p,) = book.park([5], [1])
    with pytest.raises(ValueError, match=r"slot\(s\) \[0\] are not on their parked sequence's"):
        book.grow_parked([(p, [2], 0, 2)])
    assert book.grow_parked([(p, [2], 6, 2)]) == [[1, 2]]


def test_evict_frees_the_pages_and_restore_gives_fresh_ones():
    book = PageBook(ECFG)
    _inserted(book, prompt_len=10, slots=[0, 1], max_new=6)
    p0, p1 = book.park([0, 1], [4, 5])
    assert book.allocator.num_used == 4
    book.evict(p1)
    assert p1.evicted and p1.pages == [] and book.is_parked(p1) and book.preemptions == 1
    assert book.allocator.num_used == 3  # its private copy; the full pages stay p0's
    with pytest.raises(ValueError, match="evict needs a parked sequence"):
        book.evict(p1)
    with pytest.raises(ValueError, match="an evicted sequence resumes after `restore`"):
        book.grow_parked([(p1, [1], 2, 1)])
    with pytest.raises(ValueError, match="restore needs an evicted sequence"):
        book.restore([p0])
    book.restore([p1])
    assert not p1.evicted and len(p1.pages) == 3  # its own pages now, none shared
    assert book.allocator.num_used == 6
    book.drop(p0)
    book.drop(p1)
    book.drop(p1)  # a no-op: not parked any more
    assert book.allocator.num_used == 0 and book.parked == []


def test_restore_is_all_or_nothing():
    book = PageBook(dataclasses.replace(DEMAND, num_pages=6))  # 5 usable pages
    _inserted(book, prompt_len=10, slots=[0, 1], max_new=2)  # 4 pages
    p0, p1 = book.park([0, 1], [1, 1])
    book.evict(p0)
    book.evict(p1)
    book.open_prefixes([[1] * 9])  # 2 of the 5 pages
    with pytest.raises(OutOfPagesError, match="restore needs 6 KV pages on shard 0, 3 are free"):
        book.restore([p0, p1])
    assert p0.evicted and p1.evicted and book.allocator.num_used == 2
