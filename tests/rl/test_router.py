"""The routers in the GRPO step (issue 52 item 5, rl/router.py): the load-balancing loss and the
routers' logs of a mixture of experts, against independent computations.

- the layer's RouterStats and the loss against numpy (softmax, top-k, counts, entropy and
  transformers' `load_balancing_loss_func` transcribed), its gradient against jax.grad of a plain
  jnp transcription, with and without replayed experts;
- the learner on a tiny Qwen3-MoE (tests/models/test_routing_replay.py's, f32, one device, a
  packed batch): router/aux_loss, router/entropy and the load ratios against numpy over router
  logits recomputed layer by layer, rollout/route_mismatch against the routes perturbed on
  purpose, the loss and the routers' gradient moving by coef x the loss; a dense model logs
  none of it;
- transformers (hf): Qwen3MoeForCausalLM's aux_loss with an attention mask and its gradient at
  every router equal ours;
- the expert mesh (slow): the statistics and the loss's gradient equal one device's;
- the config: rl.router_aux_loss_coef (None: the checkpoint's), its refusal, its resume
  default, and which runs record routes for the mismatch.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.default import get_config
from launch.cli import UsageError
from launch.resume_compat import check_resumable
from launch.validate import learner_config, records_routes
from models.attention import causal_hook, rope_inv_freq
from models.config import ModelConfig
from models.moe import MoE, RouterStats, moe_ffn
from models.sharding import (
    DEFAULT_RULES,
    abstract_model,
    flatten,
    init_params,
    make_mesh,
    state_shardings,
)
from rl import router
from rl.learner import Learner, LearnerConfig
from rl.losses import LossConfig
from tests.models.test_routing_replay import CFG
from tests.rl.test_routing_replay import setup  # noqa: F401 (the packed batch fixture)

NO_KL = LossConfig(kl_coef=0.0)


def _np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _np_topk(p, k):
    return np.argsort(-p, axis=-1, kind="stable")[:, :k]


def _np_hf_balance_loss(logits, mask, k):
    """transformers' load_balancing_loss_func (masked branch), per layer logits [N,E], mask [N]."""
    e = logits[0].shape[-1]
    counts, probs, rows = np.zeros(e), np.zeros(e), 0.0
    for z in logits:
        p = _np_softmax(z.astype(np.float64))
        np.add.at(counts, _np_topk(p, k).reshape(-1), np.repeat(mask, k))
        probs += (p * mask[:, None]).sum(0)
        rows += mask.sum()
    return e * np.sum(counts / rows * probs / rows)


def _np_entropy(logits):
    p = _np_softmax(logits.astype(np.float64))
    return -(p * np.log(p)).sum(-1)


def _layers(seed=0, n=40, d=16, e=8):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(n, d)).astype(np.float32) for _ in range(2)]
    routers = [rng.normal(size=(d, e)).astype(np.float32) for _ in range(2)]
    mask = (rng.random(n) < 0.7).astype(np.float32)
    return xs, routers, mask


def _stats(xs, routers, mask, k, experts=None, e=8, f=12):
    """RouterStats of two layers run through models.moe.moe_ffn (random experts' weights)."""
    rng = np.random.default_rng(1)
    w = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.1)
    gate, up, down = w(e, xs[0].shape[1], f), w(e, xs[0].shape[1], f), w(e, f, xs[0].shape[1])
    out = []
    for i, (x, r) in enumerate(zip(xs, routers)):
        ids = None if experts is None else experts[i]
        out.append(moe_ffn(x, r, gate, up, down, k, True, ids, None, jnp.asarray(mask))[2])
    return jax.tree.map(lambda *a: jnp.stack(a), *out)


@pytest.mark.parametrize("replayed", (False, True))
def test_router_stats_and_balance_loss_match_numpy(replayed):
    k = 3
    xs, routers, mask = _layers()
    logits = [x @ r for x, r in zip(xs, routers)]
    rng = np.random.default_rng(2)
    experts = [np.stack([rng.permutation(8)[:k] for _ in range(len(mask))]) for _ in xs]
    for e in experts:
        e[:5] = -1  # no record: routed by the router
    st = _stats(xs, routers, mask, k, experts if replayed else None)
    for i, z in enumerate(logits):
        p = _np_softmax(z.astype(np.float64))
        chosen, load = np.zeros(8), np.zeros(8)
        np.add.at(chosen, _np_topk(p, k).reshape(-1), np.repeat(mask, k))
        used = np.where(experts[i] < 0, _np_topk(p, k), experts[i]) if replayed else _np_topk(p, k)
        np.add.at(load, used.reshape(-1), np.repeat(mask, k))
        np.testing.assert_allclose(st.probs[i], (p * mask[:, None]).sum(0), rtol=1e-5)
        np.testing.assert_array_equal(st.chosen[i], chosen)
        np.testing.assert_array_equal(st.load[i], load)
        np.testing.assert_allclose(st.entropy[i], (_np_entropy(z) * mask).sum(), rtol=1e-5)
    want = _np_hf_balance_loss(logits, mask, k)
    got = router.balance_loss(st, mask.sum())
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert want > k  # these routers are not balanced (k is the balanced value)

    def ours(rs):
        return router.balance_loss(_stats(xs, rs, mask, k, experts if replayed else None), 1.0)

    def plain(rs):  # transformers' formula in jnp: concatenated layers, one-hot top-k counts
        z = jnp.concatenate([x @ r for x, r in zip(xs, rs)])
        m = jnp.tile(jnp.asarray(mask), len(xs))
        p = jax.nn.softmax(z, axis=-1)
        top = jax.nn.one_hot(jax.lax.top_k(jax.lax.stop_gradient(p), k)[1], 8).sum(1)
        f = (top * m[:, None]).sum(0) / m.sum()
        return 8 * jnp.sum(f * (p * m[:, None]).sum(0) / m.sum())

    g = jax.grad(ours)([jnp.asarray(r) for r in routers])
    g_plain = jax.grad(plain)([jnp.asarray(r) for r in routers])
    scale = float(mask.sum())  # ours counts `num_tokens` = 1: the sums are not divided by it
    for a, b in zip(g, g_plain):
        assert np.abs(np.asarray(b)).max() > 1e-4  # the loss's gradient reaches the routers
        np.testing.assert_allclose(np.asarray(a) / scale**2, b, rtol=1e-4, atol=1e-7)


def _router_logits(graphdef, params, batch):
    """Each MoE layer's router logits [B*T, E] (numpy), the blocks run one by one here."""
    model = nnx.merge(graphdef, params)
    tokens, positions = jnp.asarray(batch.tokens), jnp.asarray(batch.positions)
    hook = causal_hook(jnp.asarray(batch.segment_ids), "dense")
    inv = jnp.asarray(rope_inv_freq(CFG))
    x = jnp.take(model.embed[...], tokens, axis=0)
    out = []
    for layer, block in enumerate(model.blocks):
        a, hook = block.attn(block.attn_norm(x), positions, inv, layer, hook)
        x = x + a
        z = block.mlp_norm(x)
        if isinstance(block.mlp, MoE):
            r = np.asarray(block.mlp.router[...])
            out.append(np.asarray(z).reshape(-1, z.shape[-1]) @ r)
        x = x + block.mlp(z)
    return out


def _perturbed(batch, rng):
    """Batch.routes with one layer's experts changed at 3 recorded tokens and at one token
    that is not recorded (a sequence's last): (routes, the 3 positions)."""
    seg = batch.segment_ids
    last = [
        (r, t)
        for r in range(seg.shape[0])
        for t in range(seg.shape[1])
        if seg[r, t] and (t + 1 == seg.shape[1] or seg[r, t + 1] != seg[r, t])
    ]
    inner = [
        (r, t)
        for r in range(seg.shape[0])
        for t in range(seg.shape[1])
        if seg[r, t] and (r, t) not in last
    ]
    routes = np.array(batch.routes)
    picked = [inner[i] for i in rng.choice(len(inner), 3, replace=False)]
    for i, (r, t) in enumerate([*picked, last[0]]):
        layer = i % 2
        free = [e for e in range(8) if e not in routes[r, t, layer]]
        routes[r, t, layer] = free[:2]  # a different set of 2 experts
    return routes, picked


@pytest.mark.slow  # three learner compiles: 45 s on the loaded shared host
def test_learner_logs_and_adds_the_routers_terms(setup):  # noqa: F811
    _, batch, _, replaying, params = setup
    batch = batch.replace(advantages=np.ones_like(batch.advantages))
    mesh = make_mesh({}, devices=jax.devices()[:1])
    sh = state_shardings(params, mesh, DEFAULT_RULES)
    routes, picked = _perturbed(batch, np.random.default_rng(0))
    batch = batch.replace(routes=None, route_digest=router.digest(routes, np))  # replay off
    learner = lambda **kw: Learner(LearnerConfig(loss=NO_KL, **kw), replaying.graphdef, sh)
    grads0, m0 = learner().grads(params, batch)  # replay off, coefficient 0 (the default)
    logits = _router_logits(replaying.graphdef, params, batch)
    real = (batch.segment_ids != 0).reshape(-1).astype(np.float64)
    k = CFG.experts_per_token
    np.testing.assert_allclose(m0["router/aux_loss"], _np_hf_balance_loss(logits, real, k), 1e-5)
    ent = np.mean([(_np_entropy(z) * real).sum() / real.sum() for z in logits])
    np.testing.assert_allclose(m0["router/entropy"], ent, rtol=1e-5)
    ratios = []
    for z in logits:
        load = np.zeros(8)
        np.add.at(load, _np_topk(_np_softmax(z), k).reshape(-1), np.repeat(real, k))
        ratios.append(load.max() / load.mean())
    np.testing.assert_allclose(m0["router/load_max_over_mean"], np.mean(ratios), rtol=1e-6)
    np.testing.assert_allclose(m0["router/load_max_over_mean_worst"], np.max(ratios), rtol=1e-6)
    recorded = np.asarray(router.recorded(jnp.asarray(batch.segment_ids)))
    sequences = sum(len(np.unique(row[row > 0])) for row in batch.segment_ids)
    assert recorded.sum() == real.sum() - sequences  # each sequence's last token: no record
    np.testing.assert_allclose(m0["rollout/route_mismatch"], 3 / recorded.sum(), rtol=1e-6)
    np.testing.assert_allclose(m0["rollout/route_mismatch_layers"], 3 / recorded.sum() / 2, 1e-6)

    coef = 0.5
    grads, m = learner(router_aux_loss_coef=coef).grads(params, batch)
    np.testing.assert_allclose(m["loss"] - m0["loss"], coef * m0["router/aux_loss"], rtol=1e-5)
    g, g0 = flatten(grads), flatten(grads0)
    for name in ("blocks.0.mlp.router", "blocks.2.mlp.router"):
        assert np.abs(np.asarray(g[name]) - np.asarray(g0[name])).max() > 1e-4
    # the last MoE layer's experts feed no router: the loss leaves their gradient as it was
    np.testing.assert_allclose(g["blocks.2.mlp.gate"], g0["blocks.2.mlp.gate"], atol=1e-7)

    # Replayed: the record as the sampler writes it, each sequence's last token zeros (never
    # fed); the learner routes those by its routers, so with the routers' own experts elsewhere
    # everything is the unreplayed pass's (zeros there would send them to expert 0)
    record = np.where(recorded[..., None, None], setup[1].routes, 0).astype(np.int8)
    replayed = batch.replace(routes=record, route_digest=None)
    _, m_replay = learner(routing_replay="rollout").grads(params, replayed)
    assert "rollout/route_mismatch" not in m_replay  # the learner routes by the record
    for name in ("router/load_max_over_mean", "router/load_max_over_mean_worst"):
        np.testing.assert_allclose(m_replay[name], m0[name], rtol=1e-6)
    np.testing.assert_allclose(m_replay["router/aux_loss"], m0["router/aux_loss"], rtol=1e-6)


def test_route_digest_tells_expert_sets_apart():
    """rl.router.digest: the same on the host (numpy) and in the learner (jnp), free of the ids'
    order, distinct for every pair of sets that differ in one expert (any E up to 2^15: the
    codes are a bijection), and for random sets that differ, alike about 2^-16 of the time."""
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((4096, 128)), -1)[:, :8].astype(np.int16)  # top-8 of 128
    host = router.digest(ids, np)
    assert host.dtype == np.uint16 and host.shape == (4096,)
    np.testing.assert_array_equal(np.asarray(router.digest(jnp.asarray(ids))), host)
    np.testing.assert_array_equal(router.digest(ids[:, ::-1], np), host)  # any order
    codes = router.digest(np.arange(2**15)[:, None], np)  # a set of one: the id's code
    assert len(np.unique(codes)) == 2**15
    other = np.argsort(rng.random((4096, 128)), -1)[:, :8]
    differ = (np.sort(ids, -1) != np.sort(other, -1)).any(-1)
    assert ((router.digest(other, np) == host) & differ).sum() <= 2  # ~4096 / 2^16 expected
    sets = [(a, b) for a in range(8) for b in range(a + 1, 8)]  # every top-2 of 8 experts
    assert len(set(router.digest(np.array(sets), np).tolist())) == len(sets)


def test_a_dense_model_logs_no_router_metrics():
    dense = ModelConfig("qwen3", 64, 32, 40, 2, 4, 2, 16, qk_norm=True)
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(dense, mesh, DEFAULT_RULES, seed=0)
    tokens = jnp.asarray(np.arange(1, 25, dtype=np.int32).reshape(2, 12))
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), tokens.shape)
    out = nnx.merge(graphdef, params).hidden(tokens, positions, stats=True)
    assert out[2] is None
    seg = jnp.ones_like(tokens)
    batch = _dense_batch(tokens, positions, seg)
    learner = Learner(
        LearnerConfig(loss=NO_KL, router_aux_loss_coef=None),
        graphdef,
        state_shardings(params, mesh, DEFAULT_RULES),
    )
    _, metrics = jax.eval_shape(learner.grads, params, batch)  # traced, not compiled
    assert "loss" in metrics and not [k for k in metrics if k.startswith(("router", "rollout"))]


def _dense_batch(tokens, positions, seg):
    from rl.learner import Batch

    mask = jnp.ones((tokens.shape[0], tokens.shape[1] - 1), jnp.float32)
    return Batch(tokens, positions, seg, mask, mask, sampler_logp=-mask)


@pytest.mark.hf
@pytest.mark.slow  # torch, transformers and a jitted gradient: 90 s on the loaded shared host
def test_balance_loss_and_its_gradient_match_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from models.hf import load_hf
    from tests.models.test_moe_hf import _make

    hf = _make(torch, transformers, tmp_path, 6, 2, True, False, 3, [1], 1, seed=0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, (3, 10)).astype(np.int64)
    mask = np.ones((3, 10), np.int64)
    mask[1, 7:] = 0  # right padding
    mask[2, 4:] = 0
    ids = torch.tensor(tokens)
    out = hf(input_ids=ids, attention_mask=torch.tensor(mask), output_router_logits=True)
    out.aux_loss.backward()
    want_grad = [hf.model.layers[i].mlp.gate.weight.grad.numpy().T for i in (0, 2)]
    mesh = make_mesh({}, devices=jax.devices()[:1])
    cfg, graphdef, params, _ = load_hf(str(tmp_path), mesh)
    assert cfg.router_aux_loss_coef == hf.config.router_aux_loss_coef == 0.001
    positions = np.broadcast_to(np.arange(10, dtype=np.int32), tokens.shape)

    def aux(params):
        model = nnx.merge(graphdef, params)
        _, _, st = model.hidden(tokens.astype(np.int32), positions, mask > 0, stats=True)
        return router.balance_loss(st, mask.sum())

    got, grads = jax.value_and_grad(aux)(params)
    np.testing.assert_allclose(got, out.aux_loss.item(), rtol=1e-5)
    for block, want in zip((0, 2), want_grad):
        g = np.asarray(grads["blocks"][block]["mlp"]["router"].get_value())
        assert np.abs(want).max() > 1e-5
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-7)


@pytest.mark.slow  # three compiles on two meshes: 32 s on the loaded shared host
def test_router_stats_on_the_expert_mesh_equal_one_device():
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (8, 12)).astype(np.int32))
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), tokens.shape)
    valid = jnp.arange(12)[None, :] < jnp.asarray([12, 10, 8, 12, 5, 12, 12, 3])[:, None]
    params = jax.device_get(init_params(CFG, make_mesh({}, devices=jax.devices()[:1]), seed=3)[1])

    def run(cfg, mesh):
        graphdef = abstract_model(cfg)[0]
        sharded = jax.tree.map(jax.device_put, params, state_shardings(params, mesh, DEFAULT_RULES))

        def aux(params):
            _, _, st = nnx.merge(graphdef, params).hidden(tokens, positions, valid, stats=True)
            return router.balance_loss(st, valid.sum()), st

        with jax.set_mesh(mesh):
            (loss, st), g = jax.jit(jax.value_and_grad(aux, has_aux=True))(sharded)
        routers = {k: np.asarray(v) for k, v in flatten(g).items() if k.endswith("router")}
        return float(loss), jax.tree.map(np.asarray, st), routers

    one = run(CFG, make_mesh({}, devices=jax.devices()[:1]))
    remat = dataclasses.replace(CFG, remat=True)
    meshes = ((CFG, {"data": 2, "expert": 4}), (remat, {"expert": 2, "fsdp": 2, "tensor": 2}))
    for cfg, shape in meshes:
        got = run(cfg, make_mesh(shape))
        np.testing.assert_allclose(got[0], one[0], rtol=1e-6)
        for a, b in zip(got[1], one[1]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        for name in one[2]:
            assert np.abs(one[2][name]).max() > 1e-4
            np.testing.assert_allclose(got[2][name], one[2][name], rtol=1e-5, atol=1e-6)


def test_router_aux_loss_coef_config(tmp_path):
    c = get_config()
    assert c.rl.router_aux_loss_coef == 0.0 and learner_config(c, ()).router_aux_loss_coef == 0.0
    c.rl.router_aux_loss_coef = None  # the checkpoint's (resolved by the learner at trace)
    assert learner_config(c, ()).router_aux_loss_coef is None
    c.rl.router_aux_loss_coef = -1.0
    with pytest.raises(UsageError, match=r"^config.rl.router_aux_loss_coef=-1.0: must be >= 0"):
        learner_config(c, ())
    old = get_config().to_dict()
    del old["rl"]["router_aux_loss_coef"]  # a run saved before the field: no such loss
    new = get_config().to_dict()
    check_resumable(old, new)
    new["rl"]["router_aux_loss_coef"] = 0.01
    with pytest.raises(UsageError, match="router_aux_loss_coef"):
        check_resumable(old, new)
    c = get_config()  # which runs record the sampler's routes: every MoE run's
    assert records_routes(c, 8) and not records_routes(c, 0)
    c.env.name = "calculator"
    assert records_routes(c, 8)  # replay off: for route_mismatch, multi-turn too
    c.env.name, c.rl.partial_rollouts = "", True
    assert records_routes(c, 8)  # and partial rollouts
    c.rl.routing_replay = "rollout"  # replay: every run records
    assert records_routes(c, 8)
    c.env.name = "calculator"
    assert records_routes(c, 8)


def test_checkpoint_coefficient_is_read_and_written(tmp_path):
    from models.hf_config import config_from_hf, config_to_hf

    cfg = dataclasses.replace(CFG, router_aux_loss_coef=0.02)
    hf = config_to_hf(cfg, "float32")
    assert hf["router_aux_loss_coef"] == 0.02
    del hf["router_aux_loss_coef"]
    (tmp_path / "config.json").write_text(__import__("json").dumps(hf))
    assert config_from_hf(str(tmp_path)).router_aux_loss_coef == 0.001  # transformers' default
    assert RouterStats._fields == ("probs", "chosen", "load", "entropy")
