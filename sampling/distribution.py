"""The sampling distribution: temperature, top-k and top-p applied to logits, as log-probabilities.

This is the single definition of "the distribution a token was drawn from". The sampler draws from
it and records the log-probability of the chosen token; the learner's teacher-forced path
(`rl.logprobs`) calls the same function with the same parameters, so the two agree to numerics.

- temperature == 0 means greedy decoding: the token is the argmax, and its log-probability is taken
  under the unscaled distribution (temperature 1), which is the usual convention for logging.
- top_k (0 = off) keeps the k largest logits; ties at the k-th value are all kept.
- top_p (1.0 = off) keeps the smallest set of most likely tokens whose mass reaches top_p (after
  top-k), always at least one token; ties at the cut-off are kept.
The kept tokens are renormalised. RL configs default to top_k off and top_p 1, where the
tempered softmax is the whole story and no sort over the vocabulary is needed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")


def log_probs(logits, params: SamplingParams):
    """f32 log-probs [..., V] of the distribution tokens are drawn from (see module docstring)."""
    logits = logits.astype(jnp.float32)
    if params.temperature == 0:
        return jax.nn.log_softmax(logits, axis=-1)
    z = logits / params.temperature
    neg_inf = jnp.float32(-jnp.inf)
    if params.top_k and params.top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, params.top_k)[0][..., -1:]  # [...,1]
        z = jnp.where(z >= kth, z, neg_inf)
    if params.top_p < 1.0:
        lp = jax.nn.log_softmax(z, axis=-1)
        desc = -jnp.sort(-lp, axis=-1)  # [...,V] descending
        mass_before = jnp.cumsum(jnp.exp(desc), axis=-1) - jnp.exp(desc)
        n_keep = jnp.maximum(jnp.sum(mass_before < params.top_p, axis=-1, keepdims=True), 1)
        cut = jnp.take_along_axis(desc, n_keep - 1, axis=-1)
        z = jnp.where(lp >= cut, z, neg_inf)
    return jax.nn.log_softmax(z, axis=-1)


def entropy(logp):
    """Entropy [...] of the distribution with log-probs logp [..., V] (-inf entries allowed)."""
    p = jnp.exp(logp)
    return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
