"""Rollout orchestration: prompts -> sampler completions -> rewards -> advantages -> learner Batch.

`sample_groups` is the sampling half of one GRPO step. The sampler reads the policy parameters the
learner holds (same arrays, no copy). Rewards are plain host functions (`rl.rewards`); each group
is decoded and scored on a worker thread as soon as its last completion finishes, while the device
keeps decoding the other groups, so reward time hides behind device time. `finish` then computes
group advantages and lays out the learner Batch.

Sequences are laid out right-padded to a fixed length `max_prompt_len + max_new_tokens`, so every
learner step sees the same shapes and compiles once. A completion includes its stop token (the
policy must learn to stop), and `loss_mask[b, t]` marks the completion tokens tokens[b, t+1].
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Executor

import jax.numpy as jnp
import numpy as np

from rl.advantages import compute_advantages
from rl.data import reward_inputs
from rl.learner import Batch
from rl.rewards import combined_rewards
from rl.shaping import overlong_penalty


@dataclasses.dataclass
class Group:
    """One prompt and its G scored completions."""

    record: dict
    prompt: list[int]
    completions: list  # sampling.engine.Completion, G of them
    texts: list[str]
    rewards: np.ndarray  # f32 [G] total reward (weighted sum, after shaping)
    parts: dict[str, np.ndarray]  # reward name -> unweighted f32 [G]


@dataclasses.dataclass
class Rollout:
    batch: Batch  # numpy arrays, global batch of B*G rows
    groups: list[Group]
    rewards: np.ndarray  # f32 [B*G]
    stats: dict[str, float]  # reward / advantage / length statistics


def score_group(record, prompt, completions, tokenizer, rl_cfg, max_new_tokens, prompt_field):
    g = len(completions)
    texts = [tokenizer.decode(c.tokens) for c in completions]
    prompts, fields = reward_inputs([record], g, prompt_field)
    total, parts = combined_rewards(dict(rl_cfg.rewards), prompts, texts, fields)
    if rl_cfg.overlong_buffer:
        lengths = np.array([c.length for c in completions])
        penalty = overlong_penalty(
            lengths, max_new_tokens, rl_cfg.overlong_buffer, rl_cfg.overlong_penalty
        )
        parts["overlong_penalty"] = np.asarray(penalty)
        total = total + parts["overlong_penalty"]
    return Group(record, prompt, completions, texts, np.asarray(total, np.float32), parts)


def sample_groups(
    engine, params, state, records, prompts, cfg, tokenizer, seed, request_ids, pool: Executor
):
    """(groups, decode state): G completions of every prompt, scored as their groups finish."""
    g = cfg.rl.num_generations
    done: list[list] = [[None] * g for _ in prompts]
    left = [g] * len(prompts)
    futures = {}

    def on_finish(i, k, completion):
        done[i][k] = completion
        left[i] -= 1
        if not left[i]:
            futures[i] = pool.submit(
                score_group, records[i], prompts[i], done[i], tokenizer, cfg.rl,
                cfg.sampling.max_new_tokens, cfg.data.train.prompt_field,
            )  # fmt: skip

    state, _ = engine.generate_all(
        params, state, prompts, g, seed=seed, request_ids=request_ids, on_finish=on_finish
    )
    return [futures[i].result() for i in range(len(prompts))], state


def build_batch(groups: list[Group], advantages, seq_len, pad_id, mask_truncated):
    """Right-padded learner Batch (numpy) with rows group-major: row i*G+k is completion k of i."""
    rows = [(grp.prompt, c) for grp in groups for c in grp.completions]
    n_rows = len(rows)
    tokens = np.full((n_rows, seq_len), pad_id, np.int32)
    valid = np.zeros((n_rows, seq_len), bool)
    loss_mask = np.zeros((n_rows, seq_len - 1), np.float32)
    sampler_logp = np.zeros((n_rows, seq_len - 1), np.float32)
    for r, (p, c) in enumerate(rows):
        n = len(p) + c.length
        if n > seq_len:
            raise ValueError(
                f"sequence of {n} tokens > max_prompt_len + max_new_tokens = {seq_len}"
            )
        tokens[r, :n] = p + c.tokens
        valid[r, :n] = True
        if not (mask_truncated and c.finish_reason == "length"):
            loss_mask[r, len(p) - 1 : n - 1] = 1.0
        sampler_logp[r, len(p) - 1 : n - 1] = c.logprobs
    return Batch(
        tokens=tokens,
        positions=np.tile(np.arange(seq_len, dtype=np.int32), (n_rows, 1)),
        valid=valid,
        loss_mask=loss_mask,
        advantages=np.asarray(advantages, np.float32),
        sampler_logp=sampler_logp,
    )


def finish(groups: list[Group], cfg, seq_len: int, pad_id: int) -> Rollout:
    """Group advantages, statistics and the learner Batch from scored groups."""
    g = cfg.rl.num_generations
    rewards = np.concatenate([grp.rewards for grp in groups])
    adv, adv_stats = compute_advantages(
        jnp.asarray(rewards), g, cfg.rl.advantage, cfg.rl.advantage_eps
    )
    batch = build_batch(groups, np.asarray(adv), seq_len, pad_id, cfg.rl.mask_truncated)
    stats = {k: float(v) for k, v in adv_stats.items()}
    for name in groups[0].parts:
        stats[f"reward/{name}"] = float(np.mean([grp.parts[name] for grp in groups]))
    completions = [c for grp in groups for c in grp.completions]
    lengths = np.array([c.length for c in completions])
    stats["rollout/length_mean"] = float(lengths.mean())
    stats["rollout/length_max"] = float(lengths.max())
    stats["rollout/truncated_frac"] = float(
        np.mean([c.finish_reason == "length" for c in completions])
    )
    return Rollout(batch, groups, rewards, stats)
