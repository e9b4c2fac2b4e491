"""Multi-turn episodes on the engine's slots: `park` (a sequence between two turns gives up its
slot but keeps its pages, KV and page reservation), `resume` (only the new tokens are
prefilled after the cached history, in any free slot of its shard), `evict` and `restore`
(preemption: a parked sequence's pages freed, later recomputed over its history), mixed into `sampling.engine.Engine`,
whose host bookkeeping (`_len`, `_cap`, `_ids`, `_serial`, `_parked`, the page table and the
allocator) they share; `sampling.episodes` is the loop that uses them.
"""

from __future__ import annotations

from sampling.page_allocator import OutOfPagesError
from sampling.requests import Parked, check_resume
from sampling.state import DecodeState


class Turns:
    """Engine methods for sequences between turns (see the module docstring)."""

    def park(self, state, slots, last_tokens) -> tuple[DecodeState, list[Parked]]:
        """Frees the slots of sequences whose turn ended but keep their pages, KV and page
        reservation (a multi-turn episode waiting for its tool). `last_tokens[j]`: the last
        token slot j sampled (not cached; `resume` feeds it). Returns a `Parked` per slot."""
        slots = self._check_slots(slots)
        idle = [s for s in slots if s not in self._cap]
        if idle:
            raise ValueError(f"slot(s) {idle} idle: nothing to park")
        parked = []
        for s, last in zip(slots, last_tokens):
            p = Parked(self.table.clear_row(s), self._len.pop(s), int(last), self._cap.pop(s),
                       *self._ids[s], self._epoch, shard=self.shard_of(s))  # fmt: skip
            self._serial[s] += 1
            self.free_slots.append(s)
            self._parked.append(p)
            parked.append(p)
            self.plan.release(s)
        return self._now(state), parked

    def drop(self, parked: Parked) -> None:
        """Returns a parked sequence's pages to the pool (its episode ended)."""
        if parked in self._parked:
            self._parked.remove(parked)
            self.pools[parked.shard].free(parked.pages)

    def evict(self, parked: Parked) -> None:
        """Preemption: frees a parked sequence's pages. It stays parked (ids, lengths, cap), with
        no KV until `restore` recomputes it. The caller keeps its tokens."""
        if parked not in self._parked or parked.evicted:
            raise ValueError("evict needs a parked sequence of this engine that holds its pages")
        self.pools[parked.shard].free(parked.pages)
        parked.pages, parked.evicted = [], True
        self.preemptions += 1

    def restore(self, params, state, items) -> DecodeState:
        """Recomputes evicted sequences: items are (parked, history) as for `refresh`. Each gets
        fresh pages for its cached_len tokens on its shard (all or nothing), which one chunked
        prefill over the whole history fills under `params`; then it is parked as before
        eviction (`resume` continues it)."""
        for p, history in items:
            if p not in self._parked or not p.evicted or len(history) - 1 != p.cached_len:
                raise ValueError("restore needs an evicted sequence and its whole history")
        for i in {p.shard for p, _ in items}:
            need = sum(self._pages_for(p.cached_len) for p, _ in items if p.shard == i)
            if need > self.pools[i].num_free:
                raise OutOfPagesError(f"restore needs {need} KV pages on shard {i}, "
                                      f"{self.pools[i].num_free} are free")  # fmt: skip
        for p, _ in items:
            p.pages, p.evicted = self.pools[p.shard].alloc(self._pages_for(p.cached_len)), False
            self.recomputed_tokens += p.cached_len
        # its own pages: none shared
        return self.refresh(params, state, items, fresh=set(), phase="restore")

    def refresh(self, params, state, items, fresh: set | None = None,
                phase: str = "refresh") -> DecodeState:  # fmt: skip
        """Recomputes the KV of parked sequences under `params`: items are (parked, history),
        history the tokens its pages cache plus its last (uncached) token. Their pages are
        overwritten in place (a chunked prefill); nothing else changes.

        `fresh`: (shard, page id) of full pages already recomputed under these `params`
        (updated in place).
        A sequence's leading pages found there are not recomputed: its prefill starts after
        them, so siblings sharing their prompt's full pages compute the prompt once (a saving of
        compute; the values written are the same). Within one call, an item whose pages another
        item is writing waits for the next batch (usually two: one sibling, then the others).
        The caller empties the set when the parameters change, and keeps it only while every
        sequence resumed under these parameters was refreshed (`sampling.episodes`: per run)."""
        for p, history in items:
            if p not in self._parked or len(history) - 1 != p.cached_len:
                raise ValueError("refresh needs a parked sequence and its whole history")
        fresh = set() if fresh is None else fresh
        size, todo = self.ecfg.page_size, list(items)
        while todo:
            batch, claimed, later = [], set(), []
            for p, history in todo:
                full = p.cached_len // size  # pages wholly cached: the ones siblings share
                n = 0  # leading pages fresh
                while n < full and (p.shard, p.pages[n]) in fresh:
                    n += 1
                writes = {(p.shard, x) for x in p.pages[n : full + 1]}  # and the partial page
                if writes & claimed:
                    later.append((p, history))
                    continue
                claimed |= writes
                batch.append((p, n * size, list(history[n * size :])))
            starts = [Parked(p.pages, t, 0, p.cap, 0, 0, shard=p.shard) for p, t, _ in batch]
            rest = [h for *_, h in batch]
            state = self._prefill_pages(params, state, rest, starts, extend=rest, phase=phase)
            for p, *_ in batch:
                fresh.update((p.shard, x) for x in p.pages[: p.cached_len // size])
            todo = later
        return state

    def refresh_prefix(self, params, state, prefix, prompt, fresh: set) -> DecodeState:
        """Recomputes a live prefix's KV under `params` in place (a group partly inserted when
        the parameters changed: `sampling.episodes`); its full pages join `fresh`."""
        if (
            prefix.consumed
            or prefix.epoch is not self._epoch
            or len(prompt) - 1 != prefix.cached_len
        ):
            raise ValueError("refresh_prefix needs a live prefix of this engine and its prompt")
        state = self._prefill_pages(params, state, [prompt], [prefix], phase="prefix")
        fresh.update(
            (prefix.shard, x) for x in prefix.pages[: prefix.cached_len // self.ecfg.page_size]
        )
        return state

    def resume(self, params, state, items, min_new=None) -> DecodeState:
        """Continues parked sequences: items are (parked, new_tokens, slot, max_new); min_new
        per item (default the config's min_new_tokens): stop ids banned for its first min_new
        tokens (a turn resumed mid-way bans only what is left of its count). The
        parked last token and new_tokens[:-1] are prefilled onto the sequence's own pages after
        its cached history (one batched call), and new_tokens[-1] is fed by the next decode
        step; only these tokens are computed, never the history. The slots must be idle."""
        slots = self._check_slots([it[2] for it in items])
        busy = [s for s in slots if s in self._cap]
        if busy:
            raise ValueError(f"slot(s) {busy} busy: free_resource them first")
        for p, new, _, max_new in items:
            if p not in self._parked or p.epoch is not self._epoch:
                raise ValueError("not a parked sequence of this engine (resumed or dropped?)")
            check_resume(p, new, max_new)
        moved = [s for (p, _, s, _) in items if self.shard_of(s) != p.shard]
        if moved:
            raise ValueError(f"slot(s) {moved} are not on their parked sequence's shard: a "
                             "sequence resumes on the shard that holds its pages")  # fmt: skip
        seqs = [[p.last_token, *new] for p, new, _, _ in items]
        evicted = [p for p, *_ in items if p.evicted]
        if evicted:
            raise ValueError("an evicted sequence resumes after `restore`")
        more = [max(self._pages_for(p.cached_len + len(q) - 1) - len(p.pages), 0)
                for (p, *_), q in zip(items, seqs)]  # fmt: skip
        for i in {p.shard for p, *_ in items}:  # "budget": within the reservation
            need = sum(m for (p, *_), m in zip(items, more) if p.shard == i)
            if need > self.pools[i].num_free:
                raise OutOfPagesError(f"resume needs {need} KV pages on shard {i}, "
                                      f"{self.pools[i].num_free} are free")  # fmt: skip
        for (p, *_), m in zip(items, more):
            p.pages = p.pages + self.pools[p.shard].alloc(m)  # a page ahead, maybe
        state = self._prefill_pages(
            params, state, [q[1:] for q in seqs], [p for p, *_ in items], extend=seqs,
            phase="resume",
        )  # fmt: skip
        if min_new is None:
            min_new = [self.ecfg.min_new_tokens] * len(items)
        for (p, _, s, max_new), seq, banned in zip(items, seqs, min_new, strict=True):
            self._parked.remove(p)
            self.free_slots.remove(s)
            self.table.set_row(s, p.pages)
            self._ids[s] = (p.request_id, p.sample_id)
            self._serial[s] += 1
            self._len[s] = p.cached_len + len(seq) - 1
            self._cap[s] = p.cap
            self.plan.insert(s, (self._len[s], seq[-1], max_new, banned, p.request_id,
                                 p.sample_id, 0))  # fmt: skip
        return self._now(state)
