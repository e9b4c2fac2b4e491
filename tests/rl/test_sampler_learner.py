"""The paged sampler and the learner agree on every sampling option a rollout can use: top-p at
several temperatures, top-k, min_new_tokens; the learner stays finite when a sampled token falls
outside its own or the reference's top-p set; the reference and the KL use the full softmax."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.sharding import DEFAULT_RULES, init_params, make_mesh, state_shardings
from rl.groups import Group
from rl.learner import Learner, LearnerConfig
from rl.losses import LossConfig
from rl.packing import build_batch
from sampling.distribution import SamplingParams, tempered_log_probs
from sampling.engine import Engine, EngineConfig
from sampling.episodes import generate_all

CFG = ModelConfig(
    family="llama", vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8,
)  # fmt: skip
STOP_IDS = tuple(range(1, 9))
ECFG = EngineConfig(
    num_slots=8, page_size=4, num_pages=80, max_prompt_len=12, max_new_tokens=10,
    steps_per_call=5, stop_ids=STOP_IDS, backend="reference",
)  # fmt: skip
SEQ = ECFG.max_prompt_len + ECFG.max_new_tokens


@pytest.fixture(scope="module")
def models():
    """(graphdef, params, shardings) per vocabulary size, on one device."""
    mesh = make_mesh({}, devices=jax.devices()[:1])
    out = {}
    for vocab in (64, 211):
        graphdef, params = init_params(dataclasses.replace(CFG, vocab_size=vocab), mesh, seed=1)
        # Sharper logits than the random init gives, so that top-p keeps few tokens.
        params = jax.jit(lambda p: jax.tree.map(lambda x: x * 3.0, p))(params)
        out[vocab] = graphdef, params, state_shardings(params, mesh, DEFAULT_RULES)
    return out


def _rollout(model, vocab, sampling, n_prompts, g, min_new=0, seed=0):
    """A learner batch (numpy) of n_prompts x g completions from the paged sampler."""
    graphdef, params, _ = model
    ecfg = dataclasses.replace(ECFG, min_new_tokens=min_new)
    engine = Engine(dataclasses.replace(CFG, vocab_size=vocab), graphdef, ecfg, sampling)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(9, vocab, rng.integers(2, 12)).tolist() for _ in range(n_prompts)]
    _, results = generate_all(engine, params, engine.init_state(), prompts, g, seed=seed)
    groups = [Group({}, p, cs, [], np.zeros(g, np.float32), {}) for p, cs in zip(prompts, results)]
    batch, layout = build_batch(groups, SEQ, 0, min_new_tokens=min_new)  # packed rows
    return batch.replace(advantages=layout.spread(rng.normal(size=n_prompts * g)))


def _copy(params):
    return jax.tree.map(jnp.copy, params)  # the learner donates its state


@pytest.mark.parametrize(
    "temperature, top_p, vocab, n_prompts, g",
    [(0.6, 0.8, 64, 2, 4),
     # the other temperatures, and the vocabulary of 211 (not a multiple of any block), in the
     # full suite only
     *(pytest.param(*p, marks=pytest.mark.slow) for p in
       [(1.0, 0.95, 64, 4, 2), (1.3, 0.8, 64, 2, 4),
        (0.6, 0.95, 211, 3, 4), (1.0, 0.8, 211, 1, 8), (1.3, 0.95, 211, 3, 2)])],
)  # fmt: skip
def test_top_p_learner_equals_sampler_and_steps_stay_finite(
    models, temperature, top_p, vocab, n_prompts, g
):
    """Under jit, on several batch and vocabulary shapes: the learner's log-probs of the sampled
    tokens equal the sampler's within 1e-5, and three learner steps (KL and entropy terms on)
    keep every metric and parameter finite."""
    sampling = SamplingParams(temperature, top_p=top_p)
    graphdef, params, shardings = models[vocab]
    batch = _rollout(models[vocab], vocab, sampling, n_prompts, g, seed=vocab)
    loss = LossConfig(kl_coef=0.04, entropy_coef=0.01)
    cfg = LearnerConfig(learning_rate=1e-2, sampling=sampling, loss=loss, num_iterations=3)
    learner = Learner(cfg, graphdef, shardings)
    mask = batch.loss_mask > 0
    got = np.asarray(learner.logprobs(params, batch))
    np.testing.assert_allclose(got[mask], batch.sampler_logp[mask], atol=1e-5, rtol=0)
    state, history = learner.learn(learner.init_state(_copy(params)), params, batch)
    assert len(history) == 3
    for h in history:
        assert all(np.isfinite(v) for v in jax.tree.leaves(h)), h
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def test_min_new_tokens_is_applied_by_the_learner(models):
    """The sampler banned the stop ids for the first 4 tokens; the learner bans them at the same
    completion positions, so its log-probs equal the sampler's there too."""
    sampling = SamplingParams(1.0, top_k=20)
    graphdef, params, shardings = models[64]
    batch = _rollout(models[64], 64, sampling, 2, 4, min_new=4, seed=3)
    mask = batch.loss_mask > 0
    assert batch.stop_masked.sum() == 8 * 4 and not (batch.stop_masked & ~mask).any()
    learner = Learner(LearnerConfig(sampling=sampling, stop_ids=STOP_IDS), graphdef, shardings)
    got = np.asarray(learner.logprobs(params, batch))
    np.testing.assert_allclose(got[mask], batch.sampler_logp[mask], atol=1e-5, rtol=0)
    # Without the ban the first positions differ: the stop ids hold real probability mass.
    unbanned = np.asarray(learner.logprobs(params, batch.replace(stop_masked=None)))
    assert np.abs(unbanned - got)[batch.stop_masked].max() > 1e-3


def test_reference_and_kl_use_the_full_softmax_and_stay_finite(models):
    """A reference whose top-p set misses sampled tokens: the KL is still finite and equals k3 of
    the tempered full softmaxes (numpy), and the loss gradient is finite."""
    sampling = SamplingParams(0.7, top_p=0.5)
    graphdef, params, shardings = models[64]
    batch = _rollout(models[64], 64, sampling, 2, 4, seed=5)
    ref = jax.tree.map(lambda x: -x, params)  # a reference that disagrees about everything
    learner = Learner(LearnerConfig(sampling=sampling, loss=LossConfig(kl_coef=0.1)),
                      graphdef, shardings)  # fmt: skip
    mask = batch.loss_mask > 0
    ref_truncated = np.asarray(learner.logprobs(ref, batch))
    assert np.isfinite(ref_truncated[mask]).all()  # the target is always kept in the set
    model = lambda p: jax.jit(learner.logprobs, static_argnums=2)(p, batch, "full")
    pi_full, ref_full = np.asarray(model(params)), np.asarray(model(ref))
    # The full tempered softmax, from the logits directly.
    from flax import nnx

    logits = nnx.merge(graphdef, ref)(batch.tokens, batch.positions, batch.segment_ids)[0][:, :-1]
    want = np.take_along_axis(
        np.asarray(tempered_log_probs(logits, 0.7)), batch.tokens[:, 1:, None], -1
    )[..., 0]
    np.testing.assert_allclose(ref_full[mask], want[mask], atol=1e-5)
    d = np.clip(ref_full - pi_full, -10, 10)
    k3 = (np.exp(d) - d - 1)[mask].mean()
    grads, metrics = learner.grads(params, batch.replace(ref_logp=ref_full))
    np.testing.assert_allclose(float(metrics["kl"]), k3, rtol=1e-5)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(grads))


@pytest.mark.slow  # a finiteness check over several updates; CISPO's numerics: tests/rl/test_losses
def test_cispo_with_several_updates_per_rollout_stays_finite(models):
    """μ = 4 large CISPO steps with top-k 3: the policy moves, sampled tokens may leave its top-k
    set, and every ratio, weight and parameter must stay finite."""
    sampling = SamplingParams(1.0, top_k=3)
    graphdef, params, shardings = models[211]
    batch = _rollout(models[211], 211, sampling, 2, 4, seed=7)
    cfg = LearnerConfig(learning_rate=0.1, sampling=sampling, num_iterations=4,
                        loss=LossConfig(policy_loss="cispo", kl_coef=0.0))  # fmt: skip
    learner = Learner(cfg, graphdef, shardings)
    state, history = learner.learn(learner.init_state(_copy(params)), None, batch)
    assert float(history[-1]["ratio_mean"]) != 1.0  # the policy did move
    for h in history:
        assert all(np.isfinite(v) for v in jax.tree.leaves(h)), h
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
