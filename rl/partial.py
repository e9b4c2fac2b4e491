"""Partial rollouts (`rl.partial_rollouts`): the episodes that have not ended when a step's batch
is complete stay parked, with their KV pages, across the learner step, and continue under the
new parameters; the long tail of a rollout no longer idles the slots.

    step s:   resume the carried episodes (oldest first), admit new groups up to
              B + rl.extra_groups in flight, decode until B groups are complete
              --> the B oldest complete groups go to the learner (a Batch like any other)
              --> every episode still decoding is parked mid-turn; tool calls keep running
    step s+1: the same loop (`sampling.episodes.EpisodeLoop`) goes on with the parameters of s+1

Versions: every token records the step whose parameters drew it (`Completion.versions`), and its
log-prob under them is the one the batch carries as `sampler_logp`: the behaviour policy. The
learner recomputes pi_old (the proximal policy, `rl.old_logp="recompute"`), clips pi/pi_old as
always, and weights by pi_old/behaviour through `rl.is_correction` (tis or mis): decoupled PPO.

Staleness bound `rl.max_staleness` (eta): a group is carried past step s only if each of its
tokens would be at most eta versions old in step s+1's batch; otherwise the rollout waits for it
(nothing is dropped, so long episodes are not trained less often than short ones). Complete
groups past the bound go into the batch first; as rl.extra_groups <= B the batch stays B.

Checkpoints: a step with `drain=True` (a checkpoint step, the last) admits only what brings the
groups in flight up to B and decodes until all have ended, so a saved state holds no episode in
flight and a resumed run is bitwise equal to an uninterrupted one. A stop requested during a
step (SIGTERM) turns it into a draining one when its B groups are complete: it trains every
group in flight (up to B + extra) and saves. Each step admits at most B + extra groups, and a
step's request ids are step * (B + extra) + j. A version is a GRPO step (the parameters the
sampler saw), whatever the number of optimizer steps in it.

Multi-turn episodes whose tool latency decides which groups end first make the step a group
trains in depend on that latency (within the bound); single-turn rollouts are deterministic.
"""

from __future__ import annotations

import jax
import numpy as np

from sampling.episodes import EpisodeLoop


class PartialRollouts:
    """The groups in flight across steps, on one `EpisodeLoop` over the rollout engine."""

    def __init__(self, rollouts):
        self.r = rollouts  # rl.rollout.Rollouts: engine, tokenizer, config, scoring
        c = rollouts.config
        self.b, self.g = c.data.prompts_per_step, c.rl.num_generations
        self.extra, self.eta = c.rl.extra_groups, c.rl.max_staleness
        self.refresh = c.rl.refresh_kv_on_update
        sampler = rollouts.episodes
        if sampler is None:
            self.loop = EpisodeLoop(rollouts.engine, self.g, on_finish=self._on_finish)
        else:
            self.loop = sampler.loop(self.g, self._on_finish)
        self.groups: dict[int, tuple] = {}  # key -> (record, prompt), until trained
        self.done: dict[int, tuple] = {}  # key -> (completions, score future), complete
        self.next_key = 0
        self.generated: list[int] = []  # lengths of the episodes that ended in this step
        self.waits = 0  # decode calls of this step spent waiting for a group at the bound

    def _on_finish(self, key, k, completion) -> None:
        self.generated.append(completion.length)
        results = self.loop.results[key]
        if any(c is None for c in results):
            return
        record, prompt = self.groups[key]
        sampler = self.r.episodes
        if sampler is None:
            self.done[key] = (results, self.r.score(record, prompt, results))
        else:
            self.done[key] = (results, sampler.score(key))

    @property
    def carried(self) -> int:
        """Groups not trained yet (in flight or complete): none after a drained step."""
        return len(self.groups)

    def sample(self, step: int, params, state, data, drain):
        """(state, the step's groups, stats): B groups, or every group in flight when draining.
        `drain`: a bool, or a callable asked (once B groups are complete) whether to drain after
        all, e.g. a stop requested while the rollout runs."""
        c = self.r.config
        asked = drain if callable(drain) else (lambda: drain)
        draining = [bool(asked())]  # latched: once draining, the step drains

        def until():
            if not enough(self.loop, len(self.done), self.b, step, self.eta):
                self.waits += len(self.done) >= self.b  # B complete, a group at the bound
                return False
            draining[0] = draining[0] or bool(asked())
            return not draining[0]

        n_new = (self.b if draining[0] else self.b + self.extra) - self.carried
        records = data.take(n_new) if n_new > 0 else []
        if records:
            prompts = self.r.prompts_of(records)
            keys = list(range(self.next_key, self.next_key + len(records)))
            self.next_key += len(records)
            for key, record, prompt in zip(keys, records, prompts):
                self.groups[key] = (record, prompt)
                if self.r.episodes is not None:
                    self.r.episodes.begin(key, record, self.g)
            base = step * (self.b + self.extra)
            self.loop.add(prompts, request_ids=range(base, base + len(records)), keys=keys)
        root = jax.random.fold_in(jax.random.key(c.seed), step)
        seed = int(jax.random.randint(jax.random.fold_in(root, 0), (), 0, 2**31 - 1))
        self.generated, self.waits = [], 0
        try:
            state = self.loop.run(params, state, seed, version=step,
                                  until=None if draining[0] else until, refresh=self.refresh)  # fmt: skip
            keys = select(self.loop, self.done, self.b, step, self.eta, draining[0])
            groups = [self._group(key) for key in keys]
        except BaseException:
            if self.r.episodes is not None:
                self.r.episodes.abandon()  # what unscored episodes hold (workspaces)
            raise
        return state, groups, self._stats(step, groups)

    def _group(self, key: int):
        completions, scored = self.done.pop(key)
        record, prompt = self.groups.pop(key)
        self.loop.forget(key)
        if self.r.episodes is None:
            return scored.result()
        episodes, rewards = scored
        return self.r.episode_group(record, prompt, episodes, completions, rewards.result())

    def _stats(self, step: int, groups) -> dict[str, float]:
        ages, generated = [], [c for grp in groups for c in grp.completions]
        for cp in generated:
            obs = np.asarray(cp.observation or [False] * cp.length, bool)
            ages.append(step - np.asarray(cp.versions)[~obs])
        ages = np.concatenate(ages) if ages else np.zeros(0)
        in_flight = self.loop.in_flight()
        episodes = sum(sum(c is None for c in self.loop.results[k]) for k in in_flight)
        return {
            "rollout/carried_groups": float(self.carried),
            "rollout/carried_episodes": float(episodes),
            "rollout/staleness_mean": float(ages.mean()) if ages.size else 0.0,
            "rollout/staleness_max": float(ages.max()) if ages.size else 0.0,
            "rollout/offpolicy_token_frac": float((ages > 0).mean()) if ages.size else 0.0,
            "rollout/generated_length_mean": float(np.mean(self.generated or [0])),
            # passes of the rollout loop (decode calls, waits on tools) past a complete batch,
            # made only for a group at the staleness bound
            "rollout/staleness_waits": float(self.waits),
        }


def enough(loop, n_done: int, b: int, step: int, eta: int) -> bool:
    """Whether step `step`'s rollout may stop: b groups complete, and no group in flight would
    be older than eta versions in step + 1's batch (else the rollout waits for it)."""
    return n_done >= b and all(step + 1 - loop.admitted[k] <= eta for k in loop.in_flight())


def select(loop, done, b: int, step: int, eta: int, drain: bool) -> list:
    """The complete groups (keys) step `step` trains: every one when draining, else those that
    would pass the staleness bound at step + 1, then the oldest, up to b in all."""
    order = sorted(done, key=lambda k: (loop.admitted[k], k))
    if drain:
        return order
    forced = [k for k in order if step + 1 - loop.admitted[k] > eta]
    rest = [k for k in order if k not in forced]
    return forced + rest[: max(b - len(forced), 0)]


def check_partial(c) -> list[tuple[str, object, str]]:
    """(field, value, why) for each setting partial rollouts cannot run with."""
    bad = []
    if c.rl.is_correction == "none":
        bad.append(("rl.is_correction", "none", "partial rollouts train on tokens of older "
                    "policies: set tis or mis (decoupled PPO's behaviour weight)"))  # fmt: skip
    if c.rl.old_logp != "recompute":
        bad.append(("rl.old_logp", c.rl.old_logp, "partial rollouts need the proximal policy "
                    "pi_old recomputed by the learner ('recompute')"))  # fmt: skip
    if c.rl.dynamic_sampling:
        bad.append(("rl.dynamic_sampling", True, "not supported with partial rollouts"))
    if c.sampling.min_new_tokens:
        bad.append(("sampling.min_new_tokens", c.sampling.min_new_tokens,
                    "must be 0 with partial rollouts (a resumed turn would ban stop ids again)"))  # fmt: skip
    if not 1 <= c.rl.extra_groups <= c.data.prompts_per_step:
        bad.append(("rl.extra_groups", c.rl.extra_groups, f"must be in [1, data.prompts_per_step="
                    f"{c.data.prompts_per_step}] (0 would carry nothing)"))  # fmt: skip
    if c.rl.max_staleness < 1:
        bad.append(("rl.max_staleness", c.rl.max_staleness, "must be >= 1"))
    return bad
