"""Preemption for `sampling.episodes.EpisodeLoop` under `EngineConfig.reserve="demand"` (see
that module's docstring, "Preemption"): which sequence of a shard gives its pages up (the
newest), how, and what a parked episode needs to resume. Mixed into EpisodeLoop, whose state
(`owner`, `ready`, `waiting`, `admitted`, `parked_here`, `_last`) it shares, as
`sampling.turns` is into the engine.
"""

from __future__ import annotations

from sampling.page_allocator import OutOfPagesError
from sampling.requests import Episode


class Preemption:
    """EpisodeLoop methods that free a full shard's pages (see the module docstring)."""

    def _resume_pages(self, ep: Episode, obs) -> int:
        """Pages a parked episode takes to resume with `obs` and run one call ("demand")."""
        p, e = ep.parked, self.engine.ecfg
        first = min(p.cached_len + len(obs) + e.steps_per_call, p.cap)
        return self.engine._pages_for(first) - len(p.pages)

    def _newer(self, a: Episode, b: Episode) -> bool:
        """Episode a was admitted after b (its request later, or a higher sample of b's)."""
        order = {key: n for n, key in enumerate(self.admitted)}
        return (order.get(a.i, -1), a.k) > (order.get(b.i, -1), b.k)

    def _victim(self, shard: int, candidates):
        """The newest (request admitted last, then highest sample) of candidates (episode, slot
        or None) on `shard` that holds pages; None if none does."""
        order = {key: n for n, key in enumerate(self.admitted)}
        eng = self.engine
        held = [(ep, s) for ep, s in candidates
                if (eng.shard_of(s) if s is not None else ep.parked.shard) == shard
                and (s is not None or not ep.parked.evicted)]  # fmt: skip
        return max(held, key=lambda x: (order.get(x[0].i, -1), x[0].k), default=None)

    def _preempt(self, state):
        """Frees pages where the next call lacks them (`Engine.shortfall`), newest first among a
        shard's sequences: those decoding that the last call read (their tokens exact on the
        host) and those parked. No call may be in flight."""
        engine = self.engine
        while short := engine.shortfall():
            i = min(short)
            busy = [(ep, s) for s, ep in self.owner.items() if ep.seen > 0]
            parked = [(ep, None) for ep in (*self.waiting.values(), *(e for e, _ in self.ready))]
            victim = self._victim(i, busy + parked)
            if victim is None:
                raise OutOfPagesError(
                    f"shard {i} lacks {short[i]} KV pages for the next decode call and holds no "
                    "sequence to preempt (pages held from outside this loop?)"
                )
            state = self._evict(state, *victim)
        return state

    def _evict(self, state, ep: Episode, slot):
        """Preempts an episode: decoding in `slot` (parked mid-turn first, its tokens kept, then
        first in line to resume) or parked (slot None). Its pages go back to its shard's pool;
        it is recomputed when it resumes (`_resume_ready`)."""
        if slot is not None:
            del self.owner[slot]
            self._take(ep, self._last, slot)
            state, (p,) = self.engine.park(state, [slot], [ep.tokens[-1]])
            self.parked_here.append(p)
            ep.parked = p
            self.ready.appendleft((ep, []))
        self.engine.evict(ep.parked)
        return state
