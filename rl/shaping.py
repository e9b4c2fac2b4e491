"""Reward shaping and batch filtering around the GRPO loss (DAPO's extras, and KL-in-reward).

- `overlong_penalty`: DAPO's soft length penalty, a linear ramp over the last `buffer` tokens of the
  budget, added to the task reward.
- `kl_reward_penalty`: for kl_in="reward", beta * KL(pi || ref) of each sample (the k1 estimator,
  as in InstructGPT-style PPO; `rl.losses.kl_penalty` is the in-loss alternative), which
  `rl.advantages.compute_advantages` subtracts from the reward. The rollout
  (`rl.rollout.Rollouts`) calls it with both log-probs on the tempered full softmax, over every
  completion token. DAPO's overlong filtering (truncated completions get no loss) is
  `rl.mask_truncated`, applied by the rollout to the loss mask.
- `select_groups`: DAPO's dynamic sampling keeps only prompts whose G rewards differ; the refill loop
  with bounded retries lives with the rollout code.

The first two are jnp (they also accept numpy arrays, and work inside jit). `select_groups`
returns a data-dependent number of indices, so it is host-side numpy.
"""

import jax
import jax.numpy as jnp
import numpy as np

from rl.losses import kl_penalty
from rl.segments import sequence_totals


def overlong_penalty(lengths, max_new_tokens: int, buffer: int, penalty: float = 1.0):
    """f32[N] penalty (<= 0) for completion lengths int[N].

    0 up to L = max_new_tokens - buffer, then linear down to -penalty at L = max_new_tokens.
    Longer lengths (a sampler cannot produce them) stay at -penalty, as in DAPO.
    """
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"buffer={buffer} must be in (0, max_new_tokens={max_new_tokens}]")
    start = max_new_tokens - buffer
    excess = jnp.asarray(lengths, jnp.float32) - start
    return -penalty * jnp.clip(excess / buffer, 0.0, 1.0)


def kl_reward_penalty(logp, ref_logp, mask, beta: float, clamp: float = 10.0, segments=None):
    """f32 [B, T+1]: beta * sum_t k1 over the valid tokens of each sequence of the rows of [B, T],
    k1 = logp - ref_logp, the KL penalty of each sample when the KL goes into the reward
    (`rl.advantages` subtracts it). Column s of row b is sequence s of the row
    (`rl.segments.sequence_totals`; segments None: one sequence per row, column 1).

    k1 is `rl.losses.kl_penalty`'s (clamped to `clamp` per token). No gradient flows: it is data.
    """
    k1 = jnp.where(mask > 0, kl_penalty(logp, ref_logp, "k1", clamp), 0.0)  # [B, T]
    return beta * jax.lax.stop_gradient(sequence_totals(k1, segments))


def select_groups(rewards, group_size: int):
    """int64[K] indices of the groups (prompts) whose rewards are not all equal.

    Rows of group g are g*G .. g*G+G-1; `(idx[:, None] * G + np.arange(G)).reshape(-1)` gives them.
    Uses the same exact-equality test as `rl.advantages`, so the selected groups are exactly those
    with a nonzero advantage somewhere.
    """
    r = np.asarray(rewards).reshape(-1, group_size)  # [B, G]
    return np.nonzero(r.max(axis=1) != r.min(axis=1))[0]
