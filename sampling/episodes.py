"""The sampler's batch loop: continuous batching of single-turn requests and of multi-turn
episodes, over the engine's fixed slots (`Engine.generate_all` is this loop with one turn).

An episode is a prompt followed by model turns and observations (tool output, test results):

    prompt | model turn 1 (ends on a stop id) | observation 1 | model turn 2 | ... | last turn

When a turn ends, `respond(i, k, turn, left)` gives the observation ids to append (or None to end
the episode), directly or as a `concurrent.futures.Future` (a tool running on a worker thread).
Meanwhile the episode is parked (`Engine.park`): its slot decodes other sequences, its pages and
KV stay on the device, and so does its page reservation. When the observation is ready, the
episode resumes in any free slot (`Engine.resume`): only the observation tokens are prefilled
onto its own pages, batched with the other episodes resuming in the same round, never the history.
The loop polls finished futures between decode calls (every `steps_per_call` tokens) and blocks
on them only when no slot is decoding, so tool time hides behind the decoding of other episodes.

Budgets: `max_new_tokens` is the episode's token budget after the prompt (model and observation
tokens together; admission reserves its worst-case pages, so a running episode never runs out),
and `max_turn_tokens` caps one model turn. An observation that leaves no room for one more model
token ends the episode with finish_reason "length", as does a turn that uses up the budget.

Multi-process runs: every process runs the same loop on the same host values, so a future counts
as done only once it is done on every process (`_agreed_done`), and environments must give every
process the same observation ids (deterministic tools; a mismatch raises rather than hangs).
Observation ids outside the vocabulary raise ValueError (they would write NaN into the KV pages).

Determinism: a token is drawn with a key of (request, sample, cache position), so an episode's
tokens depend neither on its slot nor on when its tool answered. Resumed episodes go first, then
new groups are admitted; the admission order is the prompts' order.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, wait

import jax
import numpy as np
from jax.experimental import multihost_utils

from sampling.requests import Completion, Parked, check_requests


def _agreed_done(futures: list[Future]) -> list[Future]:
    """The futures that are done, on every process of a multi-process run: each process decides
    the same resumes and admissions, as SPMD needs (`futures` is in the same order everywhere)."""
    done = np.array([f.done() for f in futures], bool)
    if jax.process_count() == 1 or not futures:
        return [f for f, d in zip(futures, done) if d]
    done = multihost_utils.process_allgather(done).reshape(-1, len(futures)).all(axis=0)
    agreed = [f for f, d in zip(futures, done) if d]
    # Every process must append the same ids: a mismatch fails here instead of hanging later.
    digest = np.array([_digest(f) for f in agreed], np.int64)
    if agreed:
        all_digests = multihost_utils.process_allgather(digest).reshape(-1, len(agreed))
        if (all_digests != digest).any():
            raise RuntimeError(
                "an environment gave different observations on different processes; "
                "multi-process runs need deterministic tools"
            )
    return agreed


def _digest(future: Future) -> int:
    """A process-independent digest of a future's answer (-1: None, -2: it raised)."""
    if future.exception() is not None:
        return -2
    answer = future.result()
    if answer is None:
        return -1
    return zlib.crc32(np.asarray(list(answer), np.int64).tobytes())


@dataclasses.dataclass
class _Episode:
    i: int  # prompt index
    k: int  # sample in its group
    budget: int  # tokens after the prompt
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    observation: list[bool] = dataclasses.field(default_factory=list)
    turns: int = 0
    finish: str = "stop"
    parked: Parked | None = None

    @property
    def left(self) -> int:
        return self.budget - len(self.tokens)


def generate_episodes(
    engine, params, state, prompts, num_samples=1, max_new_tokens=None, *, seed=0,
    request_ids=None, on_finish=None, respond=None, max_turn_tokens=None,
):  # fmt: skip
    """(state, results): results[i][k] the `Completion` of sample k of prompt i, every token
    after the prompt. With `respond` None each episode is one turn (`Engine.generate_all`).
    `on_finish(i, k, completion)` is called as each episode ends. `state` is donated; after an
    exception the host side is cleaned up (start again from `init_state()`)."""
    e, g = engine.ecfg, num_samples
    budget, ids, need = check_requests(e, prompts, g, max_new_tokens, request_ids)
    turn_cap = e.max_new_tokens if max_turn_tokens is None else int(max_turn_tokens)
    if not 1 <= turn_cap <= e.max_new_tokens:
        raise ValueError(f"max_turn_tokens={max_turn_tokens}: need 1..{e.max_new_tokens}")
    if not engine._len:  # no busy slot: the block size can change
        engine.group = g if g > 1 and e.num_slots % g == 0 else 1
    root = jax.random.key(seed)
    params = engine.decode_params(params)  # a decode copy, if the config asks for one
    results: list[list[Completion | None]] = [[None] * g for _ in prompts]
    owner: dict[int, _Episode] = {}  # busy slot -> its episode
    mine: set[int] = set()  # every slot this call inserted into
    prefixes = []  # of the last prefill
    waiting: dict[Future, _Episode] = {}  # parked, the observation being computed
    ready: collections.deque = collections.deque()  # (episode, observation ids), parked
    pending = list(range(len(prompts)))
    parked_here: list[Parked] = []  # every sequence this call parked (dropped on an exception)
    inflight = None  # (ticket, owner at dispatch) of the decode call not read yet
    vocab = engine.cfg.vocab_size

    def finish(ep: _Episode, reason: str | None = None) -> None:
        if ep.parked is not None:
            engine.drop(ep.parked)
            ep.parked = None
        ep.finish = reason or ep.finish
        results[ep.i][ep.k] = done = Completion(
            ep.tokens, ep.logprobs, ep.finish, len(ep.tokens), ep.turns,
            None if respond is None else ep.observation,
        )  # fmt: skip
        if on_finish is not None:
            on_finish(ep.i, ep.k, done)

    def answered(ep: _Episode, obs) -> None:
        if obs is None:
            return finish(ep)
        obs = [operator.index(t) for t in obs]
        bad = [t for t in obs if not 0 <= t < vocab]
        if bad:  # an id outside the vocabulary would write NaN into the KV pages
            raise ValueError(f"observation ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if len(obs) + 1 > ep.left:  # no room for the observation and one more model token
            finish(ep, "length")
        else:
            ready.append((ep, obs))

    try:
        while pending or owner or waiting or ready:
            for fut in _agreed_done(list(waiting)):
                answer = fut.result()
                answered(waiting.pop(fut), answer)
            # Episodes between turns first: they hold pages already.
            items = []
            while ready and len(engine.free_slots) > len(items):
                ep, obs = ready.popleft()
                ep.tokens += obs
                ep.logprobs += [0.0] * len(obs)
                ep.observation += [True] * len(obs)
                items.append(
                    (ep.parked, obs, engine.free_slots[len(items)], min(turn_cap, ep.left))
                )
                owner[items[-1][2]] = ep
                ep.parked = None
            if items:
                state = engine.resume(params, state, items)
                mine.update(it[2] for it in items)
            # Admit what fits (slots, and worst-case pages counted together), prefill it in
            # batches, then put each prompt into its G slots.
            admit, need_total = [], 0
            free_pages = engine.allocator.num_free - engine._reserved()
            while pending and not ready and len(engine.free_slots) - g * len(admit) >= g:
                if need_total + need[pending[0]] > free_pages:
                    break
                need_total += need[pending[0]]
                admit.append(pending.pop(0))
            if pending and not admit and not (owner or waiting or ready):
                raise ValueError(
                    f"request {pending[0]} needs {g} slots and {need[pending[0]]} KV pages; "
                    f"{len(engine.free_slots)} slots and {free_pages} pages are free, the rest "
                    "is held by slots or prefixes from outside this call"
                )
            if admit:
                state, prefixes = engine.prefill_many(params, state, [prompts[i] for i in admit])
                for i, prefix in zip(admit, prefixes):
                    slots = engine._take_slots(g)
                    turn = min(turn_cap, budget[i])
                    state = engine.bulk_insert(state, prefix, slots, ids[i], turn, budget[i])
                    mine.update(slots)
                    owner.update({s: _Episode(i, k, budget[i]) for k, s in enumerate(slots)})
            if not owner:
                inflight = None  # every sequence it decoded has finished: nothing to read
                if waiting:  # every episode waits for its tool: nothing to decode meanwhile
                    wait(list(waiting), return_when=FIRST_COMPLETED)
                continue
            # Call n+1 goes to the device before call n's results are read: the bookkeeping
            # below overlaps decoding. A slot that finished in call n idles through call n+1.
            state, ticket = engine.dispatch(params, state, root)
            previous, inflight = inflight, (ticket, dict(owner))
            if previous is None:
                continue
            ticket, owners = previous
            r = engine.collect(ticket)
            done = [s for s in r.slots if s in owners and owner.get(s) is owners[s]]
            done = [s for s in done if not r.active[s]]
            to_free, to_park = [], []
            for s in done:
                ep, m = owner.pop(s), int(r.num_generated[s])
                toks, lps = r.tokens[s, :m].tolist(), r.logprobs[s, :m].tolist()
                ep.tokens += toks
                ep.logprobs += lps
                ep.observation += [False] * m
                ep.turns += 1
                ep.finish = "stop" if r.stopped[s] else "length"
                if respond is None:
                    to_free.append((s, ep))
                    continue
                turn = Completion(toks, lps, ep.finish, m)
                to_park.append((s, ep, respond(ep.i, ep.k, turn, ep.left)))
            if to_free:
                state = engine.free_slots_of(state, [s for s, _ in to_free])
                for _, ep in to_free:
                    finish(ep)
            if to_park:
                state, parked = engine.park(
                    state, [s for s, *_ in to_park], [ep.tokens[-1] for _, ep, _ in to_park]
                )
                parked_here += parked
                for (_, ep, answer), p in zip(to_park, parked):
                    ep.parked = p
                    if isinstance(answer, Future):
                        waiting[answer] = ep
                    else:
                        answered(ep, answer)
    except BaseException:
        for s in mine & engine._cap.keys():
            engine._free_host(s)
        for p in parked_here:  # a no-op for those already resumed or dropped
            engine.drop(p)
        for x in prefixes:
            if not x.consumed and x.epoch is engine._epoch:
                engine.allocator.free(x.pages)
                x.consumed = True
        raise
    return state, results
