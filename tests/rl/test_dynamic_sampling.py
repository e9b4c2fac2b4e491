"""DAPO's refill per batch shard (rl/dynamic_sampling.py `fill_groups`), with a fake sampler."""

import dataclasses

import numpy as np
import pytest

import rl.dynamic_sampling as dynamic_sampling
from rl.dynamic_sampling import fill_groups


@dataclasses.dataclass
class _Group:
    """What fill_groups reads of a `rl.groups.Group`: its shard, rewards and kept samples."""

    shard: int
    rewards: np.ndarray
    mask: np.ndarray | None = None

    def keep(self):
        return np.ones(len(self.rewards), bool) if self.mask is None else self.mask


def _sampler(rows_per_shard, local=None):
    """Hands out each shard's groups (reward rows, or (rewards, keep) pairs) in order, counts[i]
    of shard i a round, as a process's rollout does: only the groups of its own shards."""
    queues = {
        i: [
            _Group(i, np.array(r[0] if isinstance(r, tuple) else r, np.float32),
                   np.array(r[1], bool) if isinstance(r, tuple) else None)
            for r in rows
        ]
        for i, rows in enumerate(rows_per_shard)
    }  # fmt: skip
    local = range(len(rows_per_shard)) if local is None else local
    calls = []

    def sample_round(counts):
        calls.append(list(counts))
        out = []
        for i in local:
            out += queues[i][: counts[i]]
            del queues[i][: counts[i]]
        return out

    return sample_round, calls


def _rows(groups):
    return [g.rewards.tolist() for g in groups]


def test_drops_zero_variance_groups_and_refills():
    sample, calls = _sampler([[[1, 1], [0, 1], [0, 0], [1, 0], [1, 1], [0, 1]]])
    groups, rounds, dropped, shortfall = fill_groups(sample, 3, 1, [0], 2, 5)
    assert _rows(groups) == [[0, 1], [1, 0], [0, 1]]
    assert all(g.shard == 0 for g in groups)
    assert calls == [[3], [2], [1]]  # asks only for what is still missing
    assert (rounds, dropped, shortfall) == (3, 3, 0)


def test_a_masked_sample_neither_makes_nor_hides_a_spread():
    # [0, 1] with its 1 masked is zero-variance; [1, 1, 0] with the 0 masked too; [0, 1, 1]
    # with the first 1 masked still differs.
    sample, calls = _sampler([[([0, 1], [True, False]), ([1, 0], [True, True])]])
    groups, rounds, dropped, _ = fill_groups(sample, 1, 1, [0], 2, 3)
    assert _rows(groups) == [[1, 0]] and (rounds, dropped) == (2, 1) and calls == [[1], [1]]
    assert not dynamic_sampling.informative(_Group(0, np.float32([1, 1, 0]), np.bool_([1, 1, 0])))
    assert dynamic_sampling.informative(_Group(0, np.float32([0, 1, 1]), np.bool_([1, 0, 1])))


def test_bounded_tries_top_up_with_zero_variance_groups():
    sample, calls = _sampler([[[1, 1, 1], [0, 0, 0], [0, 1, 0], [1, 1, 1], [0, 0, 0]]])
    groups, rounds, dropped, shortfall = fill_groups(sample, 3, 1, [0], 3, 2)
    assert calls == [[3], [2]] and rounds == 2
    # The informative group first, then the zero-variance ones in the order they were drawn.
    assert _rows(groups) == [[0, 1, 0], [1, 1, 1], [0, 0, 0]]
    assert dropped == 4 and shortfall == 2


def test_errors():
    with pytest.raises(ValueError, match="max_tries=0"):
        fill_groups(_sampler([[]])[0], 1, 1, [0], 2, 0)
    with pytest.raises(RuntimeError, match="returned 1 groups for shard 0 in 3 tries, need 2"):
        fill_groups(_sampler([[[0, 1]]])[0], 2, 1, [0], 2, 3)


def test_shards_refill_independently():
    """Shard 0's first groups are all informative; shard 1 needs two more rounds, in which shard
    0 asks for nothing. Each shard keeps its own groups, in the order they were sampled."""
    sample, calls = _sampler([
        [[0, 1], [1, 0], [0, 0]],  # (the last is never asked for)
        [[1, 1], [0, 1], [0, 0], [0, 0], [1, 0]],
    ])  # fmt: skip
    groups, rounds, dropped, shortfall = fill_groups(sample, 2, 2, [0, 1], 2, 5)
    assert calls == [[2, 2], [0, 1], [0, 1], [0, 1]]
    assert [g.shard for g in groups] == [0, 0, 1, 1]
    assert _rows(groups) == [[0, 1], [1, 0], [0, 1], [1, 0]]
    assert (rounds, dropped, shortfall) == (4, 3, 0)
    # With two rounds only, shard 1 tops up with its first zero-variance group.
    sample, calls = _sampler([
        [[0, 1], [1, 0]],
        [[1, 1], [0, 1], [0, 0], [1, 0]],
    ])  # fmt: skip
    groups, rounds, dropped, shortfall = fill_groups(sample, 2, 2, [0, 1], 2, 2)
    assert calls == [[2, 2], [0, 1]]
    assert [(g.shard, g.rewards.tolist()) for g in groups] == [
        (0, [0, 1]), (0, [1, 0]), (1, [0, 1]), (1, [1, 1])
    ]  # fmt: skip
    assert (rounds, dropped, shortfall) == (2, 2, 1)


def test_a_process_returns_its_own_shards_groups(monkeypatch):
    """This process holds shard 1 of 2; the other process's needs for shard 0 (2, then 1, then
    none) reach it through `agree`, so sample_round is asked for both shards' counts, and the
    process gets back (and returns) the groups of its own shard only."""
    peer = iter([[2, 0], [1, 0], [0, 0], [0, 0]])
    sent = []

    def agree(values):  # the two processes' vectors, in process order
        sent.append(np.asarray(values).tolist())
        return np.array([next(peer), values], np.int32)

    monkeypatch.setattr(dynamic_sampling, "agree", agree)
    sample, calls = _sampler([[[0, 1]] * 4, [[1, 0], [1, 1], [0, 0], [0, 1]]], local=[1])
    groups, rounds, dropped, shortfall = fill_groups(sample, 2, 2, [1], 2, 5)
    assert sent == [[0, 2], [0, 1], [0, 1], [0, 0]]  # only its own shard's need
    assert calls == [[2, 2], [1, 1], [0, 1]]
    assert [g.shard for g in groups] == [1, 1]
    assert _rows(groups) == [[1, 0], [0, 1]]
    assert (rounds, dropped, shortfall) == (3, 2, 0)
    # Alone (no peer), the process asks for its own shard's groups only.
    monkeypatch.undo()
    sample, calls = _sampler([[[0, 1]] * 2, [[0, 0], [1, 0], [0, 1]]], local=[1])
    groups, rounds, dropped, shortfall = fill_groups(sample, 2, 2, [1], 2, 5)
    assert calls == [[0, 2], [0, 1]] and _rows(groups) == [[1, 0], [0, 1]]
    assert (rounds, dropped, shortfall) == (2, 1, 0)
