"""The sampling distribution against an independent float64 numpy reference: temperature x top-k x
top-p x banned tokens, with ties at both cut-offs; the kept set is stable under jit; the entropy
gradient stays finite on truncated distributions."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sampling.distribution import (
    SamplingParams,
    banned_stop_ids,
    entropy,
    log_probs,
    tempered_log_probs,
)


def reference(logits, temperature, top_k, top_p, banned=None):
    """float64 log-probs of one row, written from the definition, token by token."""
    z = np.asarray(logits, np.float64).copy()
    if banned is not None:
        z[banned] = -np.inf
    if temperature > 0:
        z = z / temperature
    keep = np.isfinite(z)
    if temperature > 0 and top_k:
        kth = sorted(z[keep], reverse=True)[min(top_k, keep.sum()) - 1]
        keep &= z >= kth  # ties with the k-th value stay
    if temperature > 0 and top_p < 1.0:
        p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        p /= p.sum()
        chosen, mass = [], 0.0
        for i in sorted(np.nonzero(keep)[0], key=lambda i: -z[i]):
            if chosen and mass >= top_p:
                break
            chosen.append(i)
            mass += p[i]
        last = min(z[i] for i in chosen)
        keep &= z >= last  # ties with the last chosen value stay
    out = np.full(z.shape, -np.inf)
    zk = z[keep]
    out[keep] = zk - zk.max() - np.log(np.sum(np.exp(zk - zk.max())))
    return out


def _logits(rng, rows, vocab, top_p):
    """Logits on a grid of quarters, so that ties are common, rejecting rows where a token's mass
    before it lies within 1e-4 of top_p (there f32 and f64 may legitimately choose differently)."""
    out = []
    while len(out) < rows:
        x = np.round(rng.normal(size=vocab) * 8) / 4
        ok = True
        for t, k in itertools.product((0.6, 1.0, 1.3), (0, 1, 3, 7)):
            z = x / t
            if k:
                z = np.where(z >= np.sort(z)[::-1][min(k, vocab) - 1], z, -np.inf)
            p = np.exp(z - z.max())
            p = np.sort(p / p.sum())[::-1]
            ok &= top_p == 1.0 or np.min(np.abs(np.cumsum(p) - p - top_p)) > 1e-4
        if ok:
            out.append(x)
    return np.stack(out).astype(np.float32)


@pytest.mark.parametrize("top_p", [1.0, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("vocab", [5, 50])
def test_matches_numpy_reference(vocab, top_p):
    rng = np.random.default_rng(vocab)
    logits = _logits(rng, 6, vocab, top_p)
    banned = np.zeros(logits.shape, bool)
    banned[::2, [0, 2]] = True  # rows 0, 2, 4 ban two tokens (min_new_tokens)
    for temperature, top_k in itertools.product((0.0, 0.6, 1.0, 1.3), (0, 1, 3, 7)):
        params = SamplingParams(temperature, top_k, top_p)
        got = np.asarray(jax.jit(log_probs, static_argnums=1)(logits, params, banned))
        for i in range(len(logits)):
            want = reference(logits[i], temperature, top_k, top_p, banned[i])
            where = (temperature, top_k, top_p, i)
            np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want), err_msg=str(where))
            ok = np.isfinite(want)
            np.testing.assert_allclose(got[i][ok], want[ok], atol=1e-5, err_msg=str(where))


def test_hand_worked_ties():
    # Tempered probabilities 0.4, 0.2, 0.2, 0.1, 0.1 (T = 1): top_p 0.5 needs the first two, and
    # the tie at the cut-off keeps the third; top_k 4 keeps both 0.1 tokens (tie at the 4th).
    logits = np.log(np.array([0.4, 0.2, 0.2, 0.1, 0.1], np.float32))
    kept = lambda **kw: np.isfinite(np.asarray(log_probs(logits, SamplingParams(1.0, **kw))))
    assert kept(top_p=0.5).tolist() == [True, True, True, False, False]
    assert kept(top_p=0.4).tolist() == [True, False, False, False, False]
    assert kept(top_k=4).tolist() == [True] * 5
    assert kept(top_k=1, top_p=0.01).tolist() == [True, False, False, False, False]
    # Renormalised over the kept set: log(0.4 / 0.8).
    np.testing.assert_allclose(log_probs(logits, SamplingParams(1.0, top_p=0.5))[0], np.log(0.5))


def test_keep_forces_the_target_into_the_set():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]], jnp.float32))
    lp = log_probs(logits, SamplingParams(1.0, top_p=0.5), keep=jnp.array([2]))
    np.testing.assert_allclose(np.exp(lp[0]), [0.5 / 0.7, 0, 0.2 / 0.7], atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 3, 64), (8, 37, 151), (4, 128)])
@pytest.mark.parametrize("temperature,top_p", [(0.6, 0.95), (1.0, 0.8), (1.3, 0.8)])
def test_jit_never_drops_the_whole_set(shape, temperature, top_p):
    """Under jit every row keeps at least its most likely token, whatever fusion XLA picks."""
    x = jax.random.normal(jax.random.key(sum(shape)), shape) * 4
    params = SamplingParams(temperature, top_p=top_p)
    lp = jax.jit(lambda x: log_probs(x @ jnp.eye(shape[-1]), params))(x)
    assert np.isfinite(np.asarray(lp).max(-1)).all()
    top = jnp.argmax(x, -1)
    assert np.isfinite(np.asarray(jnp.take_along_axis(lp, top[..., None], -1))).all()
    np.testing.assert_allclose(np.exp(np.asarray(lp)).sum(-1), 1.0, atol=1e-5)


def test_entropy_value_and_finite_gradient_on_truncated_rows():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    p = jax.nn.softmax(logits / 0.7, -1)
    np.testing.assert_allclose(
        entropy(tempered_log_probs(logits, 0.7)), -jnp.sum(p * jnp.log(p), -1), rtol=1e-6
    )
    for params in (SamplingParams(1.0, top_k=2), SamplingParams(1.0, top_p=0.6)):
        grad = jax.grad(lambda x, params=params: entropy(log_probs(x, params)).sum())(logits)
        assert np.isfinite(np.asarray(grad)).all(), params


def test_banned_stop_ids():
    banned = banned_stop_ids(jnp.array([True, False]), (1, 3), 5)
    assert np.asarray(banned).tolist() == [[False, True, False, True, False], [False] * 5]
    assert not np.asarray(banned_stop_ids(jnp.array([True]), (), 4)).any()
