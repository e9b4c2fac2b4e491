"""DAPO dynamic sampling: keep only prompt groups whose rewards differ, sample more to refill.

A group whose G task rewards are all equal has zero task advantage everywhere and contributes no
task gradient (only the KL and entropy terms; with kl_in="reward" its centred KL penalty, see
`rl.advantages`), so DAPO drops it and samples further prompts until the batch holds
`num_groups` informative groups. The number of extra sampling rounds is bounded by `max_tries`;
when they run out, the batch is topped up with the zero-variance groups already drawn (they stay
harmless: zero task advantage) and the shortfall is reported, so a step never stalls.

With partial rollouts (`rl.partial`) the refill is per group instead of per round: a complete
group found zero-variance (`informative`; judged once the complete groups could fill the batch
or a slot idles) is replaced by a fresh prompt, within the same budget of B x (max_tries - 1)
replacements per step.

`sample_groups(n)` is the caller's rollout: it samples n prompts x G completions and returns a list
of n group records plus their rewards f32[n*G]. This module knows nothing about what a record is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rl.shaping import select_groups
from sampling.agreement import check_agreed


def fill_groups(
    sample_groups: Callable[[int], tuple[Sequence[Any], np.ndarray]],
    num_groups: int,
    group_size: int,
    max_tries: int,
) -> tuple[list[Any], np.ndarray, dict[str, float]]:
    """(records, rewards f32[num_groups*G], stats). Records keep the order they were sampled in."""
    if max_tries < 1:
        raise ValueError(f"max_tries={max_tries}: must be >= 1")
    kept: list[Any] = []
    kept_rewards: list[np.ndarray] = []
    spare: list[tuple[Any, np.ndarray]] = []
    tries = dropped = sampled = 0
    while len(kept) < num_groups and tries < max_tries:
        records, rewards = sample_groups(num_groups - len(kept))
        rewards = np.asarray(rewards, np.float32).reshape(len(records), group_size)
        tries += 1
        sampled += len(records)
        informative = set(select_groups(rewards.reshape(-1), group_size).tolist())
        for i, record in enumerate(records):
            if i in informative:
                kept.append(record)
                kept_rewards.append(rewards[i])
            else:
                dropped += 1
                spare.append((record, rewards[i]))
    shortfall = num_groups - len(kept)
    for record, rewards in spare[:shortfall]:
        kept.append(record)
        kept_rewards.append(rewards)
    if len(kept) < num_groups:
        raise RuntimeError(
            f"sample_groups returned {sampled} groups in {tries} tries, need {num_groups}"
        )
    stats = {
        "dynamic_sampling_tries": float(tries),
        "dynamic_sampling_dropped_groups": float(dropped),
        "dynamic_sampling_shortfall": float(shortfall),
    }
    return kept, np.concatenate(kept_rewards), stats


def selection_rewards(groups) -> np.ndarray:
    """f32 [n*G] rewards for the zero-variance test of groups (`rl.rollout.Group`): a masked
    sample takes the value of its group's first kept sample, so it neither makes nor hides a
    spread."""
    out = []
    for grp in groups:
        r, keep = np.array(grp.rewards, np.float32), grp.keep()
        r[~keep] = r[keep][0] if keep.any() else 0.0
        out.append(r)
    return np.concatenate(out)


def check_rewards_agree(groups) -> None:
    """Multi-process runs: the groups' rewards and masks must be the same on every process
    before anything is decided from them (`sampling.agreement.check_agreed`)."""
    values = [np.asarray(grp.rewards, np.float64) for grp in groups]
    values += [grp.keep().astype(np.float64) for grp in groups]
    need = "deterministic rewards, and infrastructure errors (masked episodes) seen everywhere"
    check_agreed(np.concatenate(values) if values else np.zeros(0), "rewards", need)


def informative(group) -> bool:
    """Whether a group's rewards differ (DAPO keeps it)."""
    return len(select_groups(selection_rewards([group]), len(group.rewards))) > 0
