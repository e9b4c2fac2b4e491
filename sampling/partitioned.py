"""The sampler's layout on a device mesh: per-shard page pools, and every touch of the pool (the
KV write, the paged attention of decode and prefill, the page copies of an insert) inside a
`jax.shard_map`, so that each device reads and writes only the pages it holds.

The slots and the page pool are split together over the *shard axes*: the mesh axes of the
`batch` rule (data, fsdp by default), less those that split the KV heads. With S shards (the
product of their sizes), shard i holds slots [i*B/S, (i+1)*B/S) and its own pool of P/S pages,
in the rows [i*P/S, (i+1)*P/S) of every layer's [K,P,page_size,H]. Page tables hold shard-local
page ids (0..P/S-1, local page 0 that shard's null page): a request lives on one shard for its
whole life (`sampling.engine`), so nothing a shard decodes needs another shard's pages. The KV
heads are split over the axes of `kv_heads` (tensor), as the k/v projections produce them, and
the query heads N = R*K alike, so query head n stays on the device of its kv head n // R.

Why a shard_map for every backend, the pure-JAX ones included: GSPMD cannot partition a Pallas
or FFI custom call at all (JAX refuses to lower a Mosaic kernel in a multi-device jit outside a
shard_map), and it partitions a gather from a pool sharded over heads or pages as a masked local
gather plus an all-reduce of every gathered block, inside the page loop. Inside the shard_map
the page loop is local by construction: no collective, for any mesh. Rows that a device call
feeds to the pool (decode slots, prefill rows, page copies) come laid out by shard, row r of R
rows on shard r // (R/S), so the shard_map splits them by the same axes as the pool.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping

import jax
from jax.sharding import PartitionSpec as P

from models.sharding import logical_to_spec, spec_axes, spec_entry
from sampling.kv_quant import QuantPages


class _Sizes:
    """A stand-in mesh for `logical_to_spec`, which only reads `mesh.shape`."""

    def __init__(self, shape: Mapping[str, int]):
        self.shape = collections.defaultdict(lambda: 1, shape)  # a missing axis has size 1


def head_axes(shape: Mapping[str, int], rules, kv_heads: int) -> tuple[str, ...]:
    """The mesh axes (sizes `shape`, e.g. dict(mesh.shape)) that split the KV heads."""
    return spec_axes(logical_to_spec(("kv_heads",), (kv_heads,), rules, _Sizes(shape))[0])


def shard_axes(shape: Mapping[str, int], rules, kv_heads: int) -> tuple[str, ...]:
    """The mesh axes that split the slots and the page pool (module docstring): the `batch`
    rule's axes of size > 1, less the KV-head axes."""
    table = {name: spec_axes(target) for name, target in rules}
    heads = head_axes(shape, rules, kv_heads)
    return tuple(a for a in table.get("batch", ()) if shape.get(a, 1) > 1 and a not in heads)


def num_shards(shape: Mapping[str, int], rules, kv_heads: int) -> int:
    """S, the number of slot / page-pool shards of a mesh of sizes `shape`."""
    return math.prod(shape[a] for a in shard_axes(shape, rules, kv_heads))


def specs(mesh, rules, kv_heads: int) -> tuple[P, P]:
    """(pool spec of a layer's [K,P,page_size,H], slot spec of a [B, ...] buffer's first axis)."""
    shape = dict(mesh.shape)
    h, b = (
        spec_entry(head_axes(shape, rules, kv_heads)),
        spec_entry(shard_axes(shape, rules, kv_heads)),
    )
    return P(h, b, None, None), P(b)


def pool_like(pages, pool: P, wrap=lambda spec: spec):
    """The spec tree of one layer's pool `pages` from the spec `pool` of a [K,P,page_size,H]
    array: `wrap(pool)`, or for a quantised pool (`sampling.kv_quant.QuantPages`) the values
    on `pool` and their scales [K,P,page_size] on its first three entries: each device holds
    the scales of exactly the pages it holds."""
    if isinstance(pages, QuantPages):
        return pages.replace(values=wrap(pool), scales=wrap(P(*tuple(pool)[:3])))
    return wrap(pool)


def _local(mesh, rules, kv_heads):
    pool, slots = specs(mesh, rules, kv_heads)
    return pool[0], slots[0], pool


def decode_layer(
    write_attend,
    q,
    k,
    v,
    k_pages,
    v_pages,
    lengths,
    positions,
    page_indices,
    shared_len,
    mesh,
    rules,
):
    """`write_attend(q, k, v, k_pages, v_pages, lengths, positions, page_indices, shared_len)`,
    one decode layer's KV write and attention (`sampling.state.PagedDecode`), on each device's
    slots and pages: q [B,N,H], k, v [B,1,K,H], positions int32[B,1], the rest int32[B] or
    [B,pages_per_seq]. Returns (out [B,N,H], k_pages, v_pages), laid out as they came in."""
    h, b, pool = _local(mesh, rules, k_pages.shape[0])
    new = P(b, None, h, None)  # k, v [B,1,K,H]
    kp, vp = pool_like(k_pages, pool), pool_like(v_pages, pool)
    return jax.shard_map(
        write_attend,
        mesh=mesh,
        in_specs=(P(b, h, None), new, new, kp, vp, P(b), P(b, None), P(b, None), P(b)),
        out_specs=(P(b, h, None), kp, vp),
        check_vma=False,  # the kernels are opaque: their outputs carry no varying-axes info
    )(q, k, v, k_pages, v_pages, lengths, positions, page_indices, shared_len)


def prefill_layer(
    write_attend, q, k, v, k_pages, v_pages, page_indices, valid, starts, mesh, rules
):
    """`write_attend(q, k, v, k_pages, v_pages, page_indices, valid, starts)`, one prefill
    layer's KV write and attention (`sampling.state.PagedPrefill`), on each device's rows and
    pages: q [B,T,N,H], k, v [B,T,K,H], valid [B,T], starts int32[B] (zeros for fresh prompts).
    Returns (out [B,T,N,H], k_pages, v_pages)."""
    h, b, pool = _local(mesh, rules, k_pages.shape[0])
    heads = P(b, None, h, None)
    kp, vp = pool_like(k_pages, pool), pool_like(v_pages, pool)
    return jax.shard_map(
        write_attend,
        mesh=mesh,
        in_specs=(heads, heads, heads, kp, vp, P(b, None), P(b, None), P(b)),
        out_specs=(heads, kp, vp),
        check_vma=False,
    )(q, k, v, k_pages, v_pages, page_indices, valid, starts)


def copy_pages(pages: tuple, src, dst, mesh, rules) -> tuple:
    """Each layer's pool with pages src -> dst int32[S*C] copied (shard i's copies in rows
    [i*C, (i+1)*C), local ids; (0, 0) a no-op: the null page onto itself). A quantised pool's
    scales are copied with its values (both have the page axis second)."""
    h, b, pool = _local(mesh, rules, pages[0].shape[0])

    def local(pages, src, dst):
        return jax.tree.map(lambda x: x.at[:, dst].set(x[:, src]), pages)

    spec = tuple(pool_like(x, pool) for x in pages)
    return jax.shard_map(
        local, mesh=mesh, in_specs=(spec, P(b), P(b)), out_specs=spec, check_vma=False
    )(pages, src, dst)
