"""Tests for rl.advantages and rl.shaping: hand-worked values, numpy reference, DAPO helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import shaping
from rl.advantages import MODES, compute_advantages
from tests.rl import numpy_reference as ref

TOL = dict(rtol=1e-6, atol=1e-6)


def test_hand_worked_G3():
    # Group 0 = [1, 0, 0]: mean 1/3, centred [2/3, -1/3, -1/3],
    #   ddof=1 var = (4/9 + 1/9 + 1/9) / 2 = 1/3, std = 1/sqrt(3) = 0.5773503
    #   group_std -> [2/3 * sqrt(3), -1/3 * sqrt(3), ...] = [1.1547005, -0.5773503, -0.5773503]
    # Group 1 = [1, 1, 1]: zero variance -> exactly 0 in every mode.
    # batch_std: all six rewards have mean 2/3, squared deviations 4 * 1/9 + 2 * 4/9 = 4/3,
    #   ddof=1 var = (4/3) / 5 = 4/15, std = 0.5163978 -> (2/3) / std = 1.2909944
    rewards = jnp.array([1, 0, 0, 1, 1, 1], jnp.float32)
    expected = {
        "group_std": [1.1547005, -0.5773503, -0.5773503, 0, 0, 0],
        "group_mean": [2 / 3, -1 / 3, -1 / 3, 0, 0, 0],
        "batch_std": [1.2909944, -0.6454972, -0.6454972, 0, 0, 0],
    }
    for mode, want in expected.items():
        adv, stats = compute_advantages(rewards, 3, mode, eps=0.0)
        np.testing.assert_allclose(adv, want, **TOL, err_msg=mode)
        assert int(stats["zero_variance_groups"]) == 1
        assert float(stats["zero_variance_fraction"]) == 0.5


def test_hand_worked_G2():
    # [3, 1]: mean 2, centred [1, -1], ddof=1 std = sqrt(2) -> [0.7071068, -0.7071068].
    # [0, 0]: zero variance -> 0.
    adv, _ = compute_advantages(jnp.array([3.0, 1.0, 0.0, 0.0]), 2, "group_std", eps=0.0)
    np.testing.assert_allclose(adv, [0.7071068, -0.7071068, 0.0, 0.0], **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_matches_numpy(mode):
    rng = np.random.default_rng(0)
    G = 4
    rewards = rng.normal(size=6 * G).astype(np.float32)
    rewards[G : 2 * G] = 0.1  # float value whose group mean is not exactly 0.1
    rewards[3 * G : 4 * G] = rewards[3 * G]  # arbitrary constant group
    adv, stats = compute_advantages(jnp.asarray(rewards), G, mode, eps=1e-6)
    want, zero_groups = ref.advantages(rewards, G, mode, 1e-6)
    np.testing.assert_allclose(adv, want, **TOL)
    assert int(stats["zero_variance_groups"]) == zero_groups == 2
    # Exactly zero, not merely small: no reliance on float cancellation.
    assert np.all(np.asarray(adv)[G : 2 * G] == 0.0)
    assert np.all(np.asarray(adv)[3 * G : 4 * G] == 0.0)
    np.testing.assert_allclose(stats["reward_mean"], rewards.mean(), **TOL)
    np.testing.assert_allclose(stats["adv_max"], want.max(), **TOL)
    np.testing.assert_allclose(stats["adv_min"], want.min(), **TOL)


def test_large_eps_enters_the_denominator():
    # [3, 1] with eps = 1: centred [1, -1], std sqrt(2) -> 1 / (sqrt(2) + 1) = 0.4142136.
    # batch_std over [3, 1, 0, 2]: mean 1.5, ddof=1 std = sqrt(5/3) -> centred [1, -1, -1, 1]
    # over (1.2909944 + 1) = 2.2909944.
    adv, _ = compute_advantages(jnp.array([3.0, 1.0]), 2, "group_std", eps=1.0)
    np.testing.assert_allclose(adv, [0.4142136, -0.4142136], **TOL)
    adv, _ = compute_advantages(jnp.array([3.0, 1.0, 0.0, 2.0]), 2, "batch_std", eps=1.0)
    np.testing.assert_allclose(adv, np.array([1, -1, -1, 1]) / 2.2909944, **TOL)


def test_all_zero_variance_and_jit():
    f = jax.jit(compute_advantages, static_argnums=(1, 2))
    adv, stats = f(jnp.full((6,), 0.3), 3, "batch_std", 1e-6)
    assert np.all(np.asarray(adv) == 0.0)
    assert int(stats["zero_variance_groups"]) == 2
    assert float(stats["zero_variance_fraction"]) == 1.0


def test_errors():
    with pytest.raises(ValueError, match="'bogus'.*group_std, group_mean, batch_std"):
        compute_advantages(jnp.zeros(4), 2, "bogus", 1e-6)
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages(jnp.zeros(5), 2, "group_std", 1e-6)


# ---- rl.shaping -------------------------------------------------------------------------------


def test_overlong_penalty():
    # max 100, buffer 20: free up to 80, then -(L - 80) / 20: 90 -> -0.5, 100 -> -1 (x penalty).
    got = shaping.overlong_penalty(np.array([10, 80, 81, 90, 100]), 100, 20, penalty=2.0)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.1, -1.0, -2.0], **TOL)
    with pytest.raises(ValueError, match="buffer"):
        shaping.overlong_penalty(np.array([1]), 10, 0)


def test_kl_reward_penalty():
    logp = np.array([[-1.0, -2.0, 7.0], [-0.5, -0.5, -0.5]], np.float32)
    ref_logp = np.array([[-1.5, -1.0, 0.0], [-0.5, -1.5, -0.5]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    # Row 0: k1 = 0.5 + (-1.0) = -0.5 (padding ignored) -> 0.1 * -0.5 = -0.05.
    # Row 1: k1 = 0 + 1.0 + 0 = 1.0 -> 0.1.
    got = shaping.kl_reward_penalty(logp, ref_logp, mask, beta=0.1)
    np.testing.assert_allclose(got[:, 1], [-0.05, 0.1], **TOL)
    # The same two sequences packed into one row, as segments 1 and 2.
    packed = shaping.kl_reward_penalty(
        logp.reshape(1, 6), ref_logp.reshape(1, 6), mask.reshape(1, 6), beta=0.1,
        segments=np.array([[1, 1, 1, 2, 2, 2]]),
    )  # fmt: skip
    np.testing.assert_allclose(packed[0, 1:3], [-0.05, 0.1], **TOL)


def test_penalty_is_centred_per_group_and_not_rescaled():
    # Group 0 = [1, 0] (std sqrt(1/2)), group 1 ties at 0: its task advantage stays exactly 0 and
    # only its centred penalty remains, at beta's scale.
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0])
    penalty = jnp.array([0.02, 0.04, 0.011, 0.009])
    adv, _ = compute_advantages(rewards, 2, "group_std", eps=0.0, penalty=penalty)
    np.testing.assert_allclose(adv, [0.7071068 + 0.01, -0.7071068 - 0.01, -0.001, 0.001], **TOL)
    # group_mean: exactly the advantage of the shaped reward r - penalty.
    adv, _ = compute_advantages(rewards, 2, "group_mean", penalty=penalty)
    want, _ = compute_advantages(rewards - penalty, 2, "group_mean")
    np.testing.assert_allclose(adv, want, **TOL)


def test_select_groups():
    rewards = np.array([1, 0, 1, 1, 0.2, 0.2, 0, 0.5], np.float32)
    np.testing.assert_array_equal(shaping.select_groups(rewards, 2), [0, 3])


@pytest.mark.parametrize("mode", MODES)
def test_mask_matches_numpy(mode):
    """Masked samples (infra errors) leave every statistic: the float64 reference computes each
    group over its kept samples only. Groups: some masked, one fully masked, one with a single
    kept sample (no spread: 0), one whose kept samples tie though the masked one differs."""
    g = 4
    rng = np.random.default_rng(3)
    rewards = rng.integers(0, 3, 6 * g).astype(np.float32)
    rewards[16:20] = [1, 1, 0, 1]  # kept samples tie; the masked 0 must not make a spread
    penalty = rng.normal(size=6 * g).astype(np.float32)
    keep = np.ones(6 * g, bool)
    keep[[1, 6, 7]] = False
    keep[8:12] = False  # the whole group masked
    keep[[12, 13, 14]] = False  # one kept sample
    keep[18] = False
    for pen in (None, penalty):
        adv, stats = compute_advantages(jnp.asarray(rewards), g, mode, 1e-6, pen, keep)
        want = ref.masked_advantages(rewards, g, mode, 1e-6, keep, pen)
        np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-5, err_msg=str(pen is None))
        assert np.all(np.asarray(adv)[~keep] == 0.0)
    assert int(stats["masked_samples"]) == 11
    assert int(stats["zero_variance_groups"]) >= 3  # fully masked, single kept, kept tie
    np.testing.assert_allclose(stats["reward_mean"], rewards[keep].mean(), rtol=1e-6)
    np.testing.assert_allclose(stats["reward_std"], rewards[keep].std(), rtol=1e-5)
    # All kept: the unmasked result (another code path, so up to rounding).
    adv, _ = compute_advantages(jnp.asarray(rewards), g, mode, 1e-6, None, keep)
    full = np.ones(6 * g, bool)
    np.testing.assert_allclose(
        compute_advantages(jnp.asarray(rewards), g, mode, 1e-6, None, full)[0],
        compute_advantages(jnp.asarray(rewards), g, mode, 1e-6)[0], rtol=1e-6, atol=1e-6,
    )  # fmt: skip
    jitted = jax.jit(compute_advantages, static_argnums=(1, 2))
    np.testing.assert_allclose(jitted(rewards, g, mode, 1e-6, None, keep)[0], adv, atol=1e-6)
