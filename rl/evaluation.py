"""Held-out evaluation: greedy accuracy and pass@k with the unbiased estimator.

pass@k (Chen et al., 2021) from n >= k samples per prompt of which c are correct:
    pass@k = 1 - C(n - c, k) / C(n, k)
averaged over prompts. Correctness is a 0/1 reward from `rl.rewards` (>= 0.5 counts as correct).
"""

from __future__ import annotations

from math import comb

import numpy as np

from rl.data import reward_inputs, tokenize_prompts
from rl.rewards import get_reward


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _correct(reward_name, records, texts, group_size, prompt_field):
    prompts, fields = reward_inputs(records, group_size, prompt_field)
    scores = np.asarray(get_reward(reward_name)(prompts, texts, **fields), np.float32)
    return (scores >= 0.5).reshape(len(records), group_size)


def evaluate(greedy_engine, sample_engine, params, records, tokenizer, cfg, seed: int):
    """{"accuracy": greedy accuracy, f"pass@{k}": ..., "example": a completion} on the held-out
    records (config.data.eval), with a greedy engine and a sampling engine."""
    prompts = tokenize_prompts(records, tokenizer, cfg, cfg.data.eval.prompt_field)
    decode = lambda completions: [tokenizer.decode(c.tokens) for c in completions]
    ids = list(range(len(prompts)))
    _, greedy = greedy_engine.generate_all(
        params, greedy_engine.init_state(), prompts, 1, seed=seed, request_ids=ids
    )
    texts = decode([g[0] for g in greedy])
    out = {
        "accuracy": float(
            _correct(cfg.eval.reward, records, texts, 1, cfg.data.eval.prompt_field).mean()
        )
    }
    n, k = cfg.eval.pass_n, cfg.eval.pass_k
    if k:
        _, sampled = sample_engine.generate_all(
            params, sample_engine.init_state(), prompts, n, seed=seed + 1, request_ids=ids
        )
        texts = decode([c for group in sampled for c in group])
        correct = _correct(cfg.eval.reward, records, texts, n, cfg.data.eval.prompt_field).sum(
            axis=1
        )
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
    out["example"] = texts[0] if texts else ""
    return out
