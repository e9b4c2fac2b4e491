"""Blockwise (flash) causal self-attention in pure JAX: memory linear in T, on every platform.

The learner's attention over packed rows without a [T,T] array: queries and keys are cut into
blocks of `block_q` and `block_k` rows, and an online softmax runs over the key blocks of each
query block (Rabe & Staats 2021; Dao et al. 2022). The backward pass is flash attention's: a
`jax.custom_vjp` keeps only q, k, v, the segment ids, the output and the log-sum-exp of each query
row, and recomputes each block's scores; D = rowsum(dO * O) stands in for the softmax Jacobian.

- Masking is `block_mask`, the model's one rule (`models.attention.causal_mask` is its one-block
  case): query i sees key j iff j <= i (by index), both are of the same segment and the key is
  not padding (segment 0). A padding query sees nothing: its output is 0 and it sends no gradient.
- Blocks entirely above the diagonal are never visited (the key loop of query block i stops at
  the diagonal, the query loop of key block j starts there). Blocks with no visible pair (other
  segments of a packed row) are computed and masked: a `lax.cond` on them would need a predicate
  over the whole batch, which on a mesh is an all-reduce in every block iteration.
- GQA without repeating K/V: q is viewed as [B,K,R,T,H] (R = N/K query heads per KV head) and
  k, v as [B,K,T,H]; in this head-major layout every block product is a batched matmul.
- T need not be a block multiple: q and k/v are padded (segment 0) to their block multiples
  and the results sliced back. Blocks are clamped to T, so short rows are one block.
- Arithmetic is f32 inside (scores, softmax statistics, accumulators); the result is in q's dtype.

Loops are `lax.fori_loop`s with dynamic bounds (while loops): the temporaries are a few
[B,K,R,bq,bk] blocks and O(T) buffers (fwd+bwd, B=1 N=14 K=2 H=64 f32, XLA CPU temp bytes:
T=4096 dense 2716 MiB, blockwise 39 MiB; T=16384: 43122 MiB vs 136 MiB). The price is compile time,
about 1-2 s more per attention layer on CPU. This is the portable path; the accelerator kernels
(splash, Pallas GPU) are in `models.attention_kernels`, tested against the same dense reference
(`models.attention.dense_attention`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from models.order import after

BLOCK = 128  # default block_q and block_k (see blockwise_attention)
F32 = jnp.float32


def block_mask(seg_q, seg_k, q_start=0, k_start=0):
    """bool [B,Q,S]: query q_start+a sees key k_start+c. seg_q int [B,Q], seg_k int [B,S] segment
    ids (1, 2, ... per sequence, 0 = padding)."""
    qi = q_start + jnp.arange(seg_q.shape[1])
    kj = k_start + jnp.arange(seg_k.shape[1])
    causal = qi[:, None] >= kj[None, :]  # [Q,S]
    same = seg_q[:, :, None] == seg_k[:, None, :]  # [B,Q,S]
    return causal[None] & same & (seg_k[:, None, :] > 0)


def blockwise_attention(q, k, v, segments, block_q: int = BLOCK, block_k: int = BLOCK):
    """Causal self-attention of packed rows. q [B,T,N,H], k/v [B,T,K,H], segments int [B,T]
    (or bool [B,T]: one sequence per row) -> [B,T,N,H] in q's dtype."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    # Head-major inside: every block product is then a plain batched matmul over (B, K).
    qh = q.reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4)  # [B,K,R,T,H]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B,K,T,H]
    bq, bk = min(block_q, t), min(block_k, t)
    out = _flash(qh, kt, vt, segments.astype(jnp.int32), bq, bk)  # [B,K,R,T,H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _pad(x, block: int, axis: int):
    """x padded with zeros along axis to a multiple of block (zero segment ids = padding)."""
    extra = -x.shape[axis] % block
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _slice(x, start, size: int, axis: int):
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _scores(qi, kj, mask):
    """Scaled scores f32 [B,K,R,Q,S] of qi f32 [B,K,R,Q,H] and kj f32 [B,K,S,H], -inf where the
    mask bool [B,Q,S] hides the key."""
    s = jnp.einsum("BKRQH,BKSH->BKRQS", qi, kj) * (qi.shape[-1] ** -0.5)
    return jnp.where(mask[:, None, None], s, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, seg, bq: int, bk: int):
    return _forward(q, k, v, seg, bq, bk)[0]


def _forward(q, k, v, seg, bq: int, bk: int):
    """q [B,K,R,T,H], k/v [B,K,T,H] -> out [B,K,R,T,H] in q's dtype and lse f32 [B,K,R,T] (0
    where a query sees no key)."""
    b, kh, r, t, h = q.shape
    qp, sq = _pad(q, bq, 3), _pad(seg, bq, 1)  # [B,K,R,Tq,H], [B,Tq]
    kp, vp, sk = _pad(k, bk, 2), _pad(v, bk, 2), _pad(seg, bk, 1)  # [B,K,Tk,H], [B,Tk]
    nq, nk = qp.shape[3] // bq, kp.shape[2] // bk

    def q_block(i, bufs):
        i0 = i * bq
        qi = _slice(qp, i0, bq, 3).astype(F32)  # [B,K,R,bq,H]
        si = _slice(sq, i0, bq, 1)  # [B,bq]

        def k_block(j, stats):
            j0 = j * bk
            kj, vj = _slice(kp, j0, bk, 2).astype(F32), _slice(vp, j0, bk, 2).astype(F32)
            mask = block_mask(si, _slice(sk, j0, bk, 1), i0, j0)  # [B,bq,bk]

            def update(stats):
                m, l, acc = stats  # [B,K,R,bq], [B,K,R,bq], [B,K,R,bq,H]
                s = _scores(qi, kj, mask)  # [B,K,R,bq,bk]
                m_new = jnp.maximum(m, s.max(-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no inf - inf
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                pv = jnp.einsum("BKRQS,BKSH->BKRQH", p, vj)
                return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

            return update(stats)

        init = (
            jnp.full((b, kh, r, bq), -jnp.inf, F32),
            jnp.zeros((b, kh, r, bq), F32),
            jnp.zeros((b, kh, r, bq, h), F32),
        )
        last = jnp.minimum(nk, ((i + 1) * bq + bk - 1) // bk)  # key blocks up to the diagonal
        m, l, acc = lax.fori_loop(0, last, k_block, init)
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        o = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)  # [B,K,R,bq,H]
        lse = jnp.where(seen, m + jnp.log(l_safe), 0.0)  # [B,K,R,bq]
        out, lse_all = bufs
        out = lax.dynamic_update_slice_in_dim(out, o.astype(q.dtype), i0, 3)
        return out, lax.dynamic_update_slice_in_dim(lse_all, lse, i0, 3)

    # made once q is (`after`): from constants alone, XLA:CPU made every layer's at the start
    bufs = after((jnp.zeros(qp.shape, q.dtype), jnp.zeros(qp.shape[:4], F32)), qp)
    out, lse = lax.fori_loop(0, nq, q_block, bufs)
    return out[:, :, :, :t], lse[..., :t]


def _flash_fwd(q, k, v, seg, bq: int, bk: int):
    out, lse = _forward(q, k, v, seg, bq, bk)
    return out, (q, k, v, seg, out, lse)


def _flash_bwd(bq: int, bk: int, res, dout):
    """dq, dk, dv: one pass over key blocks, each visiting the query blocks from the diagonal on;
    dk/dv of the key block accumulate in the loop, dq in a [B,K,R,Tq,H] f32 buffer."""
    q, k, v, seg, out, lse = res
    t, h = q.shape[3], q.shape[4]
    delta = jnp.einsum("BKRTH,BKRTH->BKRT", dout.astype(F32), out.astype(F32))  # D [B,K,R,T]
    qp, dop, sq = _pad(q, bq, 3), _pad(dout, bq, 3), _pad(seg, bq, 1)
    lsep, deltap = _pad(lse, bq, 3), _pad(delta, bq, 3)  # [B,K,R,Tq]
    kp, vp, sk = _pad(k, bk, 2), _pad(v, bk, 2), _pad(seg, bk, 1)
    nq, nk = qp.shape[3] // bq, kp.shape[2] // bk
    scale = h**-0.5

    def k_block(j, bufs):
        j0 = j * bk
        kj, vj = _slice(kp, j0, bk, 2).astype(F32), _slice(vp, j0, bk, 2).astype(F32)
        sj = _slice(sk, j0, bk, 1)  # [B,bk]

        def q_block(i, acc):
            dq, dkj, dvj = acc
            i0 = i * bq
            qi, doi = _slice(qp, i0, bq, 3).astype(F32), _slice(dop, i0, bq, 3).astype(F32)
            lse_i, delta_i = _slice(lsep, i0, bq, 3), _slice(deltap, i0, bq, 3)  # [B,K,R,bq]
            mask = block_mask(_slice(sq, i0, bq, 1), sj, i0, j0)  # [B,bq,bk]

            def update(_):
                p = jnp.exp(_scores(qi, kj, mask) - lse_i[..., None])  # [B,K,R,bq,bk]
                dp = jnp.einsum("BKRQH,BKSH->BKRQS", doi, vj)
                ds = p * (dp - delta_i[..., None]) * scale
                return (
                    jnp.einsum("BKRQS,BKSH->BKRQH", ds, kj),  # dq of the block
                    jnp.einsum("BKRQS,BKRQH->BKSH", ds, qi),  # dk
                    jnp.einsum("BKRQS,BKRQH->BKSH", p, doi),  # dv
                )

            dqi, dk_add, dv_add = update(None)
            dq = lax.dynamic_update_slice_in_dim(dq, _slice(dq, i0, bq, 3) + dqi, i0, 3)
            return dq, dkj + dk_add, dvj + dv_add

        dq, dk, dv = bufs
        zero = jnp.zeros(kj.shape, F32)
        dq, dkj, dvj = lax.fori_loop((j * bk) // bq, nq, q_block, (dq, zero, zero))
        dk = lax.dynamic_update_slice_in_dim(dk, dkj, j0, 2)
        dv = lax.dynamic_update_slice_in_dim(dv, dvj, j0, 2)
        return dq, dk, dv

    bufs = (jnp.zeros(qp.shape, F32), jnp.zeros(kp.shape, F32), jnp.zeros(kp.shape, F32))
    dq, dk, dv = lax.fori_loop(0, nk, k_block, after(bufs, dop))  # once dout is, as above
    cut = lambda x, like, axis: lax.slice_in_dim(x, 0, t, axis=axis).astype(like.dtype)
    return cut(dq, q, 3), cut(dk, k, 2), cut(dv, v, 2), None  # no cotangent for segment ids


_flash.defvjp(_flash_fwd, _flash_bwd)
