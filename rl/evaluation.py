"""Held-out evaluation: greedy accuracy and pass@k with the unbiased estimator.

pass@k (Chen et al., 2021) from n >= k samples per prompt of which c are correct:
    pass@k = 1 - C(n - c, k) / C(n, k)
averaged over prompts. Correctness is a 0/1 reward from `rl.rewards` (>= 0.5 counts as correct),
or with an environment (multi-turn episodes) the episode's reward; then the greedy episodes'
tool-call rate is reported too, and the means of the environment's per-episode metrics over the
greedy episodes that report them (e.g. repo_fix's second_try_fix_rate; `rl.summary.metric_means`).
"""

from __future__ import annotations

import functools
import math
from math import comb

import numpy as np

from models.processes import agree_json
from rl.data import reward_inputs
from rl.groups import Group, GroupSampler
from rl.multiturn import EpisodeSampler
from rl.rewards import get_reward
from rl.summary import metric_means


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def correct_group(record, prompt, completions, tokenizer, reward_name, prompt_field) -> Group:
    """A held-out single-turn group scored by the 0/1 reward `reward_name` (rewards >= 0.5 are
    correct)."""
    g = len(completions)
    texts = [tokenizer.decode(c.tokens) for c in completions]
    prompts, fields = reward_inputs([record], g, prompt_field)
    scores = np.asarray(get_reward(reward_name)(prompts, texts, **fields), np.float32)
    return Group(record, prompt, completions, texts, scores, {})


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


def _groups(engine, params, records, tokenizer, cfg, g, seed, env=None):
    """(indices, groups) of this process's held-out records (`_mine`), G samples each through the rollout driver
    (`rl.groups.GroupSampler`, one synchronous round), as scored groups in record order:
    single-turn by `cfg.eval.reward`, with `env` its episodes by the environment."""
    index, shards = _mine(engine, records)
    score = functools.partial(
        correct_group,
        tokenizer=tokenizer,
        reward_name=cfg.eval.reward,
        prompt_field=cfg.data.eval.prompt_field,
    )
    episodes = None if env is None else EpisodeSampler(env, engine, tokenizer, cfg.env)
    sampler = GroupSampler(engine, tokenizer, g, cfg, cfg.data.eval.prompt_field, score, episodes)
    try:
        mine = [records[j] for j in index]
        _, groups = sampler.round(params, engine.init_state(), mine, index, shards, seed)
    finally:
        sampler.close()
    return index, groups


def _episodes(env, engine, params, records, tokenizer, cfg, g, seed):
    """Per held-out record (every process's, in order) {"correct": [G], "masked": [G] (infra
    failures and the environment's own errors, `rl.multiturn`: they count neither way),
    "calls": [G] (made a tool call), "metrics": [G] (the environment's, {} when masked),
    "tamper": count of episodes caught changing their grading, "text": the first sample's}."""
    index, groups = _groups(engine, params, records, tokenizer, cfg, g, seed, env)
    rows = []
    for j, grp in zip(index, groups):
        eps, r = grp.episodes, grp.rewards
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
                "text": grp.texts[0] if j == 0 else "",
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
    index, greedy = _groups(greedy_engine, params, records, tokenizer, cfg, 1, seed)
    rows = [
        {"index": j, "correct": bool(grp.rewards[0] >= 0.5), "text": grp.texts[0] if j == 0 else ""}
        for j, grp in zip(index, greedy)
    ]
    rows = _everyone(rows)
    out = {
        "accuracy": float(np.array([r["correct"] for r in rows], bool).mean()),
        "example": rows[0]["text"] if rows else "",
    }
    if k:
        index, sampled = _groups(sample_engine, params, records, tokenizer, cfg, n, seed + 1)
        correct = [int((grp.rewards >= 0.5).sum()) for grp in sampled]
        rows = _everyone([{"index": j, "c": c} for j, c in zip(index, correct)])
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, r["c"], k) for r in rows]))
    return out
