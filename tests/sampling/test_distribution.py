"""The sampling distribution against an independent float64 numpy reference: temperature x top-k x
top-p x banned tokens, with ties at both cut-offs; the kept set is stable under jit; the entropy
gradient stays finite on truncated distributions. `sample` draws the token categorical draws from
`log_probs` for the same keys, with that token's log-prob, and never leaves the kept set."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sampling.distribution import (
    SamplingParams,
    _kept,
    _kept_top_k,
    banned_stop_ids,
    entropy,
    log_probs,
    sample,
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


@pytest.mark.parametrize(
    "vocab, top_p",
    [(5, 1.0), (50, 0.95),  # no truncation, and top-p over the larger vocabulary
     # the other top_p at each vocabulary: full suite only (fast tier < 5 min)
     *(pytest.param(*p, marks=pytest.mark.slow)
       for p in [(5, 0.5), (5, 0.8), (5, 0.95), (50, 0.5), (50, 0.8), (50, 1.0)])],
)  # fmt: skip
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


SETTINGS = [(0.6, 0.95), (1.0, 0.8), (1.3, 0.8)]  # (temperature, top_p)


def _grid(shapes, fast=(0, 1, 2)):
    """Every (shape, temperature, top_p); the fast tier runs the diagonal's entries `fast` (each
    shape once, each setting once), the full suite all nine."""
    return [pytest.param(s, t, p, marks=() if i == j and i in fast else pytest.mark.slow,
                         id=f"{'x'.join(map(str, s))}-{t}-{p}")
            for i, s in enumerate(shapes) for j, (t, p) in enumerate(SETTINGS)]  # fmt: skip


@pytest.mark.parametrize("shape,temperature,top_p", _grid([(2, 3, 64), (8, 37, 151), (4, 128)]))
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


# Greedy, temperature 1, and T 0.7 with top-k, top-p and both (banned ids come with each test).
SAMPLE_PARAMS = [
    SamplingParams(0.0),
    SamplingParams(1.0),
    SamplingParams(0.7, top_k=3),
    SamplingParams(0.7, top_p=0.8),
    SamplingParams(0.7, top_k=7, top_p=0.8),
]
jit_sample = jax.jit(sample, static_argnums=1)


@functools.partial(jax.jit, static_argnums=1)
def old_path(logits, params, banned, keys):
    """The decode step before `sample`: materialised log-probs, then categorical or argmax."""
    lp = log_probs(logits, params, banned)
    if params.temperature == 0:
        tok = jnp.argmax(lp, axis=-1).astype(jnp.int32)
    else:
        tok = jax.vmap(jax.random.categorical)(keys, lp).astype(jnp.int32)
    return tok, lp


def _keys(seed, n):
    return jax.random.split(jax.random.key(seed), n)


@pytest.mark.parametrize("params", SAMPLE_PARAMS, ids=str)
def test_sample_logp_matches_log_probs_and_numpy(params):
    """On tied quarter-grid logits, with and without banned ids: logp is log_probs at the token
    and the float64 formula at the token; greedy is the first argmax of the unbanned logits."""
    rng = np.random.default_rng(7)
    logits = _logits(rng, 8, 50, params.top_p)
    banned = np.zeros(logits.shape, bool)
    banned[::2, [0, 2]] = True
    banned[1, np.argmax(logits[1])] = True  # ban a row's favourite
    for ban in (None, banned):
        for seed in range(3):
            tok, logp = jit_sample(logits, params, ban, _keys(seed, len(logits)))
            tok, logp = np.asarray(tok), np.asarray(logp)
            assert tok.dtype == np.int32 and logp.dtype == np.float32
            lp = np.asarray(log_probs(logits, params, ban))
            np.testing.assert_allclose(logp, lp[np.arange(len(tok)), tok], atol=1e-5)
            for i, t in enumerate(tok):
                row_ban = None if ban is None else ban[i]
                want = reference(logits[i], params.temperature, params.top_k, params.top_p, row_ban)
                np.testing.assert_allclose(logp[i], want[t], atol=1e-5, err_msg=str((i, seed)))
                if params.temperature == 0:
                    z = np.where(row_ban, -np.inf, logits[i]) if ban is not None else logits[i]
                    assert t == np.argmax(z), (i, seed)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("params", SAMPLE_PARAMS, ids=str)
def test_sample_draws_the_categorical_token(params, dtype):
    """Same keys, same token as the old path, bit for bit: the same gumbel noise added to the same
    log-softmax values. Random normal logits (bf16 ones have ties), a banned stop id early on."""
    b, v = 64, 1000
    logits = (jax.random.normal(jax.random.key(1), (b, v)) * 4).astype(dtype)
    banned = banned_stop_ids(jnp.arange(b) < b // 2, (5, 17), v)
    for seed in range(4):
        keys = _keys(seed, b)
        tok, logp = jit_sample(logits, params, banned, keys)
        want, lp = old_path(logits, params, banned, keys)
        np.testing.assert_array_equal(np.asarray(tok), np.asarray(want), err_msg=str(seed))
        want_lp = np.asarray(jnp.take_along_axis(lp, want[:, None], -1)[:, 0])
        np.testing.assert_allclose(np.asarray(logp), want_lp, atol=1e-5)


@pytest.mark.parametrize("params", SAMPLE_PARAMS[1:], ids=str)
def test_sample_stays_in_the_kept_set_with_the_right_frequencies(params):
    """4096 draws per row: never a banned or truncated token, and each token's frequency within
    0.03 of its probability (about 5 standard deviations)."""
    rng = np.random.default_rng(3)
    base = _logits(rng, 4, 12, params.top_p)
    banned = np.zeros(base.shape, bool)
    banned[0, np.argmax(base[0])] = banned[2, 3] = True
    n = 4096
    logits, ban = np.repeat(base, n, 0), np.repeat(banned, n, 0)
    tok, _ = jit_sample(logits, params, ban, _keys(11, len(logits)))
    tok = np.asarray(tok).reshape(len(base), n)
    for i in range(len(base)):
        p = np.exp(reference(base[i], params.temperature, params.top_k, params.top_p, banned[i]))
        assert (p[tok[i]] > 0).all(), i
        np.testing.assert_allclose(np.bincount(tok[i], minlength=12) / n, p, atol=0.03)


def test_top_k_without_sort_is_kepts_set():
    """`_kept_top_k` (lax.top_k threshold) keeps exactly `_kept`'s top-k set: ties at the k-th
    value, -inf (banned) entries, k past the number of finite entries."""
    rng = np.random.default_rng(5)
    z = np.round(rng.normal(size=(16, 9)) * 3) / 2  # many ties
    z[::3, [1, 4, 7]] = -np.inf
    z = jnp.asarray(z, jnp.float32)
    for k in range(1, 10):
        fast = _kept_top_k(z, k)
        np.testing.assert_array_equal(fast, _kept(z, SamplingParams(1.0, top_k=k)), err_msg=k)
    kept = np.asarray(_kept_top_k(jnp.log(jnp.array([0.4, 0.2, 0.2, 0.1, 0.1])), 2))
    assert kept.tolist() == [True, True, True, False, False]


# The fast tier: the largest shape only (test_jit_never_drops_the_whole_set runs the diagonal).
@pytest.mark.parametrize("shape,temperature,top_p", _grid([(8, 151), (4, 128), (32, 1024)], (2,)))
def test_sample_top_p_under_jit_is_finite(shape, temperature, top_p):
    """Under jit (logits from a matmul, as in the model), the token is one log_probs keeps and
    its log-prob is finite: the kept set cannot come out empty."""
    x = jax.random.normal(jax.random.key(sum(shape)), shape) * 4
    params = SamplingParams(temperature, top_p=top_p)
    f = jax.jit(lambda x, keys: sample(x @ jnp.eye(shape[-1]), params, None, keys))
    for seed in range(3):
        tok, logp = f(x, _keys(seed, shape[0]))
        assert np.isfinite(np.asarray(logp)).all()
        lp = np.asarray(log_probs(x, params))
        assert np.isfinite(lp[np.arange(shape[0]), np.asarray(tok)]).all()


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=50)], ids=str)
def test_sample_needs_one_fewer_bv_temporary(params):
    """XLA (CPU here) keeps at least one [B,V] f32 array fewer for `sample` than for the old path:
    the materialised log-probs. (With top-p the sort's buffers dominate both and the two are equal
    on CPU; there the saving is the log-prob write and re-read, not peak memory.)"""
    b, v = 64, 4096
    x, keys = jnp.zeros((b, v)), _keys(0, b)

    def temp_bytes(f):
        return jax.jit(f).lower(x, keys).compile().memory_analysis().temp_size_in_bytes

    new = temp_bytes(lambda x, keys: sample(x, params, None, keys))
    old = temp_bytes(lambda x, keys: old_path(x, params, None, keys)[0])  # log-probs a temporary
    assert new <= old - b * v * 4, (new, old)
