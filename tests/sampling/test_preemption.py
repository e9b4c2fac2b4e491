"""Pages on demand (`EngineConfig.reserve="demand"`, `sampling.episodes`): a pool of half the
slots' full budgets finishes a skewed workload of multi-turn G = 2 episodes by preempting the
newest sequences of a full shard (their pages freed, their history recomputed by a chunked
prefill when they resume). Against one uninterrupted run with an unconstrained pool that
reserves every budget: the same greedy tokens, T=1 tokens and log-probs within 1e-5; on one
device, on the (2,2,2) mesh and (slow) on fsdp=8. A sequence carried across a partial-rollout
stop and preempted is recomputed under the new parameters, as `refresh` does.
"""

import collections
import dataclasses

import jax
import numpy as np
import pytest

from models.sharding import DEFAULT_RULES, abstract_model, init_params, make_mesh, state_shardings
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.episodes import EpisodeLoop
from sampling.requests import group_pages
from tests.conftest import CFG, random_prompts

SLOTS, PAGE = 16, 8
ECFG = EngineConfig(
    num_slots=SLOTS, page_size=PAGE, num_pages=512, max_prompt_len=24, max_new_tokens=40,
    steps_per_call=4, reserve="budget",
)  # fmt: skip
G, TURN = 2, 24  # samples per request, model tokens per turn
PROMPTS = random_prompts([17, 23, 9, 20, 14, 22, 19, 23, 16, 21], seed=21)
BUDGETS = [40, 36, 40, 28, 40, 40, 33, 40, 24, 40]
FULL = max(group_pages(len(p), b, PAGE, 1) for p, b in zip(PROMPTS, BUDGETS))  # one sequence
# The fast tier keeps one variant of each check (README, Tests): T=1 on one device (the meshes,
# 18 s of the fast tier's worker time on (2,2,2), run in the full suite).
GREEDY = pytest.param(0.0, marks=pytest.mark.slow, id="greedy")
MESHES = {
    "one": {},
    "2x2x2": pytest.param({"data": 2, "fsdp": 2, "tensor": 2}, marks=pytest.mark.slow),
    "fsdp8": pytest.param({"fsdp": 8}, marks=pytest.mark.slow),
}


def _respond():
    turns = collections.Counter()

    def respond(i, k, turn, left):
        turns[i, k] += 1
        n = turns[i, k]
        if n == 3:  # most episodes run to their budget ("length")
            return None
        rng = np.random.default_rng(100 * i + 10 * k + n)
        return rng.integers(1, CFG.vocab_size, 1 + (i + k + n) % 4).tolist()

    return respond


def _flat(loop):
    out = [loop.results[i][k] for i in sorted(loop.results) for k in range(G)]
    return [c.tokens for c in out], [c.logprobs for c in out]


@pytest.fixture(scope="module")
def one_device():
    return init_params(CFG, make_mesh({}, devices=jax.devices()[:1]), seed=5)


def _engine(params_one, mesh_shape, temperature, **changes):
    graphdef, host = params_one
    ecfg = dataclasses.replace(ECFG, **changes)
    if not mesh_shape:
        return Engine(CFG, graphdef, ecfg, SamplingParams(temperature)), host
    mesh = make_mesh(mesh_shape)
    params = jax.device_put(host, state_shardings(abstract_model(CFG)[1], mesh, DEFAULT_RULES))
    return Engine(CFG, graphdef, ecfg, SamplingParams(temperature), mesh=mesh), params


def _count_calls(engine) -> collections.Counter:
    """calls["n"]: the engine's decode calls dispatched from now on."""
    calls, dispatch = collections.Counter(), engine.dispatch

    def counted(*a, **kw):
        calls["n"] += 1
        return dispatch(*a, **kw)

    engine.dispatch = counted
    return calls


def _run(engine, params, stop_after=None, versions=(0,), evict_carried=False, refresh=False):
    """The workload, in one run, or stopped after `stop_after` decode calls and finished by a
    run under versions[1]'s parameters (params[1])."""
    loop = EpisodeLoop(engine, G, respond=_respond(), max_turn_tokens=TURN)
    loop.add(PROMPTS, BUDGETS)
    calls = _count_calls(engine)
    until = None if stop_after is None else (lambda: calls["n"] >= stop_after)
    state = loop.run(params[0], engine.init_state(), seed=7, until=until)
    if stop_after is not None:
        carried = [ep for ep, _ in loop.ready] + list(loop.waiting.values())
        assert carried
        if evict_carried:  # as a full shard would: their pages go, their tokens stay
            for ep in carried:
                engine.pages.evict(ep.parked)
            assert all(ep.parked.evicted and not ep.parked.pages for ep in carried)
        state = loop.run(params[1], state, seed=7, version=1, refresh=refresh)
    assert loop.idle and engine.allocator.num_used == 0
    return _flat(loop)


@pytest.fixture(scope="module", params=[GREEDY, pytest.param(1.0, id="t1")])
def reference(one_device, request):
    """One device, a pool that never runs short, every budget reserved: no preemption."""
    engine, params = _engine(one_device, {}, request.param)
    out = _run(engine, (params,))
    assert engine.preemptions == 0
    return request.param, out


def _close(got, want):
    tokens, logprobs = got
    assert tokens == want[0]
    for a, b in zip(logprobs, want[1], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mesh_shape", MESHES.values(), ids=MESHES.keys())
def test_half_the_budgets_finish_with_preemptions(one_device, reference, mesh_shape):
    temperature, want = reference
    shards = 8 // mesh_shape.get("tensor", 1) if mesh_shape else 1
    # Half of the slots' full budgets (per shard: its slots' share), + each shard's null page.
    per_shard = SLOTS // shards * FULL // 2
    assert per_shard >= FULL  # one sequence always fits: progress
    engine, params = _engine(one_device, mesh_shape, temperature, reserve="demand",
                             num_pages=shards * (per_shard + 1))  # fmt: skip
    assert engine.num_shards == shards
    _close(_run(engine, (params,)), want)
    assert engine.preemptions > 0 and engine.recomputed_tokens > 0


def test_on_demand_holds_more_episodes_at_once(one_device):
    """The same pool holds more sequences decoding at once on demand than reserved."""
    peak = {}
    for reserve in ("budget", "demand"):
        engine, params = _engine(one_device, {}, 1.0, reserve=reserve,
                                 num_pages=SLOTS * FULL // 2 + 1)  # fmt: skip
        engine.slot_trace = []
        loop = EpisodeLoop(engine, G, max_turn_tokens=ECFG.max_new_tokens)
        loop.add(PROMPTS, BUDGETS)
        busy, flush = [], engine.flush

        def counted(params, state, flags=(), loop=loop, flush=flush, busy=busy):
            busy.append(len(loop.owner))  # once per round: what its decode call runs
            return flush(params, state, flags)

        engine.flush = counted
        loop.run(params, engine.init_state(), seed=3)
        peak[reserve] = max(busy)
    assert peak["demand"] > peak["budget"], peak


@pytest.mark.parametrize("temperature", [GREEDY, pytest.param(1.0, id="t1")])
def test_a_carried_sequence_preempted_is_recomputed_under_the_new_parameters(
    one_device, temperature
):
    """Stopped mid-rollout, the carried episodes evicted, the next run under new parameters:
    each is re-prefilled under them, as `refresh=True` does with the KV kept."""
    graphdef, host = one_device
    new = jax.tree.map(lambda x: x * 1.01 if x.dtype == np.float32 else x, host)
    engine, _ = _engine(one_device, {}, temperature)
    want = _run(engine, (host, new), stop_after=3, refresh=True)
    engine, _ = _engine(one_device, {}, temperature, reserve="demand")
    got = _run(engine, (host, new), stop_after=3, evict_carried=True)
    assert engine.recomputed_tokens > 0
    _close(got, want)


def test_stops_every_few_calls_with_preemptions(one_device, reference):
    """Partial-rollout stops every 5 decode calls (same parameters) on the tight pool: every
    carried episode resumes at once at the next run, and new groups are admitted beside them
    only into what their first calls leave; the tokens are the uninterrupted run's."""
    temperature, want = reference
    engine, params = _engine(one_device, {}, temperature, reserve="demand",
                             num_pages=SLOTS * FULL // 2 + 1)  # fmt: skip
    loop = EpisodeLoop(engine, G, respond=_respond(), max_turn_tokens=TURN)
    loop.add(PROMPTS, BUDGETS)
    calls = _count_calls(engine)
    state, runs = engine.init_state(), 0
    while not loop.idle:
        stop = calls["n"] + 5
        state = loop.run(params, state, seed=7, until=lambda stop=stop: calls["n"] >= stop)
        runs += 1
    assert runs > 3 and engine.preemptions > 0 and engine.allocator.num_used == 0
    _close(_flat(loop), want)


@pytest.mark.parametrize("temperature", [GREEDY, pytest.param(1.0, id="t1")])
def test_min_new_tokens_count_over_a_preemption(one_device, temperature):
    """min_new_tokens = 6 with a third of the vocabulary as stop ids, single turn: a sequence
    preempted mid-turn resumes banning only what is left of its 6, as one uninterrupted turn."""
    stops = tuple(range(1, CFG.vocab_size, 12))
    kw = dict(stop_ids=stops, min_new_tokens=6)
    engine, params = _engine(one_device, {}, temperature, **kw)
    want = _single_turn(engine, params)
    assert min(len(t) for t in want[0]) < 20  # the stop ids end some sequences early
    engine, params = _engine(one_device, {}, temperature, reserve="demand", num_pages=FULL + 3,
                             **kw)  # fmt: skip
    _close(_single_turn(engine, params), want)
    assert engine.preemptions > 0


def _single_turn(engine, params):
    loop = EpisodeLoop(engine, G)
    loop.add(PROMPTS, [ECFG.max_new_tokens] * len(PROMPTS))
    loop.run(params, engine.init_state(), seed=7)
    assert loop.idle and engine.allocator.num_used == 0
    return _flat(loop)


def test_a_pool_smaller_than_one_sample_is_refused(one_device):
    engine, _ = _engine(one_device, {}, 0.0, reserve="demand", num_pages=FULL)
    loop = EpisodeLoop(engine, G)
    with pytest.raises(ValueError, match=f"one sample may hold {FULL} KV pages, more than a "
                                          f"shard's pool \\({FULL - 1} pages\\)"):  # fmt: skip
        loop.add(PROMPTS, BUDGETS)
