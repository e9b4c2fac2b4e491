"""The engine's rounds: device work queued by the engine's methods (`sampling.plan`) and issued
by `flush`, at once after each call of a direct use of the engine, or once per round of
`sampling.episodes.EpisodeLoop` (`Engine.deferred`), after the processes of a multi-process run
have agreed on the calls' shapes. Mixed into `sampling.engine.Engine`, whose host bookkeeping
(`plan`, the layout, the shardings, `prefill_tokens`) it shares, as `sampling.turns` is.
"""

from __future__ import annotations

import numpy as np

from sampling import steps
from sampling.peers import agree, global_array
from sampling.plan import EXTENDS, Plan, Row
from sampling.state import DecodeState


class Rounds:
    """Engine methods that queue a round's device work and issue it (module docstring)."""

    def _prefill_pages(self, params, state, prompts, prefixes, extend=None, phase="admit"):
        """Queues caching prompt[:-1] of each prompt into its prefix's pages; with `extend`
        (resume, refresh), extend[j][:-1] after the cached_len tokens parked sequence j holds:
        one prefill batch of `phase` (`sampling.plan`)."""
        rows_in = [p[:-1] for p in prompts] if extend is None else [q[:-1] for q in extend]
        self.plan.prefill(phase, [
            Row(x.shard, list(t), 0 if extend is None else x.cached_len, list(x.pages))
            for t, x in zip(rows_in, prefixes)
        ])  # fmt: skip
        return self._now(state, params)

    def _now(self, state, params=None) -> DecodeState:
        """The queued work issued at once, unless the episode loop issues it per round."""
        return state if self.deferred else self.flush(params, state)[0]

    def flush(self, params, state, flags=()) -> tuple[DecodeState, np.ndarray]:
        """Issues the queued work (`sampling.plan`): the prefill batches, then one slot update.
        With several processes they first agree on the calls' shapes, and on `flags` (a few
        ints of the caller's: counts, stop flags) in the same collective. Returns (state,
        int32 [processes, len(flags)]: every process's flags)."""
        plan, e, s = self.plan, self.ecfg, self.num_shards
        flags = np.asarray(flags, np.int32).reshape(-1)
        everyone = agree(np.concatenate([flags, plan.shapes(self._chunks)]))
        shapes = everyone[:, len(flags) :].max(axis=0)
        rows = lambda x: global_array(x, self._rows)
        for phase, _, calls, batch in plan.calls(shapes, self._chunks):
            parts = batch.chunks(s) if batch is not None else []
            for j, n, t in calls:
                tokens = np.zeros((s * n, t), np.int32)
                lengths, starts = np.zeros((s * n,), np.int32), np.zeros((s * n,), np.int32)
                page_rows = np.zeros((s * n, e.pages_per_seq), np.int32)
                for i, chunk in enumerate(parts[j] if j < len(parts) else []):
                    for r, row in enumerate(chunk, start=i * n):
                        tokens[r, : len(row.tokens)] = row.tokens
                        lengths[r], starts[r] = len(row.tokens), row.start
                        page_rows[r, : len(row.pages)] = row.pages
                self.prefill_tokens += int(lengths.sum())
                state = steps.prefill(
                    self.graphdef, params, state, rows(tokens), rows(lengths), rows(page_rows),
                    self.layout, rows(starts) if phase in EXTENDS else None, e.prefill_chunk,
                )  # fmt: skip
        if shapes[-2]:  # a slot changes somewhere
            state = self._update(state, plan, steps.bucket_slots(int(shapes[-1])))
        self.plan = Plan(s, e.num_slots)
        return state, everyone[:, : len(flags)]

    def _update(self, state, plan: Plan, c: int) -> DecodeState:
        """One `steps.update` of the plan's slots, c page copies per shard (padded)."""
        b, s = self.ecfg.num_slots, self.num_shards
        put, off = np.zeros(b, bool), np.zeros(b, bool)
        values = np.zeros((7, b), np.int32)
        for slot, v in plan.slots.items():
            if v is None:
                off[slot] = True
            else:
                put[slot], values[:, slot] = True, v
        copies = np.zeros((2, s, max(c, 1)), np.int32)  # (0, 0): the null page onto itself
        for i, pairs in enumerate(plan.copies):
            if pairs:
                copies[:, i, : len(pairs)] = np.asarray(pairs, np.int32).T
        slots = lambda x: global_array(
            x, None if self._shardings is None else self._shardings.lengths
        )
        return steps.update(
            state, slots(put), slots(off), *map(slots, values), slots(copies[0].ravel()),
            slots(copies[1].ravel()), self.layout,
        )  # fmt: skip
