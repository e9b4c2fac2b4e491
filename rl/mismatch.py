"""The sampler-vs-learner mismatch: importance weights and rejections that correct for it, and its
metrics.

The sampler's log-probs (`sampler_logp`) and the learner's for the same parameters (`old_logp`)
differ by numerics (kernels, bf16, batch shapes, and with an int8 / fp8 rollout its
quantisation). `behaviour_weights` gives the policy term of `rl.losses.grpo_loss` a weight and a
keep mask from the ratio old/sampler, per `is_correction`:
- "tis": truncated importance sampling, weight min(ratio, is_cap), every token kept;
- "mis": rejection, weight 1 and tokens (or sequences) whose ratio leaves [mis_low, mis_high]
  dropped from the policy term (verl's token / sequence rejection sampling);
- "icepop": IcePop's masked two-sided truncation (Ring-1T), weight = the ratio inside
  [mis_low, mis_high] and 0 (dropped) outside. It differs from "mis" inside the band only: mis
  weighs kept tokens 1, icepop by their ratio.
and `is_level` says whose ratio: each token's ("token"); its sequence's product, the sum of the
log-ratios over the sequence's valid tokens ("sequence"); or its sequence's geometric mean,
exp(mean log-ratio over those tokens) ("geometric", length-normalised so that long sequences
are not rejected for their length alone). Sequences are segments of their row (`rl.segments`).

`resolve_correction` turns the config's "auto" into a correction: tis when the rollout is
quantised (an int8 / fp8 KV cache or decode copy of the weights), else none.
`mismatch_metrics` measures the gap.
"""

import jax.numpy as jnp
from jax import lax

from rl.segments import segment_sum

sg = lax.stop_gradient

CORRECTIONS = ("none", "tis", "mis", "icepop")  # LossConfig.is_correction
LEVELS = ("token", "sequence", "geometric")  # LossConfig.is_level
QUANTISED_DTYPES = ("int8", "float8_e4m3fn")  # sampling dtypes that make "auto" mean tis


def resolve_correction(is_correction: str, cache_dtype: str, weights_dtype: str, old_logp: str):
    """The correction a config's `rl.is_correction` means: itself, or for "auto" tis when the
    rollout is quantised (`sampling.cache_dtype` or `sampling.weights_dtype` in
    QUANTISED_DTYPES) and pi_old is the learner's ("recompute"), else none. With
    old_logp="sampler" pi_old is the sampler's own distribution: nothing to correct."""
    if is_correction != "auto":
        return is_correction
    quantised = cache_dtype in QUANTISED_DTYPES or weights_dtype in QUANTISED_DTYPES
    return "tis" if quantised and old_logp == "recompute" else "none"


def behaviour_weights(old_logp, sampler_logp, mask, cfg, segments=None):
    """IS weight old/sampler for the policy term, and which tokens to keep. [B, T] each, f32.

    "sequence" and "geometric" levels give every token of a sequence the same ratio, so MIS
    then keeps or drops whole sequences.
    """
    log_ratio = sg(old_logp - sampler_logp)  # [B, T]
    if cfg.is_level == "sequence":
        log_ratio = segment_sum(mask * log_ratio, segments)
    elif cfg.is_level == "geometric":
        length = jnp.maximum(segment_sum(mask, segments), 1.0)  # [B, T] its valid tokens
        log_ratio = segment_sum(mask * log_ratio, segments) / length
    ones = jnp.ones_like(log_ratio)
    if cfg.is_correction == "none":
        return ones, ones
    ratio = jnp.exp(log_ratio)
    if cfg.is_correction == "tis":
        return jnp.minimum(ratio, cfg.is_cap), ones
    keep = (ratio >= cfg.mis_low) & (ratio <= cfg.mis_high)
    if cfg.is_correction == "mis":
        return ones, keep.astype(jnp.float32)
    if cfg.is_correction == "icepop":
        return jnp.where(keep, ratio, 0.0), keep.astype(jnp.float32)
    raise ValueError(
        f"unknown is_correction {cfg.is_correction!r}; valid: {', '.join(CORRECTIONS)}"
    )


def mismatch_metrics(learner_logp, sampler_logp, mask):
    """Over valid tokens: sums (summable across micro-batches) of |learner - sampler| and of the
    k3 estimate of KL(sampler || learner) from the sampler's own samples, and the max of
    |learner - sampler| (reduced with max)."""
    d = jnp.where(mask > 0, learner_logp - sampler_logp, 0.0)  # [B, T]
    return {
        "abs_logp_sum": jnp.sum(jnp.abs(d)),
        "kl_sum": jnp.sum(jnp.exp(d) - d - 1.0),  # 0 at masked positions since d = 0 there
        "abs_logp_max": jnp.max(jnp.abs(d)),  # 0 at masked positions, so 0 is a neutral fill
    }
