"""The jitted GRPO train step: exact accumulation and sharding, π_old ratio, shardings kept, no
recompiles, chunked log-prob memory, and a bandit that GRPO must solve."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from launch.dry_run import abstract_batch
from models.config import ModelConfig
from models.sharding import (
    DEFAULT_RULES,
    abstract_model,
    flatten,
    init_params,
    make_mesh,
    state_shardings,
    with_shardings,
)
from rl.learner import Batch, Learner, LearnerConfig, batch_sharding
from rl.logprobs import token_logprobs
from rl.losses import AGGREGATIONS, LossConfig
from rl.optimizer import clip_by_global_norm, decayed, make_optimizer
from sampling.distribution import SamplingParams, log_probs

CFG = ModelConfig(
    family="qwen2", vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, qkv_bias=True, tie_embeddings=True,
)  # fmt: skip


def _batch(rows=32, t=24, seed=0):
    """Prompts of 2..6 tokens and completions of 1..17 tokens, right-padded to t."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((rows, t), np.int32)
    valid = np.zeros((rows, t), bool)
    loss_mask = np.zeros((rows, t - 1), np.float32)
    for i in range(rows):
        p, c = rng.integers(2, 7), rng.choice([1, 2, 17, *rng.integers(1, 18, 5)])
        tokens[i, : p + c] = rng.integers(3, CFG.vocab_size, p + c)
        valid[i, : p + c] = True
        loss_mask[i, p - 1 : p + c - 1] = 1.0  # targets tokens[p : p+c]
    positions = np.tile(np.arange(t, dtype=np.int32), (rows, 1))
    return Batch(
        tokens=tokens,
        positions=positions,
        segment_ids=valid.astype(np.int32),
        loss_mask=loss_mask,
        advantages=np.repeat(rng.normal(size=(rows, 1)).astype(np.float32), t - 1, axis=1),
        sampler_logp=np.where(loss_mask > 0, -rng.uniform(3.5, 4.5, loss_mask.shape), 0).astype(
            np.float32
        ),
        ref_logp=np.where(loss_mask > 0, -rng.uniform(3.5, 4.5, loss_mask.shape), 0).astype(
            np.float32
        ),
    )


@pytest.fixture(scope="module")
def model():
    graphdef, params = init_params(CFG, make_mesh({}, devices=jax.devices()[:1]), seed=0)
    return graphdef, jax.device_get(params)


def _setup(model, mesh, batch):
    graphdef, host_params = model
    shardings = state_shardings(host_params, mesh, DEFAULT_RULES)
    params = jax.device_put(host_params, shardings)
    batch = jax.device_put(batch, batch_sharding(mesh, DEFAULT_RULES))
    return graphdef, shardings, params, batch


# token_mean (one token count over all micro-batches) in the fast tier, the rest in the full suite
# (seq_mean_token_mean's one sequence count is in the fast tier through test_packing's gradient).
FAST = ("token_mean",)


@pytest.mark.parametrize(
    "aggregation",
    [pytest.param(a, marks=() if a in FAST else pytest.mark.slow) for a in AGGREGATIONS],
)
def test_accumulation_and_data_parallel_are_exact(model, aggregation):
    loss = LossConfig(aggregation=aggregation, max_new_tokens=17, is_correction="tis")
    batch = _batch()
    # Old log-probs away from the current ones, so that clipping is active in the gradient, and
    # from the sampler's by a varying amount whose largest |difference| (1.25) is in one row.
    noise = np.random.default_rng(2).uniform(-0.2, 0.2, batch.sampler_logp.shape)
    noise[21, :] = 0.95  # row 21: micro-batch 1 of 4, and the second device's half of the rows
    batch = batch.replace(old_logp=(batch.sampler_logp + 0.3 + noise).astype(np.float32))
    results = []
    for micro, mesh_shape, n_dev in [(1, {}, 1), (4, {}, 1), (1, {"data": 2}, 2)]:
        mesh = make_mesh(mesh_shape, devices=jax.devices()[:n_dev])
        graphdef, shardings, params, b = _setup(model, mesh, batch)
        learner = Learner(
            LearnerConfig(micro_batches=micro, loss=loss, logprob_chunk=8), graphdef, shardings
        )
        grads, metrics = learner.grads(params, b)
        results.append((flatten(jax.device_get(grads)), jax.device_get(metrics)))
    (g1, m1), others = results[0], results[1:]
    assert max(np.abs(g).max() for g in g1.values()) > 1e-3  # a real gradient, not zeros
    for g, m in others:
        for k in g1:
            np.testing.assert_allclose(g[k], g1[k], atol=1e-6, rtol=0, err_msg=k)
        np.testing.assert_allclose(m["loss"], m1["loss"], atol=1e-6)
        # Maxima are maxed over micro-batches and devices, never summed; the rest summed.
        for k in ("mismatch_abs_logp_max", "ratio_max", "is_weight_max", "mismatch_kl"):
            np.testing.assert_allclose(m[k], m1[k], rtol=1e-6, err_msg=k)
    valid = np.asarray(batch.loss_mask) > 0
    d = np.abs(np.asarray(batch.old_logp) - np.asarray(batch.sampler_logp))[valid]
    np.testing.assert_allclose(m1["mismatch_abs_logp_max"], d.max(), rtol=1e-6)
    assert abs(d.max() - 1.25) < 1e-5


def test_ratio_is_exactly_one_with_recomputed_old_logp(model):
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, shardings, params, batch = _setup(model, mesh, _batch())
    learner = Learner(LearnerConfig(loss=LossConfig(is_correction="none")), graphdef, shardings)
    _, metrics = learner.grads(params, batch)
    assert float(metrics["ratio_mean"]) == 1.0 and float(metrics["ratio_max"]) == 1.0
    assert float(metrics["clip_frac_low"]) == 0.0 and float(metrics["clip_frac_high"]) == 0.0


def test_bypass_ratio_and_mismatch_metrics(model):
    """Bypass: π_old = sampler log-probs. Here the 'sampler' is an independent unchunked dense
    log-softmax of the same parameters (the paged sampler's own check lives with the sampler)."""
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, shardings, params, batch = _setup(model, mesh, _batch())

    @jax.jit
    def dense_logp(params, b):
        logits = nnx.merge(graphdef, params)(b.tokens, b.positions, b.segment_ids)[0][:, :-1]
        lp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(lp, b.tokens[:, 1:, None], axis=-1)[..., 0]

    sampler = np.asarray(dense_logp(params, batch))
    batch = batch.replace(sampler_logp=sampler, old_logp=sampler)
    learner = Learner(LearnerConfig(old_logp="sampler"), graphdef, shardings)
    learner_logp = np.asarray(learner.logprobs(params, batch))
    _, metrics = learner.grads(params, batch)
    mask = np.asarray(batch.loss_mask) > 0
    ratio = np.exp(learner_logp - sampler)[mask]
    assert np.abs(ratio - 1).max() < 1e-4
    assert abs(float(metrics["ratio_mean"]) - 1) < 1e-4
    # Mismatch metrics equal numpy on the two arrays (π_old vs sampler: both are `sampler` here,
    # so use a shifted sampler to make them non-trivial).
    shifted = sampler + np.random.default_rng(1).normal(0, 0.05, sampler.shape).astype(np.float32)
    _, metrics = Learner(LearnerConfig(), graphdef, shardings).grads(
        params, batch.replace(sampler_logp=shifted, old_logp=learner_logp)
    )
    d = (learner_logp - shifted)[mask]
    np.testing.assert_allclose(metrics["mismatch_abs_logp"], np.abs(d).mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["mismatch_kl"], (np.exp(d) - d - 1).mean(), rtol=1e-4)


def test_step_keeps_shardings_and_compiles_once(model):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, shardings, params, _ = _setup(model, mesh, _batch())
    before = {k: v.sharding for k, v in flatten(params).items()}
    learner = Learner(LearnerConfig(learning_rate=1e-3, micro_batches=2), graphdef, shardings)
    state = learner.init_state(params)
    sizes = []  # the step's cache (shared by the Learners of this key: rl.learner._shared)
    for seed in range(3):
        batch = jax.device_put(_batch(seed=seed), batch_sharding(mesh, DEFAULT_RULES))
        state, metrics = learner.step(state, batch)
        jax.block_until_ready(metrics)
        sizes.append(learner._step._cache_size())
        for k, v in flatten(state.params).items():
            assert v.sharding == before[k], k
    assert int(state.step) == 3
    assert sizes[0] == sizes[1] == sizes[2]  # steps 2 and 3 reuse step 1's program


def test_a_non_finite_step_leaves_the_state_unchanged(model):
    """NaN advantages (a NaN reward) or NaN gradients (a NaN weight): the update is skipped, the
    parameters, optimizer state and step stay bitwise as they were, and the step is counted."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, shardings, params, batch = _setup(model, mesh, _batch())
    learner = Learner(LearnerConfig(learning_rate=1e-3), graphdef, shardings)
    state, metrics = learner.step(learner.init_state(params), batch)  # one real update first
    assert float(metrics["skipped"]) == 0.0
    before = jax.device_get(state)
    nan_adv = batch.replace(advantages=batch.advantages.at[3].set(jnp.nan))
    state, metrics = learner.step(state, nan_adv)
    assert float(metrics["skipped"]) == 1.0 and not np.isfinite(float(metrics["loss"]))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), before)
    nan_params = jax.tree.map(lambda x: x * jnp.nan, state.params)  # every gradient NaN
    state, metrics = learner.step(state.replace(params=nan_params), batch)
    assert float(metrics["skipped"]) == 1.0 and not np.isfinite(float(metrics["grad_norm"]))
    assert int(state.step) == int(before.step)  # not advanced
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.opt_state), before.opt_state)


def _logprob_grad_temp_bytes(vocab, t, b=4, chunk=16):
    cfg = dataclasses.replace(CFG, vocab_size=vocab, tie_embeddings=False)
    graphdef, params = abstract_model(cfg)
    tokens = jnp.zeros((b, t), jnp.int32)
    pos = jnp.tile(jnp.arange(t), (b, 1))
    valid = jnp.ones((b, t), bool)

    def loss(params):
        model = nnx.merge(graphdef, params)
        return token_logprobs(model, tokens, pos, valid, SamplingParams(), chunk)[0].sum()

    return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes


def test_logprob_memory_does_not_scale_with_vocab_times_length():
    """The memory that a larger vocabulary costs stays that of one [B, chunk, V] block: it does
    not double with the sequence length, and it is far below the full [B, T, V] f32 logits."""
    small, large, b = 512, 16384, 4
    extra = {
        t: _logprob_grad_temp_bytes(large, t) - _logprob_grad_temp_bytes(small, t)
        for t in (256, 512)
    }
    full_logits_extra = {t: b * t * (large - small) * 4 for t in extra}  # 62 MiB at t=256
    assert extra[256] < full_logits_extra[256] / 2, extra
    assert extra[512] < 1.25 * extra[256], extra  # full logits would double


def test_grpo_solves_a_bandit():
    """One prompt, one completion token; reward 1 iff the token is 7. 50 GRPO steps, default loss."""
    cfg = dataclasses.replace(CFG, vocab_size=16)
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(cfg, mesh, seed=3)
    shardings = state_shardings(params, mesh, DEFAULT_RULES)
    lcfg = LearnerConfig(learning_rate=3e-3, loss=LossConfig(kl_coef=0.0))
    learner = Learner(lcfg, graphdef, shardings)
    state = learner.init_state(params)
    from rl.advantages import compute_advantages

    groups, g = 4, 16
    prompt = np.tile(np.array([[1, 5, 9]], np.int32), (groups * g, 1))

    @jax.jit
    def sample(params, key):
        logits = nnx.merge(graphdef, params)(prompt, np.tile(np.arange(3), (groups * g, 1)))[0]
        lp = log_probs(logits[:, -1], lcfg.sampling)
        tok = jax.random.categorical(key, lp)
        return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]

    key = jax.random.key(0)
    rewards_seen = []
    for _ in range(50):
        key, sub = jax.random.split(key)
        tok, lp = sample(state.params, sub)
        reward = (np.asarray(tok) == 7).astype(np.float32)
        rewards_seen.append(reward.mean())
        adv, _ = compute_advantages(jnp.asarray(reward), g, "group_std", 1e-6)
        tokens = np.concatenate([prompt, np.asarray(tok)[:, None]], axis=1).astype(np.int32)
        mask = np.zeros((groups * g, 3), np.float32)
        mask[:, 2] = 1.0
        batch = Batch(
            tokens=tokens,
            positions=np.tile(np.arange(4, dtype=np.int32), (groups * g, 1)),
            segment_ids=np.ones_like(tokens),
            loss_mask=mask,
            advantages=np.repeat(np.asarray(adv)[:, None], 3, axis=1),
            sampler_logp=np.pad(np.asarray(lp)[:, None], ((0, 0), (2, 0))),
        )
        state, _ = learner.learn(state, None, batch)
    assert rewards_seen[0] < 0.2, rewards_seen[:3]
    assert np.mean(rewards_seen[-5:]) > 0.9, rewards_seen[-5:]


def test_remat_gives_the_same_gradient(model):
    graphdef, host_params = model
    mesh = make_mesh({}, devices=jax.devices()[:1])
    remat_graphdef, _ = abstract_model(dataclasses.replace(CFG, remat=True))
    batch = _batch(rows=8)
    grads = []
    for gd in (graphdef, remat_graphdef):
        _, shardings, params, b = _setup((gd, host_params), mesh, batch)
        grads.append(
            flatten(jax.device_get(Learner(LearnerConfig(), gd, shardings).grads(params, b)[0]))
        )
    for k in grads[0]:
        np.testing.assert_allclose(grads[1][k], grads[0][k], atol=1e-6, rtol=0, err_msg=k)


def test_bypass_ratio_with_the_paged_sampler(model):
    """π_old taken from the paged sampler's own log-probs (bypass): the first-pass ratio is 1
    within 1e-4, i.e. the sampler-learner gap of the sampler is all that is left."""
    from sampling.engine import Engine, EngineConfig
    from sampling.episodes import generate_all

    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, shardings, params, _ = _setup(model, mesh, _batch(rows=8))
    sampling = SamplingParams(temperature=0.7)
    ecfg = EngineConfig(num_slots=8, page_size=4, num_pages=64, max_prompt_len=16,
                        max_new_tokens=12, steps_per_call=12, backend="reference")  # fmt: skip
    engine = Engine(CFG, graphdef, ecfg, sampling)
    prompts = [[5, 9, 13, 2, 7], [11, 3, 8]]
    _, results = generate_all(engine, params, engine.init_state(), prompts, num_samples=4, seed=3)
    rows = [(p, c) for p, group in zip(prompts, results) for c in group]
    t = max(len(p) + c.length for p, c in rows)
    tokens, valid = np.zeros((len(rows), t), np.int32), np.zeros((len(rows), t), bool)
    mask, sampler = (
        np.zeros((len(rows), t - 1), np.float32),
        np.zeros((len(rows), t - 1), np.float32),
    )
    for i, (p, c) in enumerate(rows):
        n = len(p) + c.length
        tokens[i, :n], valid[i, :n] = p + c.tokens, True
        mask[i, len(p) - 1 : n - 1] = 1.0
        sampler[i, len(p) - 1 : n - 1] = c.logprobs
    batch = Batch(
        tokens=tokens,
        positions=np.tile(np.arange(t, dtype=np.int32), (len(rows), 1)),
        segment_ids=valid.astype(np.int32),
        loss_mask=mask,
        advantages=np.repeat(np.linspace(-1, 1, len(rows), dtype=np.float32)[:, None], t - 1, 1),
        sampler_logp=sampler,
        old_logp=sampler,
    )
    cfg = LearnerConfig(old_logp="sampler", sampling=sampling, loss=LossConfig(kl_coef=0.0))
    _, metrics = Learner(cfg, graphdef, shardings).grads(params, batch)
    assert abs(float(metrics["ratio_mean"]) - 1) < 1e-4
    assert abs(float(metrics["ratio_max"]) - 1) < 1e-4
    assert float(metrics["mismatch_abs_logp"]) < 1e-5


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_global_norm_clipping_is_one_scalar_factor(max_norm):
    """The learner's clip equals numpy's g * min(1, max_norm / ||g||) (to f32 rounding when it
    clips, exactly when it does not) and optax's clip_by_global_norm."""
    rng = np.random.default_rng(0)
    grads = {
        "a": rng.normal(size=(7, 5)).astype(np.float32),
        "b": rng.normal(size=3).astype(np.float32),
    }
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values()))
    factor = min(1.0, max_norm / norm)
    ours, _ = clip_by_global_norm(max_norm).update(jax.tree.map(jnp.asarray, grads), None)
    theirs, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
    for k, g in grads.items():
        if factor == 1.0:
            np.testing.assert_array_equal(np.asarray(ours[k]), g)
        else:
            np.testing.assert_allclose(np.asarray(ours[k]), g * factor, rtol=2e-7, atol=0)
        np.testing.assert_allclose(np.asarray(ours[k]), np.asarray(theirs[k]), rtol=2e-7, atol=0)
    clipped = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in ours.values()))
    assert clipped == pytest.approx(min(norm, max_norm), rel=1e-6)


def test_optimizer_is_optax_adamw_with_its_state():
    """rl.optimizer's AdamW (moments fenced off from the direction) gives optax.adamw's updates and
    state bitwise over several steps, with optax's state tree (checkpoints unchanged); with
    finite=False Adam's moments and count stay as they were."""
    cfg = LearnerConfig(learning_rate=1e-2, weight_decay=0.1, warmup_steps=2, max_grad_norm=0)
    ours = make_optimizer(cfg)
    schedule = optax.linear_schedule(0.0, 1e-2, 2)
    mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    theirs = optax.chain(optax.identity(), optax.adamw(schedule, weight_decay=0.1, mask=mask))
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros(3)}
    s1, s2 = ours.init(params), theirs.init(params)
    assert jax.tree.structure(s1) == jax.tree.structure(s2)
    for _ in range(4):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        u1, s1 = jax.jit(ours.update)(grads, s1, params)
        u2, s2 = jax.jit(theirs.update)(grads, s2, params)
        jax.tree.map(np.testing.assert_array_equal, (u1, s1), (u2, s2))
        params = optax.apply_updates(params, u1)
    _, kept = jax.jit(lambda g, s, p: ours.update(g, s, p, finite=jnp.bool_(False)))(
        grads, s1, params
    )
    adam = lambda state: state[1][
        0
    ]  # (clip, (Adam, decay, schedule)): the learner selects the rest
    jax.tree.map(np.testing.assert_array_equal, adam(kept), adam(s1))


def test_the_update_holds_no_copy_of_the_gradients_or_moments():
    """XLA:CPU's temporaries of a learner step whose parameters outweigh its activations (D 512,
    16 tokens) are about one set of gradients: no clipped copy of them (optax's division) and no
    copy of Adam's moments (the skip's select read the old ones after the new were written). With
    optax's clip and the skip selecting the whole state after the update: 2.23 x the params."""
    cfg = ModelConfig(
        family="qwen2",
        vocab_size=256,
        d_model=512,
        d_ff=2048,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        max_position_embeddings=64,
        tie_embeddings=True,
    )
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, shapes = abstract_model(cfg)
    shardings = state_shardings(shapes, mesh, DEFAULT_RULES)
    learner = Learner(LearnerConfig(), graphdef, shardings)
    batch = abstract_batch(1, 16, batch_sharding(mesh, DEFAULT_RULES), ref_logp=True)
    lowered = learner.lower_step(with_shardings(shapes, shardings), batch)
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    assert temp < 1.3 * params, temp / params


def test_weight_decay_spares_norms_and_biases():
    """The decay mask of a Qwen2 model (2-D q/k/v biases): matrices and the embedding decay; the
    norms' scales and the biases do not."""
    cfg = dataclasses.replace(CFG, qkv_bias=True)
    _, shapes = abstract_model(cfg)
    mask = {
        jax.tree_util.keystr(p): decayed(p, x)
        for p, x in jax.tree_util.tree_leaves_with_path(shapes)
    }
    biases = [k for k in mask if "bias" in k]
    assert biases and not any(mask[k] for k in biases), mask
    assert not any(mask[k] for k in mask if "norm" in k), mask
    assert all(
        mask[k] for k in mask if k.endswith(("['q'].value", "['down'].value", "['embed'].value"))
    )
