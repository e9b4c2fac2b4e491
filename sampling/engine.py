"""The sampler engine: device work only, in the shape of JetStream's (prefill, insert /
bulk_insert, generate, free_resource). The host bookkeeping of slots and pages is its page book
(`Engine.pages`, `sampling.pages.PageBook`), the weights it decodes from are its
`sampling.decode_weights.DecodeWeights`, and the work it queues for a round is its
`Plan` (below): members, not bases. The batch loop that drives it (continuous batching,
episodes, admission, preemption, `generate_all`) is `sampling.episodes`, which this module does not
import.

Device work is jitted (`sampling.steps`) over the donated `sampling.state.DecodeState`:
- `prefill` / `prefill_many`: prompts right-padded to a power-of-two length bucket, up to
  MAX_PREFILL_BATCH rows per call, written into freshly allocated pages. It caches all prompt
  tokens but the last, the slot's `last_token`, fed by the first decode step: every token is
  sampled in one place (`steps.generate`) with one key schedule (JetStream's prefill returns the
  first token instead; this costs one batched decode step per request).
- `bulk_insert`: one prefilled prompt (a `Prefix`) into idle slots, as some or all of its G samples.
  Full prompt pages are shared (a reference per sample, and the live prefix's); the partial last
  page is copied on device for all samples but the last inserted
  (`sampling.pages.PageAllocator.fork_for_group`). With `keep` the prefix stays live for the later
  samples, else it is consumed. A whole group goes on an aligned block of G slots when one is free,
  which lets the blockwise backend read the shared pages once per block (`shared_len`);
  `sampling.episodes` inserts a group sample by sample when fewer slots are free, rather than idle
  them.
- `generate`: up to `num_steps` decode steps in one `lax.while_loop`; `dispatch` and `collect`
  are its two halves, so that the batch loop queues call n+1 before it reads call n.
- `park` / `resume`: a sequence between two turns of an episode frees its slot but keeps its pages
  and their reservation (`PageBook.park`); `resume` prefills only its new tokens (batched) after
  its cached history and puts it in any free slot of its shard. `restore` recomputes a sequence
  whose pages were freed (`PageBook.evict`: preemption) over its whole history (a chunked
  prefill, as vLLM's recompute preemption), `refresh` recomputes a parked one's KV in place under
  new parameters.

Rounds: the methods above change the page book and queue their device work in the plan
(`Plan`, below), which `flush` issues: at once for a direct caller, once per round inside the
episode loop (`deferred_rounds`), where the processes of a multi-process run first agree on the
calls' shapes. Each process decides and feeds only its own batch shards (`local_shards`) and
reads back only their slots.

Sharding: no `in_shardings`, so parameters are used in their own shardings, never gathered per
call; the `DecodeState` is laid out by `sampling.state.state_shardings` and every jitted
function pins its output to that layout, so donation reuses the same buffers.

Page allocation is host-side (`sampling.pages` says why): before each call the page
book gives every busy slot the pages of its next `num_steps` tokens (`PageBook.grow`; the budget
and `EngineConfig.reserve` are `sampling.pages`').

Misuse (a consumed or stale Prefix; busy, repeated or out-of-range slots) raises ValueError
before anything changes; `prefill_many` allocates all or nothing. Every call donates the state it
is given; `init_state()` resets the page book with it.

Randomness: the token of sample g of request r fed at cache position p is drawn with
fold_in(fold_in(fold_in(root, r), g), p). It does not depend on the slot or on the other requests
in the batch, so a request gives the same tokens alone or continuously batched, and a multi-turn
episode the same tokens whenever its tool answers.
min_new_tokens bans the stop ids while fewer tokens exist; the recorded log-prob is under that
banned distribution, and the learner applies the same ban (`rl.learner.Batch.stop_masked`).

The plan (`Plan`): the device work of one round of the episode loop, queued on the host and
issued together by `flush`: the prefill batches of the round's phases, then one `steps.update`
of the slots.

Why queue it: every process of a multi-process run must make the same jitted calls with the same
shapes, in the same order, while each decides only its own batch shards (`models.processes`). So
the engine's methods (`prefill_many`, `bulk_insert`, `resume`, `park`, `restore`, ...) only
change the host bookkeeping and queue their device work in the plan. Before the round's decode
call, each process puts the shapes its own rows need into a fixed-size vector (`Plan.shapes`), the
processes agree on the elementwise maximum (one `processes.agree`, which carries the loop's own
flags too), and each issues the agreed calls with its own rows in them and zeros in the rows of the
shards it does not hold. One process is the same code with nothing to agree.

A prefill batch is what one engine call queues (`prefill_many`, `resume`, `refresh`, ...); its
rows are split per shard into chunks of up to CHUNK rows (shard i's chunk in rows [i*n, (i+1)*n)
of a call, n the largest chunk of any shard rounded up to a power of two, T the longest row of
that chunk, bucketed), as
the prefill was issued before the work was queued: a one-process run makes exactly the calls it
made then. Batches go in the order of PHASES, and in their order within a phase: a parked
sequence's restore or refresh before its resume, the siblings' refresh batches in the order
`Engine.refresh` split them (rows that write a page another row of the batch writes wait for the
next batch), the admitted prompts before the partly inserted groups' prompts are refreshed (one
batch: a shard has one such group at most, so their rows never write each other's pages). The
slot changes (inserts, resumes, releases; page copies of the inserted groups) come after every
prefill: they read pages the prefills wrote, and no prefill reads a slot.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from models import quant
from models.config import ModelConfig
from models.processes import agree, global_array, local_values, shard_processes
from models.sharding import DEFAULT_RULES, hashable_rules
from sampling import partitioned, steps
from sampling.decode_weights import DecodeWeights
from sampling.distribution import SamplingParams
from sampling.paged_attention import resolve_backend
from sampling.pages import PageBook
from sampling.requests import EngineConfig, Parked, Prefix, Results, Ticket, check_slots
from sampling.state import DecodeState, state_shardings

PHASES = ("restore", "refresh", "resume", "admit", "prefix")
EXTENDS = ("restore", "refresh", "resume")  # rows after a cached history (else fresh prompts)
BATCHES = {"restore": 8, "refresh": 8, "resume": 1, "admit": 1, "prefix": 1}  # per round, most
CHUNK = 16  # prefill rows per shard per call


def bucket(n: int) -> int:
    """A prefill length bucket: a power of two, at least 16."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


@dataclasses.dataclass
class Row:
    shard: int
    tokens: list[int]
    start: int  # cache position of tokens[0] (0: a fresh prompt)
    pages: list[int]  # the sequence's page row, shard-local ids
    owner: object = None  # what keeps the routes this row's prefill records (`.routes`), if any


@dataclasses.dataclass
class PrefillBatch:
    rows: list[Row]

    def chunks(self, num_shards: int) -> list[list[list[Row]]]:
        """[chunk j][shard i] the rows of shard i in call j."""
        per = [[r for r in self.rows if r.shard == i] for i in range(num_shards)]
        n = max(map(len, per), default=0)
        return [[q[j : j + CHUNK] for q in per] for j in range(0, n, CHUNK)]


@dataclasses.dataclass
class Plan:
    """One round's queued device work (module docstring: "The plan")."""

    num_shards: int
    num_slots: int
    batches: dict = dataclasses.field(default_factory=lambda: {p: [] for p in PHASES})
    slots: dict = dataclasses.field(default_factory=dict)  # slot -> insert values, or None: off
    copies: list = dataclasses.field(default_factory=list)  # per shard [(src, dst)]

    def __post_init__(self):
        self.copies = self.copies or [[] for _ in range(self.num_shards)]

    @property
    def empty(self) -> bool:
        return not (any(self.batches.values()) or self.slots or any(self.copies))

    def prefill(self, phase: str, rows: list[Row]) -> None:
        rows = [r for r in rows if r.tokens]
        if not rows:
            return
        batches = self.batches[phase]
        if phase == "prefix" and batches:  # the open groups of other shards (one per shard)
            if {r.shard for r in rows} & {r.shard for r in batches[0].rows}:
                raise RuntimeError("two prefix refreshes of one shard in one round")
            batches[0].rows += rows
        else:
            batches.append(PrefillBatch(rows))

    def insert(self, slot: int, values: tuple) -> None:
        """Slot starts a sequence: (lengths, last_token, max_new, min_new, request_id,
        sample_id, shared) as `steps.update` takes them."""
        self.slots[slot] = values

    def release(self, slot: int) -> None:
        self.slots[slot] = None

    def copy(self, shard: int, pairs) -> None:
        self.copies[shard] += list(pairs)

    def shapes(self, chunks: int) -> np.ndarray:
        """int32: per phase batch (BATCHES of each) its largest row count of a shard and the
        longest row of each of `chunks` chunks; then 1 if a slot changes and the most page
        copies of a shard. The elementwise maximum over processes is the round's calls."""
        out = []
        for phase in PHASES:
            batches = self.batches[phase]
            if len(batches) > BATCHES[phase]:
                raise RuntimeError(
                    f"{len(batches)} {phase} prefill batches in one round: at most {BATCHES[phase]}"
                )
            for k in range(BATCHES[phase]):
                if k >= len(batches):
                    out += [0] * (1 + chunks)
                    continue
                parts = batches[k].chunks(self.num_shards)
                if len(parts) > chunks:
                    raise RuntimeError(
                        f"a {phase} prefill of more than {chunks * CHUNK} rows "
                        "per shard in one round"
                    )
                # the most rows of a shard: its last chunk's, after len(parts) - 1 full ones
                count = CHUNK * (len(parts) - 1) + max(len(q) for q in parts[-1])
                longest = [max(len(r.tokens) for q in part for r in q) for part in parts]
                out += [count, *longest, *[0] * (chunks - len(parts))]
        out += [int(bool(self.slots)), max(map(len, self.copies))]
        return np.asarray(out, np.int32)

    def calls(self, shapes: np.ndarray, chunks: int):
        """(phase, k, [(j, n, T)], batch or None) per prefill batch the agreed `shapes` make,
        in order: n rows per shard and T tokens in call j; batch None where this process has
        no rows of it."""
        at = 0
        for phase in PHASES:
            for k in range(BATCHES[phase]):
                count, longest = int(shapes[at]), shapes[at + 1 : at + 1 + chunks]
                at += 1 + chunks
                if not count:
                    continue
                calls = []
                for j in range(-(-count // CHUNK)):
                    n = 1 << (min(CHUNK, count - CHUNK * j) - 1).bit_length()
                    calls.append((j, n, bucket(int(longest[j]))))
                mine = self.batches[phase]
                yield phase, k, calls, mine[k] if k < len(mine) else None


MAX_PREFILL_BATCH = CHUNK  # prompts per shard per prefill call


class Engine:
    """The sampler's device work over a page book (`pages`); device state is passed in and
    returned (donated) by every call. `mesh` (with the parameters' `rules`) lays the state out
    over the devices; None keeps it on the default device."""

    def __init__(
        self,
        cfg: ModelConfig,
        graphdef,
        ecfg: EngineConfig,
        sampling: SamplingParams,
        mesh: jax.sharding.Mesh | None = None,
        rules=DEFAULT_RULES,
    ):
        ecfg.validate()
        if ecfg.weights_dtype not in ("", cfg.dtype, *quant.DTYPES):
            raise ValueError(
                f"weights_dtype={ecfg.weights_dtype!r}: a decode copy of the weights must be in "
                f"the model's compute dtype {cfg.dtype!r} (the sampler's log-probs then stay the "
                f"learner's to the bit), quantised ({', '.join(quant.DTYPES)}), or '' for none"
            )
        self.cfg, self.graphdef, self.ecfg, self.sampling = cfg, graphdef, ecfg, sampling
        rules = hashable_rules(rules)  # a static jit argument
        self.layout = None if mesh is None else (mesh, rules)
        # Resolved once for this platform, shape and mesh.
        sharded = mesh is not None and mesh.size > 1
        self.backend = resolve_backend(
            ecfg.backend,
            sharded,
            ecfg.cache_dtype,
            cfg.head_dim,
            ecfg.page_size,
            platform=None if mesh is None else mesh.devices.flat[0].platform,
        )
        # S batch shards, each with its slots and its own page pool (`sampling.partitioned`).
        shape = {} if mesh is None else dict(mesh.shape)
        self.num_shards = s = partitioned.num_shards(shape, rules, cfg.num_kv_heads)
        for name in ("num_slots", "num_pages"):
            if getattr(ecfg, name) % s:
                raise ValueError(
                    f"{name}={getattr(ecfg, name)}: must divide by the {s} batch shards of the "
                    f"mesh ({' x '.join(partitioned.shard_axes(shape, rules, cfg.num_kv_heads))}"
                    f"): each shard holds num_slots / {s} slots and num_pages / {s} pages"
                )
        if ecfg.num_pages // s < 2:
            raise ValueError(
                f"num_pages={ecfg.num_pages}: need >= 2 per shard ({s} shards; "
                "each shard's page 0 is its null page)"
            )
        self.slots_per_shard, self.pages_per_shard = ecfg.num_slots // s, ecfg.num_pages // s
        # The process that decides each shard's slots (`models.processes`); this one's shards.
        axes = partitioned.shard_axes(shape, rules, cfg.num_kv_heads)
        self.owners = [0] * s if mesh is None else shard_processes(mesh, axes)
        self.local_shards = [i for i in range(s) if self.owners[i] == jax.process_index()]
        self.weights = DecodeWeights(cfg, ecfg, self.layout, axes)
        self._shardings = self._rows = None
        if mesh is not None:
            self._shardings = state_shardings(jax.eval_shape(self.zeros), *self.layout)
            self._rows = NamedSharding(mesh, partitioned.specs(mesh, rules, cfg.num_kv_heads)[1])
        # Device work is queued (`Plan`) and issued by `flush`: at once after each call
        # (a direct use of the engine), or once per round inside the episode loop
        # (`deferred_rounds`).
        self._deferred = False
        self._chunks = max(1, -(-self.slots_per_shard // CHUNK))  # prefill calls per batch
        # Jitted once: a new jit of it per init_state compiled again at every rollout.
        self._fresh = jax.jit(self.zeros, out_shardings=self._shardings)
        self.pages = PageBook(ecfg, s, self.local_shards)
        self.prefill_tokens = 0  # tokens computed by prefill (prompts, resumed turns), ever
        self.recomputed_tokens = 0  # tokens prefilled again by `restore`, ever
        self.slot_steps = [0, 0]  # decode calls' [tokens, slots x steps], ever: utilization
        self.slot_trace: list | None = None  # a list: each call's (tokens, slot-steps) appended
        self._reset_host()

    @property
    def allocator(self):
        """The page pool: on one shard its `PageAllocator`, else the shards' `PoolTotals`."""
        return self.pages.allocator

    @property
    def preemptions(self) -> int:
        """Sequences evicted, ever ("demand"; `PageBook.evict`)."""
        return self.pages.preemptions

    def _reset_host(self) -> None:
        """Host bookkeeping of an empty state: every page free, every slot idle."""
        self.pages.reset()
        self.plan = Plan(self.num_shards, self.ecfg.num_slots)
        self._uploaded = None  # the page table as last uploaded; None: upload at next call

    @property
    def records_routes(self) -> bool:
        """Whether prefill and decode record each token's experts (`EngineConfig.record_routes`
        on a mixture of experts)."""
        return self.ecfg.record_routes and self.cfg.num_moe_layers > 0

    def zeros(self) -> DecodeState:
        """An empty DecodeState, unplaced (`init_state` places it; `jax.eval_shape` of it is
        the state's shapes)."""
        e = self.ecfg
        return DecodeState.zeros(
            self.cfg,
            e.num_slots,
            e.num_pages,
            e.page_size,
            e.pages_per_seq,
            e.max_new_tokens,
            jnp.dtype(e.cache_dtype),
        )

    def init_state(self) -> DecodeState:
        """A fresh DecodeState: every slot idle, every page empty. The page book is reset to
        match (pages, slots, Prefixes not yet inserted are forgotten), so this is also how to
        start over after an exception, which leaves the donated state unusable."""
        self._reset_host()
        return self._fresh()  # on a mesh created sharded in place: no device holds the whole pool

    def state_shardings(self) -> DecodeState | None:
        """The NamedSharding of every DecodeState field, or None without a mesh."""
        return self._shardings

    # --- the weights decoding reads (`sampling.decode_weights`) ------------------------------

    def decode_params(self, params):
        """`DecodeWeights.params`: the weights decoding reads, made once per rollout."""
        return self.weights.params(params)

    def decode_shardings(self, params):
        """`DecodeWeights.shardings`."""
        return self.weights.shardings(params)

    def abstract_decode_params(self, abstract_params):
        """`DecodeWeights.abstract`: what `decode_params` returns for abstract params."""
        return self.weights.abstract(abstract_params)

    # --- prompts and slots -------------------------------------------------------------------

    def prefill(self, params, state, prompt: list[int]) -> tuple[DecodeState, Prefix]:
        state, (prefix,) = self.prefill_many(params, state, [prompt])
        return state, prefix

    def prefill_many(self, params, state, prompts, shards=None) -> tuple[DecodeState, list[Prefix]]:
        """`prefill` for several prompts, prompt j onto batch shard shards[j] (default: each on
        the shard with the most pages free and unreserved, ties by index: `PageBook.place`), up
        to MAX_PREFILL_BATCH per shard per jitted call (the row count is padded to a power of
        two, the length to a bucket, to keep compiles few). All or nothing on the host: on an
        error no page stays allocated."""
        prefixes = self.pages.open_prefixes(prompts, shards)
        try:
            state = self._prefill_pages(params, state, prompts, prefixes)
        except BaseException:
            for x in prefixes:
                self.pages.close_prefix(x)
            raise
        return state, prefixes

    def bulk_insert(
        self,
        state,
        prefix: Prefix,
        slots,
        request_id: int,
        max_new,
        reserve=0,
        *,
        samples=None,
        keep: bool = False,
    ):
        """Puts one prefix into len(slots) idle slots sharing its full pages, as samples `samples`
        of the request (default 0..len-1: each sample's PRNG stream). Each slot may cache up to
        max(max_new, reserve) tokens after the prompt (one int or one per slot; a multi-turn
        episode reserves its whole budget). The prefix is consumed (its page references pass to
        the slots), or with `keep` stays live for the request's later samples (a later call). A
        consumed or stale prefix, slots out of range, repeated or busy, or a bad max_new raise
        ValueError before anything changes."""
        e = self.ecfg
        slots = check_slots(e.num_slots, slots)
        max_new, samples, copies, shared = self.pages.insert(
            prefix, slots, request_id, max_new, reserve, samples, keep
        )
        self.plan.copy(prefix.shard, copies)
        for k, s, m in zip(samples, slots, max_new):
            self.plan.insert(
                s,
                (
                    prefix.cached_len,
                    prefix.last_token,
                    int(m),
                    e.min_new_tokens,
                    request_id,
                    int(k),
                    shared,
                ),
            )
        return self._now(state)

    def insert(self, state, prefix: Prefix, slot: int, request_id: int, max_new: int):
        return self.bulk_insert(state, prefix, [slot], request_id, max_new)

    def free_resource(self, state, slot: int) -> DecodeState:
        """Returns the slot's pages to the pool and marks the slot idle (no-op on an idle slot)."""
        return self.free_slots_of(state, [slot])

    def free_slots_of(self, state, slots) -> DecodeState:
        """`free_resource` for several slots with one device call."""
        for slot in self.pages.release(slots):
            self.plan.release(slot)
        return self._now(state)

    # --- decode calls ------------------------------------------------------------------------

    def generate(self, params, state, root_key, num_steps: int | None = None):
        """Allocates pages ahead for `num_steps` tokens per busy slot, then decodes on device;
        returns when the call is done (`dispatch` + `collect`)."""
        state, ticket = self.dispatch(params, state, root_key, num_steps)
        self.collect(ticket)
        return state

    def dispatch(self, params, state, root_key, num_steps: int | None = None):
        """`generate` without waiting: (state, ticket) at once, the call queued on the device;
        `collect(ticket)` reads its results. Another call may be dispatched first, so the host's
        bookkeeping of call n overlaps the decoding of call n+1 (`sampling.episodes`).

        The page book keeps an upper bound of each busy slot's cached length (`PageBook.grow`):
        a slot grows by at most num_steps per call in flight, and `collect` puts back what it
        did not use. The page table stays on the device and is uploaded again only after a row
        changed."""
        e = self.ecfg
        num_steps = num_steps or e.steps_per_call
        if not self.plan.empty:  # the round's work goes first (the episode loop flushes it)
            if self._deferred:
                raise RuntimeError("dispatch with device work queued: flush the round first")
            state = self.flush(params, state)[0]
        slots = self.pages.grow(num_steps)
        uploaded, array = self._uploaded, self.pages.table.array
        if uploaded is None or not np.array_equal(uploaded, array):
            uploaded = array.copy()
            # Placed like the array it replaces: a call whose table was kept and one whose
            # table was uploaded then see the same input (one compile).
            # With several processes each fills its own slots' rows (`processes.global_array`).
            sharding = state.page_indices.sharding
            table = (
                jax.device_put(uploaded, sharding)
                if jax.process_count() == 1
                else global_array(uploaded, sharding)
            )
            state = state.replace(page_indices=table)
        state, out = steps.generate(
            self.graphdef,
            params,
            state,
            self.sampling,
            num_steps,
            tuple(e.stop_ids),
            self.backend,
            root_key,
            self.layout,
            self.cascade_group(),
            e.interpret,
            self.records_routes,
        )
        self._uploaded = uploaded  # only once the call took the table
        for x in out:  # this process's part, ready for `collect` as soon as the call ends
            for part in [x] if jax.process_count() == 1 else x.addressable_shards:
                getattr(part, "data", part).copy_to_host_async()
        return state, Ticket(out, slots, self.pages.epoch)

    def collect(self, ticket: Ticket) -> Results:
        """The results of a dispatched call (blocks until it is done). `Results.slots` are the
        slots it decoded that still hold the same sequence; a slot found finished is settled
        (its exact length kept) so that calls dispatched after it leave it alone."""
        if ticket.epoch is not self.pages.epoch:
            raise ValueError("ticket was dispatched before this engine's last init_state")
        *values, steps_run = local_values(ticket.out)  # this process's slots only
        routes = values.pop() if len(values) > 6 else None  # this call's experts (`records_routes`)
        r = Results(*values, slots=[], steps=int(steps_run), routes=routes)
        r.slots = self.pages.settle(ticket.slots, r.lengths, r.active)
        return r

    def count_decoded(self, tokens: int, slot_steps: int) -> None:
        """Adds a decode call's tokens (those its caller took) and slot-steps to `slot_steps`
        (and `slot_trace`, when it is a list): utilization."""
        self.slot_steps[0] += tokens
        self.slot_steps[1] += slot_steps
        if self.slot_trace is not None:
            self.slot_trace.append((tokens, slot_steps))

    def cascade_group(self) -> int:
        """The decode loop's block size: blockwise only (others get 1, not one per group size)."""
        return self.pages.group if self.backend == "blockwise" else 1

    # --- sequences between turns -------------------------------------------------------------

    def park(self, state, slots, last_tokens) -> tuple[DecodeState, list[Parked]]:
        """Frees the slots of sequences whose turn ended but keep their pages, KV and page
        reservation (a multi-turn episode waiting for its tool; `PageBook.park`).
        `last_tokens[j]`: the last token slot j sampled (not cached; `resume` feeds it). Returns
        a `Parked` per slot."""
        slots = check_slots(self.ecfg.num_slots, slots)
        parked = self.pages.park(slots, last_tokens)
        for slot in slots:
            self.plan.release(slot)
        return self._now(state), parked

    def restore(self, params, state, items) -> DecodeState:
        """Recomputes evicted sequences (`PageBook.evict`): items are (parked, history) as for
        `refresh`. Each gets fresh pages for its cached_len tokens on its shard (all or nothing),
        which one chunked prefill over the whole history fills under `params`; then it is parked
        as before eviction (`resume` continues it)."""
        for p, history in items:
            if not self.pages.is_parked(p) or not p.evicted or len(history) - 1 != p.cached_len:
                raise ValueError("restore needs an evicted sequence and its whole history")
        self.pages.restore([p for p, _ in items])
        for p, _ in items:
            self.recomputed_tokens += p.cached_len
        # its own pages: none shared
        return self.refresh(params, state, items, fresh=set(), phase="restore")

    def refresh(
        self, params, state, items, fresh: set | None = None, phase: str = "refresh"
    ) -> DecodeState:
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
            if not self.pages.is_parked(p) or len(history) - 1 != p.cached_len:
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
        if not self.pages.live(prefix) or len(prompt) - 1 != prefix.cached_len:
            raise ValueError("refresh_prefix needs a live prefix of this engine and its prompt")
        state = self._prefill_pages(params, state, [prompt], [prefix], phase="prefix")
        fresh.update(
            (prefix.shard, x) for x in prefix.pages[: prefix.cached_len // self.ecfg.page_size]
        )
        return state

    def resume(self, params, state, items, min_new=None, owners=None) -> DecodeState:
        """Continues parked sequences: items are (parked, new_tokens, slot, max_new); min_new
        per item (default the config's min_new_tokens): stop ids banned for its first min_new
        tokens (a turn resumed mid-way bans only what is left of its count). The
        parked last token and new_tokens[:-1] are prefilled onto the sequence's own pages after
        its cached history (one batched call), and new_tokens[-1] is fed by the next decode
        step; only these tokens are computed, never the history. The slots must be idle.
        owners: None, or per item an object (or None) whose `routes` the prefill sets to those
        tokens' experts, [len(new_tokens), L_moe, k] (`record_routes`; items with new tokens)."""
        seqs = self.pages.grow_parked(items)
        state = self._prefill_pages(
            params,
            state,
            [q[1:] for q in seqs],
            [p for p, *_ in items],
            extend=seqs,
            phase="resume",
            owners=owners,
        )
        if min_new is None:
            min_new = [self.ecfg.min_new_tokens] * len(items)
        for (p, _, s, max_new), seq, banned in zip(items, seqs, min_new, strict=True):
            length = p.cached_len + len(seq) - 1
            self.pages.unpark(p, s, length)
            self.plan.insert(s, (length, seq[-1], max_new, banned, p.request_id, p.sample_id, 0))
        return self._now(state)

    # --- rounds (`Plan`) ------------------------------------------------------------

    def _prefill_pages(
        self, params, state, prompts, prefixes, extend=None, phase="admit", owners=None
    ):
        """Queues caching prompt[:-1] of each prompt into its prefix's pages; with `extend`
        (resume, refresh), extend[j][:-1] after the cached_len tokens parked sequence j holds:
        one prefill batch of `phase` (`Plan`). owners: with `extend`, per row the
        object its recorded routes go to, or None (`resume`)."""
        rows_in = [p[:-1] for p in prompts] if extend is None else [q[:-1] for q in extend]
        e_rec = self.records_routes
        if extend is None:
            owners = prefixes
        owners = [None] * len(rows_in) if owners is None or not e_rec else owners
        self.plan.prefill(
            phase,
            [
                # A fresh prompt's prefill records its routes on the Prefix (`record_routes`),
                # a resume's on its owner (the tokens it feeds: observations); a refreshed or
                # recomputed sequence keeps the routes recorded when it was sampled.
                Row(x.shard, list(t), 0 if extend is None else x.cached_len, list(x.pages), o)
                for t, x, o in zip(rows_in, prefixes, owners, strict=True)
            ],
        )
        return self._now(state, params)

    def _now(self, state, params=None) -> DecodeState:
        """The queued work issued at once, unless the episode loop issues it per round."""
        return state if self._deferred else self.flush(params, state)[0]

    @contextlib.contextmanager
    def deferred_rounds(self):
        """Within it, the device work the methods queue waits for the caller's `flush` (the
        episode loop's, once per round) instead of going out at once."""
        self._deferred = True
        try:
            yield
        finally:
            self._deferred = False

    def flush(self, params, state, flags=()) -> tuple[DecodeState, np.ndarray]:
        """Issues the queued work (`Plan`): the prefill batches, then one slot update.
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
                    self.graphdef,
                    params,
                    state,
                    rows(tokens),
                    rows(lengths),
                    rows(page_rows),
                    self.layout,
                    rows(starts) if phase in EXTENDS else None,
                    e.prefill_chunk,
                    self.records_routes,
                )
                if self.records_routes:  # the rows' experts [s*n,T,L,k]
                    state, rec = state
                    owned = [
                        (r, row)
                        for i, chunk in enumerate(parts[j] if j < len(parts) else [])
                        for r, row in enumerate(chunk, start=i * n)
                        if row.owner is not None
                    ]
                    if owned:
                        rec = local_values(rec)  # this process's rows (a host sync)
                        for r, row in owned:
                            row.owner.routes = rec[r, : len(row.tokens)].copy()
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
            state,
            slots(put),
            slots(off),
            *map(slots, values),
            slots(copies[0].ravel()),
            slots(copies[1].ravel()),
            self.layout,
        )
