"""Routing replay in the model (issue 52 item 4): `Transformer.hidden(..., record=True)` returns
the experts each token used in each MoE layer, [B,T,L_moe,k] int8 (int16 past 128 experts), and
`hidden(..., routes=record)` uses exactly those experts with gate weights from the routers.

A tiny Qwen3-MoE (8 experts, top-2, layers 0 and 2 of 3 with experts), f32, one device and the
expert=4 x data=2 mesh: replaying the recorded routes gives the unreplayed pass bitwise, with and
without remat; replaying other routes uses them (the record of that pass is what was given), moves
the output, and still gives the routers a gradient.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import ModelConfig
from models.moe import route_dtype
from models.sharding import DEFAULT_RULES, init_params, make_mesh, state_shardings

CFG = ModelConfig(
    family="qwen3_moe",
    vocab_size=64,
    d_model=32,
    d_ff=40,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
    num_experts=8,
    experts_per_token=2,
    expert_d_ff=24,
    norm_topk_prob=True,
    moe_layers=(0, 2),
)


def _model(cfg, mesh=None):
    mesh = mesh or make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(cfg, mesh, DEFAULT_RULES, seed=3)
    return graphdef, params


def _tokens():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CFG.vocab_size, (8, 12)).astype(np.int32)
    positions = np.broadcast_to(np.arange(12, dtype=np.int32), tokens.shape)
    return jnp.asarray(tokens), jnp.asarray(positions)


def _hidden(graphdef, params, tokens, positions, routes=None):
    h, _, rec = nnx.merge(graphdef, params).hidden(tokens, positions, routes=routes, record=True)
    return h, rec


_run = jax.jit(_hidden, static_argnums=0)


def _check_routes(graphdef, params, prompt, c):
    """A Completion's routes [P+N, L_moe, k] are the f32 pass's over prompt + tokens (the last
    token's row, never fed, aside)."""
    full = np.asarray([prompt + c.tokens], np.int32)
    pos = np.arange(full.shape[1], dtype=np.int32)[None]
    _, want = _run(graphdef, params, jnp.asarray(full), jnp.asarray(pos))
    assert c.routes.shape == (len(prompt) + c.length, 2, 2)
    np.testing.assert_array_equal(c.routes[:-1], np.asarray(want)[0, :-1])


def _sampler(graphdef, **fields):
    """An engine of the tiny MoE that records routes, sampling at temperature 1."""
    from sampling.distribution import SamplingParams
    from sampling.engine import Engine, EngineConfig

    ecfg = EngineConfig(record_routes=True, **fields)
    return Engine(CFG, graphdef, ecfg, SamplingParams(temperature=1.0))


def test_route_dtype():
    assert route_dtype(8) == jnp.int8 and route_dtype(128) == jnp.int8  # ids 0..127 and -1
    assert route_dtype(129) == jnp.int16


@pytest.mark.parametrize("remat", (False, True))
def test_recorded_routes_replay_bitwise(remat):
    cfg = dataclasses.replace(CFG, remat=remat)
    graphdef, params = _model(cfg)
    tokens, positions = _tokens()
    h, rec = _run(graphdef, params, tokens, positions)
    assert rec.shape == (8, 12, 2, 2) and rec.dtype == jnp.int8
    r = np.asarray(rec)
    assert r.min() >= 0 and r.max() < 8 and np.all(r[..., 0] != r[..., 1])
    plain, _ = nnx.merge(graphdef, params).hidden(tokens, positions)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(plain))
    h2, rec2 = _run(graphdef, params, tokens, positions, rec)
    np.testing.assert_array_equal(np.asarray(h2), np.asarray(h))
    np.testing.assert_array_equal(np.asarray(rec2), r)
    other = (rec + 3) % 8  # other experts, still distinct per token
    h3, rec3 = _run(graphdef, params, tokens, positions, other.astype(jnp.int8))
    np.testing.assert_array_equal(np.asarray(rec3), np.asarray(other))
    assert np.max(np.abs(np.asarray(h3) - np.asarray(h))) > 1e-3


def test_replayed_routes_give_the_router_a_gradient():
    graphdef, params = _model(CFG)
    tokens, positions = _tokens()
    _, rec = _run(graphdef, params, tokens, positions)

    def loss(params, routes):
        h, _ = nnx.merge(graphdef, params).hidden(tokens, positions, routes=routes)
        return jnp.sum(h**2)

    g_plain = jax.jit(jax.grad(loss))(params, None)
    g_replay = jax.jit(jax.grad(loss))(params, rec)
    for block in (0, 2):
        a = np.asarray(g_plain["blocks"][block]["mlp"]["router"].get_value())
        b = np.asarray(g_replay["blocks"][block]["mlp"]["router"].get_value())
        assert np.abs(b).max() > 0
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)  # same experts, same gradient


def test_record_and_replay_on_the_expert_mesh_equal_one_device():
    graphdef, params = _model(CFG)
    tokens, positions = _tokens()
    h, rec = _run(graphdef, params, tokens, positions)
    mesh = make_mesh({"data": 2, "expert": 4})
    params = jax.device_get(params)
    shardings = state_shardings(params, mesh, DEFAULT_RULES)
    sharded = jax.tree.map(jax.device_put, params, shardings)
    other = ((np.asarray(rec) + 3) % 8).astype(np.int8)
    with jax.set_mesh(mesh):
        hm, recm = _run(graphdef, sharded, tokens, positions)
        ho, _ = _run(graphdef, sharded, tokens, positions, other)
    np.testing.assert_array_equal(np.asarray(recm), np.asarray(rec))
    np.testing.assert_allclose(np.asarray(hm), np.asarray(h), atol=1e-5)
    h1, _ = _run(graphdef, params, tokens, positions, other)
    np.testing.assert_allclose(np.asarray(ho), np.asarray(h1), atol=1e-5)


@pytest.mark.parametrize(
    "chunk",
    (512, pytest.param(4, marks=pytest.mark.slow)),  # one pass; chunks over the pages
)
def test_decode_steps_record_the_fed_tokens_routes(chunk):
    """The sampler's decode step j records the experts of the token it feeds (the prompt's
    last token, then the token sampled at step j-1), and the prefill those of the prompt's
    other tokens (on the Prefix): in f32 those of the learner's pass over the whole sequence;
    no record unless asked for."""
    from sampling.distribution import SamplingParams
    from sampling.engine import Engine, EngineConfig

    graphdef, params = _model(CFG)
    prompts = [[3, 17, 42, 8, 5], [11, 2, 9, 30, 44, 12, 7], [50, 1, 33]]
    ecfg = EngineConfig(
        num_slots=4,
        page_size=8,
        num_pages=32,
        max_prompt_len=16,
        max_new_tokens=8,
        steps_per_call=8,
        prefill_chunk=chunk,
    )
    greedy = SamplingParams(temperature=0.0)
    assert not Engine(CFG, graphdef, ecfg, greedy).records_routes  # asked for only
    ecfg = dataclasses.replace(ecfg, record_routes=True)
    engine = Engine(CFG, graphdef, ecfg, greedy)
    state = engine.init_state()
    state, prefixes = engine.prefill_many(params, state, prompts)
    for slot, prefix in enumerate(prefixes):
        state = engine.insert(state, prefix, slot, slot, 8)
    state, ticket = engine.dispatch(params, state, jax.random.key(0))
    r = engine.collect(ticket)
    assert r.routes.shape == (4, 8, 2, 2) and r.routes.dtype == np.int8
    for i, p in enumerate(prompts):  # the prefill recorded the prompt's other tokens
        assert prefixes[i].routes.shape == (len(p) - 1, 2, 2)
        n = r.num_generated[i]
        full = np.asarray([p + r.tokens[i, :n].tolist()], np.int32)
        pos = np.arange(full.shape[1], dtype=np.int32)[None]
        _, want = _run(graphdef, params, jnp.asarray(full), jnp.asarray(pos))
        fed = len(p) - 1 + np.arange(n)  # the positions fed at steps 0..n-1
        np.testing.assert_array_equal(r.routes[i, :n], np.asarray(want)[0, fed])
        np.testing.assert_array_equal(prefixes[i].routes, np.asarray(want)[0, : len(p) - 1])


@pytest.mark.parametrize(  # 9: too few pages, sequences are preempted and recomputed
    "num_pages", (pytest.param(32, marks=pytest.mark.slow), 9)
)
def test_completions_carry_the_sampler_routes(num_pages):
    """`generate_all` with record_routes: each Completion's routes [P+N, L_moe, k] are the
    prefill's and decode steps' experts of its tokens (the last one, never fed, zeros), those of
    the learner's f32 pass over the sequence, also across preemption and recompute."""
    from sampling.episodes import generate_all

    graphdef, params = _model(CFG)
    prompts = [[3, 17, 42, 8, 5], [11, 2, 9, 30, 44, 12, 7], [50, 1, 33], [7, 7, 8, 9]]
    engine = _sampler(
        graphdef,
        num_slots=4,
        page_size=4,
        num_pages=num_pages,
        max_prompt_len=8,
        max_new_tokens=12,
        steps_per_call=4,
    )
    _, results = generate_all(engine, params, engine.init_state(), prompts, 1, 12, seed=3)
    if num_pages == 9:
        assert engine.preemptions > 0
    for p, (c,) in zip(prompts, results):
        _check_routes(graphdef, params, p, c)
        assert not c.routes[-1].any()


def test_carried_episodes_keep_the_routes_they_were_fed_with():
    """Partial rollouts with record_routes (`EpisodeLoop`): run 0 under params A stops after two
    decode calls with every episode parked mid-turn and a group partly inserted, run 1 under
    params B (another model) resumes them with refresh, on a pool small enough that sequences are
    preempted and recomputed. Each completion's routes at a position are those of the f32 pass
    over its tokens under the params of the run that fed that position: a decode step j feeds
    position P-1+j and draws token j (`Completion.versions[j]`), and the prompt's others were
    prefilled before token 0. So a sample inserted in run 0 keeps the prompt's experts under A
    even after its group's Prefix is recomputed under B for the samples inserted in run 1."""
    from sampling.episodes import EpisodeLoop

    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, a = init_params(CFG, mesh, DEFAULT_RULES, seed=3)
    _, b = init_params(CFG, mesh, DEFAULT_RULES, seed=4)
    prompts = [[3, 17, 42, 8, 5], [11, 2, 9, 30, 44, 12, 7], [50, 1, 33], [7, 7, 8, 9]]
    engine = _sampler(
        graphdef,
        num_slots=3,
        page_size=2,
        num_pages=18,
        max_prompt_len=8,
        max_new_tokens=10,
        steps_per_call=2,
    )
    loop = EpisodeLoop(engine, 2)
    loop.add(prompts)
    state = loop.run(a, engine.init_state(), 3, version=0, until=lambda: loop.clock >= 2)
    assert loop.open_groups() and len(loop.ready) == 3  # a group partly in, 3 parked mid-turn
    loop.run(b, state, 3, version=1, refresh=True)
    assert engine.preemptions > 0 and engine.recomputed_tokens > 0
    passes = {}
    for key, p in enumerate(prompts):
        for c in loop.results[key]:
            full = np.asarray([p + c.tokens], np.int32)
            pos = np.arange(full.shape[1], dtype=np.int32)[None]
            under_a, under_b = (
                np.asarray(_run(graphdef, x, jnp.asarray(full), jnp.asarray(pos))[1])[0, :-1]
                for x in (a, b)
            )
            fed = np.asarray([c.versions[0]] * (len(p) - 1) + c.versions)  # version per position
            passes[tuple(c.versions[:1])] = passes.get(tuple(c.versions[:1]), 0) + 1
            assert c.routes.shape == (len(p) + c.length, 2, 2) and not c.routes[-1].any()
            np.testing.assert_array_equal(
                c.routes[:-1], np.where(fed[:, None, None], under_b, under_a)
            )
    assert passes == {(0,): 3, (1,): 5}  # samples drawn first under A, and under B
    assert any(0 in c.versions and 1 in c.versions for r in loop.results.values() for c in r)


def test_multi_turn_episodes_record_their_observations_routes():
    """Multi-turn episodes with record_routes: a resume prefills the turn's last token and the
    observation but its last (`Engine.resume`'s owners record them) and the decode steps feed
    the rest, so each Completion's routes [P+N, L_moe, k] are those of the f32 pass over prompt,
    turns and observations, also where sequences are preempted and recomputed (9 pages)."""
    from sampling.episodes import generate_all

    graphdef, params = _model(CFG)
    prompts = [[3, 17, 42, 8, 5], [11, 2, 9, 30, 44, 12, 7], [50, 1, 33], [7, 7, 8, 9]]
    obs = {0: [60, 61, 62], 1: [63]}  # after turn 1: three tokens, after turn 2: one

    answered = {}  # (request, sample) -> turns answered

    def respond(i, k, turn, left):
        n = answered[i, k] = answered.get((i, k), -1) + 1
        return obs.get(n)  # None after turn 3: the episode ends

    engine = _sampler(
        graphdef,
        num_slots=4,
        page_size=4,
        num_pages=9,
        max_prompt_len=8,
        max_new_tokens=16,
        steps_per_call=4,
    )
    _, results = generate_all(
        engine, params, engine.init_state(), prompts, 1, 16, 3, respond=respond, max_turn_tokens=3
    )
    assert engine.preemptions > 0
    for p, (c,) in zip(prompts, results):
        assert c.turns == 3 and sum(c.observation) == 4
        _check_routes(graphdef, params, p, c)
        assert not c.routes[-1].any()


@pytest.mark.parametrize("turns", [1, 2])
def test_a_one_token_prompt_records_its_routes(turns):
    """A one-token prompt has nothing to prefill (its token is fed by the first decode step),
    so its Prefix records no routes: the episode's record starts empty there and still covers
    every token, single-turn and multi-turn (before, None reached np.concatenate)."""
    from sampling.episodes import generate_all

    graphdef, params = _model(CFG)
    prompts = [[5], [3, 17, 42]]
    answered = {}  # (request, sample) -> turns answered

    def respond(i, k, turn, left):
        n = answered[i, k] = answered.get((i, k), -1) + 1
        return [60, 61] if n + 1 < turns else None  # then the episode ends

    engine = _sampler(
        graphdef,
        num_slots=2,
        page_size=4,
        num_pages=16,
        max_prompt_len=4,
        max_new_tokens=12,
        steps_per_call=4,
    )
    kw = {"respond": respond, "max_turn_tokens": 3} if turns > 1 else {}
    _, results = generate_all(engine, params, engine.init_state(), prompts, 1, 12, 0, **kw)
    for p, (c,) in zip(prompts, results):
        assert c.turns == turns
        _check_routes(graphdef, params, p, c)
