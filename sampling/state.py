"""Sampler device state (paged KV cache + decode buffers) and the two paged attention hooks.

`DecodeState` is one `flax.struct.dataclass` of fixed-shape arrays, so the jitted engine calls can
donate it and update it in place. The KV pool is one array per layer, a tuple of L arrays
[K, P, page_size, H] (the layout of `sampling.paged_attention` and of JAX's Pallas kernels): a
kernel is handed layer l's pool as it is. A stacked [L,K,P,page_size,H] pool would have to be
sliced per layer for the kernels, a copy of the layer's whole pool every layer of every decode
step (6.4 GB per step for Qwen2.5-0.5B at 8192 pages); separate arrays cost nothing, since the
layers are a Python loop (`models.transformer`) with a static layer index.

The hooks implement `models.attention.Attend`, so the one transformer runs unchanged:
- `PagedPrefill` (B prompts of T tokens): a scatter of the prompt's k, v into its pages, then
  attention. With `paged` (the chunked prefill, `sampling.steps.prefill`) the T tokens are one
  chunk at cache positions starts + t and attend over the pages where they lie, by the online
  softmax of `sampling.paged_attention.paged_prefill_attention`: nothing larger than a chunk x a
  block of pages. Without it (prefill_chunk = 0, the reference) a fresh prompt gets dense
  causal attention over itself, as in training, and with `starts` (a multi-turn episode's new
  tokens after its cached history) the rows' pages are gathered whole after the write and the
  new tokens attend to the history by dense attention.
- `PagedDecode` (T = 1 per slot): writes the new token's k, v at position lengths[b], then paged
  attention over lengths[b] + 1 tokens. Idle slots write nothing (position -1 is dropped).

On a mesh (`state_shardings`) every layer's pool is split over the mesh axes of the parameters'
`kv_heads` (`tensor` by default), so each device caches exactly the heads its k/v projections
produce, and by pages over the batch shard axes (data, fsdp), together with the per-slot
buffers: each batch shard has its own slots and its own pool, in shard-local page ids
(`sampling.partitioned`, which says why). Both hooks run the write and the attention inside a
shard_map on the device's own slots (or prefill rows) and pages, for every backend, so nothing
of another shard is read or gathered.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from models.attention import causal_mask, dense_attention
from models.config import ModelConfig
from models.sharding import DEFAULT_RULES
from sampling import kv_quant, partitioned
from sampling.kv_quant import QuantPages
from sampling.paged_attention import (
    gather_kv,
    paged_attention,
    paged_prefill_attention,
    write_kv,
)


@struct.dataclass
class DecodeState:
    """Everything the decode loop reads and writes; B = slots, M = max_new_tokens."""

    # L x f32/bf16 [K,P,page_size,H], or with an int8 / fp8 cache L x `QuantPages` (values
    # [K,P,page_size,H] and bf16 scales [K,P,page_size], `sampling.kv_quant`)
    k_pages: tuple[jax.Array | QuantPages, ...]
    v_pages: tuple[jax.Array | QuantPages, ...]
    page_indices: jax.Array  # int32 [B,pages_per_seq]; uploaded from the host table
    lengths: jax.Array  # int32 [B] tokens in the cache
    last_token: jax.Array  # int32 [B] token fed to the next decode step (not yet cached)
    active: jax.Array  # bool [B] still generating
    num_generated: jax.Array  # int32 [B]
    max_new: jax.Array  # int32 [B] per-request max_new_tokens (<= M)
    min_new: jax.Array  # int32 [B] stop ids banned while num_generated < min_new (this stint)
    request_id: jax.Array  # int32 [B] the PRNG stream: fold_in(fold_in(root, request), sample)
    sample_id: jax.Array  # int32 [B] g in 0..G-1 within the request's group
    shared_len: jax.Array  # int32 [B] prompt tokens shared with its aligned slot block (cascade)
    stopped: jax.Array  # bool [B] finished on a stop id (else by length, once inactive)
    tokens: jax.Array  # int32 [B,M] generated tokens
    logprobs: jax.Array  # f32 [B,M] sampler log-probs of `tokens`

    @classmethod
    def zeros(
        cls,
        cfg: ModelConfig,
        num_slots,
        num_pages,
        page_size,
        pages_per_seq,
        max_new,
        dtype,
    ):
        pages = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        layers = lambda: tuple(kv_quant.zeros(pages, dtype) for _ in range(cfg.num_layers))
        b = num_slots
        i32 = lambda *s: jnp.zeros(s, jnp.int32)
        return cls(
            k_pages=layers(),
            v_pages=layers(),
            page_indices=i32(b, pages_per_seq),
            lengths=i32(b),
            last_token=i32(b),
            active=jnp.zeros((b,), bool),
            num_generated=i32(b),
            max_new=i32(b),
            min_new=i32(b),
            request_id=i32(b),
            sample_id=i32(b),
            shared_len=i32(b),
            stopped=jnp.zeros((b,), bool),
            tokens=i32(b, max_new),
            logprobs=jnp.zeros((b, max_new), jnp.float32),
        )


# The DecodeState fields split over the slots (their first axis); the pools are split by
# `sampling.partitioned.specs`, the rest ([B] and [B, ...] buffers) over the shard axes too.
def state_shardings(state, mesh, rules=DEFAULT_RULES) -> DecodeState:
    """A DecodeState of NamedShardings for `state` (arrays or shape structs) on mesh: every
    layer's pool [K,P,page_size,H] split over the KV-head axes and, by pages, over the shard
    axes; the slot buffers over the shard axes (`sampling.partitioned`)."""
    pool, slots = partitioned.specs(mesh, rules, state.k_pages[0].shape[0])

    def named(spec):
        # Trailing Nones dropped: P('tensor') is how jit spells the outputs, and a state spelled
        # P('tensor', None, None, None) by init_state would compile every call a second time.
        spec = tuple(spec)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        return NamedSharding(mesh, PartitionSpec(*spec))

    pools = {
        name: tuple(partitioned.pool_like(x, pool, named) for x in getattr(state, name))
        for name in ("k_pages", "v_pages")
    }
    rest = jax.tree.map(lambda _: named(slots), state.replace(k_pages=None, v_pages=None))
    return rest.replace(**pools)


@struct.dataclass
class PagedPrefill:
    """Prefill hook for tokens [B,T]: B prompts (the engine batches up to MAX_PREFILL_BATCH per
    shard), right-padded by `valid`. With `starts`, row b's tokens go to positions starts[b] + t
    after its cached history, and attend to that history too (a multi-turn episode's
    observation). With `layout` (mesh, rules) of a multi-device mesh the write and attention
    run per shard (`sampling.partitioned.prefill_layer`), rows laid out by shard."""

    k_pages: tuple[jax.Array, ...]  # L x [K,P,page_size,H]
    v_pages: tuple[jax.Array, ...]
    page_indices: jax.Array  # int32 [B,pages_per_seq], shard-local page ids
    valid: jax.Array  # bool [B,T]
    starts: jax.Array | None = None  # int32 [B] cached tokens before row b's first token
    paged: bool = struct.field(pytree_node=False, default=False)  # attend over the pages
    layout: tuple | None = struct.field(pytree_node=False, default=None)

    def attend(self, layer, q, k, v):
        fresh = self.starts is None
        starts = jnp.zeros(q.shape[:1], jnp.int32) if fresh else self.starts
        kp, vp = self.k_pages[layer], self.v_pages[layer]
        one = functools.partial(_prefill_local, fresh=fresh, paged=self.paged)
        args = (q, k, v, kp, vp, self.page_indices, self.valid, starts)
        if _sharded(self.layout):
            out, kp, vp = partitioned.prefill_layer(one, *args, *self.layout)
        else:
            out, kp, vp = one(*args)
        new = self.replace(
            k_pages=_set(self.k_pages, layer, kp), v_pages=_set(self.v_pages, layer, vp)
        )
        return out, new


def _prefill_local(q, k, v, kp, vp, page_indices, valid, starts, *, fresh: bool, paged: bool):
    """One prefill layer on one shard's rows and pages -> (out [B,T,N,H], kp, vp)."""
    t = valid.shape[1]
    positions = jnp.where(valid, jnp.arange(t)[None] + starts[:, None], -1)  # padding: -1
    kp, vp = write_kv(kp, vp, k, v, page_indices, positions)
    if paged:  # online softmax over the pages where they lie (a chunk of a prompt)
        return paged_prefill_attention(q, kp, vp, positions, page_indices), kp, vp
    if fresh:  # a fresh prompt attends to itself only
        # As stored: with a quantised cache the prompt's own k, v are read back as the pages
        # hold them (rows [B,T,K,H], not the pool), so a prompt prefilled densely, chunked or
        # recomputed after a preemption sees the same keys and values as decoding does.
        k, v = kv_quant.as_stored(k, kp.dtype), kv_quant.as_stored(v, vp.dtype)
        return dense_attention(q, k, v, causal_mask(valid)), kp, vp
    # History + new tokens, read back from the pages just written: query t (at position
    # starts + t) sees cache positions <= starts + t.
    keys = gather_kv(kp, page_indices)  # [B,S,K,H]
    values = gather_kv(vp, page_indices)
    s = keys.shape[1]
    mask = (jnp.arange(s)[None, None] <= positions[:, :, None]) & valid[:, :, None]
    return dense_attention(q, keys, values, mask), kp, vp  # [B,T,N,H]


@struct.dataclass
class PagedDecode:
    """Decode hook for one new token per slot: q/k/v [B,1,*,H]. With `layout` (mesh, rules) of
    a multi-device mesh the KV write and attention run per shard, every backend inside a
    shard_map (`sampling.partitioned.decode_layer`)."""

    k_pages: tuple[jax.Array, ...]  # L x [K,P,page_size,H]
    v_pages: tuple[jax.Array, ...]
    page_indices: jax.Array  # int32 [B,pages_per_seq], shard-local page ids
    lengths: jax.Array  # int32 [B] cached tokens before this step
    active: jax.Array  # bool [B]
    shared_len: jax.Array  # int32 [B] see `sampling.paged_attention.paged_attention_blockwise`
    backend: str = struct.field(pytree_node=False, default="auto")
    group: int = struct.field(pytree_node=False, default=1)
    interpret: bool = struct.field(pytree_node=False, default=False)
    layout: tuple | None = struct.field(pytree_node=False, default=None)

    def attend(self, layer, q, k, v):
        positions = jnp.where(self.active, self.lengths, -1)[:, None]  # [B,1]
        # Idle slots attend over length 0 (zeros out); their result is discarded by the caller.
        lengths = jnp.where(self.active, self.lengths + 1, 0)
        kp, vp = self.k_pages[layer], self.v_pages[layer]
        one = functools.partial(
            _decode_local, backend=self.backend, interpret=self.interpret, group=self.group
        )
        args = (q[:, 0], k, v, kp, vp, lengths, positions, self.page_indices, self.shared_len)
        if _sharded(self.layout):
            out, kp, vp = partitioned.decode_layer(one, *args, *self.layout)
        else:
            out, kp, vp = one(*args)
        new = self.replace(
            k_pages=_set(self.k_pages, layer, kp), v_pages=_set(self.v_pages, layer, vp)
        )
        return out[:, None], new


def _decode_local(
    q, k, v, kp, vp, lengths, positions, page_indices, shared_len, *, backend, interpret, group
):
    """One decode layer on one shard's slots and pages -> (out [B,N,H], kp, vp)."""
    kp, vp = write_kv(kp, vp, k, v, page_indices, positions)
    out = paged_attention(
        q, kp, vp, lengths, page_indices, backend, interpret, group=group, shared_len=shared_len
    )
    return out, kp, vp


def _sharded(layout) -> bool:
    return layout is not None and layout[0].size > 1


def _set(pages: tuple, layer: int, new) -> tuple:
    """The tuple of layer pools with layer `layer` replaced."""
    return pages[:layer] + (new,) + pages[layer + 1 :]
