"""The page budget of the sampler's shard pools: what each busy slot takes at the next call
(`growth`), what a shard lacks for it (`shortfall`), what is free and not promised (`room`,
`headroom`), and what admitting a group sets aside (`admission_pages`: "budget" its worst case,
"demand" its prompt and first call, with the `watermark` to spare). Mixed into
`sampling.engine.Engine` (its `ecfg`, `pools`, `table`, `_len`, `_cap`, `_parked`, `promised`).
"""

from __future__ import annotations

import numpy as np

from sampling.page_allocator import group_pages


class PageBudget:
    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.ecfg.page_size)

    def growth(self, num_steps: int | None = None) -> dict[int, tuple[int, int]]:
        """Per busy slot, (its length bound after one more call of num_steps, the pages it then
        takes from its shard's pool): what `dispatch` allocates."""
        num_steps = num_steps or self.ecfg.steps_per_call
        out = {}
        for s, n in self._len.items():
            bound = min(n + num_steps, self._cap[s])
            out[s] = bound, self._pages_for(bound) - len(self.table.row(s))
        return out

    def shortfall(self, num_steps: int | None = None) -> dict[int, int]:
        """Per shard whose pool cannot give the next call's pages (`growth`), how many it lacks."""
        need = [0] * self.num_shards
        for s, (_, n) in self.growth(num_steps).items():
            need[self.shard_of(s)] += max(n, 0)
        return {i: n - p.num_free for i, (n, p) in enumerate(zip(need, self.pools))
                if n > p.num_free}  # fmt: skip

    def room(self, shard: int) -> int:
        """Pages of a shard's pool free and not reserved (`_reserved`)."""
        return self.pools[shard].num_free - self._reserved(shard)

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

    def _reserved(self, shard: int | None = None) -> int:
        """Pages promised but not yet allocated, on one shard or on all (None): to samples not
        inserted yet, and ("budget") to busy slots and parked episodes up to their caps."""
        on = lambda i: shard is None or i == shard
        promised = sum(n for c, n in self.promised.items() if on(self.promised_on.get(c, 0)))
        if self.ecfg.demand:
            return promised
        busy = sum(self._pages_for(self._cap[s]) - len(self.table.row(s)) for s in self._cap
                   if on(self.shard_of(s)))  # fmt: skip
        parked = sum(self._pages_for(p.cap) - len(p.pages) for p in self._parked if on(p.shard))
        return busy + parked + promised
