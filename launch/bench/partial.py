"""Partial rollouts against synchronous ones: `python -m launch.bench loop --lengths skewed
--partial_rollouts [--extra_groups N] [--max_staleness ETA]`.

Both loops run in one process on bench-small (`launch.bench.iteration.Loop`: B = 8 prompts x G = 8
samples, each group one request whose prompt is prefilled once, each sample with its own
long-tailed length over 8..512, 16 slots, no stop ids; decode calls of `--steps_per_call` 4
steps, so that a slot whose sequence ended is refilled within a few steps: the loop reads call n
while call n+1 runs, so such a slot idles for the rest of call n and all of n+1), with the same
learner step (reference log-probs + one AdamW step on the packed batch of the B groups' 64
sequences), alternating iteration by iteration:

- `sync`: the rollout decodes all B groups, then the learner steps (`generate_all`);
- `partial`: one `sampling.episodes.EpisodeLoop` on its own engine keeps up to B + extra groups
  in flight; each rollout decodes until B groups are complete (`rl.partial.enough`, staleness
  bound eta), trains the B oldest complete (`rl.partial.select`) and carries the rest, parked
  mid-sequence, into the next iteration. New group j gets the prompt and the lengths of the
  synchronous batch's group j mod B, so both loops generate the same lengths. Timed in steady
  state, after the carry-over has filled up (eta + 2 warm-up iterations).

Both loops admit a group sample by sample, as slots free up (`EpisodeLoop._admit`).

Per loop: medians over --reps of `iteration_seconds`, `rollout_seconds` and `slot_utilization`
(tokens decoded / slot-steps of the rollout's decode calls); `learned_tokens_per_s`, the prompt +
completion tokens of the learner batches over the seconds of all timed iterations; and
`utilization_trace`, each decode call's utilization over the last timed rollout
(docs/performance.md's figure).

What the utilization allows, from the same run: if a slot-step cost the same in both loops, the
rollout speedup would be `slot_step_speedup` (partial utilization / synchronous), and partial
rollouts leave the learner's seconds as they are, so a partial loop at utilization 1 with the
synchronous loop's cost per slot-step would gain `learned_tokens_speedup_at_utilization_1` =
(learner + sync rollout) / (learner + sync rollout x sync utilization). A generous estimate: it
scales the whole synchronous rollout, its prompts' prefill included, and the timed partial
batches hold more or fewer tokens than the synchronous ones, so a run can measure above it.
"""

from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from launch.bench.iteration import Loop
from rl.groups import Group
from rl.packing import bucket_rows, build_batch
from rl.partial import enough, select
from sampling.engine import Engine
from sampling.episodes import EpisodeLoop


def _trace(engine) -> list[float]:
    return [round(a / t, 4) for a, t in engine.slot_trace if t]


OBSERVATION = [5, 6, 7, 8]  # --tool_ms: every tool answer's ids


class Partial:
    """The partial loop of the benchmark: an EpisodeLoop of G-sample groups carried across
    iterations. With `tools` (ms, turn tokens, workers, answer_calls): multi-turn, each model turn
    of at most `turn tokens` followed by a tool answering OBSERVATION after uniform(0, ms) ms
    (seeded), on `workers` threads; answers taken as soon as done (answer_calls None) or on the
    loop's clock (`sampling.episodes`, "Logical time")."""

    def __init__(self, loop: Loop, extra: int, eta: int, tools=None):
        e = loop.engine
        self.engine = Engine(e.cfg, e.graphdef, e.ecfg, e.sampling)  # its own slots and pages
        self.state = self.engine.init_state()
        self.loop, self.b, self.extra, self.eta = loop, len(loop.prompts), extra, eta
        self.budgets = loop.lengths.reshape(self.b, loop.g).tolist()
        self.done: dict[int, list] = {}  # key -> the group's Completions, complete, not trained
        self.pool = None
        if tools is None:
            self.episodes = EpisodeLoop(self.engine, loop.g, on_finish=self._finish)
        else:
            self.ms, turn, workers, calls = tools
            self.pool, self.rng = ThreadPoolExecutor(workers), random.Random(0)
            self.episodes = EpisodeLoop(
                self.engine,
                loop.g,
                on_finish=self._finish,
                respond=self._respond,
                max_turn_tokens=min(turn, e.ecfg.max_new_tokens),
                answer_calls=calls,
            )
        self.next, self.version = 0, 0

    def _respond(self, key, k, turn, left):
        if left < len(OBSERVATION) + 1:
            return None  # no room for an answer and one more token: the episode ends
        delay = self.rng.uniform(0.0, self.ms / 1000)
        return self.pool.submit(lambda: (time.sleep(delay), OBSERVATION)[1])

    def _finish(self, key, k, completion) -> None:
        results = self.episodes.results[key]
        if all(c is not None for c in results):
            self.done[key] = results

    @property
    def carried(self) -> int:
        return len(self.episodes.in_flight()) + len(self.episodes.pending) + len(self.done)

    def rollout(self) -> list[Group]:
        """One rollout: new groups in, B trained out, the rest carried."""
        n = self.b + self.extra - self.carried
        if n > 0:
            keys = list(range(self.next, self.next + n))
            self.next += n
            self.episodes.add(
                [self.loop.prompts[k % self.b] for k in keys],
                [self.budgets[k % self.b] for k in keys],
                request_ids=keys,
                keys=keys,
            )
        v = self.version
        until = lambda: enough(self.episodes, len(self.done), self.b, v, self.eta)  # noqa: E731
        self.state = self.episodes.run(
            self.loop.state.params, self.state, seed=v, version=v, until=until
        )
        keys = select(self.episodes, self.done, self.b, v, self.eta, drain=False)
        groups = []
        for key in keys:
            completions = self.done.pop(key)
            prompt = self.episodes.prompt(key)
            groups.append(Group({}, prompt, completions, [], np.zeros(len(completions)), {}))
            self.episodes.forget(key)
        self.version += 1
        return groups


def _warm_learner(loop: Loop, groups) -> None:
    """Compiles the reference and learner steps for every packed row count (`rl.packing`'s
    buckets) from half to twice that of `groups`: partial batches vary in length, and a timed
    iteration must not compile."""
    batch, layout = build_batch(groups, loop.width, 0, pack=True)
    batch = batch.replace(advantages=layout.spread(np.zeros(len(layout.row), np.float32)))
    n = batch.tokens.shape[0]
    cap = len(loop.lengths)  # rows: at most one per sequence
    for rows in sorted({bucket_rows(k, 1, cap) for k in range(max(n // 2, 1), 2 * n + 1)}):
        tiled = jax.tree.map(lambda x, r=rows: np.resize(x, (r, *x.shape[1:])), batch)
        loop.learn(loop.with_reference(jax.device_put(tiled, loop.sharding)))


def _iteration(loop: Loop, engine, rollout) -> dict:
    """One timed iteration: rollout, reference log-probs, learner step."""
    before = list(engine.slot_steps)
    engine.slot_trace = []
    t0 = time.perf_counter()
    groups = rollout()
    t1 = time.perf_counter()
    n = sum(len(g.completions) for g in groups)
    loop.adv = np.random.default_rng(0).normal(size=n).astype(np.float32)
    loop.learn(loop.with_reference(loop.batch(groups, pack=True)))
    t2 = time.perf_counter()
    active, total = (a - b for a, b in zip(engine.slot_steps, before))
    tokens = sum(len(g.prompt) + c.length for g in groups for c in g.completions)
    return {
        "iteration_seconds": t2 - t0,
        "rollout_seconds": t1 - t0,
        "slot_utilization": active / max(total, 1),
        "tokens": tokens,
        "sequences": len(groups),
        "trace": _trace(engine),
    }


def bench_partial(args) -> dict:
    loop = Loop(args)  # --lengths skewed (launch.bench.loop checks)
    extra = len(loop.prompts) if args.extra_groups is None else args.extra_groups
    partial = Partial(loop, extra, args.max_staleness)

    def sync():
        return loop.rollout()

    _iteration(loop, loop.engine, sync)  # warm-up: compiles everything
    _warm_learner(loop, loop.rollout())
    for _ in range(args.max_staleness + 2):  # the carry-over fills up
        _iteration(loop, partial.engine, partial.rollout)
    runs = {"sync": [], "partial": []}
    for _ in range(args.reps):
        runs["sync"].append(_iteration(loop, loop.engine, sync))
        runs["partial"].append(_iteration(loop, partial.engine, partial.rollout))
    r = {
        "device": jax.devices()[0].platform,
        "reps": args.reps,
        "num_slots": loop.engine.ecfg.num_slots,
        "batch_sequences": len(loop.lengths),
        "extra_groups": extra,
        "max_staleness": args.max_staleness,
    }
    for name, its in runs.items():
        r[name] = {
            k: statistics.median(it[k] for it in its)
            for k in ("iteration_seconds", "rollout_seconds", "slot_utilization")
        }
        # Over all timed iterations: the partial batches vary in length from one to the next.
        r[name]["learned_tokens_per_s"] = sum(it["tokens"] for it in its) / sum(
            it["iteration_seconds"] for it in its
        )
        r[name]["utilization_trace"] = its[-1]["trace"]
    r["rollout_speedup"] = r["sync"]["rollout_seconds"] / r["partial"]["rollout_seconds"]
    r["learned_tokens_speedup"] = (
        r["partial"]["learned_tokens_per_s"] / r["sync"]["learned_tokens_per_s"]
    )
    sync = r["sync"]
    learner = statistics.median(
        it["iteration_seconds"] - it["rollout_seconds"] for it in runs["sync"]
    )
    r["slot_step_speedup"] = r["partial"]["slot_utilization"] / sync["slot_utilization"]
    r["learned_tokens_speedup_at_utilization_1"] = (learner + sync["rollout_seconds"]) / (
        learner + sync["rollout_seconds"] * sync["slot_utilization"]
    )
    return r


def table(r: dict) -> str:
    rows = [("", "sync", "partial")]
    for k in ("iteration_seconds", "rollout_seconds", "slot_utilization", "learned_tokens_per_s"):
        rows.append((k.replace("_", " "), *(f"{r[m][k]:.3f}" for m in ("sync", "partial"))))
    rows.append(("rollout speedup", "", f"{r['rollout_speedup']:.2f}x"))
    rows.append(("learned tokens/s speedup", "", f"{r['learned_tokens_speedup']:.2f}x"))
    rows.append(("rollout speedup at equal slot-step cost", "", f"{r['slot_step_speedup']:.2f}x"))
    u1 = r["learned_tokens_speedup_at_utilization_1"]
    rows.append(("learned tokens/s speedup at utilization 1", "", f"{u1:.2f}x"))
    w = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{w[0]}}  {b:>{w[1]}}  {c:>{w[2]}}" for a, b, c in rows)


def _rollout(partial: Partial) -> dict:
    """One timed rollout of the partial loop (no learner step: the rule does not change it)."""
    engine = partial.engine
    before = list(engine.slot_steps)
    t0 = time.perf_counter()
    groups = partial.rollout()
    seconds = time.perf_counter() - t0
    active, total = (a - b for a, b in zip(engine.slot_steps, before))
    tokens = sum(c.length for g in groups for c in g.completions)
    return {
        "rollout_seconds": seconds,
        "slot_utilization": active / max(total, 1),
        "tokens": tokens,
    }


def bench_tools(args) -> dict:
    """--tool_ms: the partial loop, multi-turn with jittered tools, under each tool hand-off rule
    of --tool_answer_calls (0: each answer as soon as it is done; k: on the loop's clock),
    alternating rule by rule, after eta + 2 warm-up rollouts each."""
    loop = Loop(args)
    extra = len(loop.prompts) if args.extra_groups is None else args.extra_groups
    tools = lambda k: (args.tool_ms, args.turn_tokens, args.tool_workers, k or None)  # noqa: E731
    loops = {k: Partial(loop, extra, args.max_staleness, tools(k)) for k in args.tool_answer_calls}
    for _ in range(args.max_staleness + 2):  # compiles, then the carry-over fills up
        for p in loops.values():
            _rollout(p)
    runs = {k: [] for k in loops}
    for _ in range(args.reps):
        for k, p in loops.items():
            runs[k].append(_rollout(p))
    for p in loops.values():
        p.pool.shutdown()
    r = {
        "device": jax.devices()[0].platform,
        "reps": args.reps,
        "num_slots": loop.engine.ecfg.num_slots,
        "batch_sequences": len(loop.lengths),
        "extra_groups": extra,
        "max_staleness": args.max_staleness,
        "tool_ms": args.tool_ms,
        "turn_tokens": args.turn_tokens,
        "tool_workers": args.tool_workers,
        "steps_per_call": loop.engine.ecfg.steps_per_call,
        "rules": {},
    }
    for k, its in runs.items():
        r["rules"][str(k)] = {
            "rollout_seconds": statistics.median(it["rollout_seconds"] for it in its),
            "slot_utilization": statistics.median(it["slot_utilization"] for it in its),
            # trained completion tokens (observations included) over the rollouts' seconds
            "tokens_per_s": sum(it["tokens"] for it in its)
            / sum(it["rollout_seconds"] for it in its),
        }
    return r


def tools_table(r: dict) -> str:
    rows = [("tool_answer_calls", "rollout s", "slot utilization", "trained tokens/s")]
    for k, v in r["rules"].items():
        name = "0 (as soon as done)" if k == "0" else k
        rows.append(
            (
                name,
                f"{v['rollout_seconds']:.3f}",
                f"{v['slot_utilization']:.3f}",
                f"{v['tokens_per_s']:.0f}",
            )
        )
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(f"{c:>{w[i]}}" if i else f"{c:<{w[i]}}" for i, c in enumerate(row))
        for row in rows
    )
