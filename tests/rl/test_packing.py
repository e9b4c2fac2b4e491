"""Packed learner rows (rl.packing) against the padded layout of the same sequences: the same
gradients and metrics for every aggregation and the per-sequence losses, with completion lengths
1..300 and micro-batching; attention never crosses a sequence boundary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import causal_mask, dense_attention
from models.sharding import DEFAULT_RULES, flatten, init_params, make_mesh, state_shardings
from rl.groups import Group
from rl.learner import Learner, LearnerConfig, batch_sharding
from rl.losses import LossConfig
from rl.packing import build_batch
from sampling.requests import Completion
from tests.rl.test_learner import CFG

WIDTH = 6 + 300  # longest prompt + longest completion


def _groups(n=16, g=4, seed=0):
    """n // g groups; prompts of 2..6 tokens, completions of 1, 300 and a long tail in 1..300."""
    rng = np.random.default_rng(seed)
    lengths = [1, 300, *np.clip(rng.lognormal(3.0, 1.0, n - 2), 1, 300).astype(int)]
    groups = []
    for i in range(n // g):
        prompt = rng.integers(3, CFG.vocab_size, rng.integers(2, 7)).tolist()
        cs = []
        for k in range(g):
            c = int(lengths[i * g + k])
            tokens = rng.integers(3, CFG.vocab_size, c).tolist()
            cs.append(Completion(tokens, (-rng.uniform(3.5, 4.5, c)).tolist(), "stop", c))
        groups.append(Group({}, prompt, cs, [], np.zeros(g, np.float32), {}))
    return groups


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh({}, devices=jax.devices()[:1])  # sharded packed rows: tests/rl/test_rollout
    graphdef, params = init_params(CFG, mesh, seed=0)
    shardings = state_shardings(params, mesh, DEFAULT_RULES)
    groups = _groups()
    adv = np.random.default_rng(1).normal(size=16).astype(np.float32)
    batches = []
    for pack in (False, True):
        batch, layout = build_batch(groups, WIDTH, 0, pack=pack, multiple=4)
        batch = batch.replace(advantages=layout.spread(adv))
        batches.append(jax.device_put(batch, batch_sharding(mesh, DEFAULT_RULES)))
    assert batches[0].tokens.shape[0] == 16 and batches[1].tokens.shape[0] == 4
    learner = Learner(LearnerConfig(), graphdef, shardings)
    ref = jax.tree.map(lambda x: 0.9 * x, params)  # a reference model that differs
    batches = [b.replace(ref_logp=learner.logprobs(ref, b, "full")) for b in batches]
    return graphdef, shardings, params, batches


# Every aggregation, each with a loss that reduces per sequence somewhere else too.
LOSSES = [
    dict(aggregation="token_mean", is_correction="tis", is_cap=1.05),
    dict(aggregation="seq_mean_token_mean", policy_loss="gspo", is_correction="mis",
         is_level="sequence", mis_low=0.05, mis_high=20.0),
    dict(aggregation="seq_mean_token_sum", is_correction="tis", is_level="sequence",
         entropy_coef=0.01),
    dict(aggregation="drgrpo_constant", policy_loss="dual_clip"),
]  # fmt: skip


# The most per-sequence of them (GSPO, sequence-level MIS) in the fast tier, the rest in the full suite.
@pytest.mark.parametrize(
    "loss",
    [pytest.param(d, id=d["aggregation"], marks=() if d is LOSSES[1] else pytest.mark.slow)
     for d in LOSSES],
)  # fmt: skip
def test_packed_and_padded_give_the_same_gradient(setup, loss):
    graphdef, shardings, params, (padded, packed) = setup
    cfg = LearnerConfig(micro_batches=2, loss=LossConfig(kl_coef=0.04, max_new_tokens=300, **loss))
    learner = Learner(cfg, graphdef, shardings)
    (g_pad, m_pad), (g_pack, m_pack) = (jax.device_get(learner.grads(params, b))
                                        for b in (padded, packed))  # fmt: skip
    g_pad, g_pack = flatten(g_pad), flatten(g_pack)
    for name in g_pad:
        np.testing.assert_allclose(g_pack[name], g_pad[name], atol=1e-6, rtol=0, err_msg=name)
    assert float(m_pad["grad_norm"]) > 1e-4  # a real gradient
    for key in ("loss", "kl", "tokens", "response_length_mean", "response_length_max"):
        np.testing.assert_allclose(m_pack[key], m_pad[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert float(m_pack["response_length_max"]) == 300


def test_log_probs_of_a_sequence_do_not_depend_on_its_row_neighbours(setup):
    graphdef, shardings, params, (padded, packed) = setup
    learner = Learner(LearnerConfig(), graphdef, shardings)
    lp_pack = np.asarray(learner.logprobs(params, packed))
    # The tokens of every other sequence of the packed rows replaced: nothing changes.
    seg = np.asarray(packed.segment_ids)
    noise = np.random.default_rng(2).integers(3, CFG.vocab_size, seg.shape)
    tokens = np.where(seg % 2 == 0, noise, np.asarray(packed.tokens)).astype(np.int32)
    other = packed.replace(tokens=jax.device_put(tokens, packed.tokens.sharding))
    lp_other = np.asarray(learner.logprobs(params, other))
    odd = (seg[:, 1:] % 2 == 1) & (np.asarray(packed.loss_mask) > 0)
    np.testing.assert_array_equal(lp_other[odd], lp_pack[odd])
    # And they equal the padded layout's log-probs of the same tokens.
    lp_pad = np.asarray(learner.logprobs(params, padded))
    mask_pad, mask_pack = np.asarray(padded.loss_mask) > 0, np.asarray(packed.loss_mask) > 0
    assert mask_pad.sum() == mask_pack.sum()
    np.testing.assert_allclose(np.sort(lp_pack[mask_pack]), np.sort(lp_pad[mask_pad]), atol=1e-5)


def test_no_attention_weight_crosses_a_segment_boundary():
    seg = jnp.array([[1, 1, 1, 2, 2, 3, 3, 3, 0, 0], [1, 1, 1, 1, 1, 1, 2, 2, 2, 0]])
    mask = causal_mask(seg)  # [B,T,T]
    q, k = (jax.random.normal(jax.random.key(i), (2, 10, 2, 4)) for i in range(2))
    # Attention weights: the output for values that are 1 at key j only is the weight of key j.
    weights = []
    for j in range(10):
        onehot = jnp.zeros((2, 10, 2, 4)).at[:, j].set(1.0)
        weights.append(dense_attention(q, k, onehot, mask)[..., 0])  # [B,T,N]
    w = jnp.stack(weights, axis=-1)  # [B,T,N,S]
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    causal = jnp.tril(jnp.ones((10, 10), bool))
    real = seg > 0  # padding queries' outputs are never keys of a real query, nor scored
    crossing = jnp.where((same & causal)[:, :, None], 0.0, w)[real]
    assert float(jnp.abs(crossing).max()) == 0.0
    np.testing.assert_allclose(w.sum(-1)[real], 1.0, atol=1e-6)  # each real query's weights


def test_minibatches_see_the_same_sequences_packed_and_padded(setup):
    """With 2 minibatches each optimizer step packs the sequences the padded layout gives it: the
    same per-step token counts and losses, and no step is empty."""
    graphdef, shardings, params, _ = setup
    groups, adv = _groups(), np.random.default_rng(1).normal(size=16)
    cfg = LearnerConfig(minibatches=2, old_logp="sampler", loss=LossConfig(kl_coef=0.0))
    history = []
    for pack in (False, True):
        batch, layout = build_batch(groups, WIDTH, 0, pack=pack, multiple=2, minibatches=2)
        learner = Learner(cfg, graphdef, shardings)
        state = learner.init_state(jax.tree.map(jnp.copy, params))
        _, h = learner.learn(state, None, batch.replace(advantages=layout.spread(adv)))
        history.append(h)
    assert len(history[1]) == 2 and all(float(m["tokens"]) > 0 for m in history[1])
    for pad, pack in zip(*history):
        for key in ("tokens", "loss", "grad_norm"):
            np.testing.assert_allclose(pack[key], pad[key], rtol=1e-5, atol=1e-7, err_msg=key)
