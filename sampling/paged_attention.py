"""Paged KV cache writes and single-query (decode) paged attention: a pure-JAX reference, a
blockwise pure-JAX version for CPU, and dispatch to JAX's Pallas GPU and TPU kernels.

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
- blockwise (what "auto" picks on CPU): flash-decoding in plain JAX. A `lax.fori_loop` walks the
  page table in blocks of `pages_per_block` pages, gathers only that block of K and V, and keeps
  an online softmax (running max, sum, output). Its trip count is dynamic, ceil(max(lengths) /
  block), so a batch of short sequences reads only the pages it has, and the whole cache is never
  materialised: the reference's [B,S,K,H] gather is a fresh buffer per layer and step, which on
  CPU costs more than the attention math. Measured on a 2-core CPU at 256 sequences (bench-small
  shape, pages_per_seq 12): 0.45x the reference's time at half length and 0.7x at full length;
  2 pages of 16 (32 keys) per block was the fastest block, 6+ pages lose the gain. The einsum
  letter order below (q [B,K,R,H] against blocks [K,B,S,H]) was also the fastest of the layouts
  tried, by about 1.5x: XLA:CPU runs these tiny batched matmuls very differently by layout.
- pallas_tpu rounds K and V to bfloat16 inside the kernel (its page loader casts to bf16
  whatever the cache dtype), while q and the softmax stay in f32. An f32 cache therefore gets
  bf16 attention on TPU; a bf16 cache, the intended use, loses nothing.
- pallas_gpu runs `pl.dot` at default precision, which Triton lowers to TF32 for f32 operands:
  expect ~1e-3 differences on real GPUs with an f32 cache (interpret mode on CPU is exact).
  Its grid splits the pages of a sequence into `k_splits` partitions, each processed in blocks
  of `pages_per_compute_block` pages, and its q heads per KV head are padded to block_h = 16.
  On real GPUs page_size and pages_per_seq should be powers of two and H a power of two >= 16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.attention import dense_attention

BACKENDS = ("auto", "reference", "blockwise", "pallas_gpu", "pallas_tpu")


def write_kv(k_pages, v_pages, k, v, page_indices, positions, layer=None):
    """Scatters k, v [B,T,K,H] into the pages at sequence positions int32[B,T].

    Pages are one layer's [K,P,page_size,H], or with `layer` the stacked [L,K,P,page_size,H] of all
    layers, written in place at that layer (slicing a layer out and setting it back would copy the
    whole layer every decode step). positions < 0 are padding and go to the null page (slot 0),
    which no valid length covers as a real token. Positions must be < pages_per_seq * page_size.
    Returns (k_pages, v_pages); callers donate the old pages so the update is in place.
    """
    page_size = k_pages.shape[-2]
    valid = positions >= 0  # [B,T]
    pos = jnp.where(valid, positions, 0)
    page = jnp.take_along_axis(page_indices, pos // page_size, axis=1)  # [B,T]
    page = jnp.where(valid, page, 0)
    slot = jnp.where(valid, pos % page_size, 0)
    if layer is None:
        # Advanced indices page/slot [B,T] on axes 1, 2 select [K,B,T,H]; k/v must match that.
        k, v = jnp.transpose(k, (2, 0, 1, 3)), jnp.transpose(v, (2, 0, 1, 3))
        index = (slice(None), page, slot)
    else:
        # The scalar layer and page/slot are split by ':', so NumPy rules put the broadcast
        # index dims first: the update is laid out [B,T,K,H], which is k/v as given.
        index = (layer, slice(None), page, slot)
    k_pages = k_pages.at[index].set(k.astype(k_pages.dtype))
    v_pages = v_pages.at[index].set(v.astype(v_pages.dtype))
    return k_pages, v_pages


def gather_kv(pages, page_indices):
    """The cache of each sequence as a dense array: [K,P,page_size,H] -> [B,S,K,H].

    S = pages_per_seq * page_size; positions past a sequence's length hold whatever the pages
    hold (null page or stale tokens) and must be masked by the caller.
    """
    kh, _, page_size, h = pages.shape
    b, pages_per_seq = page_indices.shape
    x = pages[:, page_indices]  # [K,B,pages_per_seq,page_size,H]
    x = jnp.transpose(x, (1, 2, 3, 0, 4))  # [B,pages_per_seq,page_size,K,H]
    return x.reshape(b, pages_per_seq * page_size, kh, h)


def paged_attention_reference(q, k_pages, v_pages, lengths, page_indices):
    """Decode attention by gathering pages: q [B,N,H] -> [B,N,H]. The CPU path and the oracle.

    Gathers each sequence's pages into a dense [B,S,K,H] and calls the model's dense_attention,
    so there is one attention formula (GQA, H**-0.5, f32 softmax) in the code base. The gather
    materialises the whole cache per step, which is fine on CPU and for tests.
    """
    k = gather_kv(k_pages, page_indices)  # [B,S,K,H]
    v = gather_kv(v_pages, page_indices)
    s = k.shape[1]
    mask = jnp.arange(s)[None, :] < lengths[:, None]  # [B,S]
    out = dense_attention(q[:, None], k, v, mask[:, None, :])[:, 0]  # [B,N,H]
    return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)


def paged_attention_blockwise(q, k_pages, v_pages, lengths, page_indices, pages_per_block=2):
    """Decode attention by an online softmax over blocks of pages: q [B,N,H] -> [B,N,H].

    Same result as `paged_attention_reference` (f32 softmax, zeros for length 0) to rounding;
    see the module docstring for why it exists.
    """
    k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)  # numpy can't take tracers
    b, n, h = q.shape
    kh, _, page_size, _ = k_pages.shape
    r = n // kh
    num_blocks = -(-page_indices.shape[1] // pages_per_block)
    # Padding with the null page lets every block be a full one; positions past `lengths` are
    # masked anyway.
    table = jnp.pad(
        page_indices, ((0, 0), (0, num_blocks * pages_per_block - page_indices.shape[1]))
    )
    s_blk = pages_per_block * page_size
    qg = q.reshape(b, kh, r, h).astype(jnp.float32) * h**-0.5  # [B,K,R,H]

    def block(i, carry):
        m, l, acc = carry  # running max and sum [B,K,R], unnormalised output [B,K,R,H]
        idx = jax.lax.dynamic_slice_in_dim(table, i * pages_per_block, pages_per_block, 1)
        k = k_pages[:, idx].reshape(kh, b, s_blk, h).astype(jnp.float32)  # [K,B,S,H]
        v = v_pages[:, idx].reshape(kh, b, s_blk, h).astype(jnp.float32)
        s = jnp.einsum("BKRH,KBSH->BKRS", qg, k)
        valid = (i * s_blk + jnp.arange(s_blk))[None] < lengths[:, None]  # [B,S]
        s = jnp.where(valid[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        # A row with nothing valid yet keeps m = -inf; shifting by 0 then gives exp(-inf) = 0
        # instead of exp(nan).
        shift = jnp.where(m_new > -jnp.inf, m_new, 0.0)
        p = jnp.exp(s - shift[..., None])  # [B,K,R,S]
        scale = jnp.exp(m - shift)
        acc = acc * scale[..., None] + jnp.einsum("BKRS,KBSH->BKRH", p, v)
        return m_new, l * scale + p.sum(-1), acc

    m0 = jnp.full((b, kh, r), -jnp.inf, jnp.float32)
    init = (m0, jnp.zeros_like(m0), jnp.zeros((b, kh, r, h), jnp.float32))
    trips = (jnp.max(lengths, initial=0) + s_blk - 1) // s_blk
    _, l, acc = jax.lax.fori_loop(0, trips, block, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # length 0: acc = 0, so zeros
    return out.reshape(b, n, h).astype(q.dtype)


def _largest_divisor(n: int, candidates) -> int:
    return next(c for c in candidates if n % c == 0)


def _paged_attention_gpu(q, k_pages, v_pages, lengths, page_indices, interpret):
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
    # sees matching operand dtypes, as the kernel assumes without quantisation scales.
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
    )
    return out.astype(q.dtype)


def _paged_attention_tpu(q, k_pages, v_pages, lengths, page_indices):
    from jax.experimental.pallas.ops.tpu import paged_attention as tpu_pa

    per_block = _largest_divisor(page_indices.shape[1], (16, 8, 4, 2, 1))
    # The kernel computes q.k in f32 whatever q's dtype, so scaling in f32 loses nothing.
    qs = q.astype(jnp.float32) * q.shape[-1] ** -0.5
    out = tpu_pa.paged_attention(
        qs, k_pages, v_pages, lengths, page_indices, pages_per_compute_block=per_block
    )
    return out.astype(q.dtype)


def resolve_backend(backend: str = "auto") -> str:
    """ "auto" -> the kernel for jax.default_backend() (tpu, gpu), else "blockwise"."""
    if backend not in BACKENDS:
        raise ValueError(f"paged attention backend={backend!r}: must be one of {BACKENDS}")
    if backend == "auto":
        return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "blockwise")
    return backend


def paged_attention(
    q, k_pages, v_pages, lengths, page_indices, backend: str = "auto", interpret: bool = False
):
    """Decode attention, one query per sequence: q [B,N,H] -> [B,N,H] (see module docstring).

    interpret=True runs the Pallas GPU kernel in interpret mode (works on CPU, for tests). The
    TPU kernel is interpreted on CPU by wrapping the call in `pltpu.force_tpu_interpret_mode()`.
    """
    backend = resolve_backend(backend)
    if q.shape[1] % k_pages.shape[0]:
        raise ValueError(
            f"query heads N={q.shape[1]} not a multiple of kv heads K={k_pages.shape[0]}"
        )
    if backend == "reference":
        return paged_attention_reference(q, k_pages, v_pages, lengths, page_indices)
    if backend == "blockwise":
        return paged_attention_blockwise(q, k_pages, v_pages, lengths, page_indices)
    lengths = lengths.astype(jnp.int32)  # both kernels insist on int32
    page_indices = page_indices.astype(jnp.int32)
    if backend == "pallas_gpu":
        return _paged_attention_gpu(q, k_pages, v_pages, lengths, page_indices, interpret)
    return _paged_attention_tpu(q, k_pages, v_pages, lengths, page_indices)
