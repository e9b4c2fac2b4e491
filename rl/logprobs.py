"""Teacher-forced log-probabilities of given tokens, computed in chunks of the sequence.

The learner, the reference model and the sampler-vs-learner checks all use this one function. It
runs the transformer trunk once, then projects to the vocabulary a chunk of `chunk` positions at a
time inside a `lax.scan`: only one f32 [B, chunk, V] logits block exists at a time, never the whole
[B, T, V]. The backward pass is written out (`_chunked_projection`, a custom VJP): it recomputes
each chunk's logits from the saved hidden states, so it does not keep every chunk's logits alive
either, and
- the [D,V] matrix is cast to the compute dtype in its own sharding and gathered (in that
  dtype) once per pass, outside the loop over chunks, and its gradient is summed over the chunks
  in f32, in one accumulator per device holding that device's rows' partial sum ([S,D,V] with S
  split over the row shards), a vocabulary slice at a time (`_accumulate`: a chunk's f32 [D,V]
  gradient never exists whole beside the accumulator), reduced over the devices once at the end
  (in `grad_reduce_dtype`, `models.transformer.weight_grads_in`);
- the gathered matrix and the accumulator are made once the trunk's output (forward) or the
  scores' cotangent (backward) is (`models.order.after`), as the blocks' remat is ordered:
  made from parameters and constants alone, XLA:CPU made them before layer 0 and kept them
  across the trunk (Qwen2.5-7B shape: 6.1 GiB of f32 [D,V] buffers at 512 tokens a device). Differentiating through the scan instead, as before, summed
  the gradient across chunks in the compute dtype (bf16: 64 chunks moved it by 1.6e-2 of its
  largest entry, `tests/rl/test_logprobs.py`), and on a mesh put an all-gather of the matrix and
  an all-reduce of its gradient in every chunk (256 of each for a 32k-token row). It was one
  accumulator, not one buffer per chunk, in XLA's buffer assignment, then and now.

On a mesh, `rows` pins the hidden states to the batch's row sharding. Without it GSPMD, seeing
rows sharded over fsdp and the [D,V] projection sharded over fsdp on D, contracted over the
sharded D instead: every device gathered all rows and held the f32 [B,chunk,V] logits of the
whole global batch (all-reduced, then sliced), and propagated the same all-rows layout back into
the trunk's activations. With it every device projects its own rows with the gathered matrix, as
FSDP means. XLA CPU, Qwen2.5-0.5B shape, bf16, remat, blockwise attention, fsdp=8, one row
of 4096 tokens per device: temporaries per device of the train step 22.0 -> 11.2 GiB, of the
log-prob pass 2.77 -> 2.29 GiB. (With dense attention the train step goes 63.3 -> 52.9 GiB but
the log-prob pass 2.87 -> 4.55 GiB: one row's [T,T] scores plus every layer's gathered f32
weights, which XLA CPU all-gathered up front, outweigh the all-rows activations it held before.)
With the blocks' ordered remat (`models.transformer.remat`) and this projection: train step
3.04 GiB, log-prob pass 1.28 GiB at 4096 tokens; 10.43 and 3.85 GiB at 32,768
(docs/performance.md). The peak at 4096 tokens was this backward pass: XLA:CPU held the gathered
matrix in f32 (its dots upcast bf16) and in both layouts, one chunk's f32 [V,D] gradient and the
accumulator, 519 MiB each, whatever T; compiled as an accelerator gets it (`launch.estimate`)
the bf16 matrix, the accumulator and one vocabulary slice remain. At 32,768 tokens a layer's MLP
backward is the peak.

Position t of the outputs scores token t+1 given tokens[:, :t+1]. Two distributions are scored:
- `logp`: the sampling distribution (`sampling.distribution.log_probs`: temperature, top-k,
  top-p, and the stop ids banned where `stop_masked` says the sampler banned them), exactly what the
  sampler drew from. Importance ratios (π/π_old, π_old/sampler) compare these: they are the
  probabilities of the actions actually taken.
- `full`: the tempered full softmax (no top-k / top-p / ban). The KL to the reference model and the
  entropy are measured on it, as in TRL and verl: a truncated reference would give sampled tokens
  outside its own top-p set probability 0 (k1, k2 infinite, k3 without gradient), and the policy
  being regularised is the network's distribution, not its sampler's truncation.
Without truncation or bans the two are the same array.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.order import after
from models.sharding import spec_axes
from models.transformer import weight_grad_dtype
from sampling.distribution import (
    SamplingParams,
    banned_stop_ids,
    entropy,
    log_probs,
    tempered_log_probs,
)

VOCAB_TILES = 8  # slices of the vocabulary the projection's gradient is accumulated in


class TokenLogprobs(NamedTuple):
    logp: jax.Array  # f32 [B,T-1] sampling-distribution log-prob of tokens[:, 1:]
    full: jax.Array  # f32 [B,T-1] tempered full-softmax log-prob of tokens[:, 1:]
    entropy: jax.Array  # f32 [B,T-1] entropy of the tempered full softmax
    # With `stats` on an MoE model: the experts each token used int [B,T,L_moe,k], and the
    # routers' models.moe.RouterStats over the real tokens ([L_moe, E], [L_moe] sums; rl.router)
    routes: jax.Array | None = None
    router: object = None


def token_logprobs(
    model,
    tokens,
    positions,
    valid,
    sampling: SamplingParams,
    chunk: int = 128,
    stop_ids: tuple[int, ...] = (),
    stop_masked=None,
    rows=None,
    unembed_sharding=None,
    routes=None,
    stats: bool = False,
) -> TokenLogprobs:
    """Log-probs of tokens[:, 1:] given their prefixes (see the module docstring).

    tokens, positions: int32 [B,T]; valid: bool [B,T] real tokens, or int32 [B,T] segment ids of
    packed rows (0 = padding; attention stays within a sequence); stop_masked: bool [B,T-1] where
    the sampler banned `stop_ids` (min_new_tokens), or None; rows: the Sharding of [B,...] rows
    on a mesh, or None; unembed_sharding: the Sharding of the unembedding's master weights on
    that mesh, where they are cast to the compute dtype before they are gathered (see the module
    docstring); routes: int [B,T,L_moe,k] each token's experts in an MoE model (routing replay,
    `models.transformer.Transformer.hidden`), or None; stats: also the experts used and the
    routers' statistics (`TokenLogprobs.routes`, `.router`; an MoE model). Values at positions
    whose target is padding are finite but meaningless; the caller masks them.
    """
    h, _, *routing = model.hidden(
        tokens, positions, valid, routes=routes, record=stats, stats=stats
    )

    if rows is not None:
        h = jax.lax.with_sharding_constraint(h, rows)
    h, targets = h[:, :-1], tokens[:, 1:]  # predict t+1 from t
    b, t = targets.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    early = jnp.zeros((b, t), bool) if stop_masked is None else stop_masked
    early = jnp.pad(early, ((0, 0), (0, pad)))
    w, letters = model.unembedding()  # f32 master weights, "VD" or "DV"
    to_chunks = lambda x: x.reshape(b, n, c, *x.shape[2:]).swapaxes(0, 1)  # [n,B,c,...]
    same = not sampling.truncates and stop_masked is None
    vocab = w.shape[letters.index("V")]

    def scores(logits, tgt_c, early_c):
        """f32 logits [B,c,V] -> (logp, full, entropy) [B,c]."""
        pick = lambda lp: jnp.take_along_axis(lp, tgt_c[..., None], axis=-1)[..., 0]
        full = tempered_log_probs(logits, sampling.temperature)  # [B,c,V]
        if same:
            return pick(full), pick(full), entropy(full)
        banned = None if stop_masked is None else banned_stop_ids(early_c, stop_ids, vocab)
        lp = log_probs(logits, sampling, banned, keep=tgt_c)  # [B,c,V]
        return pick(lp), pick(full), entropy(full)

    project = _chunked_projection(scores, letters, h.dtype, rows, unembed_sharding)
    out = project(to_chunks(h), w, to_chunks(targets), to_chunks(early))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return TokenLogprobs(*(unchunk(x) for x in out), *routing)


def _chunked_projection(scores, letters: str, dtype, rows, w_sharding=None):
    """(h [n,B,c,D], w [D,V] or [V,D] f32 master, targets, early [n,B,c]) -> scores of each chunk
    [n,B,c] x3, with the backward pass written out (see the module docstring)."""
    spec = f"BCD,{letters}->BCV"
    mesh = getattr(rows, "mesh", None)
    axes = spec_axes(rows.spec[0] if rows is not None else None)
    shards = math.prod(mesh.shape[a] for a in axes) if mesh is not None else 1
    grad_dtype = weight_grad_dtype(jnp.float32) or jnp.float32  # its sum across devices

    def matrix(w, ref):
        """The master weights in the compute dtype, once ref (the trunk's output or the
        cotangent of the scores) is computed; cast in their own sharding, then gathered once
        (replicated), on a mesh."""
        w = after(w, ref).astype(dtype)
        if mesh is None:
            return w
        if w_sharding is not None:
            w = jax.lax.with_sharding_constraint(w, w_sharding)
        return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))

    def logits(h_c, w):  # [B,c,V] in f32, as `Transformer.logits` (the sampler's)
        return jnp.einsum(spec, h_c, w, preferred_element_type=jnp.float32)

    @jax.custom_vjp
    def project(h, w, targets, early):
        wc = matrix(w, h[0])
        body = lambda _, xs: (None, scores(logits(xs[0], wc), *xs[1:]))
        return jax.lax.scan(body, None, (h, targets, early))[1]

    def fwd(h, w, targets, early):
        return project(h, w, targets, early), (h, w, targets, early)

    def bwd(saved, ct):
        h, w, targets, early = saved
        ref = ct[0][0]  # [B,c] the first chunk's cotangent of logp: made after the forward pass
        wc = matrix(w, ref)
        split = lambda x: x.reshape(shards, -1, *x.shape[1:])  # [S,B/S,...]: S row shards

        def body(dw, xs):
            h_c, tgt_c, early_c, ct_c = xs
            _, vjp = jax.vjp(lambda z: scores(z, tgt_c, early_c), logits(h_c, wc))
            dz = vjp(ct_c)[0].astype(dtype)  # [B,c,V], as the transpose of the f32 cast rounds
            dh = jnp.einsum(f"BCV,{letters}->BCD", dz, wc)
            return _accumulate(dw, split(h_c), split(dz), letters, mesh, axes), dh

        dw0 = _on_rows(after(jnp.zeros((shards, *w.shape), jnp.float32), ref), mesh, axes)
        dw, dh = jax.lax.scan(body, dw0, (h, targets, early, ct))
        if grad_dtype != jnp.float32:  # summed over the row shards in it (jnp.sum would upcast)
            dw = jax.lax.reduce(dw.astype(grad_dtype), jnp.zeros((), grad_dtype), jax.lax.add, (0,))
        else:
            dw = dw.sum(0)
        return dh, dw.astype(w.dtype), None, None

    project.defvjp(fwd, bwd)
    return project


def _accumulate(dw, h_c, dz, letters: str, mesh, axes):
    """dw [S,D,V] or [S,V,D] (f32) + this chunk's gradient from h_c [S,B/S,c,D] and dz
    [S,B/S,c,V], VOCAB_TILES slices of the vocabulary at a time, each added in place: only one
    slice of the chunk's f32 gradient exists at once, not the whole [D,V] beside the
    accumulator (7B shape: 0.25 instead of 2.03 GiB). The sums are the same dot products."""
    vocab, v_axis = dz.shape[-1], 1 + letters.index("V")
    tiles = VOCAB_TILES if vocab % VOCAB_TILES == 0 else 1
    size = vocab // tiles

    def tile(j, dw):
        dz_j = jax.lax.dynamic_slice_in_dim(dz, j * size, size, axis=dz.ndim - 1)
        part = jnp.einsum(f"SBCD,SBCV->S{letters}", h_c, dz_j, preferred_element_type=jnp.float32)
        at = [0] * dw.ndim
        at[v_axis] = j * size
        now = jax.lax.dynamic_slice(dw, at, part.shape)
        return _on_rows(jax.lax.dynamic_update_slice(dw, now + part, at), mesh, axes)

    return jax.lax.fori_loop(0, tiles, tile, dw)


def _on_rows(x, mesh, axes):
    """x [S,...] with S split over the row axes (each device's own partial sum), on a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(axes or None)))
