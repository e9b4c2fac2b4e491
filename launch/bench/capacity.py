"""KV pages on demand against budget reservation, side by side (`python -m launch.bench loop
--lengths skewed --num_slots 32 --num_pages 289`; --quick: tiny, 8 slots, 2 sequences' budget): bench-small on one device, 8 prompts of 64
tokens x 8 samples, each sample stopping at its drawn length (`launch.bench.learn.skewed_lengths`,
8..512, the model turn capped there: `EpisodeLoop.add`'s max_turn_tokens) but admitted with a
512-token budget, as an RL sampler admits a sample whose length it cannot know.

For each `EngineConfig.reserve` ("budget": a group's worst case reserved at admission; "demand":
pages as sequences grow, the newest of a full pool preempted and recomputed), the same rollout
(temperature 1) runs `--reps` times after a warm-up (compilation), the two interleaved rep by
rep. Per mode:
- rollout_seconds: median wall time of one rollout;
- mean_concurrency: active slot-steps over decode steps (tokens decoded / decode steps run, from
  the engine's `slot_steps`; at most num_slots);
- preemptions and recomputed_tokens per rollout ("demand"; `Engine.preemptions`).
And `tokens_equal`: both modes drew the same tokens (the recompute of a preempted sequence
continues with the same keys; its log-probs may differ at ~1e-6, which a sampled token could
cross).
"""

from __future__ import annotations

import statistics
import time

import jax

from launch.bench.common import SMALL, TINY, random_prompts
from launch.bench.learn import skewed_lengths
from launch.cli import UsageError
from models.config import ModelConfig
from models.sharding import init_params, make_mesh
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.episodes import EpisodeLoop
from sampling.requests import group_pages

MODES = ("budget", "demand")


class Capacity:
    """bench-small (tiny with --quick), its prompts and skewed lengths, and an engine per mode."""

    def __init__(self, args):
        quick = args.quick
        cfg = ModelConfig(
            family="qwen2", qkv_bias=True, tie_embeddings=True, **(TINY if quick else SMALL)
        )
        self.g, n_prompts, plen = (2, 4, 8) if quick else (8, 8, 64)
        self.budget = 32 if quick else 512
        self.prompts = random_prompts(n_prompts, plen, cfg.vocab_size)
        self.lengths = skewed_lengths(n_prompts * self.g, 2 if quick else 8, self.budget, args.seed)
        page = 4 if quick else 16
        slots = args.num_slots or (8 if quick else 32)
        full = group_pages(plen, self.budget, page, 1)  # one sequence's whole budget
        pages = args.num_pages or (2 if quick else 8) * full + 1
        group = group_pages(plen, self.budget, page, self.g)
        if pages - 1 < group:
            raise UsageError(
                f"--num_pages={pages}: the pool must hold one group's worst case, "
                f"{group} pages + the null page (budget reservation admits a group "
                "whole)"
            )
        if self.g > slots:
            raise UsageError(f"--num_slots={slots}: need >= G = {self.g}")
        graphdef, self.params = init_params(cfg, make_mesh({}, devices=jax.devices()[:1]), seed=0)
        self.engines = {
            mode: Engine(
                cfg,
                graphdef,
                EngineConfig(
                    num_slots=slots,
                    page_size=page,
                    max_prompt_len=plen,
                    max_new_tokens=self.budget,
                    num_pages=pages,
                    steps_per_call=args.steps_per_call,
                    reserve=mode,
                ),
                SamplingParams(temperature=1.0),
            )
            for mode in MODES
        }
        self.full_budgets = (pages - 1) / full  # sequences whose whole budget the pool holds
        self.times = {m: [] for m in MODES}
        self.stats = {m: [] for m in MODES}
        self.tokens = {}

    def rollout(self, mode: str) -> None:
        engine = self.engines[mode]
        before = (list(engine.slot_steps), engine.preemptions, engine.recomputed_tokens)
        loop = EpisodeLoop(engine, self.g)
        caps = self.lengths.reshape(len(self.prompts), self.g).tolist()
        loop.add(self.prompts, self.budget, max_turn_tokens=caps)
        t0 = time.perf_counter()
        loop.run(self.params, engine.init_state(), seed=1)
        self.times[mode].append(time.perf_counter() - t0)
        got = [c for i in range(len(self.prompts)) for c in loop.results[i]]
        assert [c.length for c in got] == self.lengths.tolist()  # each stopped at its length
        tokens, slot_steps = (a - b for a, b in zip(engine.slot_steps, before[0]))
        steps = slot_steps / engine.ecfg.num_slots  # decode steps run
        self.stats[mode].append(
            {
                "mean_concurrency": tokens / max(steps, 1),
                "preemptions": engine.preemptions - before[1],
                "recomputed_tokens": engine.recomputed_tokens - before[2],
            }
        )
        self.tokens[mode] = [c.tokens for c in got]


def bench_capacity(args) -> dict:
    cap = Capacity(args)
    for mode in MODES:  # warm-up: compiles everything
        cap.rollout(mode)
    cap.times = {m: [] for m in MODES}
    cap.stats = {m: [] for m in MODES}
    for _ in range(args.reps):
        for mode in MODES:
            cap.rollout(mode)
    e = cap.engines["demand"].ecfg
    r = {
        "device": jax.devices()[0].platform,
        "lengths": "skewed",
        "reps": args.reps,
        "num_slots": e.num_slots,
        "num_pages": e.num_pages,
        "page_size": e.page_size,
        "budget_tokens": cap.budget,
        "num_sequences": len(cap.lengths),
        "completion_tokens": int(cap.lengths.sum()),
        "pool_full_budgets": cap.full_budgets,
        "tokens_equal": cap.tokens["budget"] == cap.tokens["demand"],
    }
    for mode in MODES:
        s = cap.stats[mode]
        r[mode] = {
            "rollout_seconds": statistics.median(cap.times[mode]),
            **{k: statistics.median(x[k] for x in s) for k in s[0]},
        }
    r["concurrency_ratio"] = r["demand"]["mean_concurrency"] / r["budget"]["mean_concurrency"]
    r["rollout_speedup"] = r["budget"]["rollout_seconds"] / r["demand"]["rollout_seconds"]
    return r


def table(r: dict) -> str:
    lines = [
        f"{r['num_sequences']} sequences ({r['completion_tokens']} tokens) admitted with "
        f"{r['budget_tokens']}-token budgets, {r['num_slots']} slots, {r['num_pages']} pages of "
        f"{r['page_size']} (the whole budget of {r['pool_full_budgets']:.1f} sequences); "
        f"median of {r['reps']}",
        f"{'reserve':>8s} {'rollout s':>10s} {'concurrency':>12s} {'preemptions':>12s} "
        f"{'recomputed':>11s}",
    ]
    for mode in MODES:
        m = r[mode]
        lines.append(
            f"{mode:>8s} {m['rollout_seconds']:10.3f} {m['mean_concurrency']:12.2f} "
            f"{m['preemptions']:12.0f} {m['recomputed_tokens']:11.0f}"
        )
    lines.append(
        f"demand / budget: concurrency {r['concurrency_ratio']:.2f}x, rollout "
        f"{r['rollout_speedup']:.2f}x faster; same tokens: {r['tokens_equal']}"
    )
    return "\n".join(lines)
