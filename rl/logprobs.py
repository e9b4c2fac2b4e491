"""Teacher-forced log-probabilities of given tokens, computed in chunks of the sequence.

The learner, the reference model and the sampler-vs-learner checks all use this one function. It
runs the transformer trunk once, then projects to the vocabulary a chunk of `chunk` positions at a
time inside a `lax.scan`: only one f32 [B, chunk, V] logits block exists at a time, never the whole
[B, T, V]. The chunk body is rematerialised (`jax.checkpoint`), so the backward pass does not keep
every chunk's logits alive either: it recomputes them from the saved hidden states.

On a mesh, `rows` pins the hidden states to the batch's row sharding. Without it GSPMD, seeing
rows sharded over fsdp and the [D,V] projection sharded over fsdp on D, contracted over the
sharded D instead: every device gathered all rows and held the f32 [B,chunk,V] logits of the
whole global batch (all-reduced, then sliced), and propagated the same all-rows layout back into
the trunk's activations. With it every device projects its own rows with the gathered matrix, as
FSDP means. XLA CPU, Qwen2.5-0.5B shape, bf16, remat, blockwise attention, fsdp=8, one row
of 4096 tokens per device: temporaries per device of the train step 22.0 -> 11.2 GiB, of the
log-prob pass 2.77 -> 2.29 GiB. (With dense attention the train step goes 63.3 -> 52.9 GiB but
the log-prob pass 2.87 -> 4.55 GiB: one row's [T,T] scores plus every layer's gathered f32
weights, which XLA CPU all-gathers up front, outweigh the all-rows activations it held before.)

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

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sampling.distribution import (
    SamplingParams,
    banned_stop_ids,
    entropy,
    log_probs,
    tempered_log_probs,
)


class TokenLogprobs(NamedTuple):
    logp: jax.Array  # f32 [B,T-1] sampling-distribution log-prob of tokens[:, 1:]
    full: jax.Array  # f32 [B,T-1] tempered full-softmax log-prob of tokens[:, 1:]
    entropy: jax.Array  # f32 [B,T-1] entropy of the tempered full softmax


def token_logprobs(
    model, tokens, positions, valid, sampling: SamplingParams, chunk: int = 128,
    stop_ids: tuple[int, ...] = (), stop_masked=None, rows=None,
) -> TokenLogprobs:  # fmt: skip
    """Log-probs of tokens[:, 1:] given their prefixes (see the module docstring).

    tokens, positions: int32 [B,T]; valid: bool [B,T] real tokens, or int32 [B,T] segment ids of
    packed rows (0 = padding; attention stays within a sequence); stop_masked: bool [B,T-1] where
    the sampler banned `stop_ids` (min_new_tokens), or None; rows: the Sharding of [B,...] rows
    on a mesh, or None (see the module docstring). Values at positions whose target is padding
    are finite but meaningless; the caller masks them.
    """
    h, _ = model.hidden(tokens, positions, valid)  # [B,T,D]
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
    w = model.unembed_matrix()  # [D,V]
    to_chunks = lambda x: x.reshape(b, n, c, *x.shape[2:]).swapaxes(0, 1)  # [n,B,c,...]
    same = not sampling.truncates and stop_masked is None

    @jax.checkpoint
    def one_chunk(h_c, tgt_c, early_c):
        logits = jnp.einsum("BCD,DV->BCV", h_c, w).astype(jnp.float32)
        pick = lambda lp: jnp.take_along_axis(lp, tgt_c[..., None], axis=-1)[..., 0]
        full = tempered_log_probs(logits, sampling.temperature)  # [B,c,V]
        if same:
            return pick(full), pick(full), entropy(full)
        banned = None if stop_masked is None else banned_stop_ids(early_c, stop_ids, w.shape[1])
        lp = log_probs(logits, sampling, banned, keep=tgt_c)  # [B,c,V]
        return pick(lp), pick(full), entropy(full)

    def body(_, xs):
        return None, one_chunk(*xs)

    _, out = jax.lax.scan(body, None, (to_chunks(h), to_chunks(targets), to_chunks(early)))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return TokenLogprobs(*(unchunk(x) for x in out))
