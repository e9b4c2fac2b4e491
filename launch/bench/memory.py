"""Memory against sequence length (and depth), compiled and never run: `python -m launch.bench
memory --shape qwen2_5_0_5b --tokens 4096,8192,16384,32768 [--attention auto|dense|blockwise]
[--phases learn,logprobs,prefill] [--layers 8,16] [--grad_reduce_dtype float32|bfloat16]
[--expert 2] [--output F.json]`.

For each T, a registered model shape (`launch.bench.common.SHAPES`) with bf16 compute, f32
master weights and remat on, sharded FSDP over 8 CPU devices (mesh fsdp=8, as the 0.5B config's
`--dry_run` runs it; a mixture of experts such as qwen3_30b_a3b with `--expert E`: mesh
fsdp=8/E x expert=E, configs/qwen3_coder_30b_a3b_repo.py's fsdp=4 x expert=2 with E=2, its
grouped matmuls traced as `--dry_run` traces them, `launch.estimate.grouped_matmuls`), is lowered with abstract shapes (ShapeDtypeStructs: nothing is allocated)
and compiled as `--dry_run` compiles (`launch.estimate`: XLA:CPU's passes that no accelerator
runs switched off for these compiles, named in the output; bf16 stays bf16), and the per-device
temporaries are read for three jitted functions: `Estimate.accelerator_temp` (the most bytes of
temporaries live at once, with each only-sliced all-reduce counted as the reduce-scatter an
accelerator makes of it; `*_temp_bytes` in the JSON, the table's figures) and XLA:CPU's own
allocation (`*_cpu_temp_bytes`):
- learn: `Learner.step` on one packed row of T tokens per batch shard (8 rows on fsdp=8), KL on (the batch
  carries reference log-probs), π_old recomputed, one micro-batch, the weights' gradients summed
  across devices in --grad_reduce_dtype;
- logprobs: the reference / π_old log-prob pass over the same batch;
- prefill: the sampler's `prefill` of one T-token prompt per batch shard into its shard's pages
  (`lower_prefill`; on fsdp=8 one prompt per device), in
  chunks of PREFILL_CHUNK tokens over the pages; with `--attention dense` unchunked
  (prefill_chunk 0: dense attention over the whole prompt, the reference path).
The learner's two lowerings are `launch.dry_run`'s (`abstract_batch`, `Learner.lower_step`,
`Learner.lower_logprobs`): this bench only sweeps T. Arguments and outputs (parameters,
optimizer state, KV pages) are not counted: they are resident whatever T is, and `--dry_run`
reports them.

Each compile also names the temporaries of at least 1 GiB live at its peak (XLA's live ranges:
instruction, per-device shape, the JAX operation), and for the learner the weight gradients'
reductions in the partitioned program (`launch.estimate.gradient_reductions`: count and bytes
per device by dtype, before any XLA:CPU pass). `--layers L1,L2,...` repeats the sweep with the
shape cut to that many layers and prints each phase's growth per layer between the two depths
(the same T): what one more layer costs at the peak.

The growth exponent between the two longest lengths, log(temp[T2] / temp[T1]) / log(T2 / T1),
is 1 for memory linear in T and 2 for quadratic.
"""

from __future__ import annotations

import math
import time

import jax

from launch import estimate
from launch.bench.common import (
    SHAPES,
    finish,
    integer,
    integers,
    one_of,
    parse,
    parser,
    some_of,
)
from launch.cli import UsageError
from launch.dry_run import abstract_batch
from models.config import ModelConfig
from models.sharding import (
    DEFAULT_RULES,
    abstract_model,
    make_mesh,
    state_shardings,
    with_shardings,
)
from rl.learner import GRAD_REDUCE_DTYPES, Learner, LearnerConfig, batch_sharding
from rl.losses import LossConfig
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.lowering import lower_prefill

DEVICES = 8  # the CPU devices of the mesh (fsdp=8)
PAGE_SIZE = 128  # prefill KV pages (bf16)
PREFILL_CHUNK = 512  # EngineConfig.prefill_chunk's default; --attention dense: 0 (the reference)
GIB = 2**30
PHASES = ("learn", "logprobs", "prefill")  # what --phases may compile


def cpu_devices(n: int = DEVICES) -> list:
    """n CPU devices. Splits the host CPU into n devices when JAX has not started yet (as the
    test suite does); raises if it already started with fewer."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # already initialised with another count: use what is there if enough
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise RuntimeError(f"{len(devices)} CPU devices, {n} needed: start a fresh process")
    return devices[:n]


def _compile(lowered, row: dict, phase: str) -> estimate.Estimate:
    """Compiles for the estimate (`launch.estimate`) and records the phase's temporaries, compile
    seconds and the buffers of at least 1 GiB at its peak in `row`."""
    start = time.perf_counter()
    est = estimate.compile(lowered)
    row[f"{phase}_compile_s"] = time.perf_counter() - start
    row[f"{phase}_temp_bytes"] = est.accelerator_temp
    row[f"{phase}_cpu_temp_bytes"] = est.temp
    row[f"{phase}_peak_buffers"] = [
        {"bytes": b.bytes, "type": b.type, "name": b.name, "op": estimate.short_op(b.op_name)}
        for b in est.large()
    ]
    return est


def measure(cfg: ModelConfig, t: int, mesh, phases=PHASES, grad_reduce_dtype="float32") -> dict:
    """Per-device temp bytes (and compile seconds, the large buffers at the peak) of each phase
    at T = t."""
    with estimate.grouped_matmuls():  # a mixture of experts' ragged_dot as an accelerator's
        return _measure(cfg, t, mesh, phases, grad_reduce_dtype)


def _measure(cfg: ModelConfig, t: int, mesh, phases, grad_reduce_dtype) -> dict:
    shards = mesh.shape["data"] * mesh.shape["fsdp"]  # batch shards (the rows' sharding)
    graphdef, shapes = abstract_model(cfg)
    shardings = state_shardings(shapes, mesh, DEFAULT_RULES)
    params = with_shardings(shapes, shardings)
    row = {"tokens": t, "layers": cfg.num_layers}
    if {"learn", "logprobs"} & set(phases):
        lcfg = LearnerConfig(loss=LossConfig(kl_coef=0.04), grad_reduce_dtype=grad_reduce_dtype)
        learner = Learner(lcfg, graphdef, shardings)
        batch = abstract_batch(shards, t, batch_sharding(mesh, DEFAULT_RULES), ref_logp=True)
        if "learn" in phases:
            est = _compile(learner.lower_step(params, batch), row, "learn")
            dims = {tuple(x.shape) for x in jax.tree.leaves(params)}
            dims |= {tuple(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(params)}
            grads = estimate.gradient_reductions(est.partitioned, dims)
            row["grad_reduce"] = estimate.by_dtype(grads)
        if "logprobs" in phases:
            _compile(learner.lower_logprobs(params, batch), row, "logprobs")
    if "prefill" in phases:
        ecfg = EngineConfig(
            num_slots=shards,
            page_size=PAGE_SIZE,
            max_prompt_len=t + 1,
            max_new_tokens=1,
            # A pool per batch shard, each with its null page: one prompt's pages on each.
            num_pages=shards * (-(-(t + 2) // PAGE_SIZE) + 1),
            cache_dtype=cfg.dtype,
            prefill_chunk=0 if cfg.attention == "dense" else PREFILL_CHUNK,
        )
        engine = Engine(cfg, graphdef, ecfg, SamplingParams(), mesh=mesh, rules=DEFAULT_RULES)
        _compile(lower_prefill(engine, params, rows=1, length=t), row, "prefill")
    return row


def exponent(rows: list[dict], key: str) -> float | None:
    """log(temp[T2] / temp[T1]) / log(T2 / T1) between the two longest lengths measured (at the
    greatest depth measured)."""
    deepest = max((r.get("layers", 0) for r in rows), default=0)
    have = [r for r in rows if r.get(key) and r.get("layers", 0) == deepest]
    if len(have) < 2:
        return None
    a, b = sorted(have, key=lambda r: r["tokens"])[-2:]
    return math.log(b[key] / a[key]) / math.log(b["tokens"] / a["tokens"])


def per_layer(rows: list[dict], key: str) -> dict[int, float]:
    """{T: (temp[L2] - temp[L1]) / (L2 - L1)} between the shallowest and the deepest depth
    measured at each T."""
    out = {}
    for t in sorted({r["tokens"] for r in rows}):
        have = sorted((r for r in rows if r["tokens"] == t and key in r), key=lambda r: r["layers"])
        if len(have) >= 2 and have[-1]["layers"] > have[0]["layers"]:
            a, b = have[0], have[-1]
            out[t] = (b[key] - a[key]) / (b["layers"] - a["layers"])
    return out


def bench_memory(args) -> dict:
    if DEVICES % args.expert or (args.expert > 1 and not SHAPES[args.shape].get("num_experts")):
        raise UsageError(
            f"--expert={args.expert}: needs a mixture-of-experts --shape and to divide {DEVICES}"
        )
    axes = {"fsdp": DEVICES // args.expert, "expert": args.expert}
    mesh = make_mesh(axes, devices=cpu_devices())
    shape = dict(SHAPES[args.shape])
    shape["max_position_embeddings"] = max(shape.get("max_position_embeddings", 0), *args.tokens)
    r = {
        "shape": args.shape,
        "attention": args.attention,
        "devices": DEVICES,
        "mesh": axes,
        "grad_reduce_dtype": args.grad_reduce_dtype,
        "disabled_passes": list(estimate.CPU_ONLY_PASSES),
        "rows": [],
    }
    print(header(r), flush=True)
    for layers in args.layers or [shape["num_layers"]]:
        moe = {"moe_layers": tuple(range(layers))} if shape.get("num_experts") else {}
        cfg = ModelConfig(
            **{**shape, "num_layers": layers, **moe},
            dtype="bfloat16",
            remat=True,
            attention=args.attention,
        )
        for t in args.tokens:
            r["rows"].append(measure(cfg, t, mesh, args.phases, args.grad_reduce_dtype))
            print(table_row(r["rows"][-1]), flush=True)
    for phase in PHASES:
        r[f"{phase}_exponent"] = exponent(r["rows"], f"{phase}_temp_bytes")
        r[f"{phase}_per_layer_bytes"] = per_layer(r["rows"], f"{phase}_temp_bytes")
    return r


def header(r: dict) -> str:
    return (
        f"{r['shape']}, attention {r['attention']}, mesh "
        f"{' x '.join(f'{a}={n}' for a, n in r['mesh'].items() if n > 1)}, bf16 compute, "
        f"gradients summed in {r['grad_reduce_dtype']}; XLA:CPU passes off for these "
        f"compiles: {', '.join(r['disabled_passes'])}\n{HEADER}"
    )


def table_row(row: dict) -> str:
    cell = lambda k: f"{row[k] / GIB:10.3f}" if k in row else f"{'-':>10s}"
    secs = sum(v for k, v in row.items() if k.endswith("_compile_s"))
    lines = [
        f"{row['tokens']:>7d} {row['layers']:>6d} {cell('learn_temp_bytes')} "
        f"{cell('logprobs_temp_bytes')} {cell('prefill_temp_bytes')}   "
        f"({secs:.0f} s to compile)"
    ]
    for phase in PHASES:
        for b in row.get(f"{phase}_peak_buffers", ()):
            lines.append(
                f"{'':>15s}{phase} peak: {b['bytes'] / GIB:6.2f} GiB {b['type']} "
                f"{b['name']} ({b['op']})"
            )
    for dtype, v in sorted(row.get("grad_reduce", {}).items()):
        lines.append(
            f"{'':>15s}gradient reductions: {v['count']} in {dtype}, "
            f"{v['bytes'] / GIB:.3f} GiB per device"
        )
    return "\n".join(lines)


HEADER = (
    f"{'T':>7s} {'layers':>6s} {'learn GiB':>10s} {'logp GiB':>10s} {'prefill GiB':>10s}"
    "  temp per device"
)


def table(r: dict) -> str:
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"
    lines = [header(r)]
    lines += [table_row(row) for row in r["rows"]]
    lines.append(
        f"growth exponent (two longest T): learn {fmt(r['learn_exponent'])}, "
        f"logprobs {fmt(r['logprobs_exponent'])}, prefill {fmt(r['prefill_exponent'])}"
    )
    for phase in PHASES:
        for t, v in r[f"{phase}_per_layer_bytes"].items():
            lines.append(f"{phase} at T={t}: {v / GIB:.3f} GiB per layer")
    return "\n".join(lines)


def main(argv) -> int:
    p = parser("memory", __doc__)
    p.add_argument(
        "--shape",
        type=one_of(SHAPES),
        default="qwen2_5_0_5b",
        help=f"model shape: {', '.join(SHAPES)}",
    )
    p.add_argument(
        "--tokens",
        type=integers(),
        default="4096,8192,16384,32768",
        help="comma-separated lengths T",
    )
    p.add_argument(
        "--attention",
        type=one_of(("auto", "dense", "blockwise")),
        default="auto",
        help="learner attention: auto, dense or blockwise",
    )
    p.add_argument(
        "--phases",
        type=some_of(PHASES),
        default=",".join(PHASES),
        help=f"comma-separated phases to compile: {', '.join(PHASES)}",
    )
    p.add_argument(
        "--layers",
        type=integers(),
        default=None,
        help="comma-separated layer counts: the sweep at each depth (default: the shape's own)",
    )
    p.add_argument(
        "--grad_reduce_dtype",
        type=one_of(GRAD_REDUCE_DTYPES[:2]),
        default="float32",
        help="the learner's optim.grad_reduce_dtype",
    )
    p.add_argument(
        "--expert",
        type=integer(),
        default=1,
        help="the expert mesh axis (a mixture-of-experts shape): mesh fsdp=8/E x expert=E",
    )
    args = parse(p, argv)
    r = bench_memory(args)
    return finish(args, r, table(r))
