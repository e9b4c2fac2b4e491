"""The sampler's page book: the host-side bookkeeping of an engine's slots and KV pages, plain
Python and numpy with no device work, so that it can be built and tested alone
(tests/sampling/test_pages.py).

One `PageBook` per engine (`sampling.engine.Engine.pages`) owns, per batch shard, the shard's
page pool (`PageAllocator`, below; shard i holds slots [i*B/S, (i+1)*B/S)), and for the
whole engine the page table (shard-local page ids), the idle slots, and per busy slot its
sequence's ids, an upper bound of its cached length and its cap; the parked sequences (between
two turns of an episode: pages kept, no slot); and the pages promised to samples not inserted
yet. The engine calls it for every change it queues on the device, and the episode loop
(`sampling.episodes`) asks it what fits: `admission_pages`, `headroom`, `shortfall`.

The budget: before each decode call every busy slot is given the pages of its next `num_steps`
tokens (`growth`, `grow`), counted from an upper bound of its length while calls are in flight
(`settle` takes off what a call did not use). What admission sets aside is
`EngineConfig.reserve`'s: "budget" reserves a group's worst-case pages up front (`reserved`
counts what busy slots and parked sequences may still take up to their caps), so a running
request never runs out; "demand" only the pages of its prompt and first call, with the
`watermark` to spare, and a shard that runs out frees the pages of parked sequences (`evict`),
recomputed later (`restore`).

Every method that changes something checks its arguments first and raises ValueError (or
`OutOfPagesError`) before anything changes, but two: `grow`, which its caller runs once
`shortfall` is empty (the engine's state is lost after an error there anyway), and `unpark`,
which follows `grow_parked`. `reset` forgets everything and starts a new epoch: a `Prefix`,
`Parked` or `Ticket` of an older epoch is stale.

The pools: the paged KV cache (`sampling.paged_attention`) is a fixed pool of pages per layer;
which pages a sequence owns is bookkeeping, and that bookkeeping lives here, on the host: a
`PageAllocator` per shard (free list, reference counts) and one `PageTable` of every slot's pages.

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
"""

from __future__ import annotations

import numpy as np

from sampling.requests import (
    EngineConfig,
    Parked,
    Prefix,
    check_insert,
    check_prompt,
    check_resume,
    check_slots,
    group_pages,
    take_slots,
)

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


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


class PageBook:
    """Slots, pages, lengths, caps, parked sequences and reservations of one engine's shards
    (module docstring). `local_shards`: the shards this process decides (`models.processes`); the
    other shards' slots are never free here."""

    def __init__(self, ecfg: EngineConfig, num_shards: int = 1, local_shards=None):
        if ecfg.num_slots % num_shards or ecfg.num_pages % num_shards:
            raise ValueError(
                f"num_slots={ecfg.num_slots}, num_pages={ecfg.num_pages}: must "
                f"divide by the {num_shards} batch shards"
            )
        self.ecfg, self.num_shards = ecfg, num_shards
        self.slots_per_shard = ecfg.num_slots // num_shards
        self.pages_per_shard = ecfg.num_pages // num_shards
        self.local_shards = list(range(num_shards) if local_shards is None else local_shards)
        self.pools = [PageAllocator(self.pages_per_shard) for _ in range(num_shards)]
        self.table = PageTable(ecfg.num_slots, ecfg.pages_per_seq)  # shard-local page ids
        self.preemptions = 0  # sequences evicted, ever ("demand")
        self.reset()

    def reset(self) -> None:
        """An empty book: every page free, every slot idle, nothing parked or promised; what was
        handed out before (prefixes, parked sequences, tickets) is stale from now on."""
        for pool in self.pools:
            pool.reset()
        self.table.array[:] = NULL_PAGE
        # This process's slots: the others' shards are decided and fed by their own process.
        self._free = [
            s for s in range(self.ecfg.num_slots) if self.shard_of(s) in self.local_shards
        ]
        # Cascade attention (`paged_attention_blockwise`): a group of `group` samples placed on
        # an aligned block of slots reads its shared prompt pages once per decode step.
        # `set_group` (the episode loop: its num_samples); 1 = off.
        self.group = 1
        # Per busy slot (the keys are the busy slots): cap on cached tokens and an upper bound
        # of its cached length once the calls in flight are done (exact when none is).
        self._cap: dict[int, int] = {}
        self._len: dict[int, int] = {}
        self._epoch = object()  # Prefixes made before the last reset are stale
        self._parked: list[Parked] = []  # sequences between turns: pages kept, no slot
        # Pages promised to samples not inserted yet (the episode loop: a group partly in its
        # slots), by whoever promised them: (shard, pages).
        self._promised: dict[object, tuple[int, int]] = {}
        # Per slot: (request id, sample id) of its sequence, and a serial number bumped whenever
        # the slot's sequence changes or finishes (`settle` ignores calls that predate it).
        self._ids: dict[int, tuple[int, int]] = {}
        self._serial = [0] * self.ecfg.num_slots

    # --- reading ---------------------------------------------------------------------------

    @property
    def epoch(self) -> object:
        """This book's epoch since its last `reset` (compared by identity)."""
        return self._epoch

    @property
    def allocator(self):
        """The page pool: on one shard its `PageAllocator`, else the shards' `PoolTotals`."""
        return self.pools[0] if len(self.pools) == 1 else PoolTotals(self.pools)

    @property
    def free_slots(self) -> list[int]:
        """This process's idle slots, in the order they are handed out (a copy)."""
        return list(self._free)

    def busy_slots(self) -> list[int]:
        """The slots holding a sequence, in the order they got it."""
        return list(self._len)

    def is_busy(self, slot: int) -> bool:
        return slot in self._len

    def length(self, slot: int) -> int:
        """A busy slot's cached length: exact when no call is in flight, else an upper bound."""
        return self._len[slot]

    def cap(self, slot: int) -> int:
        """The most tokens a busy slot may cache (its prompt's and its budget)."""
        return self._cap[slot]

    def ids(self, slot: int) -> tuple[int, int]:
        """(request id, sample id) of the sequence a slot holds or held last."""
        return self._ids[slot]

    @property
    def parked(self) -> list[Parked]:
        """The parked sequences, oldest first (a copy)."""
        return list(self._parked)

    def is_parked(self, parked: Parked) -> bool:
        return parked in self._parked

    def live(self, prefix: Prefix) -> bool:
        """Whether a prefix still holds its pages here (not inserted, not stale)."""
        return not prefix.consumed and prefix.epoch is self._epoch

    def shard_of(self, slot: int) -> int:
        """The batch shard of a slot: shard i holds slots [i*B/S, (i+1)*B/S)."""
        return slot // self.slots_per_shard

    def free_on(self, shard: int) -> list[int]:
        """The free slots of one shard, in `free_slots` order."""
        return [s for s in self._free if self.shard_of(s) == shard]

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` cached tokens."""
        return -(-tokens // self.ecfg.page_size)

    # --- the budget ------------------------------------------------------------------------

    def growth(self, num_steps: int | None = None) -> dict[int, tuple[int, int]]:
        """Per busy slot, (its length bound after one more call of num_steps, the pages it then
        takes from its shard's pool): what `grow` allocates."""
        num_steps = num_steps or self.ecfg.steps_per_call
        out = {}
        for s, n in self._len.items():
            bound = min(n + num_steps, self._cap[s])
            out[s] = bound, self.pages_for(bound) - len(self.table.row(s))
        return out

    def shortfall(self, num_steps: int | None = None) -> dict[int, int]:
        """Per shard whose pool cannot give the next call's pages (`growth`), how many it lacks."""
        need = [0] * self.num_shards
        for s, (_, n) in self.growth(num_steps).items():
            need[self.shard_of(s)] += max(n, 0)
        return {
            i: n - p.num_free for i, (n, p) in enumerate(zip(need, self.pools)) if n > p.num_free
        }

    def room(self, shard: int) -> int:
        """Pages of a shard's pool free and not reserved (`reserved`)."""
        return self.pools[shard].num_free - self.reserved(shard)

    def headroom(self, shard: int) -> int:
        """`room` less the pages the shard's busy slots take at the next call (`growth`)."""
        grow = sum(max(n, 0) for s, (_, n) in self.growth().items() if self.shard_of(s) == shard)
        return self.room(shard) - grow

    @property
    def watermark(self) -> int:
        """Pages a new admission leaves free on its shard ("demand": kv_watermark of the pool)."""
        e = self.ecfg
        return int(np.ceil(e.kv_watermark * (self.pages_per_shard - 1))) if e.demand else 0

    def worst_case_pages(self, prompt_len: int, max_new, g: int) -> int:
        """Pages a group of g samples (max_new: one or g budgets) may hold (`group_pages`)."""
        return group_pages(prompt_len, max_new, self.ecfg.page_size, g)

    def admission_pages(self, prompt_len: int, max_new, g: int) -> int:
        """Pages admitting a group sets aside: "budget" its worst case; "demand" its prompt and
        each sample's first call (steps_per_call tokens, at most its budget)."""
        e = self.ecfg
        if not e.demand:
            return self.worst_case_pages(prompt_len, max_new, g)
        budgets = [max_new] * g if np.ndim(max_new) == 0 else list(max_new)
        return self.worst_case_pages(prompt_len, [min(m, e.steps_per_call) for m in budgets], g)

    def reserved(self, shard: int | None = None) -> int:
        """Pages promised but not yet allocated, on one shard or on all (None): to samples not
        inserted yet (`promise`), and ("budget") to busy slots and parked sequences up to their
        caps."""
        on = lambda i: shard is None or i == shard
        promised = self.promised(shard)
        if self.ecfg.demand:
            return promised
        busy = sum(
            self.pages_for(self._cap[s]) - len(self.table.row(s))
            for s in self._cap
            if on(self.shard_of(s))
        )
        parked = sum(self.pages_for(p.cap) - len(p.pages) for p in self._parked if on(p.shard))
        return busy + parked + promised

    def promised(self, shard: int | None = None) -> int:
        """Pages promised (`promise`) on one shard or on all (None)."""
        return sum(n for i, n in self._promised.values() if shard is None or i == shard)

    def promises(self) -> dict:
        """Every promise standing: owner -> (shard, pages). A copy."""
        return dict(self._promised)

    def promise(self, owner, shard: int, pages: int | None) -> None:
        """Sets aside `pages` of a shard's pool for `owner` (any hashable: the episode loop's
        group partly inserted there), in place of what it promised before; None withdraws it.
        No admission takes promised pages (`reserved`)."""
        if pages is None:
            self._promised.pop(owner, None)
        else:
            self._promised[owner] = (shard, int(pages))

    def place(self, sizes) -> list[int]:
        """A shard per request of sizes[j] pages: of this process's shards the one with the most
        pages free and not reserved once the earlier ones are placed, ties by index."""
        room = {i: self.pools[i].num_free - self.reserved(i) for i in self.local_shards}
        out = []
        for n in sizes:
            i = max(room, key=lambda i: (room[i], -i))
            room[i] -= n
            out.append(i)
        return out

    def take_slots(self, g: int, shard: int = 0) -> list[int]:
        """g free slots of a shard for a group (`requests.take_slots`: an aligned block of
        `group` slots when one is free); `insert` marks them busy."""
        return take_slots(self.free_on(shard), g, self.group, self.ecfg.num_slots)

    def set_group(self, g: int) -> None:
        """The cascade block size (1 = off). Changes only while no slot is busy."""
        if self._len:
            raise ValueError("set_group with busy slots: the block size is fixed while they run")
        self.group = int(g)

    # --- changes: prompts and slots ---------------------------------------------------------

    def open_prefixes(self, prompts, shards=None) -> list[Prefix]:
        """Pages for caching each prompt but its last token, prompt j on shard shards[j]
        (default: `place`); all or nothing (`OutOfPagesError` when a shard lacks them)."""
        for prompt in prompts:
            check_prompt(self.ecfg, prompt)
        # The last prompt token is not cached: the first decode step feeds it.
        sizes = [self.pages_for(len(prompt) - 1) for prompt in prompts]
        shards = self.place(sizes) if shards is None else [int(x) for x in shards]
        for i in range(self.num_shards):
            need = sum(n for n, x in zip(sizes, shards) if x == i)
            if need > self.pools[i].num_free:
                on = f" on shard {i}" if self.num_shards > 1 else ""
                raise OutOfPagesError(
                    f"prefill of {len(prompts)} prompts needs {need} KV pages{on} but only "
                    f"{self.pools[i].num_free} of {self.pages_per_shard - 1} are free{on}"
                )
        prefixes = []
        for prompt, n, i in zip(prompts, sizes, shards):
            pages = self.pools[i].alloc(n)
            prefixes.append(
                Prefix(pages, len(prompt) - 1, int(prompt[-1]), epoch=self._epoch, shard=i)
            )
        return prefixes

    def close_prefix(self, prefix: Prefix) -> None:
        """Returns a live prefix's pages (one that will not be inserted); no-op otherwise."""
        if self.live(prefix):
            self.pools[prefix.shard].free(prefix.pages)
            prefix.consumed = True

    def insert(
        self,
        prefix: Prefix,
        slots,
        request_id: int,
        max_new,
        reserve=0,
        samples=None,
        keep: bool = False,
    ):
        """Gives idle slots one prefix's pages (`Engine.bulk_insert`): full pages shared, the
        partial last page a copy per slot but the last (`PageAllocator.fork_for_group`).
        Returns (max_new per slot, sample ids, the copies (src, dst) to make on the prefix's
        shard, the shared length a cascade block reads once)."""
        e = self.ecfg
        slots = check_slots(e.num_slots, slots)
        g = len(slots)
        max_new, cap, samples = check_insert(
            e, prefix, self._epoch, slots, self._cap, max_new, reserve, samples
        )
        elsewhere = [s for s in slots if self.shard_of(s) != prefix.shard]
        if elsewhere:
            raise ValueError(
                f"slot(s) {elsewhere} are not on the prefix's shard {prefix.shard} (slots "
                f"{prefix.shard * self.slots_per_shard}..{(prefix.shard + 1) * self.slots_per_shard - 1}): "
                "a request stays on the shard that holds its pages"
            )
        rows, copies = self.pools[prefix.shard].fork_for_group(
            prefix.pages, prefix.cached_len, e.page_size, g + keep
        )
        rows = rows[1:] if keep else rows  # rows[0]: the prefix's own references, kept
        prefix.consumed = not keep
        self._free = [s for s in self._free if s not in slots]
        # An aligned block of slots holding one prefix (its full pages) reads them once.
        aligned = (
            g == self.group > 1 and slots[0] % g == 0 and slots == [*range(slots[0], slots[0] + g)]
        )
        shared = prefix.cached_len // e.page_size * e.page_size if aligned else 0
        for k, s, r, c in zip(samples, slots, rows, cap):
            self.table.set_row(s, r)
            self._ids[s] = (request_id, int(k))
            self._serial[s] += 1
            self._len[s] = prefix.cached_len
            # Decode step j caches the token it is fed at position cached_len + j, j < max_new
            # (the last sampled token is never cached, but the last prompt token is).
            self._cap[s] = prefix.cached_len + c
        return max_new, samples, copies, shared

    def release(self, slots) -> list[int]:
        """Returns the slots' pages to their pools and marks them idle (no-op on an idle slot).
        Returns the slots, checked."""
        slots = check_slots(self.ecfg.num_slots, slots, unique=False)
        for slot in slots:
            self.pools[self.shard_of(slot)].free(self.table.clear_row(slot))
            self._serial[slot] += 1
            self._len.pop(slot, None)
            self._cap.pop(slot, None)
            if slot not in self._free:
                self._free.append(slot)
        return slots

    # --- changes: decode calls --------------------------------------------------------------

    def grow(self, num_steps: int) -> dict[int, tuple[int, int]]:
        """Allocates every busy slot the pages of a call of num_steps (`growth`), raises its
        length bound, and returns per busy slot (its serial number, its bound): the ticket's."""
        for s, (bound, need) in self.growth(num_steps).items():
            self._len[s] = bound
            if need > 0:
                self.table.append(s, self.pools[self.shard_of(s)].alloc(need))
        return {s: (self._serial[s], self._len[s]) for s in self._len}

    def settle(self, slots: dict[int, tuple[int, int]], lengths, active) -> list[int]:
        """A call's results read back (`Engine.collect`): slots as `grow` returned them, lengths
        and active per slot. Returns the slots that still hold the sequence the call decoded;
        their bounds lose what the call did not use, and a finished one is settled (its exact
        length kept, its serial bumped) so that later calls leave it alone."""
        out = []
        for s, (serial, bound) in slots.items():
            if self._serial[s] != serial or s not in self._len:
                continue  # freed, parked or given a new sequence since
            out.append(s)
            self._len[s] -= bound - int(lengths[s])  # exact, plus the later calls' bounds
            if not active[s]:
                self._len[s] = int(lengths[s])
                self._serial[s] += 1
        return out

    # --- changes: parked sequences ----------------------------------------------------------

    def park(self, slots, last_tokens) -> list[Parked]:
        """Frees the slots of sequences whose turn ended but keeps their pages and reservation.
        `last_tokens[j]`: the last token slot j sampled (not cached). A `Parked` per slot."""
        slots = check_slots(self.ecfg.num_slots, slots)
        idle = [s for s in slots if s not in self._cap]
        if idle:
            raise ValueError(f"slot(s) {idle} idle: nothing to park")
        parked = []
        for s, last in zip(slots, last_tokens):
            p = Parked(
                self.table.clear_row(s),
                self._len.pop(s),
                int(last),
                self._cap.pop(s),
                *self._ids[s],
                self._epoch,
                shard=self.shard_of(s),
            )
            self._serial[s] += 1
            self._free.append(s)
            self._parked.append(p)
            parked.append(p)
        return parked

    def drop(self, parked: Parked) -> None:
        """Returns a parked sequence's pages to the pool (its episode ended); no-op if it is not
        parked here."""
        if parked in self._parked:
            self._parked.remove(parked)
            self.pools[parked.shard].free(parked.pages)

    def evict(self, parked: Parked) -> None:
        """Preemption: frees a parked sequence's pages. It stays parked (ids, lengths, cap), with
        no KV until `restore` gives it pages again. The caller keeps its tokens."""
        if parked not in self._parked or parked.evicted:
            raise ValueError("evict needs a parked sequence of this engine that holds its pages")
        self.pools[parked.shard].free(parked.pages)
        parked.pages, parked.evicted = [], True
        self.preemptions += 1

    def restore(self, parked) -> None:
        """Fresh pages for evicted sequences' cached tokens on their shards, all or nothing."""
        for p in parked:
            if p not in self._parked or not p.evicted:
                raise ValueError("restore needs an evicted sequence and its whole history")
        for i in {p.shard for p in parked}:
            need = sum(self.pages_for(p.cached_len) for p in parked if p.shard == i)
            if need > self.pools[i].num_free:
                raise OutOfPagesError(
                    f"restore needs {need} KV pages on shard {i}, {self.pools[i].num_free} are free"
                )
        for p in parked:
            p.pages, p.evicted = self.pools[p.shard].alloc(self.pages_for(p.cached_len)), False

    def grow_parked(self, items) -> list[list[int]]:
        """The pages parked sequences need to resume (`Engine.resume`'s items: (parked,
        new_tokens, slot, max_new)), allocated onto them, all or nothing. Returns per item the
        tokens to feed: its last token and its new ones."""
        slots = check_slots(self.ecfg.num_slots, [it[2] for it in items])
        busy = [s for s in slots if s in self._cap]
        if busy:
            raise ValueError(f"slot(s) {busy} busy: free_resource them first")
        for p, new, _, max_new in items:
            if p not in self._parked or p.epoch is not self._epoch:
                raise ValueError("not a parked sequence of this engine (resumed or dropped?)")
            check_resume(p, new, max_new)
        moved = [s for (p, _, s, _) in items if self.shard_of(s) != p.shard]
        if moved:
            raise ValueError(
                f"slot(s) {moved} are not on their parked sequence's shard: a "
                "sequence resumes on the shard that holds its pages"
            )
        seqs = [[p.last_token, *new] for p, new, _, _ in items]
        evicted = [p for p, *_ in items if p.evicted]
        if evicted:
            raise ValueError("an evicted sequence resumes after `restore`")
        more = [
            max(self.pages_for(p.cached_len + len(q) - 1) - len(p.pages), 0)
            for (p, *_), q in zip(items, seqs)
        ]
        for i in {p.shard for p, *_ in items}:  # "budget": within the reservation
            need = sum(m for (p, *_), m in zip(items, more) if p.shard == i)
            if need > self.pools[i].num_free:
                raise OutOfPagesError(
                    f"resume needs {need} KV pages on shard {i}, {self.pools[i].num_free} are free"
                )
        for (p, *_), m in zip(items, more):
            p.pages = p.pages + self.pools[p.shard].alloc(m)  # a page ahead, maybe
        return seqs

    def unpark(self, parked: Parked, slot: int, length: int) -> None:
        """Puts a parked sequence (its pages grown by `grow_parked`) into an idle slot of its
        shard with `length` tokens cached."""
        self._parked.remove(parked)
        self._free.remove(slot)
        self.table.set_row(slot, parked.pages)
        self._ids[slot] = (parked.request_id, parked.sample_id)
        self._serial[slot] += 1
        self._len[slot] = length
        self._cap[slot] = parked.cap
