"""Partial rollouts (rl.partial) on a mesh of two batch shards: episodes carried across learner
steps (some in the middle of a turn) are trained on exactly the ids and log-probs the sampler
gave at each policy version, their observations in place, no trained token is older than the
staleness bound, and rollouts do wait for a group at the bound (`enough` and `select` are also
checked on hand-made states)."""

from collections import Counter
from concurrent.futures import Executor, Future

import jax
import numpy as np
import pytest

from launch.build import build
from launch.cli import parse_args
from models.sharding import on_devices
from rl.data import make_prompt_stream
from rl.envs import Environment, Episode, register_env
from rl.partial import enough, select
from rl.rewards import register_reward

B, G, ETA, STEPS = 2, 4, 1, 5
# data=2 on 2 of the 8 fake devices (models.sharding.on_devices): two batch shards of 4 slots,
# so a group of G = 4 decodes together on one shard, two groups at a time. (On all 8, as
# data=2 x tensor=4, the same schedule cost 4x the CPU: 90 s for the three cases.)
ARGS = [
    "--config.mesh.data=2", f"--config.data.prompts_per_step={B}",
    f"--config.rl.num_generations={G}", "--config.rl.partial_rollouts=True",
    f"--config.rl.extra_groups={B}", f"--config.rl.max_staleness={ETA}",
    "--config.rl.is_correction=tis", "--config.sampling.num_slots=8",
    "--config.sampling.steps_per_call=1", "--config.env.name=test_partial",
    "--config.env.max_turns=5", "--config.env.max_turn_tokens=6",
    "--config.sampling.max_new_tokens=48", "--config.sampling.temperature=1.5",
    "--config.optim.learning_rate=1e-2", "--config.optim.warmup_steps=0",
]  # fmt: skip


@register_env("test_partial")
class Varied(Environment):
    """A third of the records get 5 turns (or what the 48-token budget holds), with observations
    of 4-8 ids that depend on the turn, the others one turn: long groups among short ones, which
    span learner steps, reach the staleness bound and make rollouts wait for them. The reward
    is the number of model tokens, so groups are not all equal."""

    def step(self, episode: Episode, turn):
        turns = 5 if sum(map(ord, episode.record["prompt"])) % 3 == 0 else 1
        return None if episode.num_turns >= turns else _observation(turn.ids)

    def reward(self, episode):
        return float(sum(len(t.ids) for t in episode.turns))


def _observation(ids):
    return [10 + (sum(ids) + i) % 7 for i in range(4 + sum(ids) % 5)]


def _runs(flags):
    """[(flag, start, end)] of the maximal runs of equal values in a bool list."""
    out, start = [], 0
    for t in range(1, len(flags) + 1):
        if t == len(flags) or flags[t] != flags[start]:
            out.append((flags[start], start, t))
            start = t
    return out


class _Inline(Executor):
    """Runs each submitted call at once: the environment's answers are there when the loop
    first looks, so which groups are complete at each decode call does not depend on threads."""

    def submit(self, fn, /, *args, **kwargs):
        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:
            future.set_exception(e)
        return future


def _spy(engine, version):
    """Records each slot stint's sampled ids and log-probs, keyed by (request, sample), in order,
    with the version (`version[0]`) of the parameters that drew them."""
    stints = {}  # (request, sample, slot, serial) -> (version, ids, logprobs); the last read wins
    collect = engine.collect

    def spy(ticket):
        r = collect(ticket)
        for s in r.slots:
            m = int(r.num_generated[s])
            key = (*engine.pages.ids(s), s, ticket.slots[s][0])
            stints[key] = (version[0], r.tokens[s, :m].tolist(), r.logprobs[s, :m].tolist())
        return r

    engine.collect = spy
    return stints


@pytest.mark.slow  # 5 rollouts and learner steps on the mesh (~30 s each cold); fast: the unit test
@pytest.mark.parametrize("refresh, dynamic", [(False, False), (True, False), (False, True)],
                         ids=["keep_kv", "refresh_kv", "dynamic_sampling"])  # fmt: skip
def test_carried_episodes_train_on_what_each_version_sampled(refresh, dynamic):
    with on_devices(jax.devices()[:2]):
        _carried_episodes_train_on_what_each_version_sampled(refresh, dynamic)


def _carried_episodes_train_on_what_each_version_sampled(refresh, dynamic):
    # Answers taken one decode call after their turn's (env.tool_answer_calls=1): the schedule
    # that makes groups wait at the staleness bound here.
    # With dynamic sampling, seed 2 samples a run whose replacements leave a long group at the
    # bound while both shards' batches are complete (seed 0 and 1 do not wait: the schedule is
    # each shard's own, and the test asserts that a wait happens).
    seed = 2 if dynamic else 0
    config = parse_args([*ARGS, f"--config.rl.refresh_kv_on_update={refresh}",
                         f"--config.rl.dynamic_sampling={dynamic}", f"--config.seed={seed}",
                         "--config.env.tool_answer_calls=1"], {})[0]  # fmt: skip
    run = build(config)
    data = make_prompt_stream(config.data.train, batch_size=B, seed=0)
    rollouts = run.rollouts()
    rollouts.sampler.episodes.pool.shutdown()
    rollouts.sampler.episodes.pool = _Inline()  # tools answer at once: one schedule on any machine
    version = [0]
    stints = _spy(run.engines["rollout"], version)
    state, carried, midturn, at_bound, waits, utils = run.state, [], 0, 0, 0.0, []
    generated, trained = [], []  # episode lengths, as they end and as they are trained
    replaced = 0  # zero-variance groups replaced (dynamic sampling)
    asked = []  # the last step: a stop requested while its rollout runs (launch.train's SIGTERM)

    def stop():
        asked.append(len(rollouts.sampler.done))
        return len(asked) > 1  # no at the start of the step, yes once its batch is complete

    for step in range(STEPS):
        version[0] = step
        rollout = rollouts(step, state.params, data, stop=stop if step == STEPS - 1 else None)
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
                # Samples of one group may draw the same ids under parameters that did not
                # change (a step with zero advantages): any of the identical draws will do.
                assert versions in [sum(([v] * len(s) for v, s, _ in m), []) for m in match]
                assert min(versions) >= step - ETA, (step, versions)  # the staleness bound
                at_bound += min(versions) == step - ETA
                # Each observation is the environment's answer to the turn before it.
                runs = _runs(list(~model))
                for (_, a, z), (is_obs, o, e) in zip(runs, runs[1:]):
                    if is_obs:
                        assert c.tokens[o:e] == _observation(c.tokens[a:z])
                for _, a, z in (r for r in runs if not r[0]):  # a turn drawn by two versions
                    midturn += len(set(c.versions[a:z])) > 1
                # The learner row: prompt + ids and observations, behaviour log-probs bitwise.
                n, p, row, col = c.length, len(grp.prompt), layout.row[i], layout.start[i]
                np.testing.assert_array_equal(b.tokens[row, col : col + p + n],
                                              grp.prompt + c.tokens)  # fmt: skip
                logp = b.sampler_logp[row, col + p - 1 : col + p + n - 1]
                np.testing.assert_array_equal(logp, np.float32(c.logprobs))
                np.testing.assert_array_equal(b.loss_mask[row, col + p - 1 : col + p + n - 1],
                                              np.float32(model))  # fmt: skip
                i += 1
        waits += rollout.stats["rollout/staleness_waits"]
        generated += rollouts.sampler.generated
        replaced += rollout.stats.get("dynamic_sampling_replacements", 0)
        trained += [c.length for grp in rollout.groups for c in grp.completions]
        assert len(rollout.groups) >= B
        stats = rollout.stats
        assert stats["rollout/staleness_max"] <= ETA
        utils.append(stats["rollout/slot_utilization"])
        assert 0 <= utils[-1] <= 1  # 0: no decode call, B groups were complete already
        state, _ = run.learner.learn(state, run.ref_params, rollout.batch)  # a new version
        jax.block_until_ready(state.params)
    rollouts.close()
    assert all(carried[:-1]) and carried[-1] == 0  # the last step drained ...
    assert len(asked) == 2  # ... asked again once B groups were complete
    assert sum(u > 0 for u in utils) >= STEPS - 1  # the rollouts decoded
    assert midturn > 0, "no trained turn was carried across a learner step"
    assert at_bound > 0  # tokens exactly eta versions old were trained, none older
    assert waits > 0, "no rollout had to wait for a group at the staleness bound"
    if dynamic:  # episodes of zero-variance groups are dropped: trained ones are generated ones
        assert replaced > 0 and not Counter(trained) - Counter(generated)
    else:  # over the run: the lengths generated, trained
        assert sorted(trained) == sorted(generated)


class _Loop:
    """What `enough` and `select` read of an EpisodeLoop: admission versions, keys in flight."""

    def __init__(self, admitted, in_flight):
        self.admitted, self._in_flight = admitted, set(in_flight)

    def in_flight(self):
        return self._in_flight


def test_enough_waits_for_a_group_at_the_bound_and_select_trains_the_oldest():
    loop = _Loop({0: 1, 1: 3, 2: 3, 3: 4, 4: 4}, in_flight=[0, 3])
    done = {1: None, 2: None, 4: None}
    assert not enough(loop, len(done), 4, step=4, eta=4)  # 3 complete < B = 4
    assert enough(loop, len(done), 3, step=4, eta=4)  # group 0: 5 - 1 = 4 versions at step 5
    assert not enough(loop, len(done), 3, step=5, eta=4)  # ... 5 at step 6: wait for it
    assert select(loop, done, 2, step=4, eta=4, drain=False) == [1, 2]  # the oldest
    assert select(loop, done, 2, step=4, eta=1, drain=False) == [1, 2]  # both past the bound
    assert select(loop, done, 1, step=6, eta=3, drain=False) == [1, 2]  # forced: both at 6+1-3
    assert select(loop, done, 1, step=4, eta=4, drain=True) == [1, 2, 4]  # draining: every one


def test_a_stop_asked_when_every_group_ended_at_once_drains_the_step():
    """Every sequence ends in the first decode call (3 tokens, calls of 8 steps, a slot for
    each), so the loop runs dry before it could see a complete batch: a stop requested during
    the step is still asked for once all have ended, and the step then trains every group
    instead of carrying the extra ones (nothing is left to drain)."""
    config = parse_args([
        "--config.mesh.data=2", "--config.data.prompts_per_step=2",
        "--config.rl.num_generations=4", "--config.rl.partial_rollouts=True",
        "--config.rl.is_correction=tis", "--config.rl.extra_groups=2",
        "--config.sampling.num_slots=16", "--config.sampling.max_new_tokens=3",
        "--config.sampling.steps_per_call=8",
    ], {})[0]  # fmt: skip
    with on_devices(jax.devices()[:2]):  # two batch shards: one group each, one extra each
        run = build(config)
        data = make_prompt_stream(config.data.train, batch_size=2, seed=0)
        rollouts, asked = run.rollouts(), []

        def stop():
            asked.append(rollouts.schedule.carried)  # groups in flight now
            return len(asked) > 1  # no at the start of the step, yes when asked again

        rollout = rollouts(0, run.state.params, data, stop=stop)
        rollouts.close()
    assert asked == [0, 4] and len(rollout.groups) == 4 and rollouts.carried == 0


@register_reward("test_partial_ds")
def _ds_reward(prompts, completions, **_):
    """Zero-variance for two prompts in three (all 0), else each completion's own text hash."""
    return [0.0 if sum(map(ord, p)) % 3 else float(sum(map(ord, c)) % 97 + 1)
            for p, c in zip(prompts, completions)]  # fmt: skip


@pytest.mark.parametrize("tries", [1, 2])
def test_dynamic_sampling_replaces_zero_variance_groups_as_they_complete(tries):
    """With rl.dynamic_sampling, a complete zero-variance group is replaced by a fresh prompt
    (within B x (max_tries - 1) per step) and trained only to top the batch up once the
    replacements are spent and all complete (`dynamic_sampling_shortfall`; at once with
    max_tries 1); every record drawn is trained or dropped exactly once, with request ids unique
    over steps and replacements, and the last step, asked to stop once its batch is complete
    (a SIGTERM), queues no more replacements and drains."""
    with on_devices(jax.devices()[:1]):  # the decisions under test are the host's: one device
        _dynamic_sampling_replaces_zero_variance_groups_as_they_complete(tries)


def _dynamic_sampling_replaces_zero_variance_groups_as_they_complete(tries):
    b, steps = 4, 4
    config = parse_args([
        f"--config.data.prompts_per_step={b}",
        "--config.rl.num_generations=4",
        "--config.rl.partial_rollouts=True", "--config.rl.is_correction=tis",
        "--config.rl.dynamic_sampling=True", f"--config.rl.dynamic_sampling_max_tries={tries}",
        "--config.rl.extra_groups=2", "--config.sampling.num_slots=8",
        "--config.sampling.max_new_tokens=6", "--config.sampling.steps_per_call=1",
        "--config.sampling.temperature=4.0",
    ], {})[0]  # fmt: skip
    config.rl.rewards = {"test_partial_ds": 1.0}
    run = build(config)
    data = make_prompt_stream(config.data.train, batch_size=b, seed=0)
    drawn, ids = [], []
    take, rollouts = data.take_shards, run.rollouts()
    data.take_shards = lambda n, mine: [drawn.extend(r) or r for r in take(n, mine)]
    partial = rollouts.schedule
    add = partial.loop.add

    def spy_add(prompts, request_ids=None, keys=None, shards=None):
        ids.extend(request_ids)
        return add(prompts, request_ids=request_ids, keys=keys, shards=shards)

    partial.loop.add = spy_add
    trained, totals = [], {"replacements": 0, "dropped_groups": 0, "shortfall": 0}
    asked = []  # ids queued when asked whether to stop

    def stop():
        asked.append(len(ids))
        return len(asked) > 1  # no at the start of the step, yes once its batch is complete

    for step in range(steps):
        rollout = rollouts(step, run.state.params, data, stop=stop if step == steps - 1 else None)
        zero = [np.ptp(grp.rewards) == 0 for grp in rollout.groups]
        assert len(rollout.groups) == b if step < steps - 1 else len(rollout.groups) >= b
        stats = {k: rollout.stats[f"dynamic_sampling_{k}"] for k in totals}
        assert sum(zero) == stats["shortfall"] <= stats["dropped_groups"]
        assert stats["replacements"] <= b * (tries - 1)
        if stats["shortfall"] and step < steps - 1:  # once replacements are spent and ended
            assert stats["replacements"] == b * (tries - 1)
            assert set().union(*partial.replacements.values()).isdisjoint(rollouts.sampler.groups)
        totals = {k: v + stats[k] for k, v in totals.items()}
        trained += [grp.record["prompt"] for grp in rollout.groups]
    rollouts.close()
    assert rollouts.carried == 0 and partial.loop.idle
    assert len(asked) == 2 and len(ids) == asked[-1]  # nothing queued once asked to stop
    assert totals["dropped_groups"] > 0
    assert totals["replacements"] > 0 if tries > 1 else totals["shortfall"] > 0
    # Each record drawn once, then trained or dropped (found zero-variance and not trained).
    assert len(trained) + totals["dropped_groups"] - totals["shortfall"] == len(drawn)
    assert sorted(trained) == sorted(set(trained))
    assert len(set(ids)) == len(ids) == len(drawn)
