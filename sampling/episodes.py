"""The sampler's loop, above the engine: continuous batching of single-turn requests and of
multi-turn episodes over the engine's fixed slots (`EpisodeLoop`; `generate_all` is this loop
with one turn, JetStream's batch loop).

The sampler is three objects that compose: the page book (`sampling.pages.PageBook`: slots,
pages, lengths, reservations, parked sequences; host only), the engine (`sampling.engine.Engine`:
device work only, holding the page book as `Engine.pages`), and this loop, which decides what
runs when (admission, episodes, preemption, the rounds). The loop names both as types and calls
only their public methods; it asks the page book what fits (`admission_pages`, `headroom`,
`shortfall`), promises and evicts through it, and has the engine do every change that touches
the device (prefill, insert, park, resume, restore, release, a decode call). Neither imports this
module.

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
tokens together), and `max_turn_tokens` caps one model turn (per sample with `add`'s). An observation that leaves no room for one more model
token ends the episode with finish_reason "length", as does a turn that uses up the budget.

Partial rollouts (`EpisodeLoop`): `run(..., until=f)` stops as soon as `f()` holds (checked
between decode calls, e.g. "B groups are complete"). The call in flight is read, and every episode
still decoding is parked in the middle of its turn (pages, KV and reservation kept; its last
sampled token not cached yet, as between turns); episodes waiting on a tool keep waiting. The
next `run`, with new parameters, resumes them first (oldest first) and then admits new requests
(`add`). Every token records the `version` of the `run` that drew it (`Completion.versions`).
`refresh=True` re-prefills a carried episode's whole history under the new parameters when it
resumes, instead of keeping the KV the old parameters computed.

Logical time (`answer_calls`; `env.tool_answer_calls` under partial rollouts): the loop's clock
counts the decode calls it has read. By default a tool's answer is taken as soon as it is done,
so which episodes decode in which call follows the tools' wall-clock latency: the tokens do not
(keys, below), but where a stop cuts an episode, and which groups complete first, do. With
`answer_calls=k` an answer asked for when call n was read is taken once call n + k has been read
(the episode decodes again from the next call dispatched), in the order the turns ended, waiting
for the tool only if it is not done by then; when no slot decodes, the clock moves on to the
earliest answer due. Every decision (resumes, admissions, preemptions, a stop) is then a
function of the clock and of the answers, never of when they came: a partial rollout repeats
itself whatever the latency and the number of tool workers. The price: an answer done early
waits for its call (other episodes use the slot meanwhile), and a tool slower than k calls
stalls the loop until it answers (docs/performance.md measures k).

Rounds and processes: each pass of the loop is a round. Its device work (prefills, inserts,
resumes, releases) is queued by the engine and goes out at once before the round's decode call
(`Engine.flush`, `sampling.engine.Plan`). With `add`'s `shards` every request lives on its batch
shard, and every decision about a shard (admission, resumes, preemption) looks at that shard
alone. In a multi-process run each process runs this loop over its own shards only: its
requests, its tool calls, its results read from its own devices. What the processes agree on,
in the one small collective of the round's flush, is the shapes of the round's calls, whether
any slot decodes anywhere (else no call), whether all is done, and the earliest tool answer due
(the clock is the same everywhere); a stop (`until`) is agreed by its caller. So a shard
decides alike in a run of one process and of several, and each process runs the tools of its
own episodes only.
Observation ids outside the vocabulary raise ValueError (they would write NaN into the KV pages).

Admission: a group goes in once a slot of a shard is free and that shard's pool holds what
`PageBook.admission_pages` sets aside: under `EngineConfig.reserve="budget"` its worst-case pages
(a running episode never runs out), under "demand" those of its prompt and first call, with the
`kv_watermark` to spare. Its prompt is prefilled once; samples that find no slot yet go in as
slots of its shard free up, before anything new there (other shards go on admitting whole
groups), their pages promised in the page book meanwhile (`PageBook.promise`). A stop keeps the
prefix of such a group; with `refresh` its prompt is recomputed under the new parameters before
use.

Preemption ("demand"): before a decode call, a shard that cannot give every slot the pages of
its next `steps_per_call` tokens (`PageBook.shortfall`) frees the pages of its newest sequences
(request admitted last, then highest sample), after reading the call in flight so that lengths
and tokens are exact: one decoding (parked mid-turn first, then first in line to resume) or one
parked (between turns, waiting on its tool, or carried across a stop). A sequence inserted since
the last call is not preempted. The preempted keep their tokens, log-probs, versions and
observations here; when one resumes, `Engine.restore` prefills its whole history onto fresh pages
under the current parameters (for a carried one, the new ones, as `refresh` does), and it goes on
with the same keys. A parked episode resumes once its shard has the pages of its new tokens and
first call; where nothing decodes on that shard, newer parked ones there are preempted for it.

Determinism: a token is drawn with a key of (run seed, request, sample, cache position), so an
episode's tokens depend neither on its slot nor on when its tool answered (within one `run`),
and with `answer_calls` neither does the schedule.
Resumed episodes go first, then new groups are admitted; the admission order is `add`'s order.
"""

from __future__ import annotations

import collections
import operator
from concurrent.futures import FIRST_COMPLETED, Future, wait

import jax
import numpy as np

from models.moe import route_dtype
from sampling.engine import Engine
from sampling.pages import OutOfPagesError, PageBook
from sampling.requests import Completion, Episode, Parked, Recorded, check_requests

IDLE = "idle"  # what `until` returns when nothing is left to decode on any process
NEVER = 2**31 - 1  # no tool answer due (the clock's agreed minimum)


class EpisodeLoop:
    """Continuous batching of G-sample requests over the engine's slots, resumable across `run`
    calls (partial rollouts). Requests are `add`ed under a key; `on_finish(key, k, completion)`
    is called as each episode ends; `respond` as in the module docstring (None: one turn)."""

    def __init__(
        self,
        engine: Engine,
        num_samples=1,
        *,
        on_finish=None,
        respond=None,
        max_turn_tokens=None,
        answer_calls=None,
    ):
        e = engine.ecfg
        if answer_calls is not None and answer_calls < 1:
            raise ValueError(f"answer_calls={answer_calls}: need None (as soon as done) or >= 1")
        self.engine, self.g = engine, num_samples
        self.book: PageBook = engine.pages  # the engine's slots and pages, read and reserved
        self.turn_cap = e.max_new_tokens if max_turn_tokens is None else int(max_turn_tokens)
        if not 1 <= self.turn_cap <= e.max_new_tokens:
            raise ValueError(f"max_turn_tokens={max_turn_tokens}: need 1..{e.max_new_tokens}")
        if not 1 <= num_samples <= e.num_slots:
            raise ValueError(f"num_samples={num_samples}: need 1..num_slots={e.num_slots}")
        self.on_finish, self.respond = on_finish, respond
        # The tool hand-off ("Logical time" in the module docstring): None, an answer joins its
        # episode once done; k, at the k-th decode call read after its turn's.
        self.answer_calls = answer_calls
        self.clock = 0  # decode calls read: the loop's logical time
        self.due: dict[Future, int] = {}  # a waiting answer -> the clock it is taken at
        self.results: dict = {}  # key -> [Completion | None] * G
        self.admitted: dict = {}  # key -> version of the run that admitted it
        self._req: dict = {}  # key -> (prompt, budget, request id, pages admission sets aside)
        self._turn_caps: dict = {}  # key -> its G samples' caps on one model turn
        self.pending: list = []  # keys not admitted yet, in order
        self._shard: dict = {}  # key -> the batch shard it must go on (`add`'s shards)
        self.owner: dict[int, Episode] = {}  # busy slot -> its episode
        self.waiting: dict[Future, Episode] = {}  # parked, the observation being computed
        self.ready: collections.deque = collections.deque()  # (episode, ids), parked
        self.mine: set[int] = set()  # every slot this loop inserted into
        self.parked_here: list[Parked] = []  # every sequence this loop parked
        self.prefixes: list = []  # of the last prefill
        self.version = 0
        self._last = None  # the Results of the last call read
        self._next = 0  # the next default request key
        self._refreshed_pages: set[int] = set()  # emptied by each run
        # shard -> (key, next sample, live prefix, its KV's version): a group partly in
        self._opens: dict[int, tuple] = {}

    def add(
        self,
        prompts,
        max_new_tokens=None,
        request_ids=None,
        keys=None,
        max_turn_tokens=None,
        shards=None,
    ) -> list:
        """Queues requests (G samples each); returns their keys (default 0..n-1 after the last).
        shards: None (each goes where there is room when admitted) or per prompt the batch shard
        it must go on, one of this process's (`Engine.local_shards`): a shard's requests are
        admitted in their order, independently of the other shards'.
        max_turn_tokens: None (the loop's), or per prompt an int or G ints: a cap on each model
        turn below the loop's (a single-turn sample then stops there, its budget reserved as
        `max_new_tokens`'s: `launch.bench loop --lengths skewed`)."""
        book = self.book
        budget, ids, _ = check_requests(book.ecfg, prompts, self.g, max_new_tokens, request_ids)
        need = [book.admission_pages(len(p), b, self.g) for p, b in zip(prompts, budget)]
        if book.ecfg.demand:  # preempted down to one sample, a request must still go on
            pool = book.pages_per_shard - 1
            for n, (p, b) in enumerate(zip(prompts, budget)):
                one = max(book.worst_case_pages(len(p), m, 1) for m in b)
                if one > pool:
                    raise ValueError(
                        f"request {n}: one sample may hold {one} KV pages, more than a shard's "
                        f"pool ({pool} pages); raise num_pages"
                    )
        if max_turn_tokens is None:
            caps = [[self.turn_cap] * self.g] * len(prompts)
        elif len(max_turn_tokens) != len(prompts):
            raise ValueError(
                f"max_turn_tokens has {len(max_turn_tokens)} entries for {len(prompts)} prompts"
            )
        else:
            caps = [
                [int(x)] * self.g if isinstance(x, int) else [int(y) for y in x]
                for x in max_turn_tokens
            ]
            bad = [c for cs in caps for c in cs if not 1 <= c] + [
                cs for cs in caps if len(cs) != self.g
            ]
            if bad:
                raise ValueError(
                    f"max_turn_tokens: {bad[0]}: need ints >= 1, one or G = {self.g} per prompt"
                )
        shards = [None] * len(prompts) if shards is None else [int(i) for i in shards]
        if len(shards) != len(prompts):
            raise ValueError(f"shards has {len(shards)} entries for {len(prompts)} prompts")
        bad = [i for i in shards if i is not None and i not in book.local_shards]
        if bad:
            raise ValueError(
                f"shard {bad[0]}: not one of this process's batch shards {book.local_shards}"
            )
        if keys is None:
            keys = list(range(self._next, self._next + len(prompts)))
        keys = list(keys)
        if len(set(keys)) != len(keys) or any(k in self._req for k in keys):
            raise ValueError("request keys must be new and unique")
        self._next = max([self._next - 1, *[k for k in keys if isinstance(k, int)]]) + 1
        for key, p, b, r, n, cap, i in zip(keys, prompts, budget, ids, need, caps, shards):
            self._req[key] = (list(p), b, r, n)
            if i is not None:
                self._shard[key] = i
            self._turn_caps[key] = [min(c, self.turn_cap) for c in cap]
            self.results[key] = [None] * self.g
            self.pending.append(key)
        return keys

    @property
    def idle(self) -> bool:
        """Nothing queued, decoding, parked or waiting."""
        return not (self.pending or self.owner or self.waiting or self.ready or self._opens)

    def open_groups(self) -> dict[int, tuple]:
        """Per shard, its group partly inserted (admission), if any: (key, next sample, live
        prefix, the version its KV is of). A copy."""
        return dict(self._opens)

    def starved(self, shard: int) -> bool:
        """A slot of the shard is free and nothing of this loop is there to take it (nothing
        queued for it, parked ready there or partly inserted there)."""
        queued = any(self._shard.get(k, shard) == shard for k in self.pending)
        ready = any(ep.parked.shard == shard for ep, _ in self.ready)
        return bool(self.book.free_on(shard)) and not (queued or ready or shard in self._opens)

    def prompt(self, key) -> list[int]:
        """The prompt of a request added and not forgotten."""
        return self._req[key][0]

    def in_flight(self) -> set:
        """Keys admitted whose G episodes have not all ended."""
        return {k for k in self.admitted if any(c is None for c in self.results[k])}

    def forget(self, key) -> None:
        """Drops an ended request's bookkeeping (its results were read)."""
        if any(c is None for c in self.results[key]):
            raise ValueError(f"request {key} has not ended")
        for d in (self.results, self.admitted, self._req, self._turn_caps, self._shard):
            d.pop(key, None)

    def _finish(self, ep: Episode, reason: str | None = None) -> None:
        if ep.parked is not None:
            self.book.drop(ep.parked)
            ep.parked = None
        ep.finish = reason or ep.finish
        routes = None
        if ep.routes is not None:  # + the last token's (never fed)
            parts = [self._recorded(x) for x in ep.routes]  # the Prefix's first (`_record`)
            last = np.zeros((1, *parts[0].shape[1:]), parts[0].dtype)
            routes = np.concatenate([*parts, last])
        self.results[ep.i][ep.k] = done = Completion(
            ep.tokens,
            ep.logprobs,
            ep.finish,
            len(ep.tokens),
            ep.turns,
            None if self.respond is None else ep.observation,
            ep.versions,
            routes,
        )
        if self.on_finish is not None:
            self.on_finish(ep.i, ep.k, done)

    def _answered(self, ep: Episode, obs) -> None:
        if obs is None:
            return self._finish(ep)
        obs = [operator.index(t) for t in obs]
        vocab = self.engine.cfg.vocab_size
        bad = [t for t in obs if not 0 <= t < vocab]
        if bad:  # an id outside the vocabulary would write NaN into the KV pages
            raise ValueError(f"observation ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if len(obs) + 1 > ep.left:  # no room for the observation and one more model token
            self._finish(ep, "length")
        else:
            self.ready.append((ep, obs))

    def run(self, params, state, seed=0, *, version=0, until=None, refresh=False):
        """Decodes until every request has ended, or until `until()` holds (then the episodes
        still decoding are parked mid-turn, to be resumed by the next `run`). Returns the state
        (donated). After an exception the host side is cleaned up (start from `init_state()`)."""
        engine, book, g = self.engine, self.book, self.g
        if not book.busy_slots():  # no busy slot: the block size can change
            book.set_group(g if g > 1 and book.slots_per_shard % g == 0 else 1)
        self.version, self._refresh = version, refresh
        self._refreshed_pages = set()  # under this run's parameters (Engine.refresh's `fresh`)
        if self.ready:  # carried from an earlier run: the oldest request first
            order = {key: n for n, key in enumerate(self.admitted)}  # admission order
            self.ready = collections.deque(
                sorted(self.ready, key=lambda x: (order.get(x[0].i, -1), x[0].k))
            )
        root = jax.random.key(seed)
        params = engine.decode_params(params)  # a decode copy, if the config asks for one
        # Each round's device work goes out at once (`Engine.flush`).
        with engine.deferred_rounds():
            try:
                state = self._rounds(params, state, root, until, refresh)
            except BaseException:
                self._abort()
                raise
        self.parked_here = [p for p in self.parked_here if book.is_parked(p)]
        return state

    def _rounds(self, params, state, root, until, refresh: bool):
        """`run`'s rounds: answers taken, resumes, admissions, preemption, the round's flush,
        then a decode call dispatched before the previous one is read."""
        engine, book = self.engine, self.book
        inflight = None  # (ticket, owner at dispatch) of the decode call not read yet
        while True:
            for fut in self._answers():
                self._answered(self.waiting.pop(fut), fut.result())
            if until is not None:
                verdict = until()
                if verdict == IDLE:  # nothing left anywhere (`until` agreed on it)
                    break
                if verdict:
                    state = self._stop(state, inflight)
                    break
            state = self._resume_ready(params, state, refresh)
            state = self._admit(params, state)
            if self.owner and engine.ecfg.demand and book.shortfall():
                # A shard lacks the pages of the next call: its newest sequences give theirs
                # up, decided on exact lengths (the call in flight read first).
                if inflight is not None:
                    state, inflight = self._collect(state, *inflight), None
                state = self._preempt(state)
            # The round's work goes out; every process learns whether any slot decodes
            # anywhere, whether all is done, and when the next tool answer is due.
            due = min(self.due.values(), default=NEVER)
            state, flags = engine.flush(params, state, [bool(self.owner), self.idle, due])
            if not flags[:, 0].any():  # no slot decodes, on any process
                inflight = None  # every sequence it decoded has finished: nothing to read
                if flags[:, 1].all():
                    break
                if self.answer_calls is None:
                    if self.waiting:  # every episode here waits for its tool
                        wait(list(self.waiting), return_when=FIRST_COMPLETED)
                elif flags[:, 2].min() < NEVER:  # no call to count: the clock moves on to
                    self.clock = max(self.clock, int(flags[:, 2].min()))  # the next answer due
                continue
            # Call n+1 goes to the device before call n's results are read: the bookkeeping
            # below overlaps decoding. A slot that finished in call n idles through n+1.
            state, ticket = engine.dispatch(params, state, root)
            previous, inflight = inflight, (ticket, dict(self.owner))
            if previous is not None:
                state = self._collect(state, *previous)
        return state

    def _answers(self) -> list[Future]:
        """The tools' answers to take now, in the order their turns ended: those done, or with
        `answer_calls` those due on the clock, waited for if not done yet. Each process takes
        its own episodes' answers: they need not agree with anything on another host."""
        if self.answer_calls is None:
            return [f for f in self.waiting if f.done()]
        due = [f for f in self.waiting if self.due[f] <= self.clock]
        wait(due)  # returns at once when every one is done: the usual case
        for f in due:
            del self.due[f]
        return due

    def _resume_ready(self, params, state, refresh: bool):
        """Episodes between turns (or parked mid-turn) first: they hold pages already (or, once
        preempted, are recomputed first: `Engine.restore`). "demand": one goes on once its
        shard has the pages of its new tokens and first call; where nothing decodes on the shard
        to free pages, the newest other parked sequences there are preempted for them."""
        engine, book = self.engine, self.book
        items, stale, lost, wait, owners = [], [], [], collections.deque(), []
        taken: set[int] = set()
        planned = collections.Counter()  # pages of the resumes below, by shard
        while self.ready:
            ep, obs = self.ready.popleft()
            p = ep.parked
            free = [s for s in book.free_on(p.shard) if s not in taken]
            if not free:  # its shard is full: it waits, in order, for a slot there
                wait.append((ep, obs))
                continue
            if engine.ecfg.demand:
                need = self._resume_pages(ep, obs)
                idle = not any(book.shard_of(s) == p.shard for s in self.owner)
                while idle and book.headroom(p.shard) - planned[p.shard] < need:
                    # nothing decodes there to end and free pages: newer parked ones give way
                    others = [e for e, _ in (*wait, *self.ready)] + list(self.waiting.values())
                    other = self._victim(p.shard, [(e, None) for e in others if self._newer(e, ep)])
                    if other is None:
                        break
                    state = self._evict(state, *other)
                if book.headroom(p.shard) - planned[p.shard] < need:  # as the shard's ones end
                    wait.append((ep, obs))
                    continue
                planned[p.shard] += need
            taken.add(free[0])
            if p.evicted:  # recomputed under this run's parameters: no refresh after it
                lost.append((p, self.history(ep)))
                ep.kv_version = self.version
            elif refresh and ep.kv_version != self.version:
                stale.append((ep.parked, self.history(ep)))
                ep.kv_version = self.version
            ep.tokens += obs
            ep.logprobs += [0.0] * len(obs)
            ep.observation += [True] * len(obs)
            ep.versions += [self.version] * len(obs)
            max_new = min(self._turn_caps[ep.i][ep.k] - ep.turn_len, ep.left)
            items.append((ep.parked, obs, free[0], max_new))
            if ep.routes is not None and obs:  # its last token and obs[:-1], prefilled
                ep.routes.append(Recorded())
            owners.append(ep.routes[-1] if ep.routes is not None and obs else None)
            self.owner[free[0]] = ep
            ep.parked, ep.seen = None, 0
        self.ready = wait
        if lost:  # preempted: fresh pages, the whole history recomputed
            state = engine.restore(params, state, lost)
        if stale:  # the whole cached history again, under the parameters of this run
            state = engine.refresh(params, state, stale, self._refreshed_pages)
        if items:
            # A turn resumed mid-way (a stop, a preemption) bans stop ids only for what is left
            # of min_new_tokens: as one uninterrupted turn.
            left = [
                max(0, engine.ecfg.min_new_tokens - self.owner[s].turn_len) for *_, s, _ in items
            ]
            state = engine.resume(params, state, items, left, owners)
            self.mine.update(it[2] for it in items)
        return state

    def history(self, ep: Episode) -> list[int]:
        """The tokens a parked episode's pages cache, plus its last (uncached) token."""
        return self._req[ep.i][0] + ep.tokens

    def _collect(self, state, ticket, owners):
        """Reads a decode call: its tokens go to their episodes; ended turns are answered."""
        engine = self.engine
        r = self._last = engine.collect(ticket)
        self.clock += 1
        mine = [s for s in r.slots if s in owners and self.owner.get(s) is owners[s]]
        steps = [int(r.num_generated[s]) - owners[s].seen for s in mine]
        # Tokens decoded here, slot-steps run everywhere: utilization.
        engine.count_decoded(sum(steps), r.steps * engine.ecfg.num_slots)
        for s, n in zip(mine, steps):
            self._record(owners[s], r, s, n)
            owners[s].seen = int(r.num_generated[s])
        to_free, to_park = [], []
        for s in (s for s in mine if not r.active[s]):
            ep = self.owner.pop(s)
            self._take(ep, r, s)
            ep.finish = "stop" if r.stopped[s] else "length"
            turn = ep.tokens[len(ep.tokens) - ep.turn_len :]
            turn_lps = ep.logprobs[len(ep.tokens) - ep.turn_len :]
            ep.turns, ep.turn_len = ep.turns + 1, 0
            if self.respond is None:
                to_free.append((s, ep))
                continue
            answer = self.respond(
                ep.i, ep.k, Completion(turn, turn_lps, ep.finish, len(turn)), ep.left
            )
            to_park.append((s, ep, answer))
        if to_free:
            state = engine.free_slots_of(state, [s for s, _ in to_free])
            for _, ep in to_free:
                self._finish(ep)
        if to_park:
            state, parked = engine.park(
                state, [s for s, *_ in to_park], [ep.tokens[-1] for _, ep, _ in to_park]
            )
            self.parked_here += parked
            for (_, ep, answer), p in zip(to_park, parked):
                ep.parked, ep.kv_version = p, self.version
                if isinstance(answer, Future):
                    self.waiting[answer] = ep
                    if self.answer_calls is not None:
                        self.due[answer] = self.clock + self.answer_calls
                else:
                    self._answered(ep, answer)
        return state

    def _take(self, ep: Episode, r, s: int) -> None:
        """Appends the tokens slot s drew since its episode's last insert or resume."""
        m = int(r.num_generated[s])
        toks, lps = r.tokens[s, :m].tolist(), r.logprobs[s, :m].tolist()
        ep.tokens += toks
        ep.logprobs += lps
        ep.observation += [False] * m
        ep.versions += [self.version] * m
        ep.turn_len += m

    def _record(self, ep: Episode, r, s: int, n: int) -> None:
        """Appends the experts of the n tokens slot s fed in the call of `r` (the last token
        before them, then the ones it drew) to its episode's record."""
        if ep.routes is None or r.routes is None:
            return
        if n > r.routes.shape[1]:
            raise ValueError(f"slot {s}: {n} tokens read from a call of {r.routes.shape[1]} steps")
        # The prefills' records, read now that they ran: at the first call of a stint the
        # prompt's experts become those its prefill recorded for this episode, not a later
        # refresh's (a group partly inserted at a stop has its Prefix recomputed under new
        # parameters). Only the tail can still be an owner (the Prefix before the first call,
        # a resume's Recorded before the next stint's): read it, not the whole record.
        i = len(ep.routes)
        while i and not isinstance(ep.routes[i - 1], np.ndarray):
            i -= 1
        ep.routes[i:] = [self._recorded(x) for x in ep.routes[i:]]
        if n:
            ep.routes.append(r.routes[s, :n].copy())

    def _recorded(self, part) -> np.ndarray:
        """[n, L_moe, k] experts of one part of an episode's record: an array, or what a prefill
        recorded on its owner (a Prefix, a resume's `Recorded`); none ([0, L_moe, k]) where that
        prefill had no tokens (a one-token prompt: its only token is fed by decode)."""
        if isinstance(part, np.ndarray):
            return part
        if part.routes is not None:
            return part.routes
        c = self.engine.cfg
        shape = (0, c.num_moe_layers, c.experts_per_token)
        return np.zeros(shape, route_dtype(c.num_experts))

    def _stop(self, state, inflight):
        """Reads the call in flight, then parks every episode still decoding, mid-turn. A group
        partly inserted keeps its prefix (with `refresh`, recomputed before its next insert)."""
        if inflight is not None:
            state = self._collect(state, *inflight)
        if not self.owner:
            return state
        slots = list(self.owner)  # all decoded by the call just read: its buffers are exact
        eps = [self.owner.pop(s) for s in slots]
        for s, ep in zip(slots, eps):
            self._take(ep, self._last, s)
        state, parked = self.engine.park(state, slots, [ep.tokens[-1] for ep in eps])
        self.parked_here += parked
        for ep, p in zip(eps, parked):
            ep.parked, ep.kv_version = p, self.version
        self.ready.extendleft((ep, []) for ep in reversed(eps))  # first in line at the next run
        return state

    def _abort(self) -> None:
        """Releases what this loop holds on the host side after an exception."""
        book = self.book
        book.release(sorted(self.mine & set(book.busy_slots())))
        for p in self.parked_here:  # a no-op for those already resumed or dropped
            book.drop(p)
        for x in [*self.prefixes, *(o[2] for o in self._opens.values())]:
            book.close_prefix(x)  # a no-op for those inserted or stale
        self.pending, self.owner, self.waiting, self.due = [], {}, {}, {}
        for shard in list(self._opens):
            self._set_open(shard, None)
        self.ready = collections.deque()

    # --- admission (module docstring, "Admission") ------------------------------

    def _admit(self, params, state):
        """Admits what fits (a free slot, and the pages `PageBook.admission_pages` sets aside, on
        the request's batch shard: its own when `add` gave one, else of this process's shards the
        one with the most pages free and unreserved, ties by index), prefills it in batches, then
        puts each prompt's samples into free slots of its shard: all G together when G are free,
        else as many as are, the rest (`_opens`) as slots free up there, before anything new on
        that shard. Requests go in in `add`'s order per shard: one that does not fit holds back
        the later ones of its shard (a request without a shard, every later one)."""
        engine, book, g = self.engine, self.book, self.g
        # Parked episodes first: they hold pages already. A shard where one waits admits nothing.
        waiting = {ep.parked.shard for ep, _ in self.ready}
        local = book.local_shards
        free = {i: 0 if i in waiting else len(book.free_on(i)) for i in local}
        # "demand": a new group leaves the pages of the busy slots' next call, and the
        # watermark, free on a shard where sequences are.
        room = {
            i: book.headroom(i) - (book.watermark if book.pools[i].num_used else 0) for i in local
        }
        # A group partly in waits for slots of its own shard, which admits nothing before it.
        held = set(self._opens)
        admit, shards = [], []
        for key in list(self.pending):
            need, want = self._req[key][3], self._shard.get(key)
            fits = [
                i
                for i in (local if want is None else [want])
                if i not in held and free[i] > 0 and room[i] >= need
            ]
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
        open_free = [i for i in sorted(self._opens) if book.free_on(i)]
        if self.ready and not (admit or open_free):
            return state
        if (self.pending or self._opens) and not (
            admit or open_free or self.owner or self.waiting or self.ready
        ):
            key = self._opens[min(self._opens)][0] if self._opens else self.pending[0]
            n = book.num_shards
            one, most = (" on one shard", "at most ") if n > 1 else ("", "")
            raise ValueError(
                f"request {key} needs a free slot and {self._req[key][3]} KV pages{one}; "
                f"{len(book.free_slots)} slots and {most}{max(room.values())} pages"
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
                state = engine.refresh_prefix(
                    params, state, prefix, self._req[key][0], self._refreshed_pages
                )
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
        book, g = self.book, self.g
        _, budget, rid, _ = self._req[key]
        n = min(g - k0, len(book.free_on(prefix.shard)))
        slots = book.take_slots(n, prefix.shard)  # an aligned block for a group, if free
        ks = list(range(k0, k0 + n))
        turns = [min(self._turn_caps[key][k], budget[k]) for k in ks]
        state = self.engine.bulk_insert(
            state, prefix, slots, rid, turns, [budget[k] for k in ks], samples=ks, keep=k0 + n < g
        )
        self.mine.update(slots)
        # record_routes: the prompt's experts are the Prefix's once its prefill ran (`_record`)
        routes = lambda: [prefix] if self.engine.records_routes else None
        self.owner.update(
            (s, Episode(key, k, budget[k], kv_version=kv, routes=routes()))
            for s, k in zip(slots, ks)
        )
        if k0 + n < g:
            self._set_open(prefix.shard, (key, k0 + n, prefix, kv))
        return state

    def _set_open(self, shard: int, value) -> None:
        """The group partly in on `shard` (key, next sample, live prefix, the version its KV is
        of) or None, and the pages its samples not inserted yet may still take from the shard's
        pool, promised in the page book (`PageBook.promise`): no admission elsewhere takes them,
        across runs too."""
        if value is None:
            self._opens.pop(shard, None)
        else:
            self._opens[shard] = value
        self.book.promise((self, shard), shard, None)
        if value is not None:
            key, k0, prefix, _ = value
            prompt, budget = self._req[key][:2]
            left, cached = budget[k0:], len(prompt) - 1
            # The prefix's pages are allocated (its full ones, and the partial last one that the
            # last sample takes): the samples left need the rest of their group's pages.
            need = self.book.admission_pages(len(prompt), left, len(left))
            self.book.promise((self, shard), shard, need - self.book.pages_for(cached))

    # --- preemption (module docstring, "Preemption") ----------------------------

    def _resume_pages(self, ep: Episode, obs) -> int:
        """Pages a parked episode takes to resume with `obs` and run one call ("demand")."""
        p, e = ep.parked, self.book.ecfg
        first = min(p.cached_len + len(obs) + e.steps_per_call, p.cap)
        return self.book.pages_for(first) - len(p.pages)

    def _newer(self, a: Episode, b: Episode) -> bool:
        """Episode a was admitted after b (its request later, or a higher sample of b's)."""
        order = {key: n for n, key in enumerate(self.admitted)}
        return (order.get(a.i, -1), a.k) > (order.get(b.i, -1), b.k)

    def _victim(self, shard: int, candidates):
        """The newest (request admitted last, then highest sample) of candidates (episode, slot
        or None) on `shard` that holds pages; None if none does."""
        order = {key: n for n, key in enumerate(self.admitted)}
        eng = self.book
        held = [
            (ep, s)
            for ep, s in candidates
            if (eng.shard_of(s) if s is not None else ep.parked.shard) == shard
            and (s is not None or not ep.parked.evicted)
        ]
        return max(held, key=lambda x: (order.get(x[0].i, -1), x[0].k), default=None)

    def _preempt(self, state):
        """Frees pages where the next call lacks them (`PageBook.shortfall`), newest first among a
        shard's sequences: those decoding that the last call read (their tokens exact on the
        host) and those parked. No call may be in flight."""
        while short := self.book.shortfall():
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
        self.book.evict(ep.parked)
        return state


def generate_all(
    engine: Engine,
    params,
    state,
    prompts,
    num_samples=1,
    max_new_tokens=None,
    seed=0,
    request_ids=None,
    on_finish=None,
    shards=None,
    *,
    respond=None,
    max_turn_tokens=None,
):
    """(state, results): results[i][k] the `Completion` of sample k (of num_samples) of prompt
    i, every token after the prompt, with PRNG stream request_ids[i] (default i) and
    max_new_tokens (one int or one per request; default the config's). `on_finish(i, k,
    completion)` is called as each episode ends. `shards`: None, or per prompt the batch shard it
    goes on (one of `Engine.local_shards`: a multi-process run's). With `respond` None each
    episode is one turn (JetStream's batch loop), else multi-turn as `EpisodeLoop`'s. `state` is
    donated; after an exception the host side is cleaned up (start again from `init_state()`)."""
    loop = EpisodeLoop(
        engine, num_samples, on_finish=on_finish, respond=respond, max_turn_tokens=max_turn_tokens
    )
    loop.add(prompts, max_new_tokens, request_ids, shards=shards)
    state = loop.run(params, state, seed)
    return state, [loop.results[i] for i in range(len(prompts))]
