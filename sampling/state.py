"""Sampler device state (paged KV cache + decode buffers), the two paged attention hooks, and
`host_values`, which reads device arrays back to the host identically on every process.

`DecodeState` is one `flax.struct.dataclass` of fixed-shape arrays, so the jitted engine calls can
donate it and update it in place. The KV pages of all layers are stacked into one array
[L, K, P, page_size, H] (per layer the layout of `sampling.paged_attention`): a hook updates layer
`l` with `.at[l].set`, which XLA performs in place on a donated buffer.

The hooks implement `models.attention.Attend`, so the one transformer runs unchanged:
- `PagedPrefill` (B prompts of T tokens): dense causal attention over the prompt itself, as in
  training, and a scatter of the prompt's k, v into its pages; nothing is read from the cache.
  With `starts` (a multi-turn episode's new tokens after its cached history) the rows' pages are
  gathered after the write and the new tokens attend to the history too.
- `PagedDecode` (T = 1 per slot): writes the new token's k, v at position lengths[b], then paged
  attention over lengths[b] + 1 tokens. Idle slots write to the null page (position -1).

On a mesh (`state_shardings`) the KV pages are split over the mesh axes of the parameters'
`kv_heads` (`tensor` by default), so each device caches exactly the heads its k/v projections
produce and the cache writes and paged attention stay local. The page pool is not split over
slots: any slot may own any page, so splitting P would need per-shard pools. The small per-slot
buffers are split over `batch` (data, fsdp) when num_slots divides, which lets GSPMD run decode
data-parallel over slots; it adds the collectives that the update of the pool (replicated over
those axes) needs. Dimensions the axes do not divide are replicated, as for parameters
(`models.sharding.logical_to_spec`). Tested on CPU with the reference attention only: a Pallas
kernel is opaque to GSPMD, so on GPU/TPU it needs a shard_map over K to stay local.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from models.attention import causal_mask, dense_attention
from models.config import ModelConfig
from models.sharding import DEFAULT_RULES, logical_to_spec
from sampling.paged_attention import gather_kv, paged_attention, write_kv


@struct.dataclass
class DecodeState:
    """Everything the decode loop reads and writes; B = slots, M = max_new_tokens."""

    k_pages: jax.Array  # f32/bf16 [L,K,P,page_size,H]
    v_pages: jax.Array  # f32/bf16 [L,K,P,page_size,H]
    page_indices: jax.Array  # int32 [B,pages_per_seq]; uploaded from the host table
    lengths: jax.Array  # int32 [B] tokens in the cache
    last_token: jax.Array  # int32 [B] token fed to the next decode step (not yet cached)
    active: jax.Array  # bool [B] still generating
    num_generated: jax.Array  # int32 [B]
    max_new: jax.Array  # int32 [B] per-request max_new_tokens (<= M)
    request_id: jax.Array  # int32 [B] the PRNG stream: fold_in(fold_in(root, request), sample)
    sample_id: jax.Array  # int32 [B] g in 0..G-1 within the request's group
    shared_len: jax.Array  # int32 [B] prompt tokens shared with its aligned slot block (cascade)
    stopped: jax.Array  # bool [B] finished on a stop id (else by length, once inactive)
    tokens: jax.Array  # int32 [B,M] generated tokens
    logprobs: jax.Array  # f32 [B,M] sampler log-probs of `tokens`

    @classmethod
    def zeros(
        cls, cfg: ModelConfig, num_slots, num_pages, page_size, pages_per_seq, max_new, dtype
    ):
        pages = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        b = num_slots
        i32 = lambda *s: jnp.zeros(s, jnp.int32)
        return cls(
            k_pages=jnp.zeros(pages, dtype),
            v_pages=jnp.zeros(pages, dtype),
            page_indices=i32(b, pages_per_seq),
            lengths=i32(b),
            last_token=i32(b),
            active=jnp.zeros((b,), bool),
            num_generated=i32(b),
            max_new=i32(b),
            request_id=i32(b),
            sample_id=i32(b),
            shared_len=i32(b),
            stopped=jnp.zeros((b,), bool),
            tokens=i32(b, max_new),
            logprobs=jnp.zeros((b, max_new), jnp.float32),
        )


def host_values(tree):
    """Numpy copies of (possibly sharded) arrays, the same on every process.

    In a multi-process run the slot buffers are spread over devices of several hosts; gathering
    them makes every process see all finish flags and so take the same scheduling decisions.
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


# Logical axes of each DecodeState field, named as in the parameters' rules table.
_PAGES = (None, "kv_heads", None, None, None)
_AXES = DecodeState(
    k_pages=_PAGES, v_pages=_PAGES, page_indices=("batch", None), lengths=("batch",),
    last_token=("batch",), active=("batch",), num_generated=("batch",), max_new=("batch",),
    request_id=("batch",), sample_id=("batch",), shared_len=("batch",), stopped=("batch",), tokens=("batch", None),
    logprobs=("batch", None),
)  # fmt: skip


def state_shardings(state, mesh, rules=DEFAULT_RULES) -> DecodeState:
    """A DecodeState of NamedShardings for `state` (arrays or shape structs) on mesh."""
    return jax.tree.map(
        lambda axes, x: NamedSharding(mesh, logical_to_spec(axes, x.shape, rules, mesh)),
        _AXES,
        state,
        is_leaf=lambda x: isinstance(x, tuple),
    )


@struct.dataclass
class PagedPrefill:
    """Prefill hook for tokens [B,T]: B prompts (the engine batches up to MAX_PREFILL_BATCH),
    right-padded by `valid`. With `starts`, row b's tokens go to positions starts[b] + t after
    its cached history, and attend to that history too (a multi-turn episode's observation)."""

    k_pages: jax.Array  # [L,K,P,page_size,H]
    v_pages: jax.Array
    page_indices: jax.Array  # int32 [B,pages_per_seq]
    valid: jax.Array  # bool [B,T]
    starts: jax.Array | None = None  # int32 [B] cached tokens before row b's first token

    def attend(self, layer, q, k, v):
        t = self.valid.shape[1]
        positions = jnp.arange(t)[None] + (0 if self.starts is None else self.starts[:, None])
        positions = jnp.where(self.valid, positions, -1)  # padding -> null page
        kp, vp = write_kv(self.k_pages, self.v_pages, k, v, self.page_indices, positions, layer)
        if self.starts is None:  # a fresh prompt attends to itself only
            return dense_attention(q, k, v, causal_mask(self.valid)), self.replace(
                k_pages=kp, v_pages=vp
            )
        # History + new tokens, read back from the pages just written: query t (at position
        # starts + t) sees cache positions <= starts + t.
        keys = gather_kv(kp[layer], self.page_indices)  # [B,S,K,H]
        values = gather_kv(vp[layer], self.page_indices)
        s = keys.shape[1]
        mask = (jnp.arange(s)[None, None] <= positions[:, :, None]) & self.valid[:, :, None]
        out = dense_attention(q, keys, values, mask)  # [B,T,N,H]
        return out, self.replace(k_pages=kp, v_pages=vp)


@struct.dataclass
class PagedDecode:
    """Decode hook for one new token per slot: q/k/v [B,1,*,H]."""

    k_pages: jax.Array  # [L,K,P,page_size,H]
    v_pages: jax.Array
    page_indices: jax.Array  # int32 [B,pages_per_seq]
    lengths: jax.Array  # int32 [B] cached tokens before this step
    active: jax.Array  # bool [B]
    shared_len: jax.Array  # int32 [B] see `sampling.paged_attention.paged_attention_blockwise`
    backend: str = struct.field(pytree_node=False, default="auto")
    group: int = struct.field(pytree_node=False, default=1)

    def attend(self, layer, q, k, v):
        positions = jnp.where(self.active, self.lengths, -1)[:, None]  # [B,1]
        kp, vp = write_kv(self.k_pages, self.v_pages, k, v, self.page_indices, positions, layer)
        # Idle slots attend over length 0 (zeros out); their result is discarded by the caller.
        lengths = jnp.where(self.active, self.lengths + 1, 0)
        out = paged_attention(
            q[:, 0], kp, vp, lengths, self.page_indices, self.backend, layer=layer,
            group=self.group, shared_len=self.shared_len,
        )  # fmt: skip
        return out[:, None], self.replace(k_pages=kp, v_pages=vp)
