"""Page allocator and page table: refcounts, group sharing, copy-on-write, exhaustion errors."""

import pytest

from sampling.pages import NULL_PAGE, OutOfPagesError, PageAllocator, PageTable


def test_alloc_free_and_null_page():
    a = PageAllocator(8)
    assert (a.num_free, a.num_used) == (7, 0)
    pages = a.alloc(7)
    assert sorted(pages) == list(range(1, 8))  # every page but the null page, each once
    assert NULL_PAGE not in pages
    assert (a.num_free, a.num_used, a.peak_used) == (0, 7, 7)
    a.free(pages[:3])
    assert (a.num_free, a.num_used, a.peak_used) == (3, 4, 7)
    assert all(a.refcount(p) == 0 for p in pages[:3])
    assert sorted(a.alloc(3)) == sorted(pages[:3])  # freed pages come back


def test_exhaustion_names_counts_and_allocates_nothing():
    a = PageAllocator(6)
    a.alloc(3)
    with pytest.raises(OutOfPagesError, match="requested 4 KV pages but only 2 of 5 are free"):
        a.alloc(4)
    assert a.num_free == 2


def test_share_and_free_refcounts():
    a = PageAllocator(10)
    pages = a.alloc(2)
    a.share(pages)
    a.share(pages[:1])
    assert [a.refcount(p) for p in pages] == [3, 2]
    a.free(pages)
    assert a.num_used == 2
    a.free(pages)
    assert [a.refcount(p) for p in pages] == [1, 0]
    assert a.num_used == 1
    with pytest.raises(ValueError, match="not allocated"):
        a.free(pages[1:])  # double free
    with pytest.raises(ValueError, match="not allocated"):
        a.share(pages[1:])
    with pytest.raises(ValueError, match="1..9"):
        a.free([NULL_PAGE])


def test_group_shares_full_pages_and_copies_partial_page():
    g, page_size, prompt_len, decode_pages = 8, 4, 10, 2  # 2 full pages + 1 partial (2 tokens)
    a = PageAllocator(64)
    prompt = a.alloc(3)
    per_sample, copies = a.fork_for_group(prompt, prompt_len, page_size, g)
    full, last = prompt[:2], prompt[2]
    assert len(per_sample) == g
    assert all(s[:2] == full for s in per_sample)
    assert [a.refcount(p) for p in full] == [g, g]
    # Each sample owns a distinct last page: the original for sample 0, copies for the rest.
    lasts = [s[2] for s in per_sample]
    assert lasts[0] == last and len(set(lasts)) == g
    assert all(a.refcount(p) == 1 for p in lasts)
    assert copies == [(last, p) for p in lasts[1:]]
    for s in per_sample:  # each sample grows by its own decode pages
        s += a.alloc(decode_pages)
    # The prompt's full pages are held once; everything else is private to one sample.
    assert a.peak_used == len(full) + g * (1 + decode_pages)
    for s in per_sample:
        a.free(s)
    assert a.num_used == 0


def test_group_with_page_aligned_prompt_copies_nothing():
    a = PageAllocator(16)
    prompt = a.alloc(2)
    per_sample, copies = a.fork_for_group(prompt, 8, 4, 3)
    assert copies == [] and per_sample == [prompt] * 3
    assert [a.refcount(p) for p in prompt] == [3, 3]
    assert a.peak_used == 2


def test_fork_out_of_pages_leaves_refcounts_alone():
    a = PageAllocator(6)
    prompt = a.alloc(2)  # one full page, one partial
    a.alloc(2)
    with pytest.raises(OutOfPagesError):
        a.fork_for_group(prompt, 5, 4, 4)  # needs 3 copies, 1 free
    assert [a.refcount(p) for p in prompt] == [1, 1]


def test_fork_checks_page_count():
    a = PageAllocator(8)
    with pytest.raises(ValueError, match="needs 3 pages, got 2"):
        a.fork_for_group(a.alloc(2), 9, 4, 2)


def test_page_table_rows():
    t = PageTable(num_slots=3, pages_per_seq=4)
    t.set_row(1, [5, 2])
    t.append(1, [7])
    assert t.array.dtype.name == "int32"
    assert t.array[1].tolist() == [5, 2, 7, 0] and t.row(1) == [5, 2, 7]
    assert t.array[0].tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="pages_per_seq=4"):
        t.append(1, [3, 4])
    with pytest.raises(ValueError, match="null page"):
        t.set_row(2, [3, 0])
    assert t.clear_row(1) == [5, 2, 7]
    assert t.array[1].tolist() == [0, 0, 0, 0]
