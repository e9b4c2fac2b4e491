"""Multi-turn episodes end to end (rl.multiturn + rl.rollout): the learner batch holds exactly the
sampled ids and the environment's observation ids, observations get no loss, and teacher forcing
reproduces the sampler's log-probs on the model's tokens."""

import jax
import numpy as np
import pytest

from launch.build import build
from launch.cli import parse_args
from models.sharding import on_devices
from rl.data import make_prompt_stream
from rl.envs import Environment, Episode, register_env

OBS = {1: [5, 6, 7], 2: [8, 3]}
# One of the 8 fake devices (models.sharding.on_devices): the episodes, not the mesh, are under
# test here, and a one-device run costs about half the CPU of a data=8 one.
ARGS = [
    "--config.data.prompts_per_step=2", "--config.rl.num_generations=4",
    "--config.sampling.num_slots=8", "--config.env.name=test_scripted",
    "--config.env.max_turns=3", "--config.env.max_turn_tokens=3",
    "--config.sampling.max_new_tokens=16", "--config.sampling.temperature=1.3",
]  # fmt: skip  # observation ids after turns 1 and 2; turn 3 ends the episode


@register_env("test_scripted")
class Scripted(Environment):
    """Answers turn 1 and 2 with fixed ids (turn 2's observation has an error, counted), ends
    after turn 3; reward: how many model tokens the episode had, so groups are not all equal."""

    def step(self, episode: Episode, turn):
        episode.tool_calls += 1
        episode.tool_errors += episode.num_turns == 2
        return OBS.get(episode.num_turns)

    def reward(self, episode):
        return float(sum(len(t.ids) for t in episode.turns))


@pytest.fixture
def one_device():
    with on_devices(jax.devices()[:1]):
        yield


def test_episode_batch_is_the_sampled_and_observation_ids(one_device):
    config = parse_args(ARGS, {})[0]
    run = build(config)
    seen = []  # every turn the environment saw, in order per episode
    step = run.env.step
    run.env.step = lambda ep, turn: (seen.append((ep, turn.ids)), step(ep, turn))[1]
    data = make_prompt_stream(config.data.train, batch_size=2, seed=0)
    rollouts = run.rollouts()
    rollouts(0, run.state.params, data)
    rollout = rollouts(1, run.state.params, data)  # the second: counters are per rollout
    rollouts.close()
    b, layout = jax.device_get(rollout.batch), rollout.layout
    i = 0  # sequence i sits in row layout.row[i] from column layout.start[i] (rl.packing)
    for grp in rollout.groups:
        for ep, c in zip(grp.episodes, grp.completions):
            turns = [t.ids for t in ep.turns]
            assert len(turns) == 3 and [ids for e, ids in seen if e is ep] == turns[:2]
            want = turns[0] + OBS[1] + turns[1] + OBS[2] + turns[2]
            is_obs = [False] * len(turns[0]) + [True] * 3 + [False] * len(turns[1]) + [True] * 2
            is_obs += [False] * len(turns[2])
            n, p, row, col = len(want), len(grp.prompt), layout.row[i], layout.start[i]
            np.testing.assert_array_equal(b.tokens[row, col : col + p + n], grp.prompt + want)
            assert c.tokens == want and c.observation == is_obs
            np.testing.assert_array_equal(b.loss_mask[row, col : col + p - 1], 0)
            np.testing.assert_array_equal(b.loss_mask[row, col + p - 1 : col + p - 1 + n],
                                          ~np.array(is_obs))  # fmt: skip
            np.testing.assert_array_equal(b.sampler_logp[row, col + p - 1 : col + p - 1 + n],
                                          np.float32(c.logprobs))  # fmt: skip
            assert all(lp == 0 for lp, o in zip(c.logprobs, is_obs) if o)
            i += 1
    # Teacher forcing over the whole episode: the learner's log-probs of the model's tokens.
    learner = np.asarray(run.learner.logprobs(run.state.params, rollout.batch))
    m = b.loss_mask > 0
    np.testing.assert_allclose(learner[m], b.sampler_logp[m], atol=1e-5)
    s = rollout.stats
    assert s["episode/turns"] == 3 and s["episode/tool_calls"] == 2
    assert s["episode/tool_errors"] == 1 and s["episode/env_errors"] == 0
    obs_tokens = 8 * 5
    assert s["episode/observation_frac"] == pytest.approx(
        obs_tokens / (b.loss_mask.sum() + obs_tokens)
    )
    # The prompt once per group, then exactly the observation tokens.
    assert (
        s["episode/prefill_tokens"] == sum(len(g.prompt) - 1 for g in rollout.groups) + obs_tokens
    )
    assert s["episode/reprefill_tokens"] > 2 * s["episode/prefill_tokens"]


class Hostile(Scripted):
    """A broken environment: `mode` picks what goes wrong on turn 2."""

    mode = ""

    def step(self, episode, turn):
        if episode.num_turns == 2:
            if self.mode == "step_raises":
                raise RuntimeError("tool crashed")
            if self.mode == "text":
                return "not ids"
            if self.mode == "out_of_vocab":
                return [10**6]  # outside any vocabulary
        return super().step(episode, turn)

    def reward(self, episode):
        if self.mode == "nan_reward":
            return float("nan")
        if self.mode == "reward_raises":
            raise KeyError("answer")
        return super().reward(episode)

    def close(self, episode):
        if self.mode == "close_raises":
            raise OSError("workspace already gone")


MODES = ["step_raises", "text", "out_of_vocab", "nan_reward", "reward_raises", "close_raises"]


@pytest.mark.slow  # moved out of the fast tier (pytest -m 'not slow' < 5 min cold)
def test_a_broken_environment_ends_its_episodes_and_the_run_goes_on(one_device):
    """Every way an environment can fail ends the episode, masked out of the loss (an environment
    bug is not the model's doing: it was scored 0 before), counted in episode/env_errors;
    nothing raises and no KV page stays allocated."""
    config = parse_args(ARGS, {})[0]
    run = build(config)
    data = make_prompt_stream(config.data.train, batch_size=2, seed=0)
    for mode in MODES:
        env = Hostile(run.tokenizer, config)
        env.mode = mode
        run.env = env
        rollouts = run.rollouts()
        rollout = rollouts(0, run.state.params, data)
        rollouts.close()
        s = rollout.stats
        errors = {"close_raises": 0.0}.get(mode, 1.0)
        assert s["episode/env_errors"] == errors, mode
        if errors:
            assert (rollout.rewards == 0).all(), mode  # placeholders
            assert s["masked_samples"] == 8 and s["episode/infra_errors"] == 0, mode
            assert jax.device_get(rollout.batch.loss_mask).sum() == 0, mode
        else:
            assert s.get("masked_samples", 0) == 0, mode
        assert run.engines["rollout"].allocator.num_used == 0 or not (
            config.sampling.release_kv_between_phases
        )


def test_closing_the_sampler_releases_the_episodes_still_live():
    """A run stopped with groups in flight (non-finite steps, partial rollouts carrying some)
    closes its sampler: every episode begun and not scored is closed once, after the tool
    calls running have returned."""
    from types import SimpleNamespace

    from rl.multiturn import EpisodeSampler

    closed = []

    class Counting(Scripted):
        def __init__(self):  # no tokenizer: nothing here is decoded
            pass

        def close(self, episode):
            closed.append(episode)

    env = Counting()
    cfg = SimpleNamespace(max_turns=3, max_turn_tokens=0, max_tool_seconds=60.0, tool_workers=2)
    sampler = EpisodeSampler(env, SimpleNamespace(cfg=SimpleNamespace(vocab_size=16)), None, cfg)
    for key in range(3):
        sampler.begin(key, {"prompt": str(key)}, 2)
    episodes, rewards = sampler.score(1)  # scored: closed by the scoring
    rewards.result()
    live = [ep for eps in sampler.live.values() for ep in eps]
    sampler.close()
    assert len(closed) == 6 and {id(e) for e in closed} == {id(e) for e in live + episodes}
    assert sampler.live == {}


def test_an_environment_error_is_masked_as_an_infrastructure_error_is():
    """EpisodeSampler._score: a reward that raises or is not finite, or a step that raised
    (counted by _step), masks the episode like env.masked does (one path: Group.keep); the
    counts are apart: episode/infra_errors the environment's masks, episode/env_errors its
    errors, episode/tamper what it caught the model changing."""
    from types import SimpleNamespace

    from models.tokenizer import CharTokenizer
    from rl.groups import episode_group
    from rl.multiturn import EpisodeSampler
    from rl.summary import episode_stats, summary
    from sampling.requests import Completion

    class Flaky(Scripted):
        def __init__(self):  # no tokenizer: nothing here is decoded
            pass

        def reward(self, episode):
            p = episode.record["prompt"]
            episode.metrics = {"frac": float(p == "ok")}  # then nan, raise: masked, not averaged
            if p == "raise":
                raise KeyError("answer")
            return float("nan") if p == "nan" else float(p != "wrong")

        def masked(self, episode):
            return episode.record["prompt"] == "infra"

    cfg = SimpleNamespace(max_turns=3, max_turn_tokens=0, max_tool_seconds=60.0, tool_workers=1)
    sampler = EpisodeSampler(
        Flaky(), SimpleNamespace(cfg=SimpleNamespace(vocab_size=16)), None, cfg
    )
    eps = [Episode({"prompt": p}) for p in ("ok", "wrong", "raise", "nan", "infra", "step")]
    eps[5].env_errors = 1  # its step raised
    eps[1].tamper = ["unittest.case.TestCase.assertEqual"]
    try:
        rewards = sampler._score(eps)
    finally:
        sampler.close()
    assert [ep.masked for ep in eps] == [False, False, True, True, True, True]
    assert list(rewards) == [1, 0, 0, 0, 0, 0]
    assert [ep.env_errors for ep in eps] == [0, 0, 1, 1, 0, 1]
    completions = [Completion([3, 4], [-0.5, -0.5], "stop", 2) for _ in eps]
    group = episode_group({"prompt": "p"}, [1], eps, completions, rewards, CharTokenizer("ab"))
    assert list(group.keep()) == [True, True, False, False, False, False]
    s = episode_stats([summary(group, 0)], 0, 0)
    assert s["episode/infra_errors"] == 1 and s["episode/env_errors"] == 0.5
    assert s["episode/tamper"] == 1
    assert s["episode/frac"] == 0.5  # ok and wrong only: the masked episodes' metrics left out
    # the masked ones counted, and the most frequent reason (rl.summary.masked_stats)
    assert s["episode/masked"] == 4 and s["episode/count"] == 6
    assert s["episode/masked_frac"] == pytest.approx(4 / 6)
    assert s["episode/top_infra_error"] == [
        "the environment raised (episode/env_errors; warned once)",
        3,
    ]
    eps[2].env_errors = eps[3].env_errors = eps[5].env_errors = 0
    for ep in eps[2:]:
        ep.infra_error = "sandbox did not start:\n  timeout"  # one line, as exchanged
    s = episode_stats([summary(group, 0)], 0, 0)
    assert s["episode/top_infra_error"] == ["sandbox did not start: timeout", 4]
