"""Paged KV cache writes and single-query (decode) paged attention: a pure-JAX reference, a
blockwise pure-JAX version, a C++ kernel for CPU, and dispatch to JAX's Pallas GPU and TPU kernels.

Layout per layer (the layout of both Pallas kernels, so no transposes on the hot path):
  k_pages, v_pages  [K, P, page_size, H]   P pages in the pool, page 0 the null page
  page_indices      int32[B, pages_per_seq] token p of sequence b lives in page
                    page_indices[b, p // page_size], slot p % page_size; 0 = no page
  lengths           int32[B]                tokens in the cache per sequence; 0 = idle slot

Conventions all backends share, so that results agree with `models.attention.dense_attention`:
- scores are scaled by H**-0.5. Neither Pallas kernel scales (checked in jax 0.10.2), so the
  dispatcher scales q before the call; the reference gets the scale from dense_attention.
- a sequence of length 0 yields zeros (what both kernels produce; the reference matches them).
- masked positions, including pages past `lengths` inside a compute block, are read but get zero
  weight; the TPU kernel masks by adding a large negative number, so every page, including the
  null page, must hold finite values. Pages start zeroed and only ever receive k/v, so they do.

Backend notes (jax 0.10.2):
- cpu_kernel (what "auto" picks on CPU): `sampling.cpu_attention`, a C++ kernel through the XLA
  FFI that reads the pages in place. At 256 sequences (bench-small shape) it takes about half the
  blockwise backend's time. It is built on first use; without a C++ compiler "auto" falls back
  to blockwise, and it is not used when the pages are sharded over devices.
- blockwise (the portable fallback: what "auto" picks for sharded pages on every platform and
  for page shapes the Pallas kernels cannot lower, e.g. head_dim 64 on TPU): flash-decoding in
  plain JAX. A `lax.fori_loop` walks the page table in blocks of `pages_per_block` pages,
  gathers only that block of K and V, and keeps an online softmax (running max, sum, output). Its
  trip count is dynamic, so a batch of short sequences reads only the pages it has, and the whole
  cache is never materialised (the reference's [B,S,K,H] gather is a fresh buffer per layer and
  step). Three things measured on a 2-core CPU at 256 sequences decide its speed: a block is one
  1-D gather of page rows from the pool viewed as [(L*K*P), page_size*H] (about 1.4x faster than
  indexing the 4-D pool), each layer's pool is its own array (`sampling.state`: a slice of a
  stacked pool feeding a loop is copied every step), and the cascade: slots on an aligned block
  of G samples read their shared prompt pages once, with all G*R query rows at once.
- pallas_tpu is what "auto" picks on TPU for head_dim % 128 == 0 (see `resolve_backend`). Exporting for TPU from a CPU host runs the real Mosaic lowering: head_dim
  128 and 256 lower, 32, 64, 96 and 192 do not (tests/sampling/test_tpu_export.py). The kernel
  rounds K and V to bfloat16 (its page loader casts to bf16 whatever the cache dtype), while q
  and the softmax stay in f32. An f32 cache therefore gets bf16 attention on TPU; a bf16 cache,
  the intended use, loses nothing.
- Neither Pallas kernel (nor the C++ one) is partitioned by GSPMD: on a multi-device mesh JAX
  refuses to lower the TPU kernel outside a shard_map. The decode hook runs them inside one
  (`sampling.partitioned`), over the KV heads and the slots.
- pallas_gpu runs `pl.dot` at default precision, which Triton lowers to TF32 for f32 operands:
  expect ~1e-3 differences on real GPUs with an f32 cache (interpret mode on CPU is exact).
  Its grid splits the pages of a sequence into `k_splits` partitions, each processed in blocks
  of `pages_per_compute_block` pages, and its q heads per KV head are padded to block_h = 16.
  The Triton lowering (which also runs when exporting for CUDA from a CPU host) needs H and
  page_size to be powers of two, and Triton's dot needs blocks of >= 16 keys, so "auto" uses it
  for H and page_size powers of two >= 16, on one device or a mesh; pages_per_seq may be any
  number.

Quantised KV (cache dtype int8 or float8_e4m3fn, `sampling.kv_quant`): a layer's pool is a
`QuantPages` (values [K,P,page_size,H], bf16 scales [K,P,page_size]); `write_kv` quantises the
new rows, and every backend that takes it reads the values in place and dequantises a block at
a time: blockwise (scales folded into scores and probabilities, `_online_softmax`), the
reference (the sequences' gathered rows) and pallas_gpu (the kernel's own k/v_scales_pages).
pallas_tpu cannot (its scales must be broadcast to the pages' shape, a float pool-sized copy
per layer; no fp8) and cpu_kernel reads f32 only: "auto" gives a quantised cache "blockwise"
on TPU and CPU, and either refuses one when asked by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.attention import dense_attention
from sampling import cpu_attention
from sampling.kv_quant import (
    SCALE_DTYPE,
    QuantPages,
    dequantize,
    is_quantized,
    quantize,
    to_bits,
    widen,
)

# Logical axes of a layer's pool [K,P,page_size,H], named as in the parameters' rules table:
# each device caches the heads its k/v projections produce (`sampling.state.state_shardings`).
PAGE_AXES = ("kv_heads", None, None, None)
BACKENDS = ("auto", "reference", "blockwise", "cpu_kernel", "pallas_gpu", "pallas_tpu")


def write_kv(k_pages, v_pages, k, v, page_indices, positions):
    """Scatters k, v [B,T,K,H] into one layer's pages [K,P,page_size,H] at sequence positions
    int32[B,T]. positions < 0 are padding (or an idle slot) and are not written. Positions must
    be < pages_per_seq * page_size. Returns (k_pages, v_pages); callers donate the old pages so
    the update is in place.

    One scatter per array with unique indices: a position < 0 is sent to page P, out of bounds,
    and dropped, so no two rows write the same place (the valid ones write their own sequence's
    private pages: shared prompt pages are full and never written). K and V stay two scatters:
    one would need a combined K|V pool, which JAX's Pallas kernels do not read. A quantised
    pool (`sampling.kv_quant.QuantPages`) gets the rows quantised, values and scales scattered
    at the same places.
    """
    page_size, num_pages = k_pages.shape[-2], k_pages.shape[-3]
    valid = positions >= 0  # [B,T]
    pos = jnp.where(valid, positions, 0)
    page = jnp.take_along_axis(page_indices, pos // page_size, axis=1)  # [B,T]
    page = jnp.where(valid, page, num_pages)  # out of bounds: dropped
    slot = jnp.where(valid, pos % page_size, 0)
    # Advanced indices page/slot [B,T] on axes 1, 2 select [K,B,T,H]; k/v must match that.
    k, v = jnp.transpose(k, (2, 0, 1, 3)), jnp.transpose(v, (2, 0, 1, 3))
    index = (slice(None), page, slot)
    return _put(k_pages, k, index), _put(v_pages, v, index)


def _put(pages, x, index):
    """pages with rows x [K,B,T,H] set at index (K, page [B,T], slot [B,T]); out of bounds
    dropped."""
    put = dict(mode="drop", unique_indices=True)
    if isinstance(pages, QuantPages):
        values, scales = quantize(x, pages.dtype)  # [K,B,T,H], [K,B,T]
        # The new rows as the pool stores them (bits: `sampling.kv_quant`), scattered in place.
        return pages.replace(
            values=pages.values.at[index].set(to_bits(values), **put),
            scales=pages.scales.at[index].set(to_bits(scales), **put),
        )
    return pages.at[index].set(x.astype(pages.dtype), **put)


def gather_kv(pages, page_indices):
    """The cache of each sequence as a dense array: [K,P,page_size,H] -> [B,S,K,H].

    S = pages_per_seq * page_size; positions past a sequence's length hold whatever the pages
    hold (null page or stale tokens) and must be masked by the caller. A quantised pool's rows
    are dequantised (float32) after the gather: the sequences' rows, not the pool.
    """
    kh, _, page_size, h = pages.shape
    b, pages_per_seq = page_indices.shape
    if isinstance(pages, QuantPages):
        values, scales = pages.values[:, page_indices], pages.scales[:, page_indices]
        x = dequantize(values, scales, kind=pages.dtype)
    else:
        x = pages[:, page_indices]  # [K,B,pages_per_seq,page_size,H]
    x = jnp.transpose(x, (1, 2, 3, 0, 4))  # [B,pages_per_seq,page_size,K,H]
    return x.reshape(b, pages_per_seq * page_size, kh, h)


def paged_attention_reference(q, k_pages, v_pages, lengths, page_indices):
    """Decode attention by gathering pages: q [B,N,H] -> [B,N,H]. The oracle the other
    backends are tested against (backend="reference").

    Gathers each sequence's pages into a dense [B,S,K,H] and calls the model's dense_attention,
    so there is one attention formula (GQA, H**-0.5, f32 softmax) in the code base. The gather
    materialises the whole cache per step: fine for tests, slow for real decoding. It computes in
    f32 whatever the cache dtype, as the kernels do: on a bf16 cache it is the exact attention
    over the bf16-rounded K and V.
    """
    f32 = lambda x: x.astype(jnp.float32)
    k = f32(gather_kv(k_pages, page_indices))  # [B,S,K,H]
    v = f32(gather_kv(v_pages, page_indices))
    s = k.shape[1]
    mask = jnp.arange(s)[None, :] < lengths[:, None]  # [B,S]
    out = dense_attention(f32(q)[:, None], k, v, mask[:, None, :])[:, 0]  # [B,N,H]
    return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)


def paged_attention_blockwise(
    q, k_pages, v_pages, lengths, page_indices, pages_per_block=2, group=1, shared_len=None
):
    """Decode attention by an online softmax over blocks of pages: q [B,N,H] -> [B,N,H].

    Same result as `paged_attention_reference` (f32 softmax, zeros for length 0) to rounding;
    see the module docstring for why it exists. Pages are one layer's [K,P,page_size,H], read in
    place.

    Cascade (group > 1, B a multiple of it): slot b's first shared_len[b] tokens int32[B] (a
    page multiple; 0 = none) are a prompt it shares with the other slots of its aligned block
    b // group that have the same shared_len, with the same first pages in the table. Each
    block's shared pages are read once, against all of the block's group * R query rows at
    once, and every row then continues the same online softmax over its own pages only.
    """
    b, n, h = q.shape
    kh, num_pages, page_size, _ = k_pages.shape
    r = n // kh
    pool = _page_rows(k_pages, v_pages)
    qg = q.reshape(b, kh, r, h).astype(jnp.float32) * h**-0.5  # [B,K,R,H]
    m0 = jnp.full((b, kh, r), -jnp.inf, jnp.float32)
    carry = (m0, jnp.zeros_like(m0), jnp.zeros((b, kh, r, h), jnp.float32))
    start = jnp.zeros((b,), jnp.int32)  # first page of each row's own part
    if group > 1:
        carry = _shared_prefix(qg, pool, page_indices, shared_len, group, carry, pages_per_block)
        start = shared_len // page_size
    stop = jnp.broadcast_to(lengths[:, None], (b, r))
    _, l, acc = _online_softmax(qg, pool, page_indices, start, stop, carry, pages_per_block)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # length 0: acc = 0, so zeros
    return out.reshape(b, n, h).astype(q.dtype)


def paged_prefill_attention(q, k_pages, v_pages, positions, page_indices, keys_per_block=512):
    """Prefill attention over the pages: queries q [B,T,N,H] at cache positions int32[B,T]
    (< 0: padding, output 0) attend causally to cache positions <= their own, read from one
    layer's pages [K,P,page_size,H], which already hold them (the caller writes the chunk
    first). -> [B,T,N,H].

    The online softmax of `paged_attention_blockwise` with every query row carrying its own stop
    (position + 1): blocks of about `keys_per_block` keys are gathered one at a time, so the
    largest intermediate is [B,K,T*R,block] scores, a chunk by a block of pages, and no row's
    history is ever gathered whole. The trip count is the chunk's last position over the block
    size: a chunk reads the pages up to its own end.
    """
    b, t, n, h = q.shape
    kh, num_pages, page_size, _ = k_pages.shape
    r = n // kh
    pool = _page_rows(k_pages, v_pages)
    qg = q.astype(jnp.float32).reshape(b, t, kh, r, h) * h**-0.5
    qg = jnp.transpose(qg, (0, 2, 1, 3, 4)).reshape(b, kh, t * r, h)  # [B,K,T*R,H], row t*R+r
    stop = jnp.repeat(jnp.maximum(positions + 1, 0), r, axis=1)  # [B,T*R]; padding: 0
    m0 = jnp.full((b, kh, t * r), -jnp.inf, jnp.float32)
    carry = (m0, jnp.zeros_like(m0), jnp.zeros((b, kh, t * r, h), jnp.float32))
    start = jnp.zeros((b,), jnp.int32)
    pages_per_block = max(1, keys_per_block // page_size)
    _, l, acc = _online_softmax(qg, pool, page_indices, start, stop, carry, pages_per_block, True)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B,K,T*R,H]
    out = jnp.transpose(out.reshape(b, kh, t, r, h), (0, 2, 1, 3, 4))
    return out.reshape(b, t, n, h).astype(q.dtype)


def _page_rows(k_pages, v_pages):
    """The pool as `_online_softmax` reads it: (k rows, v rows, first row of each kv head, k
    scale rows, v scale rows, cache dtype), rows [(K*P), page_size*H] (scales [(K*P),
    page_size], None for an unquantised pool). Reshapes and bitcasts of the pool: no copy."""

    def rows(pages):
        if isinstance(pages, QuantPages):  # stored bits: each block widened (`widen`)
            kh, p, s, h = pages.shape
            return pages.values.reshape(kh * p, s * h), pages.scales.reshape(kh * p, s)
        pages = jnp.asarray(pages)  # numpy can't take tracers
        kh, p, s, h = pages.shape
        return pages.reshape(kh * p, s * h), None

    (k, ks), (v, vs) = rows(k_pages), rows(v_pages)
    kh, num_pages = k_pages.shape[:2]
    return k, v, jnp.arange(kh) * num_pages, ks, vs, k_pages.dtype


def _shared_prefix(qg, pool, page_indices, shared_len, group, carry, pages_per_block):
    """The cascade's first pass: each aligned block of `group` slots attends over its shared
    pages with all its query rows together; returns the online-softmax carry per slot."""
    b, kh, r, h = qg.shape
    g = b // group

    def to_blocks(x):  # [B,K,R,...] -> [G',K,group*R,...]
        x = x.reshape(g, group, kh, r, *x.shape[3:])
        return jnp.moveaxis(x, 1, 2).reshape(g, kh, group * r, *x.shape[4:])

    def from_blocks(x):
        x = x.reshape(g, kh, group, r, *x.shape[3:])
        return jnp.moveaxis(x, 2, 1).reshape(b, kh, r, *x.shape[4:])

    sl = shared_len.reshape(g, group)
    leader = jnp.arange(g) * group + jnp.argmax(sl, axis=1)  # a slot holding the shared pages
    stop = jnp.repeat(sl, r, axis=1)  # [G',group*R]: rows outside the prefix attend to nothing
    start = jnp.zeros((g,), jnp.int32)
    carry = tuple(to_blocks(x) for x in carry)
    carry = _online_softmax(
        to_blocks(qg), pool, page_indices[leader], start, stop, carry, pages_per_block
    )
    return tuple(from_blocks(x) for x in carry)


def _online_softmax(qg, pool, table, start, stop, carry, pages_per_block, peel=False):
    """Continues an online softmax of queries qg [X,K,M,H] over the pages table[x, start[x]:],
    which hold tokens start[x]*page_size .. stop[x,m]-1 for query row m; carry is the running
    max and sum [X,K,M] and the unnormalised output [X,K,M,H].

    peel: the first block runs before the loop, whose carry then starts as that block's result,
    not as the caller's constants (the prefill's, whose carry is a chunk's: [X,K,T*R,H]). XLA
    merges every layer's identical zero carry into one constant and copies it for each layer's
    loop to update in place, and XLA:CPU's scheduler made all those copies at once, before the
    first layer (a 0.5B prefill of 16 rows x a 512-token chunk: 22 x 28 MiB live at its peak).
    The decode's carry is a token's; it keeps one copy of the block's code per layer.

    `pool` is (k rows, v rows, first row of each kv head, k scale rows, v scale rows, the
    cache dtype; `_page_rows`): the pool
    viewed as one page per row [(K*P), page_size*H], so a block's pages are one gather with a
    1-D index, which XLA:CPU copies several times faster than a multi-dimensional page gather.
    A quantised pool (scale rows not None) is read as stored: the block's values are widened
    to f32 and its scales folded into the scores (K) and the probabilities (V), per key, so
    no dequantised copy of anything larger than a block is made.
    """
    k_rows, v_rows, head_base, k_scales, v_scales, dtype = pool
    x, kh, _, h = qg.shape
    page_size = k_rows.shape[1] // h
    s_blk = pages_per_block * page_size
    # Padding with the null page lets every block be a full one; its positions are masked.
    table = jnp.pad(table, ((0, 0), (0, pages_per_block)))
    last = table.shape[1] - pages_per_block

    def block(i, carry):
        m, l, acc = carry
        first = start + i * pages_per_block  # [X]
        idx = jax.vmap(lambda t, f: jax.lax.dynamic_slice_in_dim(t, f, pages_per_block))(
            table, jnp.minimum(first, last)
        )  # [X,p]; clamped rows have no valid positions left
        rows = (idx[:, None, :] + head_base[None, :, None]).reshape(-1)  # [X*K*p]
        # Table entries are pages of the pool, so in bounds: no clamping or fill per element.
        k = k_rows.at[rows].get(mode="promise_in_bounds").reshape(x, kh, s_blk, h)
        v = v_rows.at[rows].get(mode="promise_in_bounds").reshape(x, kh, s_blk, h)
        k, v = widen(k, dtype), widen(v, dtype)
        s = jnp.einsum("XKMH,XKSH->XKMS", qg, k)
        if k_scales is not None:  # key j's scale multiplies its score
            ks = k_scales.at[rows].get(mode="promise_in_bounds").reshape(x, kh, 1, s_blk)
            s = s * widen(ks, SCALE_DTYPE)
        pos = first[:, None] * page_size + jnp.arange(s_blk)  # [X,S]
        valid = pos[:, None, :] < stop[:, :, None]  # [X,M,S]
        s = jnp.where(valid[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        # A row with nothing valid yet keeps m = -inf; shifting by 0 then gives exp(-inf) = 0
        # instead of exp(nan).
        shift = jnp.where(m_new > -jnp.inf, m_new, 0.0)
        p = jnp.exp(s - shift[..., None])  # [X,K,M,S]
        scale = jnp.exp(m - shift)
        pv = p
        if v_scales is not None:  # value j's scale multiplies its weight
            vs = v_scales.at[rows].get(mode="promise_in_bounds").reshape(x, kh, 1, s_blk)
            pv = p * widen(vs, SCALE_DTYPE)
        acc = acc * scale[..., None] + jnp.einsum("XKMS,XKSH->XKMH", pv, v)
        return m_new, l * scale + p.sum(-1), acc

    todo = jnp.maximum(stop.max(1) - start * page_size, 0)
    trips = (jnp.max(todo, initial=0) + s_blk - 1) // s_blk
    if not peel:
        return jax.lax.fori_loop(0, trips, block, carry)
    # A block with nothing left to read changes no carry, so running the first one when trips
    # is 0 is exact: its probabilities are 0, and its rescale is 1 (a carry with a finite max)
    # or multiplies a zero sum and output (a fresh one: max -inf).
    return jax.lax.fori_loop(1, trips, block, block(0, carry))


def _largest_divisor(n: int, candidates) -> int:
    return next(c for c in candidates if n % c == 0)


def _paged_attention_gpu(q, k_pages, v_pages, lengths, page_indices, interpret):
    # Imported on use, like an optional dependency: a run needs one platform's kernel at most.
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_pa

    pages_per_seq, page_size = page_indices.shape[1], k_pages.shape[2]
    # k_splits partitions must tile the page list and compute blocks must tile a partition. The
    # most splits gives the most parallelism over a sequence, but a block of
    # block_k = pages_per_compute_block * page_size keys must stay >= 16 (Triton's dot minimum)
    # and a power of two (Triton's arange; so page_size should be one too).
    fits = [
        s for s in (16, 8, 4, 2) if pages_per_seq % s == 0 and pages_per_seq // s * page_size >= 16
    ]
    k_splits = fits[0] if fits else 1
    per_block = _largest_divisor(pages_per_seq // k_splits, (8, 4, 2, 1))
    # The kernel does not scale the scores. q is cast to the cache dtype so that Triton's dot
    # sees matching operand dtypes, as the kernel assumes without quantisation scales. With
    # them (a QuantPages pool) the kernel widens each block of int8 / fp8 pages to q's dtype
    # itself and multiplies the scores by the keys' scales and the probabilities by the
    # values' (its k_scales_pages / v_scales_pages [K,P,page_size], our layout): q stays in
    # the compute dtype.
    scales = {}
    if isinstance(k_pages, QuantPages):  # the stored bits as fp8 / bf16: bitcasts
        (k_pages, ks), (v_pages, vs) = k_pages.logical(), v_pages.logical()
        scales = dict(k_scales_pages=ks, v_scales_pages=vs)
        qs = (q.astype(jnp.float32) * q.shape[-1] ** -0.5).astype(q.dtype)
    else:
        qs = (q.astype(jnp.float32) * q.shape[-1] ** -0.5).astype(k_pages.dtype)
    out = gpu_pa.paged_attention(
        qs,
        k_pages,
        v_pages,
        page_indices,
        lengths,
        k_splits=k_splits,
        pages_per_compute_block=per_block,
        interpret=interpret,
        **scales,
    )
    return out.astype(q.dtype)


def _paged_attention_tpu(q, k_pages, v_pages, lengths, page_indices, interpret):
    # Imported on use, like an optional dependency: a run needs one platform's kernel at most.
    import contextlib

    if isinstance(k_pages, QuantPages):
        raise ValueError(
            f"backend 'pallas_tpu' cannot read a {k_pages.dtype} KV cache in place: JAX's TPU "
            "kernel takes int8 pages only with scales broadcast to the pages' own shape "
            "[K,P,page_size,H] (a full-size float copy of the pool per layer), and no fp8; "
            "use backend 'blockwise' (what 'auto' picks for a quantised cache on TPU)"
        )

    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import paged_attention as tpu_pa

    per_block = _largest_divisor(page_indices.shape[1], (16, 8, 4, 2, 1))
    # The kernel computes q.k in f32 whatever q's dtype, so scaling in f32 loses nothing.
    qs = q.astype(jnp.float32) * q.shape[-1] ** -0.5
    # The interpret mode applies to kernels traced under it: this call's, under any jit.
    mode = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with mode:
        out = tpu_pa.paged_attention(
            qs, k_pages, v_pages, lengths, page_indices, pages_per_compute_block=per_block
        )
    return out.astype(q.dtype)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


KERNELS = ("cpu_kernel", "pallas_gpu", "pallas_tpu")  # opaque to GSPMD: run in shard_map


def resolve_backend(
    backend: str = "auto",
    sharded: bool = False,
    dtype="float32",
    head_dim: int | None = None,
    page_size: int | None = None,
    platform: str | None = None,
) -> str:
    """The backend to run: `backend` as given, or for "auto" the fastest one that lowers here.

    `platform` is where the attention runs ("cpu", "gpu", "tpu"; default jax.default_backend(),
    the engine passes its mesh's), `sharded` whether the KV state spans several devices, `dtype`
    the cache dtype, `head_dim` and `page_size` the page shape. "auto" picks
    - tpu: "pallas_tpu" when head_dim % 128 == 0. Mosaic needs a block's last dim divisible by
      128 or equal to the array's, and the kernel gives its softmax max/sum outputs [..., 1]
      q's block spec, last dim H: head_dim 64 (Qwen2.5-0.5B, Llama-3.2-1B) fails. A quantised
      cache (int8, float8_e4m3fn) gets "blockwise": JAX's TPU kernel takes int8 pages only
      with their scales broadcast to [K,P,page_size,H] (the size of the pool again, in a
      float dtype, per layer and step) and no fp8 at all;
    - gpu: "pallas_gpu" when head_dim and page_size are powers of two >= 16 (Triton loads only
      power-of-two blocks; its dot needs >= 16 per dimension), quantised caches included (the
      kernel reads int8 / fp8 pages with per-(token, head) scales);
    - cpu: "cpu_kernel" on one device with an f32 cache, if the kernel builds (it reads f32
      pages only: a quantised cache gets "blockwise"). On a mesh of
      fake CPU devices (the tests) "blockwise": its GSPMD path is what the suite exercises;
    - otherwise "blockwise", which lowers for every shape and mesh. Unknown shapes (None) get it.
    On a mesh the kernels run inside a shard_map (`sampling.partitioned`), so `sharded` no
    longer rules them out on accelerators.
    """
    if backend not in BACKENDS:
        raise ValueError(f"paged attention backend={backend!r}: must be one of {BACKENDS}")
    if backend != "auto":
        return backend
    platform = platform or jax.default_backend()
    platform = "gpu" if platform in ("cuda", "rocm") else platform  # jax.export's spellings
    if platform == "tpu":
        fits = head_dim is not None and head_dim % 128 == 0 and not is_quantized(dtype)
        return "pallas_tpu" if fits else "blockwise"
    if platform == "gpu":
        fits = head_dim is not None and page_size is not None
        fits = fits and head_dim >= 16 and _pow2(head_dim) and page_size >= 16 and _pow2(page_size)
        return "pallas_gpu" if fits else "blockwise"
    if (
        platform == "cpu"
        and not sharded
        and jnp.dtype(dtype) == jnp.float32
        and cpu_attention.available()
    ):
        return "cpu_kernel"
    return "blockwise"


def paged_attention(
    q,
    k_pages,
    v_pages,
    lengths,
    page_indices,
    backend: str = "auto",
    interpret: bool = False,
    group: int = 1,
    shared_len=None,
):
    """Decode attention, one query per sequence: q [B,N,H] -> [B,N,H] (see module docstring).

    Pages are one layer's [K,P,page_size,H], read in place by every backend. `group` and
    `shared_len` describe prompts shared by aligned blocks of slots (see
    `paged_attention_blockwise`); only the blockwise backend uses them to read shared pages
    once, the others read every row's table as it is, which gives the same result.
    interpret=True runs the Pallas kernels in interpret mode (works on CPU, for tests): the GPU
    kernel's own flag, the TPU kernel under `pltpu.force_tpu_interpret_mode()`.
    """
    backend = resolve_backend(
        backend, dtype=k_pages.dtype, head_dim=k_pages.shape[-1], page_size=k_pages.shape[-2]
    )
    kh = k_pages.shape[0]
    if q.shape[1] % kh:
        raise ValueError(f"query heads N={q.shape[1]} not a multiple of kv heads K={kh}")
    if backend == "cpu_kernel":
        return cpu_attention.paged_attention_cpu(q, k_pages, v_pages, lengths, page_indices)
    if backend == "blockwise":
        return paged_attention_blockwise(
            q, k_pages, v_pages, lengths, page_indices, group=group, shared_len=shared_len
        )
    if backend == "reference":
        return paged_attention_reference(q, k_pages, v_pages, lengths, page_indices)
    lengths = lengths.astype(jnp.int32)  # both kernels insist on int32
    page_indices = page_indices.astype(jnp.int32)
    if backend == "pallas_gpu":
        return _paged_attention_gpu(q, k_pages, v_pages, lengths, page_indices, interpret)
    return _paged_attention_tpu(q, k_pages, v_pages, lengths, page_indices, interpret)
