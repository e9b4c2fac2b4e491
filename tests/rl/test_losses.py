"""Tests for rl.losses against the float64 numpy reference, hand-worked cases and gradients.

Everything runs eagerly (no jit per combination): the full policy x aggregation x KL x IS grid is
240 configurations, and eager dispatch of small arrays is much cheaper than 240 compilations.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import losses
from rl.losses import LossConfig, grpo_loss
from tests.rl import numpy_reference as ref

TOL = dict(rtol=1e-6, atol=1e-6)
B, T = 8, 7
SPLITS = [(0, 1), (1, 4), (4, 6), (6, 8)]  # uneven 4-way split of the rows
IS_MODES = [("none", "token"), ("tis", "token"), ("tis", "sequence"), ("mis", "token")]
IS_MODES += [("mis", "sequence")]
# (kl_estimator, is_correction, is_level) whose row splits are checked in every policy x
# aggregation cell: splits cost 4 eager calls each, and MIS (which changes per-sequence lengths)
# is where the contribution bookkeeping could go wrong.
SPLIT_COMBOS = [("k3", "mis", "token"), ("k2", "mis", "sequence"), ("k1", "tis", "sequence")]


def make_batch(seed=0):
    """Random padded batch; padding holds garbage (-inf, nan, 1e4) the loss must ignore."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[0], lengths[1] = 1, T
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)  # [B, T]
    logp = -rng.exponential(1.5, size=(B, T))
    old = logp - rng.normal(0.0, 0.4, size=(B, T))
    adv = np.array([0.9, -1.2, 0.5, -0.7, 1.3, 0.0, -0.4, 1.1])
    old[1, 2] = logp[1, 2] - 1.5  # ratio 4.5 on an A < 0 token: exercises the dual clip
    old[4, 0] = logp[4, 0] + 1.5  # ratio 0.22 on an A > 0 token
    sampler = old - rng.normal(0.0, 0.4, size=(B, T))
    ref_logp = logp + rng.normal(0.0, 0.5, size=(B, T))
    entropy = rng.uniform(0.0, 3.0, size=(B, T))
    pad = mask == 0
    for array, junk in [(logp, -np.inf), (old, 1e4), (sampler, np.nan), (ref_logp, np.inf)]:
        array[pad] = junk
    entropy[pad] = np.nan
    f32 = lambda x: np.asarray(x, np.float32)
    return dict(
        logp=f32(logp),
        old_logp=f32(old),
        sampler_logp=f32(sampler),
        ref_logp=f32(ref_logp),
        adv=f32(adv),
        mask=mask,
        entropy=f32(entropy),
    )


BATCH = make_batch()


def flat(metrics):
    metrics = jax.device_get(metrics)
    out = {k: float(v) for k, v in metrics.items() if k != "maxima"}
    out.update({k: float(v) for k, v in metrics["maxima"].items()})
    return out


def jnp_loss(batch, cfg, rows=slice(None), **counts):
    sub = {k: None if v is None else jnp.asarray(v[rows]) for k, v in batch.items()}
    if not counts:
        counts = dict(global_tokens=batch["mask"].sum(), global_seqs=batch["mask"].shape[0])
    return grpo_loss(
        sub["logp"],
        sub["old_logp"],
        sub["sampler_logp"],
        sub["ref_logp"],
        sub["adv"],
        sub["mask"],
        cfg,
        entropy=sub["entropy"],
        **counts,
    )


@pytest.mark.parametrize("policy", list(losses.POLICY_LOSSES))
@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_matches_numpy_and_splits(policy, aggregation):
    """Every KL estimator x IS mode against numpy; summed row splits for SPLIT_COMBOS."""
    counts = dict(global_tokens=BATCH["mask"].sum(), global_seqs=B)
    for estimator, (is_corr, is_level) in itertools.product(("k2", "k3"), IS_MODES):
        cfg = LossConfig(
            policy_loss=policy,
            aggregation=aggregation,
            kl_estimator=estimator,
            is_correction=is_corr,
            is_level=is_level,
            max_new_tokens=10,
            entropy_coef=0.01,
        )
        name = f"{cfg}"
        loss, metrics = jnp_loss(BATCH, cfg)
        want = ref.grpo_loss(**BATCH, cfg=cfg)
        got = flat(metrics)
        assert set(got) == set(want), name
        np.testing.assert_allclose(float(loss), want["loss"], **TOL, err_msg=name)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], **TOL, err_msg=f"{k}: {name}")
        if (estimator, is_corr, is_level) not in SPLIT_COMBOS:
            continue

        parts = [jnp_loss(BATCH, cfg, slice(a, b), **counts) for a, b in SPLITS]
        acc = parts[0][1]
        for _, m in parts[1:]:
            acc = losses.combine_metrics(acc, m)
        np.testing.assert_allclose(sum(float(p[0]) for p in parts), float(loss), **TOL)
        for k, v in flat(acc).items():
            np.testing.assert_allclose(v, got[k], **TOL, err_msg=f"split {k}: {name}")


def test_kl_in_reward_and_no_ref():
    cfg = LossConfig(kl_in="reward", kl_estimator="k1")
    loss, metrics = jnp_loss(BATCH, cfg)
    want = ref.grpo_loss(**BATCH, cfg=cfg)
    np.testing.assert_allclose(float(loss), want["loss"], **TOL)
    np.testing.assert_allclose(float(metrics["kl"]), want["kl"], **TOL)  # logged as k1
    np.testing.assert_allclose(float(loss), float(metrics["policy_loss"]), **TOL)  # no KL term
    cfg = LossConfig(kl_coef=0.0)
    b = dict(BATCH, ref_logp=None)
    loss, metrics = jnp_loss(b, cfg)
    assert "kl" not in metrics
    np.testing.assert_allclose(float(loss), ref.grpo_loss(**b, cfg=cfg)["loss"], **TOL)


def test_hand_worked_ppo_clip():
    # Ratios r and advantages A, eps_low 0.2, eps_high 0.28 (clip range [0.8, 1.28]):
    #   seq 0, A=+1: r=1.5 -> clipped high, loss -min(1.5, 1.28) = -1.28
    #                r=0.9 -> unclipped,    loss -0.9
    #   seq 1, A=-1: r=0.5 -> clipped low,  loss -min(-0.5, -0.8) = 0.8
    #                r=1.1 -> unclipped,    loss 1.1
    #                r=1.0 -> unclipped,    loss 1.0
    # token_mean = (-1.28 - 0.9 + 0.8 + 1.1 + 1.0) / 5 = 0.72 / 5 = 0.144
    # seq_mean_token_mean = (-2.18 / 2 + 2.9 / 3) / 2 = (-1.09 + 0.9666667) / 2 = -0.0616667
    old = np.full((2, 3), -1.0, np.float32)
    logp = old + np.log(np.array([[1.5, 0.9, 1.0], [0.5, 1.1, 1.0]], np.float32))
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    adv = np.array([1.0, -1.0], np.float32)
    for aggregation, want in [("token_mean", 0.144), ("seq_mean_token_mean", -0.0616667)]:
        cfg = LossConfig(kl_coef=0.0, aggregation=aggregation)
        loss, m = grpo_loss(logp, old, None, None, adv, mask, cfg, global_tokens=5, global_seqs=2)
        np.testing.assert_allclose(float(loss), want, **TOL)
        np.testing.assert_allclose(float(m["clip_frac_low"]), 0.2, **TOL)
        np.testing.assert_allclose(float(m["clip_frac_high"]), 0.2, **TOL)


def test_ratio_exactly_one_when_on_policy():
    b = BATCH
    for name, fn in losses.POLICY_LOSSES.items():
        logp = jnp.asarray(np.where(b["mask"] > 0, b["logp"], 0.0))
        _, aux = fn(logp, logp, jnp.asarray(b["adv"]), jnp.asarray(b["mask"]), LossConfig())
        assert np.all(np.asarray(aux["ratio"]) == 1.0), name
        cfg = LossConfig(policy_loss=name)
        _, m = jnp_loss(dict(b, old_logp=b["logp"]), cfg)
        assert float(m["clip_frac_low"]) == 0.0 and float(m["clip_frac_high"]) == 0.0, name
        assert float(m["maxima"]["ratio_max"]) == 1.0, name


def test_behaviour_weights_constructed():
    # Token ratios old/sampler: seq 0 = [5, 0.1, 0.8] (product 0.4), seq 1 = [1.2, 1.1] (1.32).
    ratios = np.array([[5.0, 0.1, 0.8], [1.2, 1.1, 1.0]], np.float32)
    sampler = np.full((2, 3), -2.0, np.float32)
    old = sampler + np.log(ratios)
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)

    def weights(corr, level):
        cfg = LossConfig(is_correction=corr, is_level=level)
        w, keep = losses.behaviour_weights(old, sampler, mask, cfg)
        return np.asarray(w) * mask, np.asarray(keep) * mask

    w, keep = weights("tis", "token")  # ratio 5 capped at is_cap = 2
    np.testing.assert_allclose(w, [[2.0, 0.1, 0.8], [1.2, 1.1, 0.0]], **TOL)
    w, keep = weights("tis", "sequence")
    np.testing.assert_allclose(w, [[0.4, 0.4, 0.4], [1.32, 1.32, 0.0]], **TOL)
    w, keep = weights("mis", "token")  # 5 > 2 and 0.1 < 0.5 are masked
    np.testing.assert_array_equal(keep, [[0, 0, 1], [1, 1, 0]])
    np.testing.assert_array_equal(w, mask)
    w, keep = weights("mis", "sequence")  # 0.4 < 0.5: the whole sequence goes
    np.testing.assert_array_equal(keep, [[0, 0, 0], [1, 1, 0]])
    w, keep = weights("none", "token")
    np.testing.assert_array_equal(w, mask)
    np.testing.assert_array_equal(keep, mask)


def test_mismatch_metrics():
    b = BATCH
    got = losses.mismatch_metrics(b["old_logp"], b["sampler_logp"], b["mask"])
    abs_sum = kl_sum = 0.0
    for i in range(B):
        for t in range(int(b["mask"][i].sum())):
            d = float(b["old_logp"][i, t]) - float(b["sampler_logp"][i, t])
            abs_sum += abs(d)
            kl_sum += math.exp(d) - d - 1.0
    np.testing.assert_allclose(float(got["abs_logp_sum"]), abs_sum, rtol=1e-6)
    np.testing.assert_allclose(float(got["kl_sum"]), kl_sum, rtol=1e-6)


def test_kl_penalty_values():
    logp = jnp.array([-1.0, -1.0, -20.0])
    ref_logp = jnp.array([-1.5, -0.5, -8.0])  # d = ref - logp = -0.5, 0.5, 12
    k1 = losses.kl_penalty(logp, ref_logp, "k1", 10.0)
    k2 = losses.kl_penalty(logp, ref_logp, "k2", 10.0)
    k3 = losses.kl_penalty(logp, ref_logp, "k3", 10.0)
    # The last d is clamped to 10 before every estimator.
    np.testing.assert_allclose(k1, [0.5, -0.5, -10.0], **TOL)
    np.testing.assert_allclose(k2, [0.125, 0.125, 50.0], **TOL)
    # k3 = e^d - d - 1: e^10 - 11 = 22015.4657948.
    want = [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, math.exp(10) - 11]
    np.testing.assert_allclose(k3, want, rtol=1e-6)


def _numeric_grad(batch, cfg, h=1e-6):
    """Central differences of the float64 reference loss wrt every valid logp."""
    base = {k: np.asarray(v, np.float64) for k, v in batch.items()}
    grad = np.zeros((B, T))
    for i, t in zip(*np.nonzero(batch["mask"])):
        plus, minus = base["logp"].copy(), base["logp"].copy()
        plus[i, t] += h
        minus[i, t] -= h
        f = lambda lp: ref.grpo_loss(**dict(base, logp=lp), cfg=cfg)["loss"]
        grad[i, t] = (f(plus) - f(minus)) / (2 * h)
    return grad


@pytest.mark.parametrize(
    "policy,aggregation,is_level",
    [
        ("ppo_clip", "token_mean", "token"),
        ("ppo_clip", "seq_mean_token_mean", "token"),
        ("dual_clip", "seq_mean_token_sum", "token"),
        ("gspo", "token_mean", "sequence"),
        ("gspo", "seq_mean_token_mean", "sequence"),
    ],
)
def test_grad_matches_finite_differences(policy, aggregation, is_level):
    # GSPO's per-token gradient equals the derivative of its value only when the IS weight is
    # constant within a sequence, hence sequence-level TIS there. The GSPO range is wider than the
    # default so that some sequences are unclipped and have a gradient.
    cfg = LossConfig(
        policy_loss=policy,
        aggregation=aggregation,
        is_correction="tis",
        is_level=is_level,
        entropy_coef=0.01,
        gspo_eps_low=0.1,
        gspo_eps_high=0.1,
    )
    grad_fn = jax.grad(lambda lp: jnp_loss(dict(BATCH, logp=lp), cfg)[0])
    got = np.asarray(grad_fn(BATCH["logp"]))
    assert np.all(np.isfinite(got)) and np.all(got[BATCH["mask"] == 0] == 0.0)
    assert np.count_nonzero(got) > 10
    np.testing.assert_allclose(got, _numeric_grad(BATCH, cfg), rtol=1e-5, atol=1e-6)


def test_cispo_grad_analytic():
    # d loss / d logp_t = -sg(clip(r_t)) * A * is_w_t / N + kl_coef * (1 - exp(ref - logp)) / N
    cfg = LossConfig(policy_loss="cispo", is_correction="tis")
    got = np.asarray(jax.grad(lambda lp: jnp_loss(dict(BATCH, logp=lp), cfg)[0])(BATCH["logp"]))
    b = {k: np.asarray(v, np.float64) for k, v in BATCH.items()}
    n = b["mask"].sum()
    want = np.zeros((B, T))
    for i, t in zip(*np.nonzero(b["mask"])):
        r = math.exp(b["logp"][i, t] - b["old_logp"][i, t])
        w = min(max(r, 0.8), 1.28)
        is_w = min(math.exp(b["old_logp"][i, t] - b["sampler_logp"][i, t]), 2.0)
        kl_grad = 1.0 - math.exp(b["ref_logp"][i, t] - b["logp"][i, t])
        want[i, t] = (-w * b["adv"][i] * is_w + cfg.kl_coef * kl_grad) / n
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_jit_matches_eager():
    cfg = LossConfig(
        policy_loss="dual_clip", is_correction="mis", aggregation="seq_mean_token_mean"
    )
    f = jax.jit(grpo_loss, static_argnames="cfg")
    b = {k: jnp.asarray(v) for k, v in BATCH.items()}
    loss, m = f(**b, cfg=cfg, global_tokens=BATCH["mask"].sum(), global_seqs=B)
    eager_loss, eager_m = jnp_loss(BATCH, cfg)
    np.testing.assert_allclose(float(loss), float(eager_loss), **TOL)
    np.testing.assert_allclose(flat(m)["mis_masked_frac"], flat(eager_m)["mis_masked_frac"])


def test_config_validation():
    for bad, field in [
        (dict(policy_loss="ppo"), "policy_loss"),
        (dict(aggregation="drgrpo_constant"), "max_new_tokens"),
        (dict(dual_clip_c=0.5), "dual_clip_c"),
        (dict(kl_in="both"), "kl_in"),
        (dict(is_level="batch"), "is_level"),
        (dict(mis_low=3.0), "mis_low"),
        (dict(eps_low=1.0), "eps_low"),
        (dict(kl_estimator="k1"), "kl_estimator='k1': k1 in the loss has zero expected gradient"),
        (dict(kl_in="reward"), "kl_estimator='k3': kl_in='reward' folds k1"),
    ]:
        with pytest.raises(ValueError, match=f"LossConfig.{field}"):
            LossConfig(**bad).validate()
    LossConfig(aggregation="drgrpo_constant", max_new_tokens=16).validate()
    with pytest.raises(ValueError, match="needs ref_logp"):
        jnp_loss(dict(BATCH, ref_logp=None), LossConfig())
    with pytest.raises(ValueError, match="needs sampler_logp"):
        jnp_loss(dict(BATCH, sampler_logp=None), LossConfig(is_correction="tis"))


def test_minus_inf_log_probs_give_a_finite_loss_and_gradient():
    """A reference (or old policy) log-prob of -inf on a valid token: the clamp of every KL
    estimator and the forced-in target keep the loss and its gradient finite."""
    b = dict(BATCH)
    b["ref_logp"] = np.where(BATCH["mask"] > 0, -np.inf, BATCH["ref_logp"]).astype(np.float32)
    for estimator in ("k2", "k3"):
        cfg = LossConfig(kl_coef=0.1, kl_estimator=estimator, entropy_coef=0.01)
        f = lambda lp, cfg=cfg: jnp_loss(dict(b, logp=lp), cfg)[0]
        loss, grad = jax.value_and_grad(f)(jnp.asarray(BATCH["logp"]))
        assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all(), estimator


@pytest.mark.parametrize("corr", ["tis", "mis"])
def test_decoupled_ppo_with_stale_behaviour_matches_numpy(corr):
    """Partial rollouts (rl.partial): tokens drawn 0..4 policy versions ago. The loss is decoupled
    PPO, -(1/N) sum_t w_t min(r_t A, clip(r_t) A) with r = pi/pi_prox (pi_prox = old_logp, the
    learner's recomputation) and w = pi_prox/pi_behav (the sampler's log-probs of the version that
    drew the token): truncated at is_cap (tis), or 0/1 outside [mis_low, mis_high] (mis)."""
    rng = np.random.default_rng(7)
    b, t = 6, 9
    mask = (np.arange(t)[None] < rng.integers(2, t + 1, b)[:, None]).astype(np.float32)
    logp = -rng.exponential(1.2, (b, t))
    prox = logp - rng.normal(0.0, 0.15, (b, t))
    age = rng.integers(0, 5, (b, t))  # versions behind the proximal policy
    behav = prox - rng.normal(0.0, 0.35, (b, t)) * age
    adv = rng.normal(size=b)
    cfg = LossConfig(is_correction=corr, kl_coef=0.0, aggregation="token_mean")
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    loss, _ = grpo_loss(f32(logp), f32(prox), f32(behav), None, f32(adv), f32(mask), cfg,
                        global_tokens=mask.sum(), global_seqs=b)  # fmt: skip
    logp, prox, behav = (np.float64(np.float32(x)) for x in (logp, prox, behav))
    total = 0.0
    for i in range(b):
        a = float(np.float32(adv[i]))
        for j in range(int(mask[i].sum())):
            r = math.exp(logp[i, j] - prox[i, j])
            clipped = min(max(r, 1 - cfg.eps_low), 1 + cfg.eps_high)
            w = math.exp(prox[i, j] - behav[i, j])
            if corr == "tis":
                w = min(w, cfg.is_cap)
            else:
                w = 1.0 if cfg.mis_low <= w <= cfg.mis_high else 0.0
            total += -w * min(r * a, clipped * a)
    np.testing.assert_allclose(float(loss), total / mask.sum(), rtol=1e-6, atol=1e-6)
