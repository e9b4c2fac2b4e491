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

`fill_groups` refills per batch shard (`rl.rollout`): each shard of the mesh keeps its own B/S
groups, so the decisions are the same whichever process holds the shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from models.processes import agree
from rl.shaping import select_groups


def fill_groups(
    sample_round: Callable[[list[int]], list[Any]],
    quota: int,
    num_shards: int,
    local: Sequence[int],
    group_size: int,
    max_tries: int,
) -> tuple[list[Any], int, int, int]:
    """(this process's groups, rounds, dropped, shortfall): `quota` groups per batch shard.

    Each round every shard asks for what it still misses (`models.processes.agree`: each process
    gives its own shards' counts), and `sample_round(counts)` samples counts[i] prompts x G for
    every shard i (returning this process's groups, with `.shard`, `.rewards` and `.keep()`), so
    every process runs the same rounds. A shard keeps its informative groups in the order they
    were sampled and, once `max_tries` rounds are spent, tops up with its zero-variance ones.
    `dropped` and `shortfall` count this process's shards (the caller sums them over processes);
    with one shard this is DAPO's refill of the whole batch."""
    if max_tries < 1:
        raise ValueError(f"max_tries={max_tries}: must be >= 1")
    kept: dict[int, list] = {i: [] for i in local}
    spare: dict[int, list] = {i: [] for i in local}
    tries = dropped = 0
    while tries < max_tries:
        need = np.zeros(num_shards, np.int32)
        for i in local:
            need[i] = quota - len(kept[i])
        counts = agree(need).sum(axis=0)  # every shard's need: each process sends its own
        if not counts.any():
            break
        groups = sample_round([int(n) for n in counts])
        tries += 1
        for grp in groups:
            if informative(grp):
                kept[grp.shard].append(grp)
            else:
                dropped += 1
                spare[grp.shard].append(grp)
    shortfall = 0
    for i in local:
        top_up = spare[i][: quota - len(kept[i])]
        shortfall += len(top_up)
        kept[i] += top_up
        if len(kept[i]) < quota:
            raise RuntimeError(
                f"sample_round returned {len(kept[i])} groups for shard {i} in "
                f"{tries} tries, need {quota}"
            )
    return [grp for i in local for grp in kept[i]], tries, dropped, shortfall


def selection_rewards(groups) -> np.ndarray:
    """f32 [n*G] rewards for the zero-variance test of groups (`rl.groups.Group`): a masked
    sample takes the value of its group's first kept sample, so it neither makes nor hides a
    spread."""
    out = []
    for grp in groups:
        r, keep = np.array(grp.rewards, np.float32), grp.keep()
        r[~keep] = r[keep][0] if keep.any() else 0.0
        out.append(r)
    return np.concatenate(out)


def informative(group) -> bool:
    """Whether a group's rewards differ (DAPO keeps it)."""
    return len(select_groups(selection_rewards([group]), len(group.rewards))) > 0
