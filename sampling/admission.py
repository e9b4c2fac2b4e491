"""Admission for `sampling.episodes.EpisodeLoop` (that module's docstring, "Admission"): which
queued requests go in on which batch shard, their prompts prefilled in batches, their samples
put into free slots of their shard, and a group partly in (`_opens`, one per shard at most) with
the pages its samples left may take promised at the engine. Every decision about a shard looks
at that shard alone, so a shard decides alike whichever process holds it and whatever the other
shards hold (`sampling.peers`). Mixed into EpisodeLoop, whose state (`pending`, `_req`,
`_shard`, `ready`, `owner`, `_opens`, `prefixes`) it shares.
"""

from __future__ import annotations

from sampling.requests import Episode


class Admission:
    """EpisodeLoop methods that admit requests (see the module docstring)."""

    def _admit(self, params, state):
        """Admits what fits (a free slot, and the pages `Engine.admission_pages` sets aside, on
        the request's batch shard: its own when `add` gave one, else of this process's shards the
        one with the most pages free and unreserved, ties by index), prefills it in batches, then
        puts each prompt's samples into free slots of its shard: all G together when G are free,
        else as many as are, the rest (`_opens`) as slots free up there, before anything new on
        that shard. Requests go in in `add`'s order per shard: one that does not fit holds back
        the later ones of its shard (a request without a shard, every later one)."""
        engine, g = self.engine, self.g
        # Parked episodes first: they hold pages already. A shard where one waits admits nothing.
        waiting = {ep.parked.shard for ep, _ in self.ready}
        local = engine.local_shards
        free = {i: 0 if i in waiting else len(engine.free_on(i)) for i in local}
        # "demand": a new group leaves the pages of the busy slots' next call, and the
        # watermark, free on a shard where sequences are.
        room = {i: engine.headroom(i) - (engine.watermark if engine.pools[i].num_used else 0)
                for i in local}  # fmt: skip
        # A group partly in waits for slots of its own shard, which admits nothing before it.
        held = set(self._opens)
        admit, shards = [], []
        for key in list(self.pending):
            need, want = self._req[key][3], self._shard.get(key)
            fits = [i for i in (local if want is None else [want])
                    if i not in held and free[i] > 0 and room[i] >= need]  # fmt: skip
            if not fits:
                if want is None:
                    break
                held.add(want)  # its shard's later requests wait behind it
                continue
            best = max(fits, key=lambda i: (room[i], -i))
            self.pending.remove(key)
            admit.append(key)
            shards.append(best)
            room[best] -= need
            free[best] -= g
            if free[best] < 0:  # only the last group admitted on a shard may go in partly
                held.add(best)
        open_free = [i for i in sorted(self._opens) if engine.free_on(i)]
        if self.ready and not (admit or open_free):
            return state
        if (self.pending or self._opens) and not (admit or open_free or self.owner
                                                  or self.waiting or self.ready):  # fmt: skip
            key = self._opens[min(self._opens)][0] if self._opens else self.pending[0]
            n = engine.num_shards
            one, most = (" on one shard", "at most ") if n > 1 else ("", "")
            raise ValueError(
                f"request {key} needs a free slot and {self._req[key][3]} KV pages{one}; "
                f"{len(engine.free_slots)} slots and {most}{max(room.values())} pages"
                f"{' per shard' if n > 1 else ''} are free, the rest is held by slots or "
                "prefixes from outside this loop"
            )
        if not (admit or open_free):
            return state
        if admit:
            state, self.prefixes = engine.prefill_many(
                params, state, [self._req[k][0] for k in admit], shards
            )
        todo = []
        for i in open_free:  # first
            key, k, prefix, kv = self._opens[i]
            if self._refresh and kv != self.version:  # its prompt under this run's parameters
                state = engine.refresh_prefix(params, state, prefix, self._req[key][0],
                                              self._refreshed_pages)  # fmt: skip
                kv = self.version
            todo.append((key, k, prefix, kv))
            self._set_open(i, None)  # set again by its insert if slots are still short
        todo += [(key, 0, x, self.version) for key, x in zip(admit, self.prefixes if admit else [])]
        for key, k, prefix, kv in todo:
            if k == 0:
                self.admitted[key] = self.version
            state = self._insert(state, key, k, prefix, kv)
        return state

    def _insert(self, state, key, k0: int, prefix, kv: int):
        """Samples k0.. of request `key` into free slots; those that do not fit stay open
        (`_opens`)."""
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
            self._set_open(prefix.shard, (key, k0 + n, prefix, kv))
        return state

    def _set_open(self, shard: int, value) -> None:
        """The group partly in on `shard` (key, next sample, live prefix, the version its KV is
        of) or None, and the pages its samples not inserted yet may still take from the shard's
        pool, promised at the engine (`Engine._reserved`): no admission elsewhere takes them,
        across runs too."""
        if value is None:
            self._opens.pop(shard, None)
        else:
            self._opens[shard] = value
        self.engine.promised.pop((self, shard), None)
        self.engine.promised_on.pop((self, shard), None)
        if value is not None:
            key, k0, prefix, _ = value
            prompt, budget = self._req[key][:2]
            left, cached = budget[k0:], len(prompt) - 1
            # The prefix's pages are allocated (its full ones, and the partial last one that the
            # last sample takes): the samples left need the rest of their group's pages.
            need = self.engine.admission_pages(len(prompt), left, len(left))
            self.engine.promised[self, shard] = need - self.engine._pages_for(cached)
            self.engine.promised_on[self, shard] = shard
