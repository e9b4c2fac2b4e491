"""Per-shard page pools on the (2,2,2) and fsdp=8 meshes (`sampling.partitioned`): slots and KV
pages split over the batch shards, each request on one shard for its life, the weights in the
"tensor" decode layout. Against one device without a mesh, on a workload of multi-turn episodes
with shared prompt pages (G = 2) that a partial-rollout stop carries across two runs (KV kept, and
KV refreshed): the same greedy tokens, and T=1 tokens and log-probs within 1e-5. Placement
balances the shards' pages and never moves a request.
"""

import collections
import dataclasses

import jax
import numpy as np
import pytest

from models.sharding import DEFAULT_RULES, abstract_model, init_params, make_mesh, state_shardings
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.episodes import EpisodeLoop, generate_all
from sampling.requests import group_pages
from tests.conftest import CFG, random_prompts

ECFG = EngineConfig(
    num_slots=16, page_size=8, num_pages=256, max_prompt_len=24, max_new_tokens=20,
    steps_per_call=4,
)  # fmt: skip
MESHES = {
    "2x2x2": {"data": 2, "fsdp": 2, "tensor": 2},
    "fsdp8": pytest.param({"fsdp": 8}, marks=pytest.mark.slow),
}
G, TURN = 2, 3  # samples per request, model tokens per turn
PROMPTS = random_prompts([5, 17, 9, 23, 3, 12, 20, 7], seed=11)
BUDGETS = [20, 9, 14, 20, 6, 17, 11, 20]  # skewed: worst-case pages differ per request


def _obs(i, k, turn_no):
    """The scripted observation after turn `turn_no` of sample k of request i (None: the end)."""
    if turn_no == 2:
        return None
    rng = np.random.default_rng(100 * i + 10 * k + turn_no)
    return rng.integers(1, CFG.vocab_size, 1 + (i + k + turn_no) % 3).tolist()


def _respond():
    turns = collections.Counter()

    def respond(i, k, turn, left):
        turns[i, k] += 1
        return _obs(i, k, turns[i, k] - 1)

    return respond


def _flat(results):
    out = [results[i][k] for i in sorted(results) for k in range(G)]
    return [c.tokens for c in out], [c.logprobs for c in out]


@pytest.fixture(scope="module")
def one_device():
    mesh = make_mesh({}, devices=jax.devices()[:1])
    return init_params(CFG, mesh, seed=3)


# Greedy is the slow variant (the fast tier keeps one of each check: README, Tests).
@pytest.fixture(scope="module", params=[pytest.param(0.0, marks=pytest.mark.slow, id="greedy"),
                                        pytest.param(1.0, id="t1")])  # fmt: skip
def reference(one_device, request):
    """Tokens and log-probs of the workload on one device, in one uninterrupted run."""
    graphdef, params = one_device
    engine = Engine(CFG, graphdef, ECFG, SamplingParams(request.param))
    _, results = generate_all(
        engine, params, engine.init_state(), PROMPTS, G, BUDGETS, seed=7, respond=_respond(),
        max_turn_tokens=TURN,
    )  # fmt: skip
    return request.param, _flat(dict(enumerate(results)))


def _sharded_run(mesh_shape, params_one, temperature, refresh):
    """The workload on the mesh, stopped after two decode calls (episodes parked mid-turn and
    waiting are carried) and finished by a second run; records where every request went."""
    mesh = make_mesh(mesh_shape)
    graphdef, host = params_one
    params = jax.device_put(host, state_shardings(abstract_model(CFG)[1], mesh, DEFAULT_RULES))
    engine = Engine(CFG, graphdef, ECFG, SamplingParams(temperature), mesh=mesh)
    shards = collections.defaultdict(set)  # request id -> the shards of its slots and prefixes
    insert, resume = engine.bulk_insert, engine.resume

    def bulk_insert(state, prefix, slots, request_id, *a, **kw):
        shards[request_id] |= {prefix.shard, *map(engine.pages.shard_of, slots)}
        return insert(state, prefix, slots, request_id, *a, **kw)

    def resume_(params, state, items, *a):
        for p, _, slot, _ in items:
            shards[p.request_id] |= {p.shard, engine.pages.shard_of(slot)}
        return resume(params, state, items, *a)

    engine.bulk_insert, engine.resume = bulk_insert, resume_
    loop = EpisodeLoop(engine, G, respond=_respond(), max_turn_tokens=TURN)
    loop.add(PROMPTS, BUDGETS)
    calls = collections.Counter()
    dispatch = engine.dispatch

    def counted(*a, **kw):
        calls["n"] += 1
        return dispatch(*a, **kw)

    engine.dispatch = counted
    state = loop.run(params, engine.init_state(), seed=7, until=lambda: calls["n"] >= 2)
    carried = len(loop.ready) + len(loop.waiting)
    state = loop.run(params, state, seed=7, version=1, refresh=refresh)
    assert loop.idle and engine.allocator.num_used == 0
    return engine, carried, shards, _flat(loop.results)


@pytest.mark.parametrize("refresh", [False, True], ids=["kv-kept", "kv-refreshed"])
@pytest.mark.parametrize("mesh_shape", MESHES.values(), ids=MESHES.keys())
def test_sharded_pools_match_one_device(one_device, reference, mesh_shape, refresh):
    temperature, (want_tokens, want_logprobs) = reference
    engine, carried, shards, (tokens, logprobs) = _sharded_run(
        mesh_shape, one_device, temperature, refresh
    )
    assert engine.num_shards == 8 // mesh_shape.get("tensor", 1)
    assert engine.ecfg.weights_layout == "tensor"
    assert carried > 0  # the stop really carried episodes into the second run
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # A request never changes shard: its prefix, every slot it decoded in, every resume.
    request_ids = range(len(PROMPTS))
    assert sorted(shards) == list(request_ids)
    assert all(len(s) == 1 for s in shards.values()), dict(shards)
    assert len({next(iter(s)) for s in shards.values()}) > 1  # and requests use several shards


def test_placement_balances_the_shards_pages(one_device):
    """A skewed queue (worst cases 4 to 12 pages) on 4 shards of 8 slots and 31 pages each:
    after every admission round that the pool cut short, the shards' pages in use + reserved
    differ by at most one group's worst case; and a full shard never stops another's."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, host = one_device
    params = jax.device_put(host, state_shardings(abstract_model(CFG)[1], mesh, DEFAULT_RULES))
    ecfg = dataclasses.replace(ECFG, num_slots=32, num_pages=128)
    engine = Engine(CFG, graphdef, ecfg, SamplingParams(1.0), mesh=mesh)
    prompts = random_prompts([3 + (7 * i) % 21 for i in range(24)], seed=5)
    budgets = [4 + (11 * i) % 17 for i in range(24)]
    need = [group_pages(len(p), b, ecfg.page_size, G) for p, b in zip(prompts, budgets)]
    assert min(need) < max(need)
    loop = EpisodeLoop(engine, G)
    loop.add(prompts, budgets)
    spreads, flush, book = [], engine.flush, engine.pages

    def measure_and_flush(params, state, flags=()):  # once per round, after its admissions
        if loop.pending:  # the pool (not the queue) ended this round
            load = [p.num_used + book.reserved(i) for i, p in enumerate(book.pools)]
            spreads.append(max(load) - min(load))
        return flush(params, state, flags)

    engine.flush = measure_and_flush
    loop.run(params, engine.init_state(), seed=1)
    assert loop.idle and all(c is not None for r in loop.results.values() for c in r)
    assert spreads and max(spreads) <= max(need), spreads


def test_a_group_partly_in_does_not_stall_the_other_shards(one_device):
    """G = 3 on 4 shards of 4 slots, seven groups: each shard takes one whole group, and the
    next three go in partly, one on each of shards 0..2 (a shard's group partly in waits for
    that shard's slots only: every decision about a shard looks at that shard alone), and each
    completes its samples as its own shard's slots free up."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, host = one_device
    params = jax.device_put(host, state_shardings(abstract_model(CFG)[1], mesh, DEFAULT_RULES))
    engine = Engine(CFG, graphdef, ECFG, SamplingParams(0.0), mesh=mesh)
    prompts = random_prompts([9] * 7, seed=3)  # equal needs: ties go by shard index
    budgets = [20, 2, 20, 20, 20, 4, 4]  # group 1 (shard 1) ends first
    loop = EpisodeLoop(engine, 3)
    loop.add(prompts, budgets)
    events, opens, prefill, flush = [], [], engine.prefill_many, engine.flush

    def prefill_many(params, state, prompts, shards=None):
        events.append(list(shards))
        return prefill(params, state, prompts, shards)

    def look_and_flush(params, state, flags=()):  # once per round, after its admissions
        opens.append({i: o[0] for i, o in loop.open_groups().items()})
        return flush(params, state, flags)

    engine.prefill_many, engine.flush = prefill_many, look_and_flush
    loop.run(params, engine.init_state(), seed=1)
    assert loop.idle and all(c is not None for r in loop.results.values() for c in r)
    assert events == [[0, 1, 2, 3, 0, 1, 2]]  # one round admits all: three go in partly
    assert opens[0] == {0: 4, 1: 5, 2: 6}, opens[0]  # one open group per shard
    assert {} in opens  # each completed on its own shard


def test_groups_partly_in_on_several_shards_refresh_their_prompts_in_one_round(one_device):
    """Three groups partly in (one on each of shards 0..2) when a stop comes: the next run, under
    new parameters with refresh, completes them in the same round on the three shards, each
    prompt recomputed (one prefill batch of the round, a row per shard), and their later
    samples draw the tokens of their request decoded alone under the new parameters."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, host = one_device
    shardings = state_shardings(abstract_model(CFG)[1], mesh, DEFAULT_RULES)
    engine = Engine(CFG, graphdef, ECFG, SamplingParams(0.0), mesh=mesh)
    prompts, budget = random_prompts([9] * 7, seed=3), 8  # equal: the shards free up together
    loop = EpisodeLoop(engine, 3)
    loop.add(prompts, [budget] * 7)
    calls, dispatch = [0], engine.dispatch

    def counted(*a, **kw):
        calls[0] += 1
        return dispatch(*a, **kw)

    engine.dispatch = counted
    state = loop.run(jax.device_put(host, shardings), engine.init_state(), seed=1,
                     until=lambda: calls[0] >= 1)  # fmt: skip
    assert {i: o[:2] for i, o in loop.open_groups().items()} == {0: (4, 1), 1: (5, 1), 2: (6, 1)}
    new = jax.tree.map(lambda x: x * 1.25, host)
    loop.run(jax.device_put(new, shardings), state, seed=1, version=1, refresh=True)
    assert loop.idle and engine.allocator.num_used == 0
    alone = Engine(CFG, graphdef, ECFG, SamplingParams(0.0))
    for key in (4, 5, 6):
        _, (want,) = generate_all(alone, new, alone.init_state(), [prompts[key]], 3, budget,
                                        seed=1, request_ids=[key])  # fmt: skip
        for k in (1, 2):  # inserted after the stop, from the refreshed prompt
            assert loop.results[key][k].tokens == want[k].tokens, (key, k)
