"""Sampler engine in the shape of JetStream's: prefill, insert / bulk_insert, generate, free_resource,
plus the batch loop `generate_all` (continuous batching over a fixed number of slots; it is
`sampling.episodes.generate_episodes`, which also runs multi-turn episodes with `park` / `resume`).

Device work is jitted (`sampling.steps`) over the donated `sampling.state.DecodeState`:
- `prefill` / `prefill_many`: prompts right-padded to a power-of-two length bucket, up to
  MAX_PREFILL_BATCH rows per call, written into freshly allocated pages. It caches all prompt
  tokens but the last, the slot's `last_token`, fed by the first decode step: every token is
  sampled in one place (`steps.generate`) with one key schedule (JetStream's prefill returns the
  first token instead; this costs one batched decode step per request).
- `bulk_insert`: one prefilled prompt (a `Prefix`) into idle slots, as some or all of its G
  samples. Full prompt pages are shared (a reference per sample, and the live prefix's); the
  partial last page is copied on device for all samples but the last inserted
  (`PageAllocator.fork_for_group`). With `keep` the prefix stays live for the later samples, else
  it is consumed. A whole group goes on an aligned block of G slots when one is free, which lets
  the blockwise backend read the shared pages once per block (`shared_len`); `sampling.episodes`
  inserts a group sample by sample when fewer slots are free, rather than idle them.
- `generate`: up to `num_steps` decode steps in one `lax.while_loop`; `dispatch` and `collect`
  are its two halves, so that the batch loop queues call n+1 before it reads call n.
- `park` / `resume`: a sequence between two turns of an episode frees its slot but keeps its pages
  and their reservation; `resume` prefills only its new tokens (batched) after its cached history
  and puts it in any free slot (`sampling.turns`).

Rounds: the methods above change the host bookkeeping and queue their device work, which
`flush` issues (`sampling.rounds`, `sampling.plan`): at once for a direct caller, once per round
inside the episode loop, where the processes of a multi-process run first agree on the calls'
shapes. Each process decides and feeds only its own batch shards (`local_shards`) and reads back
only their slots. The weights decoding reads are `sampling.decode_weights`'.

Sharding: no `in_shardings`, so parameters are used in their own shardings, never gathered per
call; the `DecodeState` is laid out by `sampling.state.state_shardings` and every jitted
function pins its output to that layout, so donation reuses the same buffers.

Page allocation is host-side (`sampling.page_allocator` says why): before each call the host
gives every busy slot the pages of its next `num_steps` tokens, counted from an upper bound of
its length while calls are in flight (`growth`; the budget is `sampling.budget`'s). What
admission sets aside is `EngineConfig.reserve`'s: "budget" reserves a group's worst-case pages
(`group_pages`) up front, so a running request never runs out; "demand" only the pages of its
prompt and first call (`admission_pages`), and a shard that runs out frees the pages of its
newest sequences (`evict`: preemption, decided by `sampling.episodes`), which are recomputed
over their whole history when they come back (`restore`, a chunked prefill, as vLLM's recompute
preemption).

Misuse (a consumed or stale Prefix; busy, repeated or out-of-range slots) raises ValueError
before anything changes; `prefill_many` allocates all or nothing. Every call donates the state it
is given; `init_state()` resets the host bookkeeping with it.

Randomness: the token of sample g of request r fed at cache position p is drawn with
fold_in(fold_in(fold_in(root, r), g), p). It does not depend on the slot or on the other requests
in the batch, so a request gives the same tokens alone or continuously batched, and a multi-turn
episode the same tokens whenever its tool answers.
min_new_tokens bans the stop ids while fewer tokens exist; the recorded log-prob is under that
banned distribution, and the learner applies the same ban (`rl.learner.Batch.stop_masked`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from models.config import ModelConfig
from models.sharding import DEFAULT_RULES
from sampling import partitioned, steps
from sampling.budget import PageBudget
from sampling.decode_weights import DecodeWeights
from sampling.distribution import SamplingParams
from sampling.page_allocator import (
    NULL_PAGE,
    OutOfPagesError,
    PageAllocator,
    PageTable,
    PoolTotals,
)
from sampling.paged_attention import resolve_backend
from sampling.peers import global_array, local_values, shard_processes
from sampling.plan import CHUNK, Plan
from sampling.requests import (
    EngineConfig,
    Parked,
    Prefix,
    Results,
    Ticket,
    check_insert,
    check_prompt,
    check_slots,
    take_slots,
)
from sampling.rounds import Rounds
from sampling.state import DecodeState, state_shardings
from sampling.turns import Turns

MAX_PREFILL_BATCH = CHUNK  # prompts per shard per prefill call


class Engine(Turns, Rounds, DecodeWeights, PageBudget):
    """Host side of the sampler: allocator, page table, slot bookkeeping; device state is passed
    in and returned (donated) by every call. `mesh` (with the parameters' `rules`) lays the state
    out over the devices; None keeps it on the default device."""

    def __init__(
        self, cfg: ModelConfig, graphdef, ecfg: EngineConfig, sampling: SamplingParams,
        mesh: jax.sharding.Mesh | None = None, rules=DEFAULT_RULES,
    ):  # fmt: skip
        ecfg.validate()
        if ecfg.weights_dtype not in ("", cfg.dtype):
            raise ValueError(
                f"weights_dtype={ecfg.weights_dtype!r}: a decode copy of the weights must be in "
                f"the model's compute dtype {cfg.dtype!r} (the sampler's log-probs then stay the "
                f"learner's to the bit), or '' for none"
            )
        self.cfg, self.graphdef, self.ecfg, self.sampling = cfg, graphdef, ecfg, sampling
        # Hashable (a static jit argument), also for rules written as lists in a config.
        rules = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rules)
        self.layout = None if mesh is None else (mesh, rules)
        # Resolved once for this platform, shape and mesh.
        sharded = mesh is not None and mesh.size > 1
        self.backend = resolve_backend(
            ecfg.backend, sharded, ecfg.cache_dtype, cfg.head_dim, ecfg.page_size,
            platform=None if mesh is None else mesh.devices.flat[0].platform,
        )  # fmt: skip
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
            raise ValueError(f"num_pages={ecfg.num_pages}: need >= 2 per shard ({s} shards; "
                             "each shard's page 0 is its null page)")  # fmt: skip
        self.slots_per_shard, self.pages_per_shard = ecfg.num_slots // s, ecfg.num_pages // s
        # The process that decides each shard's slots (`sampling.peers`); this one's shards.
        axes = partitioned.shard_axes(shape, rules, cfg.num_kv_heads)
        self.owners = [0] * s if mesh is None else shard_processes(mesh, axes)
        self.local_shards = [i for i in range(s) if self.owners[i] == jax.process_index()]
        self._shardings = self._rows = None
        if mesh is not None:
            self._shardings = state_shardings(jax.eval_shape(self._zeros), *self.layout)
            self._rows = NamedSharding(mesh, partitioned.specs(mesh, rules, cfg.num_kv_heads)[1])
        # Device work is queued (`sampling.plan`) and issued by `flush`: at once after each call
        # (a direct use of the engine), or once per round inside `EpisodeLoop.run` (`deferred`).
        self.deferred = False
        self._chunks = max(1, -(-self.slots_per_shard // CHUNK))  # prefill calls per batch
        # Jitted once: a new jit of it per init_state compiled again at every rollout.
        self._fresh = jax.jit(self._zeros, out_shardings=self._shardings)
        self.pools = [PageAllocator(self.pages_per_shard) for _ in range(s)]  # one per shard
        self.table = PageTable(ecfg.num_slots, ecfg.pages_per_seq)  # shard-local page ids
        self.prefill_tokens = 0  # tokens computed by prefill (prompts, resumed turns), ever
        self.preemptions = 0  # sequences evicted, ever ("demand")
        self.recomputed_tokens = 0  # tokens prefilled again by `restore`, ever
        self.slot_steps = [0, 0]  # decode calls' [tokens, slots x steps], ever: utilization
        self.slot_trace: list | None = None  # a list: each call's (tokens, slot-steps) appended
        self._reset_host()

    @property
    def allocator(self):
        """The page pool: on one shard its `PageAllocator`, else the shards' `PoolTotals`."""
        return self.pools[0] if len(self.pools) == 1 else PoolTotals(self.pools)

    def shard_of(self, slot: int) -> int:
        """The batch shard of a slot: shard i holds slots [i*B/S, (i+1)*B/S)."""
        return slot // self.slots_per_shard

    def free_on(self, shard: int) -> list[int]:
        """The free slots of one shard, in `free_slots` order."""
        return [s for s in self.free_slots if self.shard_of(s) == shard]

    def _reset_host(self) -> None:
        """Host bookkeeping of an empty state: every page free, every slot idle."""
        for pool in self.pools:
            pool.reset()
        self.table.array[:] = NULL_PAGE
        self.plan = Plan(self.num_shards, self.ecfg.num_slots)
        # This process's slots: the others' shards are decided and fed by their own process.
        self.free_slots = [s for s in range(self.ecfg.num_slots)
                           if self.shard_of(s) in self.local_shards]  # fmt: skip
        # Cascade attention (`paged_attention_blockwise`): a group of `group` samples placed on
        # an aligned block of slots reads its shared prompt pages once per decode step.
        # `generate_all` sets it to its num_samples; 1 = off.
        self.group = 1
        # Per busy slot (the keys are the busy slots): cap on cached tokens and an upper bound
        # of its cached length once the calls in flight are done (exact when none is).
        self._cap: dict[int, int] = {}
        self._len: dict[int, int] = {}
        self._epoch = object()  # Prefixes made before the last reset are stale
        self._parked: list[Parked] = []  # sequences between turns: pages kept, no slot
        # Pages a caller promised to samples not inserted yet (`EpisodeLoop`: a group partly
        # in its slots), by caller, and the shard they are promised on.
        self.promised: dict[object, int] = {}
        self.promised_on: dict[object, int] = {}
        # Per slot: (request id, sample id) of its sequence, and a serial number bumped whenever
        # the slot's sequence changes or finishes (`collect` ignores calls that predate it).
        self._ids: dict[int, tuple[int, int]] = {}
        self._serial = [0] * self.ecfg.num_slots
        self._uploaded = None  # the page table as last uploaded; None: upload at next call

    def _zeros(self) -> DecodeState:
        e = self.ecfg
        return DecodeState.zeros(
            self.cfg, e.num_slots, e.num_pages, e.page_size, e.pages_per_seq,
            e.max_new_tokens, jnp.dtype(e.cache_dtype),
        )  # fmt: skip

    def init_state(self) -> DecodeState:
        """A fresh DecodeState: every slot idle, every page empty. The host bookkeeping is reset
        to match (pages, slots, Prefixes not yet inserted are forgotten), so this is also how to
        start over after an exception, which leaves the donated state unusable."""
        self._reset_host()
        return self._fresh()  # on a mesh created sharded in place: no device holds the whole pool

    def state_shardings(self) -> DecodeState | None:
        """The NamedSharding of every DecodeState field, or None without a mesh."""
        return self._shardings

    def prefill(self, params, state, prompt: list[int]) -> tuple[DecodeState, Prefix]:
        state, (prefix,) = self.prefill_many(params, state, [prompt])
        return state, prefix

    def prefill_many(self, params, state, prompts, shards=None) -> tuple[DecodeState, list[Prefix]]:
        """`prefill` for several prompts, prompt j onto batch shard shards[j] (default: each on
        the shard with the most pages free and unreserved, ties by index), up to
        MAX_PREFILL_BATCH per shard per jitted call (the row count is padded to a power of two,
        the length to a bucket, to keep compiles few). All or nothing on the host: on an error
        no page stays allocated."""
        for prompt in prompts:
            check_prompt(self.ecfg, prompt)
        # The last prompt token is not cached: the first decode step feeds it.
        sizes = [self._pages_for(len(prompt) - 1) for prompt in prompts]
        shards = self._place(sizes) if shards is None else [int(x) for x in shards]
        for i in range(self.num_shards):
            need = sum(n for n, x in zip(sizes, shards) if x == i)
            if need > self.pools[i].num_free:
                on = f" on shard {i}" if self.num_shards > 1 else ""
                raise OutOfPagesError(
                    f"prefill of {len(prompts)} prompts needs {need} KV pages{on} but only "
                    f"{self.pools[i].num_free} of {self.pages_per_shard - 1} are free{on}"
                )
        prefixes = []
        try:
            for prompt, n, i in zip(prompts, sizes, shards):
                pages = self.pools[i].alloc(n)
                prefixes.append(Prefix(pages, len(prompt) - 1, int(prompt[-1]), epoch=self._epoch,
                                       shard=i))  # fmt: skip
            state = self._prefill_pages(params, state, prompts, prefixes)
        except BaseException:
            for x in prefixes:
                self.pools[x.shard].free(x.pages)
            raise
        return state, prefixes

    def _place(self, sizes) -> list[int]:
        """A shard per request of sizes[j] pages: of this process's shards the one with the most
        pages free and not reserved once the earlier ones are placed, ties by index."""
        room = {i: self.pools[i].num_free - self._reserved(i) for i in self.local_shards}
        out = []
        for n in sizes:
            i = max(room, key=lambda i: (room[i], -i))
            room[i] -= n
            out.append(i)
        return out

    def _check_slots(self, slots, unique: bool = True) -> list[int]:
        return check_slots(self.ecfg.num_slots, slots, unique)

    def bulk_insert(
        self, state, prefix: Prefix, slots, request_id: int, max_new, reserve=0, *,
        samples=None, keep: bool = False,
    ):  # fmt: skip
        """Puts one prefix into len(slots) idle slots sharing its full pages, as samples `samples`
        of the request (default 0..len-1: each sample's PRNG stream). Each slot may cache up to
        max(max_new, reserve) tokens after the prompt (one int or one per slot; a multi-turn
        episode reserves its whole budget). The prefix is consumed (its page references pass to
        the slots), or with `keep` stays live for the request's later samples (a later call). A
        consumed or stale prefix, slots out of range, repeated or busy, or a bad max_new raise
        ValueError before anything changes."""
        e = self.ecfg
        slots = self._check_slots(slots)
        g = len(slots)
        max_new, cap, samples = check_insert(e, prefix, self._epoch, slots, self._cap, max_new,
                                             reserve, samples)  # fmt: skip
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
        self.free_slots = [s for s in self.free_slots if s not in slots]
        # An aligned block of slots holding one prefix (its full pages) reads them once.
        aligned = (
            g == self.group > 1 and slots[0] % g == 0 and slots == [*range(slots[0], slots[0] + g)]
        )
        shared = prefix.cached_len // e.page_size * e.page_size if aligned else 0
        self.plan.copy(prefix.shard, copies)
        for k, s, r, c, m in zip(samples, slots, rows, cap, max_new):
            self.table.set_row(s, r)
            self._ids[s] = (request_id, int(k))
            self._serial[s] += 1
            self._len[s] = prefix.cached_len
            # Decode step j caches the token it is fed at position cached_len + j, j < max_new
            # (the last sampled token is never cached, but the last prompt token is).
            self._cap[s] = prefix.cached_len + c
            self.plan.insert(s, (prefix.cached_len, prefix.last_token, int(m), e.min_new_tokens,
                                 request_id, int(k), shared))  # fmt: skip
        return self._now(state)

    def insert(self, state, prefix: Prefix, slot: int, request_id: int, max_new: int):
        return self.bulk_insert(state, prefix, [slot], request_id, max_new)

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

        The host keeps an upper bound of each busy slot's cached length (`_len`): a slot grows
        by at most num_steps per call in flight, and `collect` puts back what it did not use.
        The page table stays on the device and is uploaded again only after a row changed."""
        e = self.ecfg
        num_steps = num_steps or e.steps_per_call
        if not self.plan.empty:  # the round's work goes first (`EpisodeLoop` flushes it)
            if self.deferred:
                raise RuntimeError("dispatch with device work queued: flush the round first")
            state = self.flush(params, state)[0]
        for s, (bound, need) in self.growth(num_steps).items():
            self._len[s] = bound
            if need > 0:
                self.table.append(s, self.pools[self.shard_of(s)].alloc(need))
        uploaded = self._uploaded
        if uploaded is None or not np.array_equal(uploaded, self.table.array):
            uploaded = self.table.array.copy()
            # Placed like the array it replaces: a call whose table was kept and one whose
            # table was uploaded then see the same input (one compile).
            # With several processes each fills its own slots' rows (`peers.global_array`).
            sharding = state.page_indices.sharding
            table = (jax.device_put(uploaded, sharding) if jax.process_count() == 1
                     else global_array(uploaded, sharding))  # fmt: skip
            state = state.replace(page_indices=table)
        state, out = steps.generate(
            self.graphdef, params, state, self.sampling, num_steps, tuple(e.stop_ids),
            self.backend, root_key, self.layout, self._cascade_group(),
            e.interpret,
        )  # fmt: skip
        self._uploaded = uploaded  # only once the call took the table
        for x in out:  # this process's part, ready for `collect` as soon as the call ends
            for part in [x] if jax.process_count() == 1 else x.addressable_shards:
                getattr(part, "data", part).copy_to_host_async()
        slots = {s: (self._serial[s], self._len[s]) for s in self._len}
        return state, Ticket(out, slots, self._epoch)

    def collect(self, ticket: Ticket) -> Results:
        """The results of a dispatched call (blocks until it is done). `Results.slots` are the
        slots it decoded that still hold the same sequence; a slot found finished is settled
        (its exact length kept) so that calls dispatched after it leave it alone."""
        if ticket.epoch is not self._epoch:
            raise ValueError("ticket was dispatched before this engine's last init_state")
        *values, steps_run = local_values(ticket.out)  # this process's slots only
        r = Results(*values, slots=[], steps=int(steps_run))
        for s, (serial, bound) in ticket.slots.items():
            if self._serial[s] != serial or s not in self._len:
                continue  # freed, parked or given a new sequence since
            r.slots.append(s)
            self._len[s] -= bound - int(r.lengths[s])  # exact, plus the later calls' bounds
            if not r.active[s]:
                self._len[s] = int(r.lengths[s])
                self._serial[s] += 1
        return r

    def _cascade_group(self) -> int:
        """The decode loop's block size: blockwise only (others get 1, not one per group size)."""
        return self.group if self.backend == "blockwise" else 1

    def free_resource(self, state, slot: int) -> DecodeState:
        """Returns the slot's pages to the pool and marks the slot idle (no-op on an idle slot)."""
        return self.free_slots_of(state, [slot])

    def free_slots_of(self, state, slots) -> DecodeState:
        """`free_resource` for several slots with one device call."""
        slots = self._check_slots(slots, unique=False)
        for slot in slots:
            self._free_host(slot)
            self.plan.release(slot)
        return self._now(state)

    def _free_host(self, slot: int) -> None:
        self.pools[self.shard_of(slot)].free(self.table.clear_row(slot))
        self._serial[slot] += 1
        self._len.pop(slot, None)
        self._cap.pop(slot, None)
        if slot not in self.free_slots:
            self.free_slots.append(slot)

    def _take_slots(self, g: int, shard: int = 0) -> list[int]:
        """g free slots of a shard for a group (`requests.take_slots`); `bulk_insert` marks them
        busy."""
        return take_slots(self.free_on(shard), g, self.group, self.ecfg.num_slots)

    def generate_all(
        self, params, state, prompts, num_samples=1, max_new_tokens=None, seed=0,
        request_ids=None, on_finish=None, shards=None,
    ):  # fmt: skip
        """(state, results): results[i][g] the `Completion` of sample g (of num_samples) of
        prompt i, with PRNG stream request_ids[i] (default i) and max_new_tokens (one int or one
        per request; default the config's). `on_finish(i, g, completion)` is called as each
        sequence finishes. `shards`: None, or per prompt the batch shard it goes on (one of
        `local_shards`: a multi-process run's). `state` is donated; after an exception the host
        side is cleaned up (start again from `init_state()`).
        `sampling.episodes.generate_episodes`, one turn."""
        from sampling.episodes import generate_episodes

        return generate_episodes(
            self, params, state, prompts, num_samples, max_new_tokens, seed=seed,
            request_ids=request_ids, on_finish=on_finish, shards=shards,
        )  # fmt: skip
