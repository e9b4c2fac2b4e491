"""A step's statistics and advantages from the groups of every process, without their data.

Each process samples, scores and packs only the groups of its own batch shards
(`models.processes`). What needs the whole batch, the advantages of `advantage=batch_std`, the KL
folded into the rewards, the logged means, takes a `summary` of every group: a few numbers per
sample (reward, mask, length, turns, tool counts, KL penalty, token ages), never a token or a
text. The processes exchange them in one `processes.agree_json` a step, in shard order, and every
process computes the same statistics from the same list. A run of one process takes the same
path, so its statistics are those of a run of several, to the bit.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from models.processes import agree_json


def summary(grp, idx: int, step: int | None = None) -> dict:
    """The JSON-able facts of a `rl.groups.Group` that statistics and advantages need: per
    sample its reward, parts, mask, length, finish, observation tokens, and for multi-turn
    episodes their counters; `idx` orders it within its shard; with `step` (partial rollouts)
    the ages step - version of its model tokens (sum, count, max, count > 0)."""
    cs = grp.completions
    out = {
        "shard": int(grp.shard),
        "idx": idx,
        "prompt_len": len(grp.prompt),
        "rewards": [float(r) for r in grp.rewards],
        "keep": grp.keep().tolist(),
        "parts": {k: [float(x) for x in v] for k, v in grp.parts.items()},
        "lengths": [int(c.length) for c in cs],
        "stop": [c.finish_reason == "stop" for c in cs],
        "observation": [int(sum(c.observation or [])) for c in cs],
        "turn_starts": [_turn_starts(c) for c in cs],
        "penalty": None,
    }
    if grp.episodes is not None:
        out["episodes"] = [
            {
                "turns": ep.num_turns,
                "tool_calls": ep.tool_calls,
                "tool_errors": ep.tool_errors,
                "tool_seconds": ep.tool_seconds,
                "env_errors": ep.env_errors,
                "masked": bool(getattr(ep, "masked", False)),
                "tamper": bool(ep.tamper),
                "error": _masked_why(ep),
                "metrics": {k: float(v) for k, v in getattr(ep, "metrics", {}).items()},
            }
            for ep in grp.episodes
        ]
    if step is not None:
        ages = []
        for c in cs:
            obs = np.asarray(c.observation or [False] * c.length, bool)
            a = step - np.asarray(c.versions)[~obs]
            ages.append([float(a.sum()), int(a.size), float(a.max(initial=0)), int((a > 0).sum())])
        out["ages"] = ages
    return out


def _masked_why(ep) -> str:
    """Why an episode is masked, in one line ("" when it is not): its environment's
    infrastructure error, or an exception of the environment's own."""
    if not getattr(ep, "masked", False):
        return ""
    why = getattr(ep, "infra_error", "") or (
        "the environment raised (episode/env_errors; warned once)" if ep.env_errors else "masked"
    )
    return " ".join(str(why).split())[:MAX_ERROR_CHARS]


MAX_ERROR_CHARS = 300  # of an episode's masking error, as the processes exchange it


def _turn_starts(c) -> list[int]:
    """The positions where a model turn starts after observations (re-prefill accounting)."""
    obs = np.asarray(c.observation or [False] * c.length, bool)
    return (np.flatnonzero(obs[:-1] & ~obs[1:]) + 1).tolist()


def gather(summaries: list[dict], counters: dict) -> tuple[list[dict], list[dict]]:
    """(every process's summaries in shard order, every process's counters in process order)."""
    everyone = agree_json({"groups": summaries, "counters": counters})
    groups = [g for p in everyone for g in p["groups"]]
    groups.sort(key=lambda g: (g["shard"], g["idx"]))
    return groups, [p["counters"] for p in everyone]


def flat(groups: list[dict], field: str, dtype=np.float32) -> np.ndarray:
    """[N] the samples' values of a per-sample field, group-major (the advantages' order)."""
    return np.asarray([x for g in groups for x in g[field]], dtype)


def length_stats(groups: list[dict]) -> dict[str, float]:
    lengths = flat(groups, "lengths")
    return {
        "rollout/length_mean": float(lengths.mean()),
        "rollout/length_max": float(lengths.max()),
        "rollout/truncated_frac": float(np.mean(~flat(groups, "stop", bool))),
    }


def reward_parts(groups: list[dict]) -> dict[str, float]:
    """reward/<name>: each reward's mean over the samples that count."""
    keep = flat(groups, "keep", bool)
    out = {}
    for name in groups[0]["parts"]:
        part = np.asarray([x for g in groups for x in g["parts"][name]], np.float32)
        out[f"reward/{name}"] = float(np.mean(part[keep])) if keep.any() else 0.0
    return out


def reprefill_tokens(groups: list[dict]) -> int:
    """The tokens a design that re-prefills the whole history every turn would prefill for these
    groups (each prompt once per group, like ours, then prompt + history before every turn)."""
    total = 0
    for g in groups:
        total += g["prompt_len"] - 1
        for starts in g["turn_starts"]:
            total += sum(g["prompt_len"] - 1 + s for s in starts)
    return total


def episode_stats(groups: list[dict], prefill_tokens: int, reprefill: int) -> dict:
    """Per-rollout metrics of multi-turn episodes (means are per episode).

    `episode/prefill_tokens` is what the engines prefilled (each prompt once per group, then only
    observations) and `episode/reprefill_tokens` what re-prefilling the history every turn would
    have: both over every sampling round of the step, dynamic sampling's dropped groups too."""
    episodes = [ep for g in groups for ep in g["episodes"]]
    n_obs = int(flat(groups, "observation", np.int64).sum())
    mean = lambda f: float(np.mean([f(ep) for ep in episodes]))
    return {
        "episode/turns": mean(lambda ep: ep["turns"]),
        "episode/tool_calls": mean(lambda ep: ep["tool_calls"]),
        "episode/tool_call_rate": mean(lambda ep: ep["tool_calls"] > 0),
        "episode/tool_errors": mean(lambda ep: ep["tool_errors"]),
        "episode/tool_seconds": mean(lambda ep: ep["tool_seconds"]),
        "episode/env_errors": mean(lambda ep: ep["env_errors"]),
        # counts, not means: masked by the environment (env errors are counted above), tampering
        "episode/infra_errors": float(
            sum(ep["masked"] and not ep["env_errors"] for ep in episodes)
        ),
        "episode/tamper": float(sum(ep["tamper"] for ep in episodes)),
        "episode/observation_frac": n_obs / max(1, int(flat(groups, "lengths", np.int64).sum())),
        "episode/prefill_tokens": float(prefill_tokens),
        "episode/reprefill_tokens": float(reprefill),
        **masked_stats(episodes),
        **metric_means([ep for ep in episodes if not ep["masked"]]),
    }


def masked_stats(episodes: list[dict]) -> dict:
    """The step's masked episodes (infrastructure errors and the environment's own): how many
    (`episode/masked`), of how many (`episode/count`), their fraction (`episode/masked_frac`), and
    `episode/top_infra_error`, [the most frequent reason's line, how many episodes it masked]
    (["", 0] when none; ties: the first in shard order). That one is a list, not a scalar: the
    run logger keeps scalars only, and a run that stops when its episodes are all masked names
    it."""
    reasons = Counter(ep["error"] for ep in episodes if ep["masked"])
    ((text, n),) = reasons.most_common(1) or [("", 0)]
    masked = sum(reasons.values())
    return {
        "episode/masked": float(masked),
        "episode/count": float(len(episodes)),
        "episode/masked_frac": masked / max(1, len(episodes)),
        "episode/top_infra_error": [text, n],
    }


def metric_means(episodes: list[dict]) -> dict[str, float]:
    """`episode/<name>`: the mean of each environment metric over the (unmasked) episodes that
    report it: a masked episode's metrics say nothing of the model."""
    values: dict[str, list[float]] = {}
    for ep in episodes:
        for name, v in ep["metrics"].items():
            values.setdefault(name, []).append(v)
    return {f"episode/{name}": float(np.mean(v)) for name, v in sorted(values.items())}


def age_stats(groups: list[dict]) -> dict[str, float]:
    """Staleness of the trained model tokens (partial rollouts): their age in versions."""
    ages = np.asarray([a for g in groups for a in g["ages"]], np.float64).reshape(-1, 4)
    n = ages[:, 1].sum()
    return {
        "rollout/staleness_mean": float(ages[:, 0].sum() / n) if n else 0.0,
        "rollout/staleness_max": float(ages[:, 2].max(initial=0)) if n else 0.0,
        "rollout/offpolicy_token_frac": float(ages[:, 3].sum() / n) if n else 0.0,
    }


def per_process(counters: list[dict], name: str) -> dict[str, float]:
    """rollout/<name>_per_process_max / _min: a counter's spread over the processes (each runs
    its own episodes' tools and sandboxes)."""
    values = [float(c.get(name, 0.0)) for c in counters]
    return {
        f"rollout/{name}_per_process_max": max(values),
        f"rollout/{name}_per_process_min": min(values),
    }


def total(counters: list[dict], name: str) -> float:
    return float(sum(c.get(name, 0.0) for c in counters))


def step_stats(
    groups: list[dict],
    counts: list[dict],
    *,
    rows: int,
    width: int,
    row_shapes: int,
    extra: dict,
    partial: dict,
    episodes: bool,
) -> dict:
    """A step's statistics from every process's group summaries and counters: `rows` learner
    rows of `width` tokens (all shards), `row_shapes` row counts compiled so far, the sampler's
    `extra` statistics, partial rollouts' (`rl.partial`) and, for `episodes`, the episodes'.
    Floats, but for `episode/top_infra_error` (a list: `masked_stats`)."""
    sums = lambda name: total(counts, name)
    stats = {
        "learn/rows": float(rows),
        "learn/row_shapes": float(row_shapes),
        "learn/padding_frac": 1.0
        - float(
            sum(g["prompt_len"] * len(g["lengths"]) for g in groups) + flat(groups, "lengths").sum()
        )
        / (rows * width),
        "rollout/slot_utilization": sums("decoded") / max(counts[0]["slot_steps"], 1.0),
        "rollout/preemptions": sums("preemptions"),
        "rollout/recomputed_tokens": sums("recomputed_tokens"),
        **length_stats(groups),
        **reward_parts(groups),
        **extra,
    }
    for name in counts[0]:  # what the processes counted of the step, summed
        if name.startswith("sum/"):
            stats[name[4:]] = sums(name)
    stats.update(partial)
    if episodes:
        stats.update(
            episode_stats(groups, int(sums("prefill_tokens")), int(sums("reprefill_tokens")))
        )
        for name in ("tool_calls", "tool_seconds", "sandbox_runs"):
            stats.update(per_process(counts, name))
    return stats
