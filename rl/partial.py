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
dynamic sampling's replacements (R = B x (max_tries - 1), below; 0 without it). A version is a
GRPO step (the parameters the sampler saw), whatever the number of optimizer steps in it.

Batch shards: every count here is per batch shard of the mesh (S shards: B/S groups a step,
extra/S more in flight, R/S replacements, the staleness wait), and a group lives on its shard
(`rl.rollout`), so a shard decides alike whichever process holds it. Shard i's request ids in
step s are (s * S + i) * (B + extra + R) / S + j. The processes agree once per round of the loop
on whether every shard's batch is complete and young enough, whether all is idle, and on the
replacements each shard draws (their records come from the data's global order in shard order).

Dynamic sampling (`rl.dynamic_sampling`): complete groups are judged (their scores waited for)
once they could complete the batch or a slot has nothing to decode, so that rewards are computed
behind decoding and yet a resumed run decides alike (rewards must then be deterministic, as in
synchronous steps; each process judges only its own shards' groups). Multi-turn
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

from models.processes import agree
from rl import summary as S
from rl.dynamic_sampling import informative
from rl.groups import GroupSampler
from sampling.episodes import IDLE


class Partial:
    """Partial rollouts, an option of the rollout driver (`rl.groups.GroupSampler`): its loop
    kept across steps, stopped once a step's batch is complete (`until`), the complete groups
    the step trains chosen (`select`) and the rest carried. Every count of the module docstring
    is per batch shard (B/S groups a step, extra_groups/S more in flight, B/S x (max_tries - 1)
    replacements): a shard decides alike whichever process holds it, and the processes agree,
    once per round, only on whether the step's batch is complete."""

    carries = True  # groups may be carried to a later step (their token ages are logged)

    def __init__(self, sampler: GroupSampler, config, num_shards: int, local):
        self.sampler, self.config = sampler, config
        c = config
        self.shards, self.local = num_shards, list(local)
        self.mine = [i in self.local for i in range(num_shards)]
        self.b, self.g = c.data.prompts_per_step // num_shards, c.rl.num_generations
        self.extra, self.eta = c.rl.extra_groups // self.shards, c.rl.max_staleness
        self.refresh = c.rl.refresh_kv_on_update
        self.ds = bool(c.rl.dynamic_sampling)
        # Dynamic sampling: zero-variance groups replaced per shard and step at most.
        self.budget = self.b * (c.rl.dynamic_sampling_max_tries - 1) if self.ds else 0
        # Tool answers and multi-turn gradings taken on the loop's clock (None: as soon as done).
        self.answer_calls = sampler.answer_calls
        sampler.open()  # the one loop, kept across steps
        self.zero: set[int] = set()  # complete keys judged zero-variance (dynamic sampling)
        self.waits = 0  # decode calls of this step spent waiting for a group at the bound
        self.replacements: dict[int, set] = {}  # shard -> keys of this step's replacements

    @property
    def loop(self):
        """The driver's episode loop (`sampling.episodes.EpisodeLoop`)."""
        return self.sampler.loop

    @property
    def idle(self) -> bool:
        """Nothing in flight: no episode queued, decoding, parked or waiting on a tool."""
        return self.sampler.loop.idle

    @property
    def carried(self) -> int:
        """This process's groups not trained yet (in flight or complete): none after a drained
        step."""
        return len(self.sampler.groups)

    def _of(self, shard: int, keys) -> list:
        return self.sampler.of(shard, keys)

    def _add(self, step: int, shard: int, records, first: int) -> list[int]:
        """Queues records as new groups of `shard`, keyed by their request ids
        (step * S + shard) * stride + first + j: unique over steps, shards and replacements
        (stride: the most groups a shard admits in a step)."""
        stride = self.b + self.extra + self.budget
        base = (step * self.shards + shard) * stride + first
        keys = list(range(base, base + len(records)))
        self.sampler.add(records, keys, [shard] * len(keys))
        return keys

    def _draw(self, step: int, data, wants: dict, first) -> bool:
        """Every shard's wants agreed (one collective), the records drawn from the global order
        in shard order, this process's queued: first(shard) the index of a shard's first.
        Whether any shard (of any process) queued one."""
        counts = np.zeros(self.shards, np.int32)
        for i, n in wants.items():
            counts[i] = n
        counts = agree(counts).sum(axis=0)
        return self._take(step, data, counts, first)

    def _take(self, step, data, counts, first) -> bool:
        if not counts.any():
            return False
        records = data.take_shards([int(n) for n in counts], self.mine)
        for i in self.local:
            if counts[i]:
                keys = self._add(step, i, records[i], first(i))
                if first(i):  # a replacement
                    self.replacements[i].update(keys)
        return True

    def _replacement_first(self, shard: int) -> int:
        return self.b + self.extra + len(self.replacements[shard])

    def _judge(self, force: bool, replace: bool) -> dict[int, int]:
        """Dynamic sampling, per shard: scores the shard's groups complete since the last
        judgement (waiting for them) once they could complete its batch, or a slot of the
        shard has nothing to decode (`EpisodeLoop.starved`), or with `force`, and not before:
        slow rewards run behind decoding, yet a resumed run decides alike. Multi-turn groups
        are judged without `force` only `answer_calls` decode calls after they completed
        (waited for then: a decision of the shard's own, on the loop's clock, whatever the
        other shards decode), or without it, while slots decode here, once scored: decoding
        does not stop for an environment's grading before then. A zero-variance group joins `zero`;
        with `replace`, while the shard's budget lasts, a fresh prompt is to be queued in its
        place: returns shard -> how many."""
        wants = {}
        if not self.ds:
            return wants
        for i in self.local:
            new = [k for k in self._of(i, self.sampler.done) if k not in self.sampler.scored]
            if not new:
                continue
            if not (force or self.loop.starved(i) or self._informative(i) + len(new) >= self.b):
                continue
            if self.sampler.episodes is not None and not force:
                if self.answer_calls is not None:  # due on the loop's clock, as tool answers
                    new = [
                        k
                        for k in new
                        if self.sampler.done_at[k] + self.answer_calls <= self.loop.clock
                    ]
                elif self.loop.owner:  # while slots decode here: those graded by now
                    new = [k for k in new if self.sampler.graded(k)]
                if not new:
                    continue
            zero = [k for k in new if not informative(self._scored(k))]
            self.zero.update(zero)
            n = min(len(zero), self.budget - len(self.replacements[i])) if replace else 0
            if n > 0:
                wants[i] = n
        return wants

    def _scored(self, key):
        """The `rl.groups.Group` of a complete group (waits for its score)."""
        return self.sampler.group(key)

    def _informative(self, shard: int) -> int:
        """Complete groups of a shard judged informative."""
        return sum(
            k in self.sampler.scored and k not in self.zero
            for k in self._of(shard, self.sampler.done)
        )

    def _complete(self, shard: int) -> int:
        """Complete groups of a shard that count towards its batch: without dynamic sampling
        every one; with it the informative ones, and the zero-variance ones too once the
        shard's replacements are spent and have all completed (as the synchronous refill waits
        for its last round before it tops the batch up)."""
        done = self._of(shard, self.sampler.done)
        if not self.ds:
            return len(done)
        reps = self.replacements[shard]
        spent = len(reps) >= self.budget and reps <= set(done)
        return self._informative(shard) + (sum(k in self.zero for k in done) if spent else 0)

    def sample(self, step: int, params, state, data, drain: bool, stop=None):
        """(state, this process's groups of the step, stats): B/S groups per shard, or every
        group in flight when draining. `drain`: a checkpoint step. `stop`: None, or a callable
        asked at the start and once every shard's groups are complete (or, if the loop ran
        dry first, once all have ended) whether a stop was requested (SIGTERM); then the step
        drains too, and queues no more replacements."""
        c = self.config
        stop = stop or (lambda: False)
        stopping = [bool(stop())]  # latched, as is draining: once draining, the step drains
        draining = [bool(drain) or stopping[0]]
        stopped = [False]  # `until` ended the run, groups still in flight
        queued = [False]  # replacements queued anywhere as the run ended: it runs again
        self.sampler.generated, self.waits = [], 0
        self.replacements = {i: set() for i in self.local}
        first = self._replacement_first

        def until():  # asked by the loop before each round: IDLE, stop here (True) or not
            wants = self._judge(force=False, replace=not stopping[0])
            ones = np.ones(self.shards, np.int32)
            full, fresh, counts = ones.copy(), ones.copy(), np.zeros(self.shards, np.int32)
            for i in self.local:
                counts[i] = wants.get(i, 0)
                full[i] = self._complete(i) >= self.b
                fresh[i] = young(self.loop, self._of(i, self.loop.in_flight()), step, self.eta)
            s = self.shards
            everyone = agree([self.loop.idle, *counts, *full, *fresh])
            drawn = self._take(step, data, everyone[:, 1 : 1 + s].sum(axis=0), first)
            if everyone[:, 0].all():
                queued[0] = drawn
                return IDLE
            if draining[0]:
                return False  # on until every group has ended
            full, fresh = everyone[:, 1 + s : 1 + 2 * s].all(), everyone[:, 1 + 2 * s :].all()
            if not (full and fresh):
                self.waits += bool(full)  # every batch complete, a group at the bound
                return False
            stopping[0] = draining[0] = bool(stop())  # asked once the batch is complete
            stopped[0] = not draining[0]
            return stopped[0]

        room = lambda i: (
            (self.b if draining[0] else self.b + self.extra) - len(self._of(i, self.sampler.groups))
        )
        self._draw(step, data, {i: max(room(i), 0) for i in self.local}, lambda i: 0)
        root = jax.random.fold_in(jax.random.key(c.seed), step)
        seed = int(jax.random.randint(jax.random.fold_in(root, 0), (), 0, 2**31 - 1))
        try:
            while True:  # again only for replacements queued after the loop ran dry
                stopped[0] = queued[0] = False
                state = self.loop.run(
                    params, state, seed, version=step, until=until, refresh=self.refresh
                )
                more = self._draw(
                    step, data, self._judge(force=True, replace=not stopping[0]), first
                )
                # Agreed: a process whose shards queued nothing runs the loop with the others.
                if stopped[0] or not (queued[0] or more):
                    break
            if not (stopped[0] or draining[0]):  # ran dry before `until` saw the batch complete
                stopping[0] = draining[0] = bool(stop())  # all ended: draining trains them all
            groups, found, short = [], 0, 0
            for i in self.local:
                keys = select(
                    self.loop,
                    [k for k in self._of(i, self.sampler.done) if k not in self.zero],
                    self.b,
                    step,
                    self.eta,
                    draining[0],
                )
                spare = sorted(self._of(i, self.zero), key=lambda k: (self.loop.admitted[k], k))
                top_up = spare[: max(self.b - len(keys), 0)]  # zero-variance groups fill it
                groups += [self._group(key) for key in keys + top_up]
                for key in spare[len(top_up) :]:  # dropped: never trained
                    self._group(key)
                found, short = found + len(spare), short + len(top_up)
        except BaseException:
            self.sampler.abandon()  # what unscored episodes hold (workspaces)
            raise
        in_flight = self.loop.in_flight()
        episodes = sum(sum(c is None for c in self.loop.results[k]) for k in in_flight)
        counters = {
            "sum/rollout/carried_groups": self.carried,
            "sum/rollout/carried_episodes": episodes,
            "generated_sum": sum(self.sampler.generated),
            "generated_n": len(self.sampler.generated),
        }
        if self.ds:
            counters.update(
                {
                    "sum/dynamic_sampling_replacements": sum(map(len, self.replacements.values())),
                    "sum/dynamic_sampling_dropped_groups": found,  # found (as synchronous) ...
                    "sum/dynamic_sampling_shortfall": short,  # ... and trained anyway
                }
            )
        # passes of the rollout loop (decode calls, waits on tools) past a complete batch, made
        # only for a group at the staleness bound (the same on every process)
        return state, groups, {"rollout/staleness_waits": float(self.waits), "counters": counters}

    def stats(self, groups: list[dict], counts: list[dict]) -> dict[str, float]:
        """The statistics of the step's trained groups (every process's summaries) that need
        the whole batch: token ages, and the mean length of the episodes that ended."""
        n = S.total(counts, "generated_n")
        return {
            **S.age_stats(groups),
            "rollout/generated_length_mean": S.total(counts, "generated_sum") / n if n else 0.0,
        }

    def _group(self, key: int):
        """A complete group's `rl.groups.Group`, forgotten (trained or dropped)."""
        self.zero.discard(key)
        return self.sampler.take(key)


def enough(loop, n_done: int, b: int, step: int, eta: int) -> bool:
    """Whether a rollout over one shard may stop: b groups complete, and no group in flight would
    be older than eta versions in step + 1's batch (else the rollout waits for it)."""
    return n_done >= b and young(loop, loop.in_flight(), step, eta)


def young(loop, keys, step: int, eta: int) -> bool:
    """Whether none of the groups `keys` in flight would be older than eta versions in step + 1's
    batch (else the rollout waits for it)."""
    return all(step + 1 - loop.admitted[k] <= eta for k in keys)


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
        bad.append(
            (
                "rl.is_correction",
                "none",
                "partial rollouts train on tokens of older "
                "policies: set tis or mis (decoupled PPO's behaviour weight)",
            )
        )
    if c.rl.old_logp != "recompute":
        bad.append(
            (
                "rl.old_logp",
                c.rl.old_logp,
                "partial rollouts need the proximal policy "
                "pi_old recomputed by the learner ('recompute')",
            )
        )
    if c.sampling.min_new_tokens:
        bad.append(
            (
                "sampling.min_new_tokens",
                c.sampling.min_new_tokens,
                "must be 0 with partial rollouts (a resumed turn would ban stop ids again)",
            )
        )
    if not 1 <= c.rl.extra_groups <= c.data.prompts_per_step:
        bad.append(
            (
                "rl.extra_groups",
                c.rl.extra_groups,
                f"must be in [1, data.prompts_per_step="
                f"{c.data.prompts_per_step}] (0 would carry nothing)",
            )
        )
    if c.rl.max_staleness < 1:
        bad.append(("rl.max_staleness", c.rl.max_staleness, "must be >= 1"))
    return bad
