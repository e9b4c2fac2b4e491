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
    rewards, group_size: int, mode: str = "group_std", eps: float = 1e-6, penalty=None
):
    """Advantages for flat, group-contiguous rewards.

    Args:
      rewards: f32[B*G], group i in rows i*G .. i*G+G-1.
      group_size: G (static).
      mode: one of MODES (static).
      eps: added to the std in the std modes.
      penalty: optional f32[B*G] per-sample penalty (KL in the reward), centred per group and
        subtracted after the normalisation (module docstring).

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
