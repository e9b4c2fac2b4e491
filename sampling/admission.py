"""Admission for `sampling.episodes.EpisodeLoop` (that module's docstring, "Admission"): which
queued requests go in on which batch shard, their prompts prefilled in batches, their samples
put into free slots of their shard, and a group partly in (`_open`) with the pages its samples
left may take promised at the engine. Mixed into EpisodeLoop, whose state (`pending`, `_req`,
`ready`, `owner`, `_open`, `prefixes`) it shares.
"""

from __future__ import annotations

from sampling.requests import Episode


class Admission:
    """EpisodeLoop methods that admit requests (see the module docstring)."""

    def _admit(self, params, state):
        """Admits what fits (a free slot, and the group's worst-case pages, on one batch shard:
        the one with the most pages free and unreserved, ties by index), prefills it in
        batches, then puts each prompt's samples into free slots of its shard: all G together
        when G are free, else as many as are, the rest (`_open`) as slots free up there, before
        anything new."""
        engine, g, n = self.engine, self.g, self.engine.num_shards
        # Parked episodes first: they hold pages already. A shard where one waits admits nothing.
        waiting = {ep.parked.shard for ep, _ in self.ready}
        free = [0 if i in waiting else len(engine.free_on(i)) for i in range(n)]
        # "demand": a new group leaves the pages of the busy slots' next call, and the
        # watermark, free on a shard where sequences are.
        room = [engine.headroom(i) - (engine.watermark if engine.pools[i].num_used else 0)
                for i in range(n)]  # fmt: skip
        admit, shards = [], []
        # A group partly in waits for slots of its own shard; other shards admit whole groups.
        held = None if self._open is None else self._open[2].shard
        while self.pending:
            need = self._req[self.pending[0]][3]
            fits = [i for i in range(n) if free[i] > 0 and room[i] >= need
                    and (held is None or (i != held and free[i] >= g))]  # fmt: skip
            if not fits:
                break
            best = max(fits, key=lambda i: (room[i], -i))
            admit.append(self.pending.pop(0))
            shards.append(best)
            room[best] -= need
            free[best] -= g
            if free[best] < 0:  # only the last group admitted may go in partly
                break
        open_free = self._open is not None and engine.free_on(self._open[2].shard)
        if self.ready and not (admit or open_free):
            return state
        slots_free, pages_free = len(engine.free_slots), max(room)
        blocked = self.pending if self._open is None else not open_free
        if blocked and not (admit or self.owner or self.waiting or self.ready):
            key = self._open[0] if self._open else self.pending[0]
            one, most = (" on one shard", "at most ") if n > 1 else ("", "")
            raise ValueError(
                f"request {key} needs a free slot and {self._req[key][3]} KV pages{one}; "
                f"{slots_free} slots and {most}{pages_free} pages{' per shard' if n > 1 else ''} "
                "are free, the rest is held by slots or prefixes from outside this loop"
            )
        if not (admit or open_free):
            return state
        if admit:
            state, self.prefixes = engine.prefill_many(
                params, state, [self._req[k][0] for k in admit], shards
            )
        todo = [(key, 0, x, self.version) for key, x in zip(admit, self.prefixes if admit else [])]
        if open_free:  # first
            key, k, prefix, kv = self._open
            if self._refresh and kv != self.version:  # its prompt under this run's parameters
                state = engine.refresh_prefix(params, state, prefix, self._req[key][0],
                                              self._refreshed_pages)  # fmt: skip
                kv = self.version
            todo.insert(0, (key, k, prefix, kv))
            self._set_open(None)  # set again by its insert if slots are still short
        for key, k, prefix, kv in todo:
            if k == 0:
                self.admitted[key] = self.version
            state = self._insert(state, key, k, prefix, kv)
        return state

    def _insert(self, state, key, k0: int, prefix, kv: int):
        """Samples k0.. of request `key` into free slots; those that do not fit stay `_open`."""
        engine, g = self.engine, self.g
        _, budget, rid, _ = self._req[key]
        n = min(g - k0, len(engine.free_on(prefix.shard)))
        slots = engine._take_slots(n, prefix.shard)  # an aligned block for a group, if free
        ks = list(range(k0, k0 + n))
        turns = [min(self._turn_caps[key][k], budget[k]) for k in ks]
        state = engine.bulk_insert(state, prefix, slots, rid, turns, [budget[k] for k in ks],
                                   samples=ks, keep=k0 + n < g)  # fmt: skip
        self.mine.update(slots)
        self.owner.update((s, Episode(key, k, budget[k], kv_version=kv))
                          for s, k in zip(slots, ks))  # fmt: skip
        if k0 + n < g:
            self._set_open((key, k0 + n, prefix, kv))
        return state

    def _set_open(self, value) -> None:
        """`_open` (key, next sample, live prefix, the version its KV is of) or None, and the pages
        its samples not inserted yet may still take from the pool, promised at the engine
        (`Engine._reserved`): no admission elsewhere takes them, across runs too."""
        self._open = value
        self.engine.promised.pop(self, None)
        self.engine.promised_on.pop(self, None)
        if value is not None:
            key, k0, prefix, _ = value
            prompt, budget = self._req[key][:2]
            left, cached = budget[k0:], len(prompt) - 1
            # The prefix's pages are allocated (its full ones, and the partial last one that the
            # last sample takes): the samples left need the rest of their group's pages.
            need = self.engine.admission_pages(len(prompt), left, len(left))
            self.engine.promised[self] = need - self.engine._pages_for(cached)
            self.engine.promised_on[self] = prefix.shard
