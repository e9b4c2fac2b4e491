"""The sampler-vs-learner mismatch: importance weights that correct for it, and its metrics.

The sampler's log-probs (`sampler_logp`) and the learner's for the same parameters (`old_logp`)
differ only by numerics (kernels, bf16, batch shapes). `behaviour_weights` gives the policy term
of `rl.losses.grpo_loss` a truncated (tis) or masked (mis) importance weight old/sampler, per token
or per sequence (a sum over the sequence's segment of its row, `rl.segments`);
`mismatch_metrics` measures the gap.
"""

import jax.numpy as jnp
from jax import lax

from rl.segments import segment_sum

sg = lax.stop_gradient


def behaviour_weights(old_logp, sampler_logp, mask, cfg, segments=None):
    """IS weight old/sampler for the policy term, and which tokens to keep. [B, T] each, f32.

    "sequence" level uses the product of token ratios (the sum of log-ratios) for every token of a
    sequence, so MIS then keeps or drops whole sequences.
    """
    log_ratio = sg(old_logp - sampler_logp)  # [B, T]
    if cfg.is_level == "sequence":
        log_ratio = segment_sum(mask * log_ratio, segments)
    ones = jnp.ones_like(log_ratio)
    if cfg.is_correction == "none":
        return ones, ones
    ratio = jnp.exp(log_ratio)
    if cfg.is_correction == "tis":
        return jnp.minimum(ratio, cfg.is_cap), ones
    if cfg.is_correction == "mis":
        keep = (ratio >= cfg.mis_low) & (ratio <= cfg.mis_high)
        return ones, keep.astype(jnp.float32)
    raise ValueError(f"unknown is_correction {cfg.is_correction!r}; valid: none, tis, mis")


def mismatch_metrics(learner_logp, sampler_logp, mask):
    """Sums over valid tokens (summable across micro-batches): |learner - sampler| and the k3
    estimate of KL(sampler || learner) from the sampler's own samples."""
    d = jnp.where(mask > 0, learner_logp - sampler_logp, 0.0)  # [B, T]
    return {
        "abs_logp_sum": jnp.sum(jnp.abs(d)),
        "kl_sum": jnp.sum(jnp.exp(d) - d - 1.0),  # 0 at masked positions since d = 0 there
    }
