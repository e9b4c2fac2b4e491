"""One decode layer's KV write and attention kernel on a device mesh, inside `jax.shard_map`, as
MaxText and tpu-inference run their paged attention.

Why: GSPMD cannot partition a custom call. JAX refuses to lower a Mosaic (TPU) kernel in a
multi-device jit outside a shard_map, and it would run a Triton (GPU) or FFI (CPU) call on
gathered, replicated operands. Inside the shard_map every device runs the kernel on what it holds:
- the pool of its KV heads: a layer's pool [K,P,page_size,H] is split over the mesh axes of
  `kv_heads` (`sampling.state.state_shardings`), and the query heads N = R*K alike, so query
  head n stays on the device of its kv head n // R;
- the slots of its batch shard: q, lengths and page-table rows are split over the axes of
  `batch` when the state's slot buffers are.
The pool is not split over slots (any slot may own any page), so the devices of one KV-head group
each hold the whole pool of those heads, and the copies must stay equal. Before writing, each
device all-gathers the new token's k, v, positions and page-table rows over the batch axes (B x K
x H per layer: tiny next to the pool) and writes every slot's token, as GSPMD does for the
reference path; then it reads only its own slots' pages.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from models.sharding import logical_to_spec
from sampling.paged_attention import PAGE_AXES, paged_attention, write_kv


def _axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry (None, a name or a tuple of names) as a tuple of mesh axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def decode_layer(
    q, k, v, k_pages, v_pages, lengths, positions, page_indices, backend: str, interpret: bool,
    mesh, rules,
):  # fmt: skip
    """Writes the new token's k, v [B,1,K,H] at positions int32[B,1] (-1: none) into one layer's
    pages [K,P,page_size,H], then decode attention of q [B,N,H] over lengths int32[B] tokens.
    Returns (out [B,N,H], k_pages, v_pages), laid out as they came in."""
    heads = _axes(logical_to_spec(PAGE_AXES, k_pages.shape, rules, mesh)[0])
    rows = _axes(logical_to_spec(("batch",), lengths.shape, rules, mesh)[0])
    rows = tuple(a for a in rows if a not in heads)
    h, b = _entry(heads), _entry(rows)
    pool = P(h, None, None, None)

    def local(q, k, v, k_pages, v_pages, lengths, positions, page_indices):
        every = lambda x: jax.lax.all_gather(x, rows, axis=0, tiled=True) if rows else x
        k_pages, v_pages = write_kv(
            k_pages, v_pages, every(k), every(v), every(page_indices), every(positions)
        )
        out = paged_attention(q, k_pages, v_pages, lengths, page_indices, backend, interpret)
        return out, k_pages, v_pages

    new = P(b, None, h, None)  # k, v [B,1,K,H]
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(b, h, None), new, new, pool, pool, P(b), P(b, None), P(b, None)),
        out_specs=(P(b, h, None), pool, pool),
        check_vma=False,  # the kernels are opaque: their outputs carry no varying-axes info
    )(q, k, v, k_pages, v_pages, lengths, positions, page_indices)
