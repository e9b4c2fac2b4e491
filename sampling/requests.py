"""What the sampler engine takes and gives: its config (`EngineConfig`), a dispatched decode call
and its results (`Ticket`, `Results`), a prefilled prompt (`Prefix`), a finished sample
(`Completion`) and one in progress (`Episode`), and the checks a batch of requests passes before
the engine changes anything (`check_requests`), so a bad argument never leaves pages or slots
half taken. `group_pages` is the one formula for the most pages a group of samples holds: the
engine admits requests by it, and config validation and benchmarks size the pool with it.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from models.quant import DTYPES as WEIGHTS_QUANTIZED  # quantised EngineConfig.weights_dtype
from sampling.kv_quant import CACHE_DTYPES, QUANT_DTYPES
from sampling.paged_attention import BACKENDS

WEIGHTS_LAYOUTS = ("tensor", "training")  # EngineConfig.weights_layout
RESERVES = ("demand", "budget")  # EngineConfig.reserve


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 8  # B, sequences decoded together
    page_size: int = 16
    num_pages: int = 256  # P, pages in the pool including the null page 0
    max_prompt_len: int = 256
    max_new_tokens: int = 64  # M, size of the output buffers
    min_new_tokens: int = 0  # stop ids are masked before this many tokens
    steps_per_call: int = 16  # decode steps per `generate` call (host sync period)
    stop_ids: tuple[int, ...] = ()
    backend: str = "auto"  # paged attention backend (sampling.paged_attention.BACKENDS)
    cache_dtype: str = "float32"  # KV pages; int8 / float8_e4m3fn: with scales (sampling.kv_quant)
    interpret: bool = False  # Pallas kernels in interpret mode: runs them on CPU (tests)
    # "": decode from the params as given; else a copy, one per rollout: in the compute dtype,
    # or "int8" / "float8_e4m3fn": block projections quantised per output channel, W8A8
    # matmuls (models.quant), the rest in the compute dtype; with either weights_layout.
    weights_dtype: str = ""
    # "tensor": decode from a copy in the compute dtype split over the KV-head / tensor axes only
    # (replicated over the shard axes), made once per rollout, so a decode step moves only its
    # own slots' activations; "training": from the params in their training layout (zero copy;
    # every step all-reduces every slot's partial sums over fsdp). `Engine.decode_params`.
    weights_layout: str = "tensor"
    prefill_chunk: int = 512  # prompt tokens per prefill pass over the pages; 0: one dense pass
    # KV pages of an admitted sequence (`sampling.episodes`): "demand" = taken as it grows, the
    # newest sequence of a shard preempted (its pages freed, recomputed later) when the shard
    # runs out; "budget" = its whole budget's worst case reserved at admission (never preempted).
    reserve: str = "demand"
    kv_watermark: float = 0.01  # "demand": a new admission leaves this fraction of a shard free
    record_routes: bool = False  # MoE: decode steps record each fed token's experts (replay)

    @property
    def demand(self) -> bool:
        return self.reserve == "demand"

    @property
    def pages_per_seq(self) -> int:
        return -(-(self.max_prompt_len + self.max_new_tokens) // self.page_size)

    def validate(self):
        """Raises ValueError naming the first bad field and why."""
        for name in ("num_slots", "page_size", "max_prompt_len", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.steps_per_call < 1:
            raise ValueError(f"steps_per_call={self.steps_per_call}: must be >= 1")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk={self.prefill_chunk}: must be >= 0 (0 = unchunked)")
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages}: must be >= 2 (page 0 is reserved)")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens}: must be in [0, {self.max_new_tokens}]"
            )
        if not all(isinstance(i, int) and i >= 0 for i in self.stop_ids):
            raise ValueError(f"stop_ids={self.stop_ids}: must be token ids (ints >= 0)")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: must be one of {', '.join(BACKENDS)}")
        if self.weights_dtype not in ("", "float32", "bfloat16", "float16", *WEIGHTS_QUANTIZED):
            raise ValueError(
                f"weights_dtype={self.weights_dtype!r}: must be '', float32, bfloat16, float16, "
                "int8 or float8_e4m3fn"
            )
        if self.weights_layout not in WEIGHTS_LAYOUTS:
            raise ValueError(
                f"weights_layout={self.weights_layout!r}: must be one of "
                f"{', '.join(WEIGHTS_LAYOUTS)}"
            )
        if self.reserve not in RESERVES:
            raise ValueError(f"reserve={self.reserve!r}: must be one of {', '.join(RESERVES)}")
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(
                f"kv_watermark={self.kv_watermark}: must be in [0, 1) (a fraction "
                "of each shard's pages)"
            )
        if self.cache_dtype not in CACHE_DTYPES:  # int8 / fp8: quantised (`sampling.kv_quant`)
            raise ValueError(
                f"cache_dtype={self.cache_dtype!r}: must be one of {', '.join(CACHE_DTYPES)}"
            )
        if self.cache_dtype in QUANT_DTYPES and self.backend in ("pallas_tpu", "cpu_kernel"):
            raise ValueError(
                f"backend={self.backend!r} cannot read a {self.cache_dtype} KV cache "
                "(sampling.paged_attention.resolve_backend says why): use 'auto' or 'blockwise'"
            )
        return self


@dataclasses.dataclass
class Ticket:
    """A dispatched `generate` call: its result arrays on the device, and per busy slot the
    slot's serial number and length bound at dispatch."""

    out: tuple
    slots: dict[int, tuple[int, int]]
    epoch: object = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass
class Results:
    """Host copies of a decode call's slot buffers (`steps.generate`; with several processes
    only this process's slots are filled in), and the slots they are about (`Engine.collect`)."""

    active: np.ndarray  # bool [B]
    num_generated: np.ndarray  # int32 [B]
    stopped: np.ndarray  # bool [B]
    lengths: np.ndarray  # int32 [B]
    tokens: np.ndarray  # int32 [B,M]
    logprobs: np.ndarray  # f32 [B,M]
    slots: list[int]
    steps: int = 0  # decode steps the call ran (every slot's: slot-steps = steps x B)
    # [B,num_steps,L_moe,k] the experts of the token each slot fed at each step of this call (its
    # first num_generated - (its count before the call) columns: `steps.generate`); None: not
    # recorded (`Engine.records_routes`)
    routes: np.ndarray | None = None


@dataclasses.dataclass
class Prefix:
    """A prefilled prompt: its pages hold the KV of tokens[:-1]; tokens[-1] is fed at decode.

    Single use: `bulk_insert` hands its page references to the slots and sets `consumed`. It is
    valid only in the engine that made it, until that engine's next `init_state`."""

    pages: list[int]  # local page ids of its shard's pool
    cached_len: int
    last_token: int
    consumed: bool = False
    epoch: object = dataclasses.field(default=None, repr=False, compare=False)
    shard: int = 0  # the batch shard whose pool holds its pages (`sampling.partitioned`)
    # [cached_len, L_moe, k] the experts of tokens[:-1] in the prefill (`record_routes`), or None
    routes: object = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass(eq=False)
class Parked:
    """A sequence between two turns of an episode (`Engine.park`): no slot, its pages (KV of
    cached_len tokens) and its reservation up to `cap` cached tokens kept."""

    pages: list[int]
    cached_len: int
    last_token: int  # sampled last, not cached yet
    cap: int
    request_id: int
    sample_id: int
    epoch: object = dataclasses.field(default=None, repr=False)
    shard: int = 0  # the batch shard it lives on: it resumes in a slot of that shard
    evicted: bool = False  # preempted: no pages (empty `pages`) until `Engine.restore`


@dataclasses.dataclass
class Completion:
    """A finished sample: every token after the prompt. For a multi-turn episode that is the
    model's turns and the observations between them (`observation[t]` True), in order;
    observation tokens have log-prob 0."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    length: int
    turns: int = 1
    observation: list[bool] | None = None  # None: every token is the model's
    versions: list[int] | None = None  # per token: the version of the sampler run that drew it
    # int8/int16 [P+length, L_moe, k]: every token's experts per MoE layer, prompt's first
    # (routing replay, `models.transformer.Transformer.hidden`); None: not recorded
    routes: object = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass
class Episode:
    """An episode in progress in `sampling.episodes.EpisodeLoop`."""

    i: int  # request key
    k: int  # sample in its group
    budget: int  # tokens after the prompt
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    observation: list[bool] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # run version of each token
    turns: int = 0
    turn_len: int = 0  # model tokens of the turn in progress (parked mid-turn: > 0)
    seen: int = 0  # tokens of this slot stint already read (utilization; each call's routes)
    kv_version: int = 0  # the version whose parameters computed the cached KV (refresh)
    finish: str = "stop"
    parked: Parked | None = None
    # record_routes: the prompt's experts but the last token's [P-1, L_moe, k] (its Prefix's
    # until its first decode call is read), then in order [n, L_moe, k] pieces: each decode
    # call's fed tokens' and each resume's prefilled ones' (a turn's last token and the
    # observation but its last: a `Recorded` until the next decode call is read); else None
    routes: list | None = None

    @property
    def left(self) -> int:
        return self.budget - len(self.tokens)


@dataclasses.dataclass(eq=False)
class Recorded:
    """Where the routes a resume's prefill records land (`Engine.resume`'s owners)."""

    routes: object = None


def check_slots(num_slots: int, slots, unique: bool = True) -> list[int]:
    """slots as ints, or ValueError when one is out of range (or repeated, with `unique`)."""
    slots = [operator.index(s) for s in slots]
    bad = [s for s in slots if not 0 <= s < num_slots]
    if bad:
        raise ValueError(f"slot(s) {bad} out of range: need 0..{num_slots - 1}")
    dup = sorted({s for s in slots if slots.count(s) > 1})
    if unique and dup:
        raise ValueError(f"slot(s) {dup} given more than once")
    return slots


def _per_slot(x, g: int, name: str) -> list[int]:
    if np.ndim(x) == 0:
        return [int(x)] * g
    if len(x) != g:
        raise ValueError(f"{name} has {len(x)} entries, need {g}")
    return [int(v) for v in x]


def check_insert(ecfg: EngineConfig, prefix, epoch, slots, busy, max_new, reserve, samples):
    """(max_new int32[G], cap per slot: tokens it may cache after the prompt, sample ids
    int32[G]) of a `bulk_insert` into slots, or ValueError before anything changes."""
    g = len(slots)
    if not g:
        raise ValueError("bulk_insert needs at least one slot")
    if prefix.consumed:
        raise ValueError("prefix already inserted (bulk_insert consumes it): prefill again")
    if prefix.epoch is not epoch:
        raise ValueError("prefix was not prefilled by this engine since its last init_state")
    taken = [s for s in slots if s in busy]
    if taken:
        raise ValueError(f"slot(s) {taken} busy: free_resource them first")
    max_new, reserve = _per_slot(max_new, g, "max_new"), _per_slot(reserve, g, "reserve")
    bad = [m for m in max_new if not 1 <= m <= ecfg.max_new_tokens]
    if bad:
        raise ValueError(f"max_new_tokens={bad[0]}: need 1..{ecfg.max_new_tokens}")
    samples = np.arange(g) if samples is None else np.asarray(samples)
    if samples.shape != (g,) or len(set(samples.tolist())) != g or samples.min() < 0:
        raise ValueError(f"samples {samples.tolist()}: need {g} distinct sample ids >= 0")
    cap = [max(m, r) for m, r in zip(max_new, reserve)]
    return np.asarray(max_new, np.int32), cap, samples.astype(np.int32)


def check_resume(parked: Parked, new_tokens, max_new: int) -> None:
    """ValueError when a parked sequence's new tokens and next turn exceed its reservation."""
    if max_new < 1 or parked.cached_len + len(new_tokens) + max_new > parked.cap:
        raise ValueError(
            f"{len(new_tokens)} new tokens + max_new={max_new} exceed the sequence's reserved "
            f"{parked.cap - parked.cached_len} tokens after {parked.cached_len} cached"
        )


def check_prompt(ecfg: EngineConfig, prompt) -> None:
    if not 1 <= len(prompt) <= ecfg.max_prompt_len:
        raise ValueError(f"prompt of {len(prompt)} tokens: need 1..{ecfg.max_prompt_len}")


def group_pages(prompt_len: int, max_new, page_size: int, g: int) -> int:
    """KV pages a group of g samples of one prompt holds at its longest, as the engine allocates.
    max_new: every sample's budget, or one per sample (g of them).

    The engine caches the prompt's first prompt_len - 1 tokens (the first decode step feeds the
    last one) and each sample at most its max_new more (`sampling.engine`). The full pages of the
    cached prompt are shared by the g samples, so they count once; each sample owns the rest of
    its pages: a copy of the partial last prompt page, if any (`sampling.pages.PageAllocator.
    fork_for_group`), and its decode pages.
    """
    budgets = [max_new] * g if np.ndim(max_new) == 0 else list(max_new)
    if (
        prompt_len < 1
        or min(budgets, default=-1) < 0
        or page_size < 1
        or g < 1
        or len(budgets) != g
    ):
        raise ValueError(
            f"group_pages(prompt_len={prompt_len}, max_new={max_new}, page_size={page_size}, "
            f"g={g}): need prompt_len >= 1, max_new >= 0 (one or g), page_size >= 1, g >= 1"
        )
    cached = prompt_len - 1
    shared = cached // page_size
    return shared + sum(-(-(cached + m) // page_size) - shared for m in budgets)


def check_requests(ecfg: EngineConfig, prompts, g: int, max_new_tokens, request_ids):
    """(max_new per request: a list of its G samples' budgets, request ids, worst-case KV pages
    per request) of a `generate_all` call, or ValueError naming the bad argument.
    max_new_tokens: None (the config's), one int, or one per prompt (an int, or G ints: one per
    sample); request_ids: None (0..n-1) or one per prompt."""
    n = len(prompts)
    if not 1 <= g <= ecfg.num_slots:
        raise ValueError(f"num_samples={g}: need 1..num_slots={ecfg.num_slots}")
    if np.ndim(max_new_tokens) == 0:
        max_new_tokens = [max_new_tokens or ecfg.max_new_tokens] * n
    elif len(max_new_tokens) != n:
        raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {n} prompts")
    max_new = [_per_slot(m, g, "max_new_tokens of a request") for m in max_new_tokens]
    bad = [m for ms in max_new for m in ms if not 1 <= m <= ecfg.max_new_tokens]
    if bad:
        raise ValueError(f"max_new_tokens={bad[0]}: need 1..{ecfg.max_new_tokens}")
    ids = list(range(n)) if request_ids is None else list(request_ids)
    if len(ids) != n:
        raise ValueError(f"request_ids has {len(ids)} entries for {n} prompts")
    for prompt in prompts:
        check_prompt(ecfg, prompt)
    need = [group_pages(len(p), m, ecfg.page_size, g) for p, m in zip(prompts, max_new)]
    for i, pages in enumerate(need):  # "demand": one sample's (`EpisodeLoop.add`, per shard)
        if not ecfg.demand and pages > ecfg.num_pages - 1:
            raise ValueError(
                f"request {i} needs {pages} KV pages, more than the pool ({ecfg.num_pages - 1}); "
                "raise num_pages"
            )
    return max_new, ids, need


def take_slots(free_slots: list[int], g: int, group: int, num_slots: int) -> list[int]:
    """g of the free slots for a group or part of one: an aligned block when g = `group` (the
    engine's cascade block) and one is free, else the free slots of partly used blocks first,
    keeping whole blocks for later groups."""
    free = set(free_slots)
    if group <= 1:
        return free_slots[:g]
    for b0 in range(0, num_slots, group) if g == group else ():
        if all(s in free for s in range(b0, b0 + g)):
            return list(range(b0, b0 + g))
    whole = lambda s: all(t in free for t in range(s - s % group, s - s % group + group))
    return sorted(free_slots, key=whole)[:g]
