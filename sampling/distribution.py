"""The sampling distribution: temperature, top-k, top-p and banned tokens applied to logits.

This is the single definition of "the distribution a token was drawn from". The sampler draws from
`log_probs` and records the log-probability of the chosen token; the learner's teacher-forced path
(`rl.logprobs`) calls the same function with the same parameters, so the two agree to numerics.

- temperature == 0 means greedy decoding: the token is the argmax, and its log-probability is taken
  under the unscaled distribution (temperature 1), which is the usual convention for logging.
  Rollouts for training refuse it (`launch.validate`).
- top_k (0 = off) keeps the k largest tempered logits; ties at the k-th value are all kept.
- top_p (1.0 = off) keeps the smallest set of most likely tokens whose mass (renormalised after
  top-k) reaches top_p, always at least one token; ties at the cut-off are kept.
- `banned` tokens (the stop ids before `min_new_tokens`, see `banned_stop_ids`) get probability 0
  before top-k and top-p.
The kept tokens are renormalised.

Why the kept set is chosen in sorted order and scattered back, rather than by comparing every
log-prob with a cut-off value: under jit XLA may compute the two uses of a log-softmax in
different fusions with different bits, and the token at the cut-off (sometimes the only kept one)
then drops out: -inf everywhere, NaN in the learner. Sorting once and deciding on ranks of that
one sorted array cannot disagree with itself.

`keep` (the learner's sampled targets) is always kept in the set. The sampler's token is in its own
set by construction; forcing it in on the learner side changes nothing then, but keeps the
learner finite when numerics (or, after a few updates, the policy itself) move a sampled token
just outside the set: a ratio or a CISPO weight of an "impossible" token would be -inf.

`tempered_log_probs` is the full tempered softmax without truncation: the distribution the KL to
the reference and the entropy are measured on (`rl.logprobs` explains why).

`sample` is the sampler's draw from the same distribution, made of reductions over the logits
without building the [B,V] f32 log-prob array that `log_probs` returns (156 MB at V=151936, B=256,
written and read back every decode step). It masks the tempered logits z to the kept set (`_kept`;
for top-k alone the k-th largest value from `lax.top_k` gives the same set, ties included, without
a full sort), then reduces: max and log-sum-exp of z, the Gumbel-max token argmax(gumbel +
log_softmax(z)) with the noise `jax.random.categorical` draws for the same key, and the token's
log-prob z[tok] - lse. The log-softmax terms are formed as `jax.nn.log_softmax` forms them,
((z - max) - lse), so the token is the one `categorical(key, log_probs(...))` draws, bit for bit
(tested on CPU; it could differ only if a backend summed the lse in a different order in the two
programs and a near-tie flipped).
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

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p cut the tempered softmax (greedy never truncates)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)


def banned_stop_ids(early, stop_ids, vocab_size: int):
    """bool [...,V]: the stop ids at positions where early [...] is True (min_new_tokens)."""
    is_stop = jnp.zeros((vocab_size,), bool)
    if stop_ids:
        is_stop = is_stop.at[jnp.asarray(stop_ids, jnp.int32)].set(True, mode="drop")
    return early[..., None] & is_stop


def tempered_log_probs(logits, temperature: float):
    """f32 log_softmax(logits / temperature) [...,V]; temperature 0 counts as 1 (greedy)."""
    z = logits.astype(jnp.float32)
    if temperature > 0:
        z = z / temperature
    return jax.nn.log_softmax(z, axis=-1)


def _kept(z, params: SamplingParams):
    """bool [...,V]: the top-k / top-p set of tempered logits z [...,V], decided in sorted order."""
    v = z.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    neg, order = jax.lax.sort_key_val(-z, iota)  # ascending -z: descending z, and its indices
    desc = -neg  # [...,V]
    keep = jnp.ones(z.shape, bool)
    if params.top_k and params.top_k < v:
        keep = desc >= desc[..., params.top_k - 1 : params.top_k]
    if params.top_p < 1.0:
        p = jax.nn.softmax(jnp.where(keep, desc, -jnp.inf), axis=-1)  # renormalised after top-k
        mass_before = jnp.cumsum(p, axis=-1) - p
        n_keep = jnp.maximum(jnp.sum(keep & (mass_before < params.top_p), -1, keepdims=True), 1)
        keep = keep & (desc >= jnp.take_along_axis(desc, n_keep - 1, axis=-1))
    # Back to vocabulary order: position order[..., i] holds sorted entry i.
    flat_keep, flat_order = keep.reshape(-1, v), order.reshape(-1, v)
    rows = jnp.arange(flat_keep.shape[0])[:, None]
    out = jnp.zeros_like(flat_keep).at[rows, flat_order].set(flat_keep, unique_indices=True)
    return out.reshape(z.shape)


def log_probs(logits, params: SamplingParams, banned=None, keep=None):
    """f32 log-probs [...,V] of the distribution tokens are drawn from (see module docstring).

    logits [...,V]; banned: bool broadcastable to [...,V], tokens that get probability 0, or None;
    keep: int32 [...] a token always kept in the top-k / top-p set (the learner's target), or None.
    """
    z = logits.astype(jnp.float32)
    if banned is not None:
        z = jnp.where(banned, -jnp.inf, z)
    if params.temperature == 0:
        return jax.nn.log_softmax(z, axis=-1)
    z = z / params.temperature
    if params.truncates:
        kept = _kept(z, params)
        if keep is not None:
            kept = kept | (
                jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == keep[..., None]
            )
        z = jnp.where(kept, z, -jnp.inf)
    return jax.nn.log_softmax(z, axis=-1)


def entropy(logp):
    """Entropy [...] of the distribution with log-probs logp [..., V] (-inf entries allowed).

    The inner `where` keeps the gradient finite: p * logp at p = 0 would differentiate 0 * -inf.
    """
    p = jnp.exp(logp)
    return -jnp.sum(jnp.where(p > 0, p * jnp.where(p > 0, logp, 0.0), 0.0), axis=-1)


def _kept_top_k(z, k: int):
    """bool [...,V]: the top-k set of `_kept` (ties at the k-th value kept) without a full sort."""
    return z >= jax.lax.top_k(z, k)[0][..., k - 1 : k]


def sample(logits, params: SamplingParams, banned=None, keys=None):
    """tok int32 [B], logp f32 [B]: a token drawn from the distribution `log_probs` defines, and
    its log-probability under it, without materialising that [B,V] distribution.

    logits f32/bf16 [B,V]; banned: bool broadcastable to [B,V], or None; keys: [B] PRNG keys, one
    per row (unused, may be None, when temperature == 0). The token is the one
    `jax.vmap(jax.random.categorical)(keys, log_probs(logits, params, banned))` draws; greedy
    (temperature 0) takes the first argmax of the (unbanned) logits, which is argmax(log_probs)
    unless two distinct logits round to one log-prob, and its log-prob at temperature 1.
    """
    z = logits.astype(jnp.float32)  # [B,V]
    if banned is not None:
        z = jnp.where(banned, -jnp.inf, z)
    if params.temperature > 0:
        z = z / params.temperature
        if params.truncates:
            k, v = params.top_k, z.shape[-1]
            if params.top_p == 1.0:
                kept = _kept_top_k(z, k) if k < v else None
            else:
                kept = _kept(z, params)
            if kept is not None:
                z = jnp.where(kept, z, -jnp.inf)
    # Reductions of z: the same operations as jax.nn.log_softmax, so the same bits.
    z_max = jnp.max(z, axis=-1, keepdims=True)  # [B,1]
    lse = jnp.log(jnp.sum(jnp.exp(z - z_max), axis=-1, keepdims=True))  # [B,1]
    if params.temperature == 0:
        tok = jnp.argmax(z, axis=-1)
    else:
        # jax.random.categorical(key, lp) is argmax(gumbel(key, lp.shape, lp.dtype) + lp).
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, z.shape[-1:], jnp.float32))(keys)
        tok = jnp.argmax(gumbel + ((z - z_max) - lse), axis=-1)  # [B]
    tok = tok.astype(jnp.int32)
    z_tok = jnp.take_along_axis(z, tok[:, None], axis=-1)  # [B,1]
    return tok, ((z_tok - z_max) - lse)[:, 0]
