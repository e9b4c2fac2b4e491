"""Rollout orchestration: prompts -> sampler completions -> rewards -> advantages -> learner Batch.

`rollout()` is the whole rollout phase of one GRPO step. The sampler reads the policy parameters
the learner holds (same arrays, no copy). Rewards are plain host functions (`rl.rewards`); the
completions are decoded and scored on the host while nothing else waits on them.

Sequences are laid out right-padded to a fixed length `max_prompt_len + max_new_tokens`, so every
learner step sees the same shapes and compiles once. A completion includes its stop token (the
policy must learn to stop), and `loss_mask[b, t]` marks the completion tokens tokens[b, t+1].
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from rl.advantages import compute_advantages
from rl.data import reward_inputs
from rl.learner import Batch
from rl.rewards import combined_rewards
from rl.shaping import overlong_penalty


@dataclasses.dataclass
class Rollout:
    batch: Batch  # numpy arrays, global batch of B*G rows
    texts: list[str]  # decoded completions, B*G
    rewards: np.ndarray  # f32 [B*G] total reward (after shaping)
    stats: dict[str, float]  # reward / advantage / length statistics


def sample_groups(
    engine, params, prompts: list[list[int]], group_size: int, seed: int, request_ids
):
    """Completions [B*G] (group i is rows i*G..i*G+G-1) of every prompt, sampled with `engine`."""
    _, results = engine.generate_all(
        params, engine.init_state(), prompts, group_size, seed=seed, request_ids=request_ids
    )
    return [c for group in results for c in group]


def build_batch(prompts, completions, group_size, advantages, seq_len, pad_id, mask_truncated):
    """Right-padded learner Batch (numpy) from prompts [B] and completions [B*G]."""
    rows = len(completions)
    tokens = np.full((rows, seq_len), pad_id, np.int32)
    valid = np.zeros((rows, seq_len), bool)
    loss_mask = np.zeros((rows, seq_len - 1), np.float32)
    sampler_logp = np.zeros((rows, seq_len - 1), np.float32)
    for r, c in enumerate(completions):
        p = prompts[r // group_size]
        n = len(p) + c.length
        if n > seq_len:
            raise ValueError(
                f"sequence of {n} tokens exceeds max_prompt_len + max_new_tokens = {seq_len}"
            )
        tokens[r, :n] = p + c.tokens
        valid[r, :n] = True
        if not (mask_truncated and c.finish_reason == "length"):
            loss_mask[r, len(p) - 1 : n - 1] = 1.0
        sampler_logp[r, len(p) - 1 : n - 1] = c.logprobs
    return Batch(
        tokens=tokens,
        positions=np.tile(np.arange(seq_len, dtype=np.int32), (rows, 1)),
        valid=valid,
        loss_mask=loss_mask,
        advantages=np.asarray(advantages, np.float32),
        sampler_logp=sampler_logp,
    )


def score(records, completions, texts, group_size, rl_cfg, max_new_tokens, prompt_field):
    """Total rewards f32[B*G] with overlong shaping, and per-reward means."""
    prompts, fields = reward_inputs(records, group_size, prompt_field)
    total, parts = combined_rewards(dict(rl_cfg.rewards), prompts, texts, fields)
    stats = {f"reward/{k}": float(np.mean(v)) for k, v in parts.items()}
    if rl_cfg.overlong_buffer:
        lengths = np.array([c.length for c in completions])
        penalty = np.asarray(
            overlong_penalty(
                lengths, max_new_tokens, rl_cfg.overlong_buffer, rl_cfg.overlong_penalty
            )
        )
        total = total + penalty
        stats["reward/overlong_penalty"] = float(penalty.mean())
    return np.asarray(total, np.float32), stats


def finish(prompts, records, completions, texts, rewards, stats, cfg, seq_len, pad_id) -> Rollout:
    """Advantages and the learner Batch from scored completions."""
    g = cfg.rl.num_generations
    adv, adv_stats = compute_advantages(
        jnp.asarray(rewards), g, cfg.rl.advantage, cfg.rl.advantage_eps
    )
    batch = build_batch(
        prompts, completions, g, np.asarray(adv), seq_len, pad_id, cfg.rl.mask_truncated
    )
    stats = dict(stats)
    stats.update({k: float(v) for k, v in adv_stats.items()})
    lengths = np.array([c.length for c in completions])
    stats["rollout/length_mean"] = float(lengths.mean())
    stats["rollout/length_max"] = float(lengths.max())
    stats["rollout/truncated_frac"] = float(
        np.mean([c.finish_reason == "length" for c in completions])
    )
    return Rollout(batch, texts, rewards, stats)
