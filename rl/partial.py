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
(nothing is dropped for its length, so long episodes are not trained less often than short
ones). Complete groups past the bound go into the batch first; as rl.extra_groups <= B the batch
stays B (with dynamic sampling's shortfalls, below, more than extra groups can be carried, and a
later step may have to train more than B of them).

Checkpoints: a step with `drain=True` (a checkpoint step, the last) admits only what brings the
groups in flight up to B and decodes until all have ended, so a saved state holds no episode in
flight and a resumed run is bitwise equal to an uninterrupted one. A stop requested (SIGTERM;
`stop`, asked at the start of a step and when its B groups are complete, or when every group
has ended if the loop ran dry first) turns the step into a
draining one: it trains every group in flight (B + extra, or more with dynamic sampling's
replacements and shortfalls) and saves. Each step admits at most B + extra groups plus
dynamic sampling's replacements (R = B x (max_tries - 1), below; 0 without it), and a step's
request ids are step * (B + extra + R) + j. A version is a GRPO step (the parameters the sampler
saw), whatever the number of optimizer steps in it.

Dynamic sampling (`rl.dynamic_sampling`): complete groups are judged (their scores waited for)
once they could complete the batch or a slot has nothing to decode, so that rewards are computed
behind decoding and yet every process, and a resumed run, decides alike (rewards must then be
deterministic, as in synchronous steps; multi-process runs check that they agree). Multi-turn
groups are judged while slots decode only once scored (decoding does not wait for grading): with
`env.tool_answer_calls` = k, once k decode calls have been read since the group completed (its
grading waited for if it is not done by then), as tool answers are taken; with 0, once graded,
which makes those decisions follow the grading's timing. A zero-variance group does not count towards B and,
while the step's R replacements last, a fresh prompt is queued in its place (request ids after
the step's first B + extra). Once the R are spent and have all completed (as the synchronous
refill waits for its last round), zero-variance groups count and top the batch up after the
informative ones (`dynamic_sampling_shortfall`); the others are dropped at the step's end,
dropped for their reward, not their length. Once a stop is requested no replacement is queued.

Determinism: single-turn rollouts repeat themselves. With an environment, which episodes are cut
at a stop, at which token, and which groups complete first follow the loop's logical clock
(`sampling.episodes`, "Logical time"): a tool's answer asked for when decode call n was read is
taken once call n + `env.tool_answer_calls` has been read, waiting for the tool only if it is not
done by then, so a run repeats itself (and resumes exactly) whatever the tools' latency and
`env.tool_workers`. With `env.tool_answer_calls=0` answers are taken as soon as done (the rule
before the field existed): the step a group trains in then follows the tools' latency (within
the bound). Wall-clock limits (`env.max_tool_seconds`, a sandbox's timeout) still end episodes
by the clock on the wall, as they must.
"""

from __future__ import annotations

import jax
import numpy as np

from rl.dynamic_sampling import check_rewards_agree, informative
from sampling.agreement import agreed_done
from sampling.episodes import EpisodeLoop


class PartialRollouts:
    """The groups in flight across steps, on one `EpisodeLoop` over the rollout engine."""

    def __init__(self, rollouts):
        self.r = rollouts  # rl.rollout.Rollouts: engine, tokenizer, config, scoring
        c = rollouts.config
        self.b, self.g = c.data.prompts_per_step, c.rl.num_generations
        self.extra, self.eta = c.rl.extra_groups, c.rl.max_staleness
        self.refresh = c.rl.refresh_kv_on_update
        self.ds = bool(c.rl.dynamic_sampling)
        # Dynamic sampling: zero-variance groups replaced per step at most.
        self.budget = self.b * (c.rl.dynamic_sampling_max_tries - 1) if self.ds else 0
        sampler = rollouts.episodes
        # Tool answers and multi-turn gradings taken on the loop's clock (0: as soon as done).
        self.answer_calls = (c.env.get("tool_answer_calls", 0) or None) if sampler else None
        if sampler is None:
            self.loop = EpisodeLoop(rollouts.engine, self.g, on_finish=self._on_finish)
        else:
            self.loop = sampler.loop(self.g, self._on_finish, self.answer_calls)
        self.groups: dict[int, tuple] = {}  # key -> (record, prompt), until trained
        self.done: dict[int, tuple] = {}  # key -> (completions, score future), complete
        self.scored: dict = {}  # key -> rl.rollout.Group, once its score was waited for
        self.zero: set[int] = set()  # keys in `done` judged zero-variance (dynamic sampling)
        self.done_at: dict[int, int] = {}  # key in `done` -> the loop's clock when it completed
        self.next_key = 0
        self.generated: list[int] = []  # lengths of the episodes that ended in this step
        self.waits = 0  # decode calls of this step spent waiting for a group at the bound
        self.replacements: set[int] = set()  # keys of this step's replacement groups

    def _on_finish(self, key, k, completion) -> None:
        self.generated.append(completion.length)
        results = self.loop.results[key]
        if any(c is None for c in results):
            return
        record, prompt = self.groups[key]
        sampler = self.r.episodes
        self.done_at[key] = self.loop.clock
        if sampler is None:
            self.done[key] = (results, self.r.score(record, prompt, results))
        else:
            self.done[key] = (results, sampler.score(key))

    @property
    def carried(self) -> int:
        """Groups not trained yet (in flight or complete): none after a drained step."""
        return len(self.groups)

    def _add(self, step: int, records, first: int) -> list[int]:
        """Queues records as new groups, with request ids step * stride + first + j, unique over
        steps and replacements (stride: the most groups a step admits)."""
        prompts = self.r.prompts_of(records)
        keys = list(range(self.next_key, self.next_key + len(records)))
        self.next_key += len(records)
        for key, record, prompt in zip(keys, records, prompts):
            self.groups[key] = (record, prompt)
            if self.r.episodes is not None:
                self.r.episodes.begin(key, record, self.g)
        base = step * (self.b + self.extra + self.budget) + first
        self.loop.add(prompts, request_ids=range(base, base + len(records)), keys=keys)
        return keys

    def _judge(self, step: int, data, force: bool, replace: bool) -> None:
        """Dynamic sampling: scores the groups complete since the last judgement (waiting for
        them) once they could complete the batch, or a slot has nothing to decode (the loop is
        `starved`), or with `force`, and not before: slow rewards run behind decoding, yet every
        process, and a resumed run, decides alike. Multi-turn groups are judged without `force`,
        while slots decode, only `answer_calls` decode calls after they completed (waited for
        then), or without it once scored on every process: decoding does not stop for an
        environment's grading before then. A zero-variance group joins `zero`;
        with `replace`, while the step's budget lasts, a fresh prompt is queued in its place."""
        new = [k for k in self.done if k not in self.scored]
        if not (self.ds and new):
            return
        if not (force or self.loop.starved or self._informative() + len(new) >= self.b):
            return
        if self.r.episodes is not None and not force and self.loop.owner:  # while decoding
            if self.answer_calls is None:  # those graded by now
                futures = [self.done[k][1][1] for k in new]
                scored = {id(f) for f in agreed_done(futures, "rewards", "deterministic rewards")}
                new = [k for k in new if id(self.done[k][1][1]) in scored]
            else:  # those due on the loop's clock, as tool answers are (waited for if need be)
                new = [k for k in new if self.done_at[k] + self.answer_calls <= self.loop.clock]
            if not new:
                return
        check_rewards_agree([self._scored(k) for k in new])  # before deciding from them
        zero = [k for k in new if not informative(self._scored(k))]
        self.zero.update(zero)
        n = min(len(zero), self.budget - len(self.replacements)) if replace else 0
        if n > 0:
            first = self.b + self.extra + len(self.replacements)
            self.replacements.update(self._add(step, data.take(n), first))

    def _scored(self, key):
        """The `rl.rollout.Group` of a complete group (waits for its score)."""
        if key not in self.scored:
            completions, scored = self.done[key]
            if self.r.episodes is None:
                self.scored[key] = scored.result()
            else:
                record, prompt = self.groups[key]
                episodes, rewards = scored
                self.scored[key] = self.r.episode_group(
                    record, prompt, episodes, completions, rewards.result()
                )
        return self.scored[key]

    def _informative(self) -> int:
        """Complete groups judged informative."""
        return sum(k in self.scored and k not in self.zero for k in self.done)

    def _complete(self) -> int:
        """Complete groups that count towards the batch: without dynamic sampling every one;
        with it the informative ones, and the zero-variance ones too once the step's
        replacements are spent and have all completed (as the synchronous refill waits for its
        last round before it tops the batch up)."""
        if not self.ds:
            return len(self.done)
        spent = len(self.replacements) >= self.budget and self.replacements <= self.done.keys()
        return self._informative() + (len(self.zero) if spent else 0)

    def sample(self, step: int, params, state, data, drain: bool, stop=None):
        """(state, the step's groups, stats): B groups, or every group in flight when draining.
        `drain`: a checkpoint step. `stop`: None, or a callable asked at the start and once B
        groups are complete (or, if the loop ran dry first, once all have ended) whether a stop
        was requested (SIGTERM); then the step drains too, and queues no more replacements."""
        c = self.r.config
        stop = stop or (lambda: False)
        stopping = [bool(stop())]  # latched, as is draining: once draining, the step drains
        draining = [bool(drain) or stopping[0]]
        self.generated, self.waits, self.replacements = [], 0, set()

        def until():  # asked by the loop before each decode call: whether to stop here
            self._judge(step, data, force=False, replace=not stopping[0])
            if draining[0]:
                return False  # on until every group has ended
            if not enough(self.loop, self._complete(), self.b, step, self.eta):
                self.waits += self._complete() >= self.b  # B complete, a group at the bound
                return False
            stopping[0] = draining[0] = bool(stop())  # asked once the batch is complete
            return not draining[0]

        n_new = (self.b if draining[0] else self.b + self.extra) - self.carried
        if n_new > 0:
            self._add(step, data.take(n_new), 0)
        root = jax.random.fold_in(jax.random.key(c.seed), step)
        seed = int(jax.random.randint(jax.random.fold_in(root, 0), (), 0, 2**31 - 1))
        try:
            while True:  # again only for replacements queued after the loop ran dry
                state = self.loop.run(params, state, seed, version=step, until=until,
                                      refresh=self.refresh)  # fmt: skip
                stopped = not self.loop.idle  # `until` ended the run, groups still in flight
                self._judge(step, data, force=True, replace=not stopping[0])
                if stopped or not self.loop.pending:
                    break
            if not (stopped or draining[0]):  # ran dry before `until` saw the batch complete
                stopping[0] = draining[0] = bool(stop())  # all ended: draining trains them all
            keys = select(self.loop, [k for k in self.done if k not in self.zero], self.b, step,
                          self.eta, draining[0])  # fmt: skip
            spare = sorted(self.zero, key=lambda k: (self.loop.admitted[k], k))
            top_up = spare[: max(self.b - len(keys), 0)]  # zero-variance groups fill the batch
            groups = [self._group(key) for key in keys + top_up]
            check_rewards_agree(groups)
            for key in spare[len(top_up) :]:  # dropped: never trained
                self._group(key)
        except BaseException:
            if self.r.episodes is not None:
                self.r.episodes.abandon()  # what unscored episodes hold (workspaces)
            raise
        stats = self._stats(step, groups)
        if self.ds:
            stats["dynamic_sampling_replacements"] = float(len(self.replacements))
            stats["dynamic_sampling_dropped_groups"] = float(len(spare))  # found (as synchronous)
            stats["dynamic_sampling_shortfall"] = float(len(top_up))  # ... and trained anyway
        return state, groups, stats

    def _group(self, key: int):
        """A complete group's `rl.rollout.Group`, forgotten here (trained or dropped)."""
        grp = self._scored(key)
        for d in (self.done, self.groups, self.scored):
            d.pop(key)
        self.done_at.pop(key, None)
        self.zero.discard(key)
        self.loop.forget(key)
        return grp

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
    if c.sampling.min_new_tokens:
        bad.append(("sampling.min_new_tokens", c.sampling.min_new_tokens,
                    "must be 0 with partial rollouts (a resumed turn would ban stop ids again)"))  # fmt: skip
    if not 1 <= c.rl.extra_groups <= c.data.prompts_per_step:
        bad.append(("rl.extra_groups", c.rl.extra_groups, f"must be in [1, data.prompts_per_step="
                    f"{c.data.prompts_per_step}] (0 would carry nothing)"))  # fmt: skip
    if c.rl.max_staleness < 1:
        bad.append(("rl.max_staleness", c.rl.max_staleness, "must be >= 1"))
    return bad
