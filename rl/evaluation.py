"""Held-out evaluation: greedy accuracy and pass@k with the unbiased estimator.

pass@k (Chen et al., 2021) from n >= k samples per prompt of which c are correct:
    pass@k = 1 - C(n - c, k) / C(n, k)
averaged over prompts. Correctness is a 0/1 reward from `rl.rewards` (>= 0.5 counts as correct),
or with an environment (multi-turn episodes) the episode's reward; then the greedy episodes'
tool-call rate is reported too, and the means of the environment's per-episode metrics over the
greedy episodes that report them (e.g. repo_fix's second_try_fix_rate; `rl.multiturn.env_metrics`).
"""

from __future__ import annotations

import math
from math import comb

import numpy as np

from rl.data import reward_inputs, tokenize_prompts
from rl.multiturn import EpisodeSampler, env_metrics
from rl.rewards import get_reward
from rl.rollout import env_prompts


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


def _episodes(env, engine, params, records, tokenizer, cfg, g, seed):
    """(correct bool [R,G], masked bool [R,G], tool-call rate, texts, env metrics) of G episodes
    per record; masked: infrastructure failures (`env.masked`) and the environment's own errors
    (`rl.multiturn`), which count neither way; the metrics hold "tamper", the count of episodes
    whose environment caught the model changing its grading (`episode.tamper`)."""
    sampler = EpisodeSampler(env, engine, tokenizer, cfg.env)
    try:
        prompts = env_prompts(env, records, cfg.sampling.max_prompt_len, cfg.data.eval.prompt_field)
        ids = range(len(records))
        _, out = sampler.run(params, engine.init_state(), records, prompts, g, seed, ids)
        correct = np.stack([fut.result() >= 0.5 for _, _, fut in out])
    finally:
        sampler.close()
    masked = np.array([[ep.masked for ep in eps] for eps, _, _ in out], bool)
    calls = np.mean([ep.tool_calls > 0 for eps, _, _ in out for ep in eps])
    texts = [tokenizer.decode(c.tokens) for _, cs, _ in out for c in cs]
    episodes = [ep for eps, _, _ in out for ep in eps]
    metrics = {k.removeprefix("episode/"): v for k, v in env_metrics(episodes).items()}
    metrics["tamper"] = float(sum(bool(ep.tamper) for ep in episodes))
    return correct, masked, float(calls), texts, metrics


def episode_scores(correct, masked, k: int = 0) -> dict:
    """Greedy accuracy (k = 0; correct/masked bool [R,1]) or pass@k ([R,n]) over the episodes
    that were not masked (infrastructure failures: the model's result is unknown), and their
    count as "infra_errors". A record with fewer than k unmasked samples is left out of pass@k;
    with nothing left the score is NaN (unknown), not 0."""
    keep = ~masked
    out = {"infra_errors": float(masked.sum())}
    if not k:
        out["accuracy"] = float(correct[keep].mean()) if keep.any() else math.nan
        return out
    n, c = keep.sum(axis=1), (correct & keep).sum(axis=1)
    scores = [pass_at_k(int(ni), int(ci), k) for ni, ci in zip(n, c) if ni >= k]
    out[f"pass@{k}"] = float(np.mean(scores)) if scores else math.nan
    return out


def evaluate(greedy_engine, sample_engine, params, records, tokenizer, cfg, seed: int, env=None):
    """{"accuracy": greedy accuracy, f"pass@{k}": ..., "example": the first greedy completion}
    on the held-out records (config.data.eval), with a greedy engine and a sampling engine;
    with `env`, of multi-turn episodes, plus "tool_call_rate" of the greedy ones, "infra_errors"
    (masked) and "tamper" (caught changing their grading): counts over both runs."""
    if env is not None:
        correct, masked, rate, texts, metrics = _episodes(
            env, greedy_engine, params, records, tokenizer, cfg, 1, seed
        )
        out = {**metrics, **episode_scores(correct, masked), "tool_call_rate": rate,
               "example": texts[0]}  # fmt: skip
        n, k = cfg.eval.pass_n, cfg.eval.pass_k
        if k:
            correct, masked, _, _, sampled = _episodes(
                env, sample_engine, params, records, tokenizer, cfg, n, seed + 1
            )
            scores = episode_scores(correct, masked, k)
            out[f"pass@{k}"] = scores[f"pass@{k}"]
            out["infra_errors"] += scores["infra_errors"]
            out["tamper"] += sampled["tamper"]
        return out
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
        ),
        "example": texts[0] if texts else "",
    }
    n, k = cfg.eval.pass_n, cfg.eval.pass_k
    if k:
        _, sampled = sample_engine.generate_all(
            params, sample_engine.init_state(), prompts, n, seed=seed + 1, request_ids=ids
        )
        samples = decode([c for group in sampled for c in group])
        correct = _correct(cfg.eval.reward, records, samples, n, cfg.data.eval.prompt_field).sum(
            axis=1
        )
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
    return out
