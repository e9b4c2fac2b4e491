"""GRPO-iteration benchmark: `python -m launch.bench loop [--lengths skewed] [--output F]`.

One iteration = rollout (`generate_all` on the policy's own arrays) + reference log-probs
(`Learner.logprobs` of the reference model, full softmax) + one AdamW step (`Learner.step`, μ 1,
π_old from the same forward) on bench-small, one device (`launch.bench.iteration.Loop`): 8 prompts
x 8 samples, prompts of 64 tokens, temperature 1, no top-k / top-p, KL β 0.04.

- `--lengths fixed`: exactly 128 new tokens per sample (no stop ids), 64 slots.
- `--lengths skewed`: each sample's length drawn from a seeded long-tailed distribution over
  8..512 (`launch.bench.learn.skewed_lengths`; each sample gets that budget, its group's prompt
  prefilled once), 16 slots. Also timed: the same rollout as static batches
  (`static_rollout_seconds`: the groups in fixed batches of 16 samples, each decoding until its
  longest sequence ends, so a finished row idles), and the learner step on padded rather than
  packed rows (`padded_learn_seconds`).
  Continuous batching is a policy for a fixed number of slots; with every sequence in its own
  slot from the start, both would wait for the longest sequence alone.

Each key is the median of `--reps` iterations after a warm-up iteration (compilation).
With `--partial_rollouts` (and `--lengths skewed`) the command runs partial.py instead, and with
`--num_slots` / `--num_pages` (and `--lengths skewed`) capacity.py: KV pages on demand against
budget reservation, each sample admitted with a 512-token budget. With `--partial_rollouts
--tool_ms MS` the partial loop only, multi-turn: each model turn of at most `--turn_tokens`
followed by a tool answering 4 ids after a seeded uniform(0, MS) ms on `--tool_workers` threads,
under each tool hand-off rule of `--tool_answer_calls` (0: an answer as soon as it is done, the
wall-clock rule; k: k decode calls after its turn, `sampling.episodes` "Logical time"):
rollout seconds, slot utilization and trained tokens per rollout second (no learner step).
"""

from __future__ import annotations

import statistics

import jax

from launch.bench import capacity, partial
from launch.bench.common import finish, integer, integers, one_of, parse, parser
from launch.bench.iteration import Loop


def bench_loop(args) -> dict:
    loop = Loop(args)
    loop.iteration()  # warm-up: compiles everything
    loop.times = {k: [] for k in loop.times}
    for _ in range(args.reps):
        loop.iteration()
    med = {k: statistics.median(v) for k, v in loop.times.items() if v}
    r = {
        "device": jax.devices()[0].platform,
        "lengths": args.lengths,
        "reps": args.reps,
        "num_slots": loop.engine.ecfg.num_slots,
        "num_sequences": len(loop.lengths),
        "completion_tokens": int(loop.lengths.sum()),
        "tokens_per_s": int(loop.lengths.sum()) / med["iteration"],
    }
    for key in (
        "iteration",
        "rollout",
        "reference",
        "learn",
        "static_rollout",
        "padded_reference",
        "padded_learn",
    ):
        if key in med:
            r[f"{key}_seconds"] = med[key]
    if loop.skewed:
        r["continuous_speedup"] = med["static_rollout"] / med["rollout"]
        r["packed_learn_speedup"] = med["padded_learn"] / med["learn"]
    return r


def table(r: dict) -> str:
    rows = [(f"{k.replace('_', ' ')}", f"{r[k]:.3f} s") for k in r if k.endswith("_seconds")]
    rows.append(("tokens/s (completion tokens / iteration)", f"{r['tokens_per_s']:.0f}"))
    for k in ("continuous_speedup", "packed_learn_speedup"):
        if k in r:
            rows.append((k.replace("_", " "), f"{r[k]:.2f}x"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main(argv) -> int:
    p = parser("loop", __doc__)
    p.add_argument("--quick", action="store_true", help="tiny model and workload (tests)")
    p.add_argument(
        "--lengths",
        type=one_of(("fixed", "skewed")),
        default="fixed",
        help="fixed (128 tokens each) or skewed (long-tailed over 8..512)",
    )
    p.add_argument("--seed", type=integer(0), default=0, help="seed of the lengths")
    p.add_argument("--reps", type=integer(), default=3, help="timed iterations (median)")
    p.add_argument(
        "--steps_per_call",
        type=integer(),
        default=None,
        help="EngineConfig.steps_per_call (default 32, partial 4)",
    )
    p.add_argument(
        "--partial_rollouts",
        action="store_true",
        help="--lengths skewed: sync against partial rollouts",
    )
    p.add_argument(
        "--extra_groups",
        type=integer(0),
        default=None,
        help="--partial_rollouts: groups in flight beyond B (default B)",
    )
    p.add_argument("--max_staleness", type=integer(0), default=4, help="--partial_rollouts: eta")
    p.add_argument(
        "--tool_ms",
        type=integer(1),
        default=None,
        help="--partial_rollouts: multi-turn, tools delayed by uniform(0, MS) ms",
    )
    p.add_argument(
        "--turn_tokens", type=integer(), default=32, help="--tool_ms: model tokens per turn at most"
    )
    p.add_argument("--tool_workers", type=integer(), default=8, help="--tool_ms: tool threads")
    p.add_argument(
        "--tool_answer_calls",
        type=integers(0),
        default=[0, 1, 2, 4, 8],
        help="--tool_ms: the rules compared, comma-separated (0 = wall-clock)",
    )
    p.add_argument(
        "--num_slots",
        type=integer(),
        default=None,
        help="--lengths skewed: compare sampling.reserve demand / budget on this many "
        "slots (capacity.py; default 32)",
    )
    p.add_argument(
        "--num_pages",
        type=integer(2),
        default=None,
        help="--lengths skewed: ... and a pool of this many pages (default: 8 "
        "sequences' whole budget + the null page)",
    )
    args = parse(p, argv)
    if args.num_slots is not None or args.num_pages is not None:
        if args.lengths != "skewed" or args.partial_rollouts:
            p.error(
                "--num_slots / --num_pages: the capacity comparison needs --lengths=skewed "
                "and no --partial_rollouts"
            )
        args.steps_per_call = args.steps_per_call or 8
        r = capacity.bench_capacity(args)
        return finish(args, r, capacity.table(r))
    if args.steps_per_call is None:
        args.steps_per_call = 4 if args.partial_rollouts else 32
    if not args.partial_rollouts:
        r = bench_loop(args)
        return finish(args, r, table(r))
    if args.lengths != "skewed":
        p.error(f"--partial_rollouts: needs --lengths=skewed (got --lengths={args.lengths})")
    if args.tool_ms is not None:
        r = partial.bench_tools(args)
        return finish(args, r, partial.tools_table(r))
    r = partial.bench_partial(args)
    return finish(args, r, partial.table(r))
