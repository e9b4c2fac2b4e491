"""Multi-turn episodes in the engine (`sampling.episodes`): KV kept on the device across turns,
only observation tokens prefilled, outputs equal to re-prefilling the whole history every turn,
and tool latency hidden behind the decoding of other episodes."""

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sampling.distribution import SamplingParams
from sampling.engine import Engine
from sampling.episodes import generate_all
from tests.conftest import CFG, ECFG, random_prompts

MCFG = dataclasses.replace(ECFG, max_new_tokens=24, num_pages=160)
TURN = 3  # model tokens per turn (the random model rarely hits a stop id: turns end by length)


def _obs(i, k, turn_no):
    """The scripted observation after turn `turn_no` of sample k of prompt i (None: the end)."""
    if turn_no == 2:
        return None
    rng = np.random.default_rng(100 * i + 10 * k + turn_no)
    return rng.integers(1, CFG.vocab_size, 2 + (i + k + turn_no) % 4).tolist()


def _scripted(history):
    def respond(i, k, turn, left):
        history.setdefault((i, k), []).append(turn.tokens)
        return _obs(i, k, len(history[(i, k)]) - 1)

    return respond


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_multi_turn_equals_reprefill_and_prefills_only_new_tokens(tiny, temperature):
    graphdef, params = tiny
    engine = Engine(CFG, graphdef, MCFG, SamplingParams(temperature))
    prompts = random_prompts([5, 9, 17, 3, 12], seed=4)
    g = 2 if temperature == 0 else 1  # sampled: one per request, so the reference has its key
    history = {}
    state, results = generate_all(engine, params, engine.init_state(), prompts, g, seed=7)
    assert results  # the single-turn loop still works next to the multi-turn one
    before = engine.prefill_tokens
    state, episodes = generate_all(
        engine, params, state, prompts, g, seed=7, respond=_scripted(history),
        max_turn_tokens=TURN,
    )  # fmt: skip
    # The reference engine takes whole histories as prompts.
    ref_engine = Engine(CFG, graphdef, dataclasses.replace(MCFG, max_prompt_len=48),
                        SamplingParams(temperature))  # fmt: skip
    ref_state = ref_engine.init_state()
    observations = 0
    for i, prompt in enumerate(prompts):
        for k in range(g):
            ep = episodes[i][k]
            assert ep.turns == 3
            # Reference: every turn re-prefills prompt + everything so far, one turn at a time.
            seq, want_tokens, want_obs, want_lp = list(prompt), [], [], []
            for t in range(3):
                ref_state, ref = generate_all(
                    ref_engine, params, ref_state, [seq], 1, TURN, seed=7, request_ids=[i]
                )
                assert k == 0 or temperature == 0
                turn = ref[0][0]
                assert turn.tokens == history[(i, k)][t], (i, k, t)
                want_tokens += turn.tokens
                want_lp += turn.logprobs
                want_obs += [False] * turn.length
                obs = _obs(i, k, t)
                if obs is not None:
                    observations += len(obs)
                    want_tokens += obs
                    want_lp += [0.0] * len(obs)
                    want_obs += [True] * len(obs)
                    seq = seq + turn.tokens + obs
            assert ep.tokens == want_tokens
            assert ep.observation == want_obs
            np.testing.assert_allclose(ep.logprobs, want_lp, atol=1e-5)
    # The prompt once per group (its last token is fed by the first decode step), then exactly
    # each observation (the turn's last sampled token and all but the last observation token).
    assert engine.prefill_tokens - before == sum(len(p) - 1 for p in prompts) + observations
    assert engine.allocator.num_used == 0 and not engine.pages.parked


def _timed_rollout(graphdef, params, tool_seconds, slow=None, runs=3):
    """64 episodes (8 prompts x 8), two tool calls each through 8 tool workers, `runs` times;
    returns the best wall time of the runs after the first (which compiles) and each episode's
    finish time. `slow`: an episode (i, k) whose first tool call returns only once every other
    episode has finished (`waited` says whether it did, within 300 s: the first run compiles)."""
    engine = Engine(CFG, graphdef, MCFG, SamplingParams(1.0))
    prompts = random_prompts([6] * 8, seed=5)
    pool = ThreadPoolExecutor(8)
    calls, finished, waited = {}, {}, []
    rest_done = threading.Event()

    def tool(i, k):
        if (i, k) == slow and calls[(i, k)] == 1:
            waited.append(rest_done.wait(300))
        else:
            time.sleep(tool_seconds)
        return [5, 6, 7]

    def respond(i, k, turn, left):
        n = calls[(i, k)] = calls.get((i, k), 0) + 1
        if n > 2:
            return None
        if tool_seconds == 0 and slow is None:
            return [5, 6, 7]
        return pool.submit(tool, i, k)

    state = engine.init_state()
    start = [0.0]

    def on_finish(i, k, completion):
        finished[(i, k)] = time.perf_counter() - start[0]
        if len([key for key in finished if key != slow]) == 63:
            rest_done.set()

    walls = []
    for _ in range(runs):  # the first run compiles; the best of the others (a shared machine)
        calls.clear()
        finished.clear()
        rest_done.clear()
        start[0] = time.perf_counter()
        state, results = generate_all(
            engine, params, state, prompts, 8, seed=1, respond=respond, max_turn_tokens=TURN,
            on_finish=on_finish,
        )  # fmt: skip
        walls.append(time.perf_counter() - start[0])
    wall = min(walls[1:] or walls)
    pool.shutdown()
    assert all(c.turns == 3 for grp in results for c in grp)
    return wall, finished, waited


@pytest.mark.slow  # moved out of the fast tier (pytest -m 'not slow' < 5 min cold)
def test_tool_latency_is_hidden_behind_decoding(tiny):
    graphdef, params = tiny
    instant = _timed_rollout(graphdef, params, 0.0)[0]
    sleeping = _timed_rollout(graphdef, params, 0.1)[0]
    # Waiting on each of the 128 calls in turn would add 12.8 s; 8 workers at least 1.6 s. The
    # margin is wide: in the full suite this runs beside training runs on the other worker.
    print(f"instant tool {instant:.2f} s, 100 ms tool {sleeping:.2f} s")
    assert sleeping < instant + 6.0


@pytest.mark.slow  # moved out of the fast tier (pytest -m 'not slow' < 5 min cold)
def test_a_slow_tool_does_not_delay_the_other_episodes(tiny):
    graphdef, params = tiny
    # The slow episode's first tool call returns only once the 63 others have ended: the
    # loop must go on decoding them meanwhile (it would otherwise wait the 300 s out). One
    # run: nothing here is timed (three ran the same episodes three times: 15.5 s of CPU).
    _, finished, waited = _timed_rollout(graphdef, params, 0.0, slow=(3, 2), runs=1)
    assert waited == [True]
    assert max(finished, key=finished.get) == (3, 2)


def test_resume_refuses_what_exceeds_the_reservation(tiny):
    graphdef, params = tiny
    engine = Engine(CFG, graphdef, MCFG, SamplingParams(0.0))
    state = engine.init_state()
    state, prefix = engine.prefill(params, state, random_prompts([6])[0])
    state = engine.bulk_insert(state, prefix, [0], 0, 2, reserve=8)
    state = engine.generate(params, state, None, 2)
    state, (parked,) = engine.park(state, [0], [9])
    with pytest.raises(ValueError, match="exceed the sequence's reserved"):
        engine.resume(params, state, [(parked, [1, 2, 3, 4, 5, 6], 1, 3)])
    assert engine.pages.free_slots.count(1) == 1 and engine.pages.is_parked(parked)  # unchanged
    state = engine.resume(params, state, [(parked, [1, 2], 1, 3)])
    assert engine.pages.length(1) == 5 + 2 + 2 and not engine.pages.parked
    engine.free_resource(state, 1)
    assert engine.allocator.num_used == 0


@pytest.mark.parametrize("failure", ["tool_raises", "on_finish_raises", "out_of_vocab"])
def test_an_exception_leaves_no_page_or_parked_sequence(tiny, failure):
    graphdef, params = tiny
    engine = Engine(CFG, graphdef, MCFG, SamplingParams(0.0))
    pool = ThreadPoolExecutor(2)

    def tool(i, k):
        if failure == "tool_raises" and i == 2:
            raise RuntimeError("tool crashed")
        return [CFG.vocab_size + 5] if failure == "out_of_vocab" and i == 1 else [4, 5]

    def respond(i, k, turn, left):
        return pool.submit(tool, i, k) if turn.length == TURN and left > 8 else None

    def on_finish(i, k, completion):
        if failure == "on_finish_raises" and i == 3:
            raise KeyError("scoring failed")

    error = {"tool_raises": RuntimeError, "on_finish_raises": KeyError,
             "out_of_vocab": ValueError}[failure]  # fmt: skip
    with pytest.raises(error):
        generate_all(
            engine, params, engine.init_state(), random_prompts([5, 7, 9, 4, 6]), 2,
            respond=respond, on_finish=on_finish, max_turn_tokens=TURN,
        )  # fmt: skip
    pool.shutdown()
    assert engine.allocator.num_used == 0 and not engine.pages.parked
    assert not engine.pages.busy_slots()
