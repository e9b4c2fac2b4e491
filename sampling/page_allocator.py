"""Host-side KV page allocator with reference counts, and the per-slot page table.

The paged KV cache (`sampling.paged_attention`) is a fixed pool of pages per layer; which pages a
sequence owns is bookkeeping, and that bookkeeping lives here, on the host, in plain Python/numpy.

Why on the host: a free list is a dynamically sized structure and requests have variable sizes
(a prompt needs ceil(len / page_size) pages, a finished sample returns however many it grew to).
Inside jit that means fixed-size masks, scans over the pool and data-dependent failure, all awkward
and slow to compile. Allocation only happens at insert / refill time, between jitted `generate`
calls, so it is off the hot path: the decode loop itself never allocates. The engine pre-reserves
the pages a slot may grow into before it launches k decode steps, then pushes the page table to
the device as one int32 array.

Page 0 is the null page: never handed out, so a 0 in a page table means "no page" (padding
writes are dropped, see `write_kv`). It must only ever hold finite values: kernels read it.

Reference counts exist for GRPO's G samples per prompt: the prompt is prefilled once and its full
pages are shared by all G samples (refcount G). A partially filled last prompt page cannot be
shared, because each sample appends its own tokens into the free slots of that page, so
`fork_for_group` gives every sample its own copy of it (copy-on-write done eagerly at fork time,
since every sample is certain to write into it on its first decode step). Sample 0 keeps the
original page, so only G - 1 copies are made and no page is freed during the fork; that avoids a
freed source page being re-allocated as a copy destination before the device has done the copy.

`group_pages` is the one formula for the most pages such a group holds: the engine admits requests
by it, and config validation and benchmarks size the pool with it.
"""

from __future__ import annotations

import numpy as np

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


def group_pages(prompt_len: int, max_new, page_size: int, g: int) -> int:
    """KV pages a group of g samples of one prompt holds at its longest, as the engine allocates.
    max_new: every sample's budget, or one per sample (g of them).

    The engine caches the prompt's first prompt_len - 1 tokens (the first decode step feeds the
    last one) and each sample at most its max_new more (`sampling.engine`). The full pages of the
    cached prompt are shared by the g samples, so they count once; each sample owns the rest of
    its pages: a copy of the partial last prompt page, if any, and its decode pages.
    """
    budgets = [max_new] * g if np.ndim(max_new) == 0 else list(max_new)
    if (
        prompt_len < 1
        or min(budgets, default=-1) < 0
        or page_size < 1
        or g < 1
        or len(budgets) != g
    ):
        raise ValueError(
            f"group_pages(prompt_len={prompt_len}, max_new={max_new}, page_size={page_size}, "
            f"g={g}): need prompt_len >= 1, max_new >= 0 (one or g), page_size >= 1, g >= 1"
        )
    cached = prompt_len - 1
    shared = cached // page_size
    return shared + sum(-(-(cached + m) // page_size) - shared for m in budgets)


class PageAllocator:
    """Reference-counted pool of pages 1..num_pages-1 (page 0 is the reserved null page)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is reserved)")
        self.num_pages = num_pages
        self._refcount = np.zeros(num_pages, np.int32)
        self.reset()
        self._peak_used = 0

    def reset(self) -> None:
        """Every page free again, whatever held it (a fresh decode state); keeps `peak_used`."""
        self._refcount[:] = 0
        # A stack popped from the end; reversed so a fresh pool hands out 1, 2, 3, ... in order,
        # which keeps tests and debugging output readable.
        self._free = list(range(self.num_pages - 1, NULL_PAGE, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    @property
    def peak_used(self) -> int:
        """Most pages in use at any one time since construction (or `reset_peak`)."""
        return self._peak_used

    def reset_peak(self) -> None:
        self._peak_used = self.num_used

    def refcount(self, page: int) -> int:
        return int(self._refcount[page])

    def alloc(self, n: int) -> list[int]:
        """n fresh pages with refcount 1. All or nothing: on failure nothing is allocated."""
        if n < 0:
            raise ValueError(f"alloc({n}): n must be >= 0")
        if n > len(self._free):
            raise OutOfPagesError(
                f"requested {n} KV pages but only {len(self._free)} of {self.num_pages - 1} are "
                f"free ({self.num_used} in use); raise the number of pages or lower the batch"
            )
        pages = [self._free.pop() for _ in range(n)]
        self._refcount[pages] = 1
        self._peak_used = max(self._peak_used, self.num_used)
        return pages

    def share(self, pages) -> None:
        """One more reference to each of pages (which must be in use)."""
        for p in pages:
            self._check_live(p, "share")
        for p in pages:
            self._refcount[p] += 1

    def free(self, pages) -> None:
        """Drops one reference to each of pages; a page back at refcount 0 is free again."""
        for p in pages:
            self._check_live(p, "free")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(int(p))

    def _check_live(self, p, what: str) -> None:
        if not 0 < p < self.num_pages:
            raise ValueError(f"{what}({p}): page must be in 1..{self.num_pages - 1}")
        if self._refcount[p] <= 0:
            raise ValueError(f"{what}({p}): page is not allocated (double free?)")

    def fork_for_group(
        self, prompt_pages, prompt_len: int, page_size: int, num_samples: int
    ) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """Turns one prefilled prompt's pages into page lists for num_samples (G) samples.

        prompt_pages holds exactly ceil(prompt_len / page_size) pages with one reference each
        (the prefill's). Afterwards full pages have G references (one per sample), and if the last
        page is partial, sample 0 keeps it and samples 1..G-1 get fresh private pages. Returns
        (per-sample page lists, [(src, dst), ...] page copies the device must perform before the
        samples' first decode writes). Each sample later frees its own list.
        """
        prompt_pages = [int(p) for p in prompt_pages]
        n_pages = -(-prompt_len // page_size)
        if len(prompt_pages) != n_pages:
            raise ValueError(
                f"prompt of {prompt_len} tokens at page_size={page_size} needs {n_pages} pages, "
                f"got {len(prompt_pages)}"
            )
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples}: must be >= 1")
        partial = prompt_len % page_size != 0
        full = prompt_pages[:-1] if partial else prompt_pages
        # Allocate before touching refcounts so that running out of pages leaves no trace.
        copies = self.alloc(num_samples - 1) if partial else []
        for _ in range(num_samples - 1):
            self.share(full)
        if not partial:
            return [list(full) for _ in range(num_samples)], []
        last = prompt_pages[-1]
        per_sample = [full + [last]] + [full + [c] for c in copies]
        return per_sample, [(last, c) for c in copies]


class PageTable:
    """Host copy of the page table int32[slots, pages_per_seq]; 0 (the null page) = no page.

    Kept on the host because the allocator edits it between jitted calls; the engine uploads
    `array` whenever it has changed.
    """

    def __init__(self, num_slots: int, pages_per_seq: int):
        self.array = np.zeros((num_slots, pages_per_seq), np.int32)  # [B, pages_per_seq]

    @property
    def pages_per_seq(self) -> int:
        return self.array.shape[1]

    def row(self, slot: int) -> list[int]:
        """The pages of slot, in sequence order (a row is a prefix of pages, then nulls)."""
        r = self.array[slot]
        return [int(p) for p in r[r != NULL_PAGE]]

    def set_row(self, slot: int, pages) -> None:
        pages = list(pages)
        if len(pages) > self.pages_per_seq:
            raise ValueError(
                f"slot {slot}: {len(pages)} pages exceed pages_per_seq={self.pages_per_seq}"
            )
        if NULL_PAGE in pages:
            raise ValueError(f"slot {slot}: the null page {NULL_PAGE} cannot be assigned")
        self.array[slot] = NULL_PAGE
        self.array[slot, : len(pages)] = pages

    def append(self, slot: int, pages) -> None:
        """Adds pages after the slot's current ones (a sequence growing during decode)."""
        self.set_row(slot, self.row(slot) + list(pages))

    def clear_row(self, slot: int) -> list[int]:
        """Empties the row and returns the pages it held, for the caller to free."""
        pages = self.row(slot)
        self.array[slot] = NULL_PAGE
        return pages


class PoolTotals:
    """Read-only totals over the page pools of several batch shards (`Engine.allocator` on a
    mesh): each shard's `PageAllocator` hands out its own local ids, so there is no one pool to
    allocate from; `PageBook.pools[i]` is shard i's."""

    def __init__(self, pools):
        self.pools = list(pools)

    @property
    def num_pages(self) -> int:
        return sum(p.num_pages for p in self.pools)

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self.pools)

    @property
    def num_used(self) -> int:
        return sum(p.num_used for p in self.pools)

    @property
    def peak_used(self) -> int:
        """The sum of the shards' peaks (at least the peak of the total)."""
        return sum(p.peak_used for p in self.pools)

    def reset_peak(self) -> None:
        for p in self.pools:
            p.reset_peak()
