"""The plots of docs/performance.md, from the benchmarks' JSON files (needs the `plots` extra):

    python -m launch.bench sampler --batch_sweep 8,16,32,64,128,256 --output bench_sampler.json
    python -m launch.bench learn --output bench_learn.json
    python -m launch.bench loop --output bench_loop.json
    python -m launch.bench loop --lengths skewed --output bench_loop_skewed.json
    python -m launch.bench plots --out docs/img

writes sampler_batch.png (sampler tokens/s against the number of sequences), learner_packing.png
(learner real tokens/s, packed against padded) and iteration_split.png (a GRPO iteration's time
split into rollout, reference log-probs and learning, for each workload and layout). With

    python -m launch.bench memory --attention dense --tokens 1024,2048,4096,8192 --output bench_memory_dense.json
    python -m launch.bench memory --attention blockwise --tokens 1024,2048,4096,8192,16384,32768 --output bench_memory.json
    python -m launch.bench plots --only_memory --memory_dense bench_memory_dense.json --memory bench_memory.json

it writes memory_tokens.png (per-device temporaries of the learner step and the prefill
against the row length, dense against blockwise; log-log). With

    python -m launch.bench loop --lengths skewed --partial_rollouts --reps 7 --output bench_partial.json
    python -m launch.bench plots --only_partial --partial bench_partial.json

it writes partial_utilization.png (each decode call's slot utilization over one rollout,
synchronous against partial rollouts).

A file that is missing, not JSON or not the JSON of its benchmark (a key the plot needs is not
there) is one `error:` line naming the flag and the command that writes it; so is an --out that
is a file, lies under one or may not be written, before any file is read.
"""

from __future__ import annotations

import json
import os

from launch.bench.common import HelpFormatter, Parser
from launch.cli import UsageError
from launch.validate import check_writable_dir

# What each file flag reads: the command that writes it and the keys the plots need.
FILES = {
    "sampler": ("sampler --batch_sweep 8,16,32", ("device", "batch_sweep")),
    "learn": (
        "learn",
        ("device", "padded_rows", "packed_rows", "padded_tokens_per_s", "packed_tokens_per_s"),
    ),
    "loop": ("loop", ("device", "rollout_seconds", "reference_seconds", "learn_seconds")),
    "loop_skewed": (
        "loop --lengths skewed",
        (
            "rollout_seconds",
            "reference_seconds",
            "learn_seconds",
            "static_rollout_seconds",
            "padded_reference_seconds",
            "padded_learn_seconds",
        ),
    ),
    "memory_dense": ("memory --attention dense", ("shape", "attention", "devices", "rows")),
    "memory": ("memory --attention blockwise", ("shape", "attention", "devices", "rows")),
    "partial": (
        "loop --lengths skewed --partial_rollouts",
        ("sync", "partial", "batch_sequences", "num_slots"),
    ),
}


def _load(flag: str, path: str) -> dict:
    """The JSON of --flag, or one UsageError line naming the flag and the command to run."""
    command, keys = FILES[flag]
    fix = f"write it with python -m launch.bench {command} --output {path}"
    try:
        with open(path) as f:
            r = json.load(f)
    except OSError as e:
        raise UsageError(f"--{flag}={path}: {e.strerror.lower()}; {fix}") from None
    except ValueError as e:
        raise UsageError(f"--{flag}={path}: not JSON ({e}); {fix}") from None
    missing = [k for k in keys if not isinstance(r, dict) or k not in r]
    if missing:
        raise UsageError(f"--{flag}={path}: no {missing[0]!r} in it; {fix}")
    return r


def plot(sampler, learn, loop, skewed, out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    paths = []

    def save(fig, name):
        fig.tight_layout()
        paths.append(os.path.join(out, name))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    sweep = sampler["batch_sweep"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([r["num_seqs"] for r in sweep], [r["tokens_per_s"] for r in sweep], "o-")
    ax.set(
        xscale="log",
        xlabel="sequences decoded together",
        ylabel="tokens/s",
        title=f"sampler, bench-small, {sampler['device']}",
    )
    ax.set_xticks([r["num_seqs"] for r in sweep], [str(r["num_seqs"]) for r in sweep])
    ax.grid(alpha=0.3)
    save(fig, "sampler_batch.png")

    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = [f"padded\n{learn['padded_rows']} rows", f"packed\n{learn['packed_rows']} rows"]
    values = [learn["padded_tokens_per_s"], learn["packed_tokens_per_s"]]
    ax.bar(names, values, color=["#bbbbbb", "#4477aa"])
    ax.set(ylabel="real tokens/s", title=f"learner step, long-tailed lengths, {learn['device']}")
    save(fig, "learner_packing.png")

    fig, ax = plt.subplots(figsize=(6, 3.4))
    bars = [
        ("fixed 128", loop["rollout_seconds"], loop["reference_seconds"], loop["learn_seconds"]),
        (
            "skewed:\ncontinuous, packed",
            skewed["rollout_seconds"],
            skewed["reference_seconds"],
            skewed["learn_seconds"],
        ),
        (
            "skewed:\nstatic, padded",
            skewed["static_rollout_seconds"],
            skewed["padded_reference_seconds"],
            skewed["padded_learn_seconds"],
        ),
    ]
    bottom = [0.0] * len(bars)
    for j, (part, color) in enumerate(
        [("rollout", "#4477aa"), ("reference", "#ccbb44"), ("learn", "#ee6677")], start=1
    ):
        heights = [b[j] for b in bars]
        ax.bar([b[0] for b in bars], heights, bottom=bottom, label=part, color=color)
        bottom = [x + h for x, h in zip(bottom, heights)]
    ax.set(ylabel="seconds per iteration", title=f"GRPO iteration, bench-small, {loop['device']}")
    ax.legend()
    save(fig, "iteration_split.png")
    return paths


def plot_memory(dense, blockwise, out: str) -> str:
    """memory_tokens.png: learner-step and prefill temporaries (GiB per device) against T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r, style in ((dense, "--"), (blockwise, "-")):
        for key, name, color in (
            ("learn_temp_bytes", "learner step", "#ee6677"),
            ("prefill_temp_bytes", "prefill", "#4477aa"),
        ):
            rows = [x for x in r["rows"] if x.get(key)]
            label = f"{name}, {r['attention']}"
            ax.plot(
                [x["tokens"] for x in rows],
                [x[key] / 2**30 for x in rows],
                style,
                marker="o",
                color=color,
                label=label,
            )
    ax.axhline(16, color="#999999", lw=0.8)
    ax.text(ax.get_xlim()[0], 16, " 16 GiB (TPU v5e)", va="bottom", fontsize=8, color="#666666")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="tokens per row (T)",
        ylabel="GiB per device",
        title=f"{blockwise['shape']}, fsdp={blockwise['devices']}, XLA:CPU memory analysis",
    )
    ax.set_xticks(
        [x["tokens"] for x in blockwise["rows"]],
        [f"{x['tokens'] // 1024}k" for x in blockwise["rows"]],
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "memory_tokens.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_partial(r, out: str) -> str:
    """partial_utilization.png: each decode call's slot utilization over one rollout, the
    synchronous loop against partial rollouts (`launch.bench loop --partial_rollouts`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name, color in (("sync", "#ee6677"), ("partial", "#4477aa")):
        trace = r[name]["utilization_trace"]
        label = (
            f"{name}: {r[name]['rollout_seconds']:.1f} s, mean {r[name]['slot_utilization']:.2f}"
        )
        ax.step(range(1, len(trace) + 1), trace, where="post", color=color, label=label)
    ax.set(
        xlabel="decode call of the rollout",
        ylabel="busy slots / slots",
        ylim=(0, 1.05),
        title=f"one rollout, {r['batch_sequences']} sequences of 8..512 tokens, "
        f"{r['num_slots']} slots",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "partial_utilization.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv) -> int:
    p = Parser(
        prog="python -m launch.bench plots", description=__doc__, formatter_class=HelpFormatter
    )
    for flag in ("sampler", "learn", "loop", "loop_skewed"):
        p.add_argument(
            f"--{flag}",
            default=f"bench_{flag}.json",
            help=f"python -m launch.bench {FILES[flag][0]} JSON",
        )
    p.add_argument("--out", default="docs/img", help="directory of the PNG files (made if missing)")
    p.add_argument("--memory_dense", default=None, help="bench memory JSON, --attention dense")
    p.add_argument("--memory", default=None, help="bench memory JSON, --attention blockwise")
    p.add_argument("--only_memory", action="store_true", help="draw memory_tokens.png alone")
    p.add_argument(
        "--partial",
        default=None,
        help="bench loop --partial_rollouts JSON: draw partial_utilization.png",
    )
    p.add_argument("--only_partial", action="store_true", help="draw partial_utilization.png alone")
    a = p.parse_args(argv)
    check_writable_dir("--out", a.out)  # before any file is read or drawn
    if bool(a.memory_dense) != bool(a.memory) or (a.only_memory and not a.memory):
        p.error("--memory_dense and --memory: memory_tokens.png needs both JSON files")
    if a.only_partial and not a.partial:
        p.error("--only_partial: needs --partial, the JSON of the partial-rollout bench")
    flags = [
        f
        for f in ("sampler", "learn", "loop", "loop_skewed")
        if not (a.only_memory or a.only_partial)
    ]
    flags += ["partial"] * bool(a.partial) + ["memory_dense", "memory"] * bool(a.memory)
    r = {flag: _load(flag, getattr(a, flag)) for flag in flags}  # all read before any is drawn
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("the plots need matplotlib: pip install -e '.[plots]'") from None
    paths = []
    if a.partial:
        paths.append(plot_partial(r["partial"], a.out))
    if not (a.only_memory or a.only_partial):
        paths += plot(r["sampler"], r["learn"], r["loop"], r["loop_skewed"], a.out)
    if a.memory:
        paths.append(plot_memory(r["memory_dense"], r["memory"], a.out))
    for path in paths:
        print(f"wrote {path}")
    return 0
