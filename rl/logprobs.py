"""Teacher-forced log-probabilities of given tokens, computed in chunks of the sequence.

The learner, the reference model and the sampler-vs-learner checks all use this one function. It
runs the transformer trunk once, then projects to the vocabulary a chunk of `chunk` positions at a
time inside a `lax.scan`: only one f32 [B, chunk, V] logits block exists at a time, never the whole
[B, T, V]. The chunk body is rematerialised (`jax.checkpoint`), so the backward pass does not keep
every chunk's logits alive either: it recomputes them from the saved hidden states.

Position t of the output scores token t+1: logp[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1])
under `sampling.distribution.log_probs` with the given SamplingParams (temperature, top-k, top-p),
exactly the distribution the sampler drew from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sampling.distribution import SamplingParams, entropy, log_probs


def token_logprobs(model, tokens, positions, valid, sampling: SamplingParams, chunk: int = 128):
    """(logp f32[B,T-1], entropy f32[B,T-1]) of tokens[:, 1:] given their prefixes.

    tokens, positions: int32 [B,T]; valid: bool [B,T] real tokens. Values at positions whose target
    is padding are garbage-free but meaningless; the caller masks them.
    """
    h, _ = model.hidden(tokens, positions, valid)  # [B,T,D]
    h, targets = h[:, :-1], tokens[:, 1:]  # predict t+1 from t
    b, t = targets.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    w = model.unembed_matrix()  # [D,V]
    h = h.reshape(b, n, c, -1).swapaxes(0, 1)  # [n,B,c,D]
    targets = targets.reshape(b, n, c).swapaxes(0, 1)  # [n,B,c]

    @jax.checkpoint
    def one_chunk(h_c, tgt_c):
        logits = jnp.einsum("BCD,DV->BCV", h_c, w).astype(jnp.float32)
        lp = log_probs(logits, sampling)  # [B,c,V]
        chosen = jnp.take_along_axis(lp, tgt_c[..., None], axis=-1)[..., 0]
        return chosen, entropy(lp)

    def body(_, xs):
        return None, one_chunk(*xs)

    _, (lp, ent) = jax.lax.scan(body, None, (h, targets))  # [n,B,c] each
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return unchunk(lp), unchunk(ent)
