"""Routing replay in the learner (issue 52 item 4): each completion's recorded experts
(`Completion.routes`, [P+N, L_moe, k]) packed with the learner rows (rl.packing), and every
learner pass (log-probs for pi_old, the reference, the loss) routing by them; the config field
rl.routing_replay, its refusals and its resume default.

Tiny Qwen3-MoE (tests/models/test_routing_replay.py's), f32, one device: routes recorded one
sequence at a time land on the packed positions of their sequence, and the packed pass with them
gives the packed pass without them (the same experts) within 1e-6, while other routes move it.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from configs.default import get_config
from launch.cli import UsageError
from launch.resume_compat import check_resumable
from launch.validate import check_routing_replay
from models.sharding import DEFAULT_RULES, init_params, make_mesh, state_shardings
from rl import router
from rl.groups import Group
from rl.learner import Learner, LearnerConfig
from rl.packing import build_batch
from sampling.requests import Completion
from tests.models.test_routing_replay import CFG

WIDTH = 24


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(CFG, mesh, DEFAULT_RULES, seed=0)
    model = nnx.merge(graphdef, params)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, CFG.vocab_size, rng.integers(3, 7)).tolist() for _ in range(2)]
    seqs = [(p, rng.integers(1, CFG.vocab_size, rng.integers(2, 10)).tolist()) for p in prompts]
    seqs = [s for s in seqs for s in (s, (s[0], s[1][:-1]))]  # two completions per prompt
    tokens = np.zeros((4, WIDTH), np.int32)  # one sequence per row, padded on the right
    for i, (p, c) in enumerate(seqs):
        tokens[i, : len(p) + len(c)] = p + c
    positions = np.broadcast_to(np.arange(WIDTH, dtype=np.int32), tokens.shape)
    rec = np.asarray(jax.jit(lambda t: model.hidden(t, positions, record=True)[2])(tokens))
    cs = [
        Completion(c, [-1.0] * len(c), "stop", len(c), routes=rec[i, : len(p) + len(c)])
        for i, (p, c) in enumerate(seqs)
    ]
    groups = [
        Group({}, p, cs[2 * i : 2 * i + 2], [], np.zeros(2), {}) for i, p in enumerate(prompts)
    ]
    batch, layout = build_batch(groups, WIDTH, 0, pack=True, routes="replay")
    cfg = LearnerConfig(routing_replay="rollout")
    learner = Learner(cfg, graphdef, state_shardings(params, mesh, DEFAULT_RULES))
    return groups, batch, layout, learner, params


def test_routes_are_packed_with_their_sequences(setup):
    groups, batch, layout, _, _ = setup
    assert batch.tokens.shape[0] < 4  # packed: several sequences per row
    assert batch.routes.shape == (batch.tokens.shape[0], WIDTH, 2, 2)
    assert batch.routes.dtype == np.int8
    covered = np.zeros(batch.tokens.shape, bool)
    for i, c in enumerate(cp for g in groups for cp in g.completions):
        r, s, n = layout.row[i], layout.start[i], layout.length[i]
        np.testing.assert_array_equal(batch.routes[r, s : s + n], c.routes)
        covered[r, s : s + n] = True
    assert not batch.routes[~covered].any()  # padding: expert 0
    # replay off: the record's digests (rl.router.digest) in the same places, padding 0
    compared = build_batch(groups, WIDTH, 0, pack=True, routes="compare")[0]
    assert compared.routes is None and compared.route_digest.dtype == np.uint16
    np.testing.assert_array_equal(
        compared.route_digest, np.where(covered[..., None], router.digest(batch.routes, np), 0)
    )
    bad = [Group({}, groups[0].prompt, [groups[0].completions[0]], [], np.zeros(1), {})]
    short = Completion([5, 6], [-1.0, -1.0], "stop", 2, routes=np.zeros((1, 2, 2), np.int8))
    bad[0].completions.append(short)
    for routes in ("replay", "compare"):
        with pytest.raises(ValueError, match="sequence 1: routes for"):
            build_batch(bad, WIDTH, 0, routes=routes)
    plain = Completion([5, 6], [-1.0, -1.0], "stop", 2)  # one without a record
    mixed = [Group({}, groups[0].prompt, [groups[0].completions[0], plain], [], np.zeros(2), {})]
    none = build_batch(mixed, WIDTH, 0)[0]  # a dense model's run: no record asked for
    assert none.routes is None and none.route_digest is None
    for routes in ("replay", "compare"):  # the learner would route or compare it wrongly
        with pytest.raises(ValueError, match="sequence 1: no recorded routes"):
            build_batch(mixed, WIDTH, 0, routes=routes)
    with pytest.raises(ValueError, match="routes='ids': one of None, 'replay', 'compare'"):
        build_batch(groups, WIDTH, 0, routes="ids")


def test_every_learner_pass_routes_by_the_record(setup):
    _, batch, _, learner, params = setup
    mask = batch.loss_mask > 0
    free = batch.replace(routes=None)
    other = batch.replace(routes=(batch.routes + 3) % 8)
    for which in ("logp", "full"):  # pi_old and the policy side of KL: the experts it chose
        got, want, moved = (
            np.asarray(learner.logprobs(params, b, which))[mask] for b in (batch, free, other)
        )
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
        assert np.abs(moved - want).max() > 1e-3
    ref = jax.tree.map(lambda x: 0.9 * x, params)  # its routers choose otherwise: replay differs
    got, want, moved = (
        np.asarray(learner.reference_logprobs(params, ref, b))[mask] for b in (batch, free, other)
    )
    assert np.abs(got - want).max() > 1e-4 and np.abs(moved - got).max() > 1e-3
    np.testing.assert_array_equal(
        got, np.asarray(learner.reference_logprobs(params, ref, batch))[mask]
    )


def test_routing_replay_config():
    c = get_config()
    check_routing_replay(c, 8)  # "none": any model
    c.rl.routing_replay = "rollout"
    with pytest.raises(UsageError, match=r"^config.rl.routing_replay='rollout': .* dense model"):
        check_routing_replay(c, 0)
    check_routing_replay(c, 8)  # single-turn, synchronous: the rollout carries the record
    c.env.name = "calculator"  # observations' routes recorded on resume (sampling.episodes)
    check_routing_replay(c, 8)
    c.rl.partial_rollouts = True  # carried episodes keep their record (sampling.episodes)
    check_routing_replay(c, 8)
    c.rl.routing_replay = "sampler"
    with pytest.raises(UsageError, match=r"expected 'none' or 'rollout'"):
        check_routing_replay(c, 8)
    new = get_config().to_dict()
    old = get_config().to_dict()
    del old["rl"]["routing_replay"]  # a run saved before the field: the routers routed
    check_resumable(old, new)
    new["rl"]["routing_replay"] = "rollout"
    with pytest.raises(UsageError, match="routing_replay"):
        check_resumable(old, new)
