"""Partial rollouts (rl.partial) with multi-turn episodes whose environment is slow on purpose:
dynamic sampling does not stop decoding while a complete group is graded, and an episode whose
tool call is still running when the batch is complete is carried across the learner step with
the call in flight, then resumes under the new version."""

import threading
import time

import jax
import numpy as np
import pytest

from launch.build import build
from launch.cli import parse_args
from models.sharding import on_devices
from rl.data import make_prompt_stream
from rl.envs import Environment, Episode, register_env
from tests.rl.test_partial_rollouts import ARGS, B, Varied


@pytest.fixture(autouse=True)
def _two_devices():
    """ARGS' mesh (data=2: two batch shards) on 2 of the 8 fake devices, as test_partial_rollouts."""
    with on_devices(jax.devices()[:2]):
        yield


@register_env("test_partial_slow_grading")
class SlowGrading(Varied):
    """Varied, whose grading of a group returns only once the rollout's clock is CALLS decode calls
    past the group's completion (the calls it read, and its moves while nothing decoded), or the
    loop has no sequence left to decode (`watch`, set by the test). It waits 120 s at most (a
    loop that compiles a new shape meanwhile is slow on a loaded machine); once one grading has
    timed out the others return at once, so a loop that stalls fails in 120 s, not 120 s each."""

    # Calls a grading waits for: fewer than the 16 at which dynamic sampling needs it, and few
    # enough that some group completes with that much decoding left in the rollout (at 12, one
    # group of the run's did, and on a loaded CI worker once none: every grading saw "idle").
    CALLS = 4
    watch = None  # (engine, the loop's clock, record prompt -> clock at completion), by the test
    outcomes: list = []  # per graded episode: "decoded", "idle" or "timeout"

    def reward(self, episode):
        engine, clock, completed = self.watch
        start = completed[episode.record["prompt"]]
        deadline = time.monotonic() + (0 if "timeout" in SlowGrading.outcomes else 120)
        while time.monotonic() < deadline:
            if clock() >= start + SlowGrading.CALLS:
                SlowGrading.outcomes.append("decoded")
                break
            # No busy slot: nothing the loop could decode meanwhile.
            if not engine.pages.busy_slots():
                SlowGrading.outcomes.append("idle")
                break
            time.sleep(0.002)
        else:
            SlowGrading.outcomes.append("timeout")
        return super().reward(episode)


@pytest.mark.slow  # two multi-turn rollouts on the mesh; a regression test
def test_dynamic_sampling_does_not_stop_decoding_for_an_environments_grading():
    """Multi-turn groups are judged by dynamic sampling env.tool_answer_calls decode calls after
    they complete, on the loop's clock (their grading waited for then): a grading that needs
    the loop to go on for CALLS (4) calls of its clock gets them before it is due at 16; a loop that
    waited for it at once would stall until the grading's timeout."""
    config = parse_args([*ARGS, "--config.env.name=test_partial_slow_grading",
                         "--config.rl.dynamic_sampling=True",
                         "--config.env.tool_answer_calls=16"], {})[0]  # fmt: skip
    run = build(config)
    data = make_prompt_stream(config.data.train, batch_size=B, seed=0)
    rollouts = run.rollouts()
    engine, completed, sampler = run.engines["rollout"], {}, rollouts.sampler.episodes
    clock = lambda: rollouts.sampler.loop.clock  # noqa: E731
    score = sampler.score

    def completing(key):  # a group's G episodes ended: its grading starts now on the clock
        completed[sampler.live[key][0].record["prompt"]] = clock()
        return score(key)

    sampler.score = completing
    SlowGrading.watch, SlowGrading.outcomes = (engine, clock, completed), []
    for step in range(2):
        rollouts(step, run.state.params, data)
    rollouts.close()
    assert "timeout" not in SlowGrading.outcomes, SlowGrading.outcomes
    assert "decoded" in SlowGrading.outcomes  # decoding went on while an episode was graded


@register_env("test_partial_gated")
class Gated(Environment):
    """Two turns per episode; the first tool call made waits for `gate` (set by the test)."""

    gate, lock, held = threading.Event(), threading.Lock(), []

    def step(self, episode: Episode, turn):
        if episode.num_turns >= 2:
            return None
        with Gated.lock:
            first = not Gated.held
            Gated.held += [episode] if first else []
        if first:
            Gated.gate.wait(300)  # set by the test (also when it fails)
        return [11, 12, 13]

    def reward(self, episode):
        return float(sum(len(t.ids) for t in episode.turns))


@pytest.mark.slow  # two multi-turn rollouts on the mesh
def test_an_episode_waiting_on_its_tool_is_carried_and_resumes_under_the_new_version():
    """A tool call still running when the step's batch is complete stays in flight across the
    learner step (its group carried); the next step takes its answer, decodes the episode's
    next turn under version 1 and trains it: first turn drawn by version 0, the observation in
    place, the row as sampled. Under env.tool_answer_calls=0 (each answer as soon as it is
    done): under a k > 0 the loop would wait for the held answer k calls after its turn."""
    config = parse_args([*ARGS, "--config.env.name=test_partial_gated",
                         "--config.rl.max_staleness=4",
                         "--config.env.tool_answer_calls=0"], {})[0]  # fmt: skip
    run = build(config)
    data = make_prompt_stream(config.data.train, batch_size=B, seed=0)
    rollouts, Gated.held = run.rollouts(), []
    Gated.gate.clear()
    try:
        first = rollouts(0, run.state.params, data)
        waiting = rollouts.sampler.loop.waiting
        assert rollouts.carried > 0 and any(not f.done() for f in waiting)  # the held call
        assert all(Gated.held[0] not in (grp.episodes or []) for grp in first.groups)
        Gated.gate.set()  # the tool answers during the learner step
        second = rollouts(1, run.state.params, data, drain=True)
    finally:
        Gated.gate.set()
        rollouts.close()
    b, layout, i = jax.device_get(second.batch), second.layout, 0
    for grp in second.groups:
        for ep, c in zip(grp.episodes, grp.completions):
            if ep is Gated.held[0]:
                obs = np.asarray(c.observation, bool)
                model = np.asarray(c.versions)[~obs]
                assert model[0] == 0 and model[-1] == 1, c.versions  # both versions drew it
                start = obs.argmax()
                assert c.tokens[start : start + 3] == [11, 12, 13]
                n, p, row, col = c.length, len(grp.prompt), layout.row[i], layout.start[i]
                np.testing.assert_array_equal(b.tokens[row, col : col + p + n],
                                              grp.prompt + c.tokens)  # fmt: skip
                return
            i += 1
    raise AssertionError("the held episode was not trained in the draining step")
