import numpy as np
import pytest

from rl.dynamic_sampling import fill_groups


def _sampler(reward_rows):
    """Hands out the given groups' rewards in order, as a rollout would, counting calls."""
    rows = list(reward_rows)
    calls = []

    def sample(n):
        calls.append(n)
        taken, rows[:] = rows[:n], rows[n:]
        return [tuple(r) for r in taken], np.array(taken, np.float32).reshape(-1)

    return sample, calls


def test_drops_zero_variance_groups_and_refills():
    groups = [[1, 1], [0, 1], [0, 0], [1, 0], [1, 1], [0, 1]]
    sample, calls = _sampler(groups)
    records, rewards, stats = fill_groups(sample, num_groups=3, group_size=2, max_tries=5)
    assert records == [(0, 1), (1, 0), (0, 1)]
    np.testing.assert_array_equal(rewards, [0, 1, 1, 0, 0, 1])
    assert calls == [3, 2, 1]  # asks only for what is still missing
    assert stats == {
        "dynamic_sampling_tries": 3.0,
        "dynamic_sampling_dropped_groups": 3.0,
        "dynamic_sampling_shortfall": 0.0,
    }


def test_bounded_tries_top_up_with_zero_variance_groups():
    sample, calls = _sampler([[1, 1, 1], [0, 0, 0], [0, 1, 0], [1, 1, 1], [0, 0, 0]])
    records, rewards, stats = fill_groups(sample, num_groups=3, group_size=3, max_tries=2)
    assert len(calls) == 2
    assert records == [(0, 1, 0), (1, 1, 1), (0, 0, 0)]
    assert rewards.shape == (9,)
    assert stats["dynamic_sampling_shortfall"] == 2.0


def test_errors():
    with pytest.raises(ValueError, match="max_tries=0"):
        fill_groups(_sampler([])[0], 1, 2, 0)
    with pytest.raises(RuntimeError, match="need 2"):
        fill_groups(_sampler([[0, 1]])[0], 2, 2, 3)
