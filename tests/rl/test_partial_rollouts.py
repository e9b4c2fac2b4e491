"""Partial rollouts (rl.partial) on the 8-device mesh: episodes carried across learner steps are
trained on exactly the ids and log-probs the sampler gave at each policy version, their
observations in place, and no trained token is older than the staleness bound."""

import jax
import numpy as np
import pytest

from launch.build import build
from launch.cli import parse_args
from rl.data import PromptStream, make_prompt_iterator
from rl.envs import Environment, Episode, register_env

B, G, ETA = 4, 4, 2
ARGS = [
    "--config.mesh.data=8", f"--config.data.prompts_per_step={B}",
    f"--config.rl.num_generations={G}", "--config.rl.partial_rollouts=True",
    f"--config.rl.extra_groups={B}", f"--config.rl.max_staleness={ETA}",
    "--config.rl.is_correction=tis", "--config.sampling.num_slots=8",
    "--config.sampling.steps_per_call=1", "--config.env.name=test_partial",
    "--config.env.max_turns=3", "--config.env.max_turn_tokens=4",
    "--config.sampling.max_new_tokens=24", "--config.sampling.temperature=1.5",
    "--config.optim.learning_rate=1e-2", "--config.optim.warmup_steps=0",
]  # fmt: skip


@register_env("test_partial")
class Varied(Environment):
    """Observations of 1-5 ids that depend on the turn (episodes end at different times); the
    reward is the number of model tokens, so groups are not all equal."""

    def step(self, episode: Episode, turn):
        if episode.num_turns >= 3:
            return None
        return [10 + (sum(turn.ids) + i) % 7 for i in range(1 + sum(turn.ids) % 5)]

    def reward(self, episode):
        return float(sum(len(t.ids) for t in episode.turns))


def _spy(engine, version):
    """Records each slot stint's sampled ids and log-probs, keyed by (request, sample), in order,
    with the version (`version[0]`) of the parameters that drew them."""
    stints = {}  # (request, sample, slot, serial) -> (version, ids, logprobs); the last read wins
    collect = engine.collect

    def spy(ticket):
        r = collect(ticket)
        for s in r.slots:
            m = int(r.num_generated[s])
            key = (*engine._ids[s], s, ticket.slots[s][0])
            stints[key] = (version[0], r.tokens[s, :m].tolist(), r.logprobs[s, :m].tolist())
        return r

    engine.collect = spy
    return stints


@pytest.mark.parametrize("refresh", [False, True], ids=["keep_kv", "refresh_kv"])
def test_carried_episodes_train_on_what_each_version_sampled(refresh):
    config = parse_args([*ARGS, f"--config.rl.refresh_kv_on_update={refresh}"], {})[0]
    run = build(config)
    data = PromptStream(make_prompt_iterator(config.data.train, batch_size=B, seed=0))
    rollouts = run.rollouts()
    version = [0]
    stints = _spy(run.engines["rollout"], version)
    state, carried, mixed = run.state, [], 0
    for step in range(3):
        version[0] = step
        rollout = rollouts(step, state.params, data, drain=step == 2)
        carried.append(rollouts.carried)
        b, layout = jax.device_get(rollout.batch), rollout.layout
        drawn = {}  # (request, sample) -> [(version, ids, logprobs)] in the order drawn
        for (req, k, *_), stint in stints.items():
            drawn.setdefault((req, k), []).append(stint)
        i = 0
        for grp in rollout.groups:
            for c in grp.completions:
                model = ~np.asarray(c.observation, bool)
                ids = np.asarray(c.tokens)[model].tolist()
                lps = np.asarray(c.logprobs)[model].tolist()
                versions = np.asarray(c.versions)[model].tolist()
                match = [v for v in drawn.values()
                         if sum((s[1] for s in v), []) == ids
                         and sum((s[2] for s in v), []) == lps]  # fmt: skip
                assert match, "a trained episode's ids and log-probs were not drawn as such"
                assert versions == sum(([v] * len(s) for v, s, _ in match[0]), [])
                mixed += len(set(versions)) > 1
                assert min(versions) >= step - ETA, (step, versions)  # the staleness bound
                # The learner row: prompt + ids and observations, behaviour log-probs bitwise.
                n, p, row, col = c.length, len(grp.prompt), layout.row[i], layout.start[i]
                np.testing.assert_array_equal(b.tokens[row, col : col + p + n],
                                              grp.prompt + c.tokens)  # fmt: skip
                logp = b.sampler_logp[row, col + p - 1 : col + p + n - 1]
                np.testing.assert_array_equal(logp, np.float32(c.logprobs))
                np.testing.assert_array_equal(b.loss_mask[row, col + p - 1 : col + p + n - 1],
                                              np.float32(model))  # fmt: skip
                i += 1
        assert len(rollout.groups) >= B
        stats = rollout.stats
        assert stats["rollout/staleness_max"] <= ETA
        assert 0 < stats["rollout/slot_utilization"] <= 1
        state, _ = run.learner.learn(state, run.ref_params, rollout.batch)  # a new version
        jax.block_until_ready(state.params)
    rollouts.close()
    assert carried[0] > 0 and carried[1] > 0 and carried[2] == 0  # the last step drained
    assert mixed > 0, "no trained episode was carried across a learner step"
