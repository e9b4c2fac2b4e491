"""Group-relative advantages: rewards of G completions per prompt -> one scalar advantage each.

Rewards arrive flat, `f32[B*G]`, with the G completions of prompt i in rows i*G .. i*G+G-1 (the
order the sampler emits them). Three normalisations:

- "group_std":  (r - group mean) / (group std + eps)      the GRPO paper (DeepSeekMath).
- "group_mean": r - group mean                            Dr. GRPO: no std, so easy or hard prompts
                                                          (small std) are not up-weighted.
- "batch_std":  (r - group mean) / (batch std + eps)      group baseline, batch scale (the "Lite PPO"
                                                          recipe). The batch std is the std of the raw
                                                          rewards over all B*G rows, not of the
                                                          centred values.

Both stds are Bessel-corrected (ddof=1): with G=4 the population std would shrink the scale by
sqrt(3/4) and no reference implementation we compare against does that.

A zero-variance group (all G rewards equal) carries no learning signal. Its advantages are set to
exactly 0.0 with `jnp.where` instead of trusting `r - mean` to cancel: for rewards like 0.1 the
float mean is not exactly 0.1, and dividing that rounding error by `eps` would give a large,
meaningless advantage. The stats count such groups because a high fraction means the prompts are
too easy or too hard (what DAPO's dynamic sampling filters, see `rl.shaping.select_groups`).

A KL penalty in the reward (kl_in="reward", `penalty` = beta * sum_t k1 per sample) enters as
-(penalty - group mean of penalty), after the normalisation. With "group_mean" that is exactly the
advantage of the shaped reward r - penalty. The std modes do not divide it by the reward std: a
group whose task rewards tie (std 0) would otherwise turn its tiny KL differences into
unit-size advantages whatever beta, and the ties keep their exact zero task advantage.

An optional `mask` (bool [B*G], True = the sample counts) leaves samples out: an episode whose
environment failed (a sandbox that died, a harness timeout: `rl.envs`) is not the model's fault, so
its reward is no evidence. Means, stds, the zero-variance test and the stats then run over the
unmasked samples only, as if the group had been drawn without them, and masked samples get
advantage 0 (their loss mask is zeroed by the caller too). `mask=None` is the unmasked code path,
bit for bit.

Everything is jnp with static `group_size`/`mode`, so it can run inside a jitted step.
"""

import jax.numpy as jnp

MODES = ("group_std", "group_mean", "batch_std")


def _std_ddof1(x, axis=None):
    """Bessel-corrected std; a single element gives 0 instead of NaN (0/0)."""
    n = x.size if axis is None else x.shape[axis]
    centred = x - jnp.mean(x, axis=axis, keepdims=True)
    return jnp.sqrt(jnp.sum(centred * centred, axis=axis) / max(n - 1, 1))


def compute_advantages(
    rewards, group_size: int, mode: str = "group_std", eps: float = 1e-6, penalty=None, mask=None
):
    """Advantages for flat, group-contiguous rewards.

    Args:
      rewards: f32[B*G], group i in rows i*G .. i*G+G-1.
      group_size: G (static).
      mode: one of MODES (static).
      eps: added to the std in the std modes.
      penalty: optional f32[B*G] per-sample penalty (KL in the reward), centred per group and
        subtracted after the normalisation (module docstring).
      mask: optional bool[B*G], False = the sample is left out of every statistic and gets
        advantage 0 (module docstring); None = all count.

    Returns:
      adv: f32[B*G].
      stats: dict of f32 scalars (zero_variance_groups is int32): reward_mean, reward_std (population
        std, for logging), adv_mean, adv_std, adv_min, adv_max, zero_variance_groups,
        zero_variance_fraction.
    """
    if mode not in MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; valid modes: {', '.join(MODES)}")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"group_size={group_size} must be >= 1 and divide the number of rewards "
            f"({rewards.shape[0]})"
        )
    if mask is not None:
        return _masked_advantages(rewards, group_size, mode, eps, penalty, mask)
    r = jnp.asarray(rewards, jnp.float32)
    grouped = r.reshape(-1, group_size)  # [B, G]
    centred = grouped - jnp.mean(grouped, axis=1, keepdims=True)  # [B, G]
    # Exact equality, not a std threshold: any real difference in rewards is a signal.
    zero_var = jnp.max(grouped, axis=1) == jnp.min(grouped, axis=1)  # [B]

    if mode == "group_std":
        scale = _std_ddof1(grouped, axis=1)[:, None] + eps  # [B, 1]
    elif mode == "batch_std":
        scale = _std_ddof1(r) + eps  # scalar
    else:
        scale = jnp.ones((), jnp.float32)
    # The safe denominator keeps the untaken branch finite even with eps=0.
    scale = jnp.where(zero_var[:, None], 1.0, scale)  # [B, 1]
    adv = jnp.where(zero_var[:, None], 0.0, centred / scale)  # [B, G]
    if penalty is not None:
        p = jnp.asarray(penalty, jnp.float32).reshape(-1, group_size)  # [B, G]
        adv = adv - (p - jnp.mean(p, axis=1, keepdims=True))
    adv = adv.reshape(-1)  # [B*G]

    n_zero = jnp.sum(zero_var.astype(jnp.int32))
    stats = {
        "reward_mean": jnp.mean(r),
        "reward_std": jnp.std(r),
        "adv_mean": jnp.mean(adv),
        "adv_std": jnp.std(adv),
        "adv_min": jnp.min(adv),
        "adv_max": jnp.max(adv),
        "zero_variance_groups": n_zero,
        "zero_variance_fraction": n_zero.astype(jnp.float32) / grouped.shape[0],
    }
    return adv, stats


def _masked_advantages(rewards, group_size, mode, eps, penalty, mask):
    """compute_advantages over the samples where mask is True (the same formulas, with each
    group's count of kept samples in place of G)."""
    r = jnp.asarray(rewards, jnp.float32)
    keep = jnp.asarray(mask, bool).reshape(r.shape)
    w = keep.astype(jnp.float32)
    grouped, wg = r.reshape(-1, group_size), w.reshape(-1, group_size)  # [B, G]
    n = jnp.sum(wg, axis=1, keepdims=True)  # [B, 1] kept samples per group

    def group_centre(x):
        mean = jnp.sum(wg * x, axis=1, keepdims=True) / jnp.maximum(n, 1.0)
        return jnp.where(wg > 0, x - mean, 0.0)

    centred = group_centre(grouped)  # [B, G], 0 on masked samples
    # A group with fewer than two kept samples has no spread either: max <= min then.
    top = jnp.max(jnp.where(wg > 0, grouped, -jnp.inf), axis=1)
    bottom = jnp.min(jnp.where(wg > 0, grouped, jnp.inf), axis=1)
    zero_var = top <= bottom  # [B]

    total = jnp.maximum(jnp.sum(w), 1.0)
    r_mean = jnp.sum(w * r) / total
    r_sq = jnp.sum(w * (r - r_mean) ** 2)
    if mode == "group_std":
        var = jnp.sum(centred * centred, axis=1, keepdims=True) / jnp.maximum(n - 1.0, 1.0)
        scale = jnp.sqrt(var) + eps  # [B, 1]
    elif mode == "batch_std":
        scale = jnp.sqrt(r_sq / jnp.maximum(total - 1.0, 1.0)) + eps  # scalar
    else:
        scale = jnp.ones((), jnp.float32)
    scale = jnp.where(zero_var[:, None], 1.0, scale)  # [B, 1]
    adv = jnp.where(zero_var[:, None], 0.0, centred / scale)  # [B, G]
    if penalty is not None:
        p = jnp.asarray(penalty, jnp.float32).reshape(-1, group_size)  # [B, G]
        adv = adv - group_centre(p)
    adv = jnp.where(wg > 0, adv, 0.0).reshape(-1)  # [B*G]

    adv_mean = jnp.sum(w * adv) / total
    any_kept = jnp.any(keep)
    n_zero = jnp.sum(zero_var.astype(jnp.int32))
    stats = {
        "reward_mean": r_mean,
        "reward_std": jnp.sqrt(r_sq / total),
        "adv_mean": adv_mean,
        "adv_std": jnp.sqrt(jnp.sum(w * (adv - adv_mean) ** 2) / total),
        "adv_min": jnp.where(any_kept, jnp.min(jnp.where(keep, adv, jnp.inf)), 0.0),
        "adv_max": jnp.where(any_kept, jnp.max(jnp.where(keep, adv, -jnp.inf)), 0.0),
        "zero_variance_groups": n_zero,
        "zero_variance_fraction": n_zero.astype(jnp.float32) / grouped.shape[0],
        "masked_samples": jnp.sum(1 - keep.astype(jnp.int32)),
    }
    return adv, stats
