"""Held-out evaluation: greedy accuracy and pass@k with the unbiased estimator.

pass@k (Chen et al., 2021) from n >= k samples per prompt of which c are correct:
    pass@k = 1 - C(n - c, k) / C(n, k)
averaged over prompts. Correctness is a 0/1 reward from `rl.rewards` (>= 0.5 counts as correct),
or with an environment (multi-turn episodes) the episode's reward; then the greedy episodes'
tool-call rate is reported too, and the means of the environment's per-episode metrics over the
greedy episodes that report them (e.g. repo_fix's second_try_fix_rate; `rl.summary.metric_means`).
"""

from __future__ import annotations

import math
from math import comb

import numpy as np

from models.processes import agree_json
from rl.data import reward_inputs, tokenize_prompts
from rl.multiturn import EpisodeSampler
from rl.rewards import get_reward
from rl.rollout import env_prompts
from rl.summary import metric_means
from sampling.episodes import generate_all


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _correct(reward_name, records, texts, group_size, prompt_field):
    if not records:  # a process whose shards hold none of the held-out records
        return np.zeros((0, group_size), bool)
    prompts, fields = reward_inputs(records, group_size, prompt_field)
    scores = np.asarray(get_reward(reward_name)(prompts, texts, **fields), np.float32)
    return (scores >= 0.5).reshape(len(records), group_size)


def _mine(engine, records) -> tuple[list[int], list[int]]:
    """(indices, shards) of the held-out records this process evaluates: shard i of the S batch
    shards takes records [i*n/S, (i+1)*n/S), and each process its own shards'."""
    n, s = len(records), engine.num_shards
    pairs = [(j, i) for i in engine.local_shards for j in range(i * n // s, (i + 1) * n // s)]
    return [j for j, _ in pairs], [i for _, i in pairs]


def _everyone(rows: list[dict]) -> list[dict]:
    """Every process's per-record results, in record order (one small agreement: counts and
    the first record's text, no tokens)."""
    return sorted((r for part in agree_json(rows) for r in part), key=lambda r: r["index"])


def _episodes(env, engine, params, records, tokenizer, cfg, g, seed):
    """Per held-out record (every process's, in order) {"correct": [G], "masked": [G] (infra
    failures and the environment's own errors, `rl.multiturn`: they count neither way),
    "calls": [G] (made a tool call), "metrics": [G] (the environment's, {} when masked),
    "tamper": count of episodes caught changing their grading, "text": the first sample's}."""
    index, shards = _mine(engine, records)
    mine = [records[j] for j in index]
    sampler = EpisodeSampler(env, engine, tokenizer, cfg.env)
    try:
        prompts = env_prompts(env, mine, cfg.sampling.max_prompt_len, cfg.data.eval.prompt_field)
        _, out = sampler.run(params, engine.init_state(), mine, prompts, g, seed, index, shards)
        rewards = [fut.result() for _, _, fut in out]
    finally:
        sampler.close()
    rows = []
    for j, (eps, cs, _), r in zip(index, out, rewards):
        rows.append(
            {
                "index": j,
                "correct": (r >= 0.5).tolist(),
                "masked": [bool(ep.masked) for ep in eps],
                "calls": [ep.tool_calls > 0 for ep in eps],
                "tamper": sum(bool(ep.tamper) for ep in eps),
                "metrics": [
                    {} if ep.masked else {k: float(v) for k, v in ep.metrics.items()} for ep in eps
                ],
                "text": tokenizer.decode(cs[0].tokens) if j == 0 else "",
            }
        )
    return _everyone(rows)


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
    (masked) and "tamper" (caught changing their grading): counts over both runs. In a
    multi-process run each process evaluates its own batch shards' share of the records and
    the processes agree on the per-record results (`_everyone`)."""
    n, k = cfg.eval.pass_n, cfg.eval.pass_k
    if env is not None:
        rows = _episodes(env, greedy_engine, params, records, tokenizer, cfg, 1, seed)
        arr = lambda f: np.array([r[f] for r in rows], bool)
        kept = [{"metrics": m} for r in rows for m, x in zip(r["metrics"], r["masked"]) if not x]
        metrics = {key.removeprefix("episode/"): v for key, v in metric_means(kept).items()}
        metrics["tamper"] = float(sum(r["tamper"] for r in rows))
        out = {
            **metrics,
            **episode_scores(arr("correct"), arr("masked")),
            "tool_call_rate": float(np.mean(arr("calls"))),
            "example": rows[0]["text"],
        }
        if k:
            rows = _episodes(env, sample_engine, params, records, tokenizer, cfg, n, seed + 1)
            scores = episode_scores(arr("correct"), arr("masked"), k)
            out[f"pass@{k}"] = scores[f"pass@{k}"]
            out["infra_errors"] += scores["infra_errors"]
            out["tamper"] += float(sum(r["tamper"] for r in rows))
        return out
    index, shards = _mine(greedy_engine, records)
    mine = [records[j] for j in index]
    prompts = tokenize_prompts(mine, tokenizer, cfg, cfg.data.eval.prompt_field)
    decode = lambda completions: [tokenizer.decode(c.tokens) for c in completions]
    _, greedy = generate_all(
        greedy_engine,
        params,
        greedy_engine.init_state(),
        prompts,
        1,
        seed=seed,
        request_ids=index,
        shards=shards,
    )
    texts = decode([g[0] for g in greedy])
    right = _correct(cfg.eval.reward, mine, texts, 1, cfg.data.eval.prompt_field)[:, 0]
    rows = [
        {"index": j, "correct": bool(c), "text": t if j == 0 else ""}
        for j, c, t in zip(index, right, texts)
    ]
    rows = _everyone(rows)
    out = {
        "accuracy": float(np.array([r["correct"] for r in rows], bool).mean()),
        "example": rows[0]["text"] if rows else "",
    }
    if k:
        _, sampled = generate_all(
            sample_engine,
            params,
            sample_engine.init_state(),
            prompts,
            n,
            seed=seed + 1,
            request_ids=index,
            shards=shards,
        )
        samples = decode([c for group in sampled for c in group])
        correct = _correct(cfg.eval.reward, mine, samples, n, cfg.data.eval.prompt_field)
        rows = _everyone([{"index": j, "c": int(c)} for j, c in zip(index, correct.sum(axis=1))])
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, r["c"], k) for r in rows]))
    return out
