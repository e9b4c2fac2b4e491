"""The rollout's learner batch on hand-made groups (which tokens the loss mask selects, where the
sampler log-probs sit), and KL-in-reward changing the advantages as defined."""

import jax
import numpy as np
import pytest

from launch.build import build
from launch.cli import parse_args
from models.sharding import on_devices
from rl.data import make_prompt_stream
from rl.groups import Group
from rl.packing import build_batch
from sampling.requests import Completion

PAD = 0


def _group(prompt, *completions):
    cs = [Completion(list(t), list(lp), reason, len(t)) for t, lp, reason in completions]
    return Group({}, list(prompt), cs, [], np.zeros(len(cs), np.float32), {})


GROUPS = [
    _group([10, 11, 12], ([20, 21, 2], [-0.1, -0.2, -0.3], "stop"), ([22], [-0.4], "length")),
    _group([13], ([23, 24, 25, 26], [-0.5, -0.6, -0.7, -0.8], "length"), ([2], [-0.9], "stop")),
]


def test_build_batch_by_hand():
    b, layout = build_batch(GROUPS, 6, PAD, pack=False)
    np.testing.assert_array_equal(
        b.tokens,
        [[10, 11, 12, 20, 21, 2], [10, 11, 12, 22, PAD, PAD],
         [13, 23, 24, 25, 26, PAD], [13, 2, PAD, PAD, PAD, PAD]],
    )  # fmt: skip
    np.testing.assert_array_equal(b.segment_ids, b.tokens != PAD)
    # Position t scores tokens[t + 1]: the mask covers exactly the completion tokens.
    np.testing.assert_array_equal(
        b.loss_mask,
        [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]],
    )  # fmt: skip
    np.testing.assert_allclose(
        b.sampler_logp,
        [[0, 0, -0.1, -0.2, -0.3], [0, 0, -0.4, 0, 0],
         [-0.5, -0.6, -0.7, -0.8, 0], [-0.9, 0, 0, 0, 0]],
    )  # fmt: skip
    np.testing.assert_array_equal(b.positions, np.where(b.tokens != PAD, np.arange(6), 0))
    assert b.stop_masked is None and b.advantages.shape == (4, 5)
    assert layout.rows == 4 and list(layout.row) == [0, 1, 2, 3]


def test_packed_batch_by_hand():
    """Lengths 6, 4, 5, 2 in rows of 10, first-fit decreasing: [6 | 4] and [5 | 2 | pad]."""
    b, layout = build_batch(GROUPS, 10, PAD)
    np.testing.assert_array_equal(
        b.tokens,
        [[10, 11, 12, 20, 21, 2, 10, 11, 12, 22], [13, 23, 24, 25, 26, 13, 2, PAD, PAD, PAD]],
    )  # fmt: skip
    np.testing.assert_array_equal(b.segment_ids, [[1] * 6 + [2] * 4, [1] * 5 + [2] * 2 + [0] * 3])
    np.testing.assert_array_equal(
        b.positions, [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        b.loss_mask, [[0, 0, 1, 1, 1, 0, 0, 0, 1], [1, 1, 1, 1, 0, 1, 0, 0, 0]]
    )
    np.testing.assert_allclose(
        b.sampler_logp,
        [[0, 0, -0.1, -0.2, -0.3, 0, 0, 0, -0.4], [-0.5, -0.6, -0.7, -0.8, 0, -0.9, 0, 0, 0]],
    )  # fmt: skip
    # Per-sequence values go on every position that scores one of the sequence's tokens.
    np.testing.assert_array_equal(
        layout.spread([1, 2, 3, 4]), [[1, 1, 1, 1, 1, 0, 2, 2, 2], [3, 3, 3, 3, 0, 4, 0, 0, 0]]
    )
    totals = np.arange(22).reshape(2, 11)  # [rows, T+1]: row r, segment s
    np.testing.assert_array_equal(layout.gather(totals), [1, 2, 12, 13])
    assert layout.padding_frac == pytest.approx(3 / 20)


def test_row_buckets():
    """Rows: the smallest bucket (multiple x 1..8, 10, 12, 14, 16, 20, ...) that holds the
    sequences, at most the padded count."""
    from rl.packing import bucket_rows, place

    assert [bucket_rows(n, 8, 64) for n in (1, 8, 9, 17, 33, 64)] == [8, 8, 16, 24, 40, 64]
    assert [bucket_rows(n, 1, 99) for n in (9, 11, 15, 17, 21, 33)] == [10, 12, 16, 20, 24, 40]
    assert bucket_rows(60, 8, 44) == 48  # the padded count rounded up to a multiple
    lengths = np.random.default_rng(0).integers(2, 300, 200)
    layout = place(lengths, 300, multiple=4)
    for r in range(layout.rows):  # no row overflows, and no two sequences overlap
        cells = np.zeros(300, int)
        for i in np.nonzero(layout.row == r)[0]:
            cells[layout.start[i] : layout.start[i] + lengths[i]] += 1
        assert cells.max() <= 1
    assert layout.rows % 4 == 0 and layout.rows < 200


def test_build_batch_marks_min_new_tokens():
    b, _ = build_batch(GROUPS, 6, PAD, min_new_tokens=2, pack=False)
    np.testing.assert_array_equal(
        b.stop_masked,
        [[0, 0, 1, 1, 0], [0, 0, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]],
    )  # fmt: skip
    with pytest.raises(ValueError, match="sequence of 6 tokens > max_prompt_len"):
        build_batch(GROUPS, 5, PAD)


def _group_std(r, g, eps):
    r = r.reshape(-1, g)
    std = r.std(axis=1, ddof=1, keepdims=True)
    same = (r.max(1) == r.min(1))[:, None]
    return np.where(same, 0.0, (r - r.mean(1, keepdims=True)) / (std + eps)).reshape(-1)


def test_kl_in_reward_and_mask_truncated():
    """kl_in="reward": the advantages are the task rewards' minus beta * sum_t k1 centred per group
    (rl.advantages), k1 over every completion token on the tempered full softmaxes; with
    mask_truncated, completions cut by the length limit get no loss but still their KL."""
    beta = 0.5
    args = [
        "--config.mesh.data=2", "--config.data.prompts_per_step=2", "--config.rl.num_generations=4",
        "--config.sampling.num_slots=8", "--config.rl.kl_in=reward", "--config.rl.kl_estimator=k1",
        f"--config.rl.kl_coef={beta}", "--config.data.eval.num=1", "--config.rl.mask_truncated=True",
        "--config.sampling.max_new_tokens=3", "--config.seed=1",
    ]  # fmt: skip
    with on_devices(jax.devices()[:2]):  # 2 batch shards, one group each
        _check_kl_in_reward(args, beta)


def _check_kl_in_reward(args, beta):
    config = parse_args(args, {})[0]
    run = build(config)
    run.ref_params = jax.tree.map(lambda x: 0.8 * x, run.ref_params)  # a reference that differs
    data = make_prompt_stream(config.data.train, batch_size=2, seed=0)
    rollout = run.rollouts()(0, run.state.params, data)
    raw = np.concatenate([grp.rewards for grp in rollout.groups])
    b = jax.device_get(rollout.batch)
    completions = [c for grp in rollout.groups for c in grp.completions]
    truncated = np.array([c.finish_reason == "length" for c in completions])
    assert truncated.any() and not truncated.all()
    # Each of the 2 batch shards packs its own group into the same number of rows.
    parts = [build_batch([grp], 3 + 8, 0) for grp in rollout.groups]
    rows = max(lay.rows for _, lay in parts)
    parts = [build_batch([grp], 3 + 8, 0, rows=rows) for grp in rollout.groups]
    assert [grp.shard for grp in rollout.groups] == [0, 1]
    want = jax.tree.map(lambda *x: np.concatenate(x), *[w for w, _ in parts])
    layout = rollout.layout
    offsets = np.repeat([0, rows], 4)
    np.testing.assert_array_equal(
        layout.row, np.concatenate([lay.row for _, lay in parts]) + offsets
    )
    np.testing.assert_array_equal(b.tokens, want.tokens)
    want_mask = want.loss_mask  # every completion token
    np.testing.assert_array_equal(b.loss_mask, want_mask * layout.spread(~truncated))
    pi = np.asarray(run.learner.logprobs(run.state.params, rollout.batch, "full"))
    ref = np.asarray(run.learner.logprobs(run.ref_params, rollout.batch, "full"))
    k1 = np.where(want_mask > 0, np.clip(pi - ref, -10, 10), 0)
    segments = want.segment_ids[:, 1:]
    penalty = beta * np.array(
        [k1[r][segments[r] == s].sum() for r, s in zip(layout.row, layout.segment)]
    )
    assert np.abs(penalty[truncated]).max() > 0.01  # truncated completions keep their KL
    centred = (penalty.reshape(2, 4) - penalty.reshape(2, 4).mean(1, keepdims=True)).reshape(-1)
    want_adv = layout.spread(_group_std(raw, 4, 1e-6) - centred)
    np.testing.assert_allclose(b.advantages, want_adv, atol=1e-4)
    assert np.abs(centred).max() > 1e-3  # the KL changed the advantages
    np.testing.assert_allclose(rollout.rewards, raw - penalty, atol=1e-5)
    np.testing.assert_allclose(b.ref_logp, ref, atol=1e-6)  # kept for the learner's KL metric
