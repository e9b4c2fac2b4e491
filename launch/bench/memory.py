"""Memory against sequence length, compiled and never run: `python -m launch.bench memory
--shape qwen2_5_0_5b --tokens 4096,8192,16384,32768 [--attention auto|dense|blockwise]
[--output F.json]`.

For each T, a registered model shape (`launch.bench.common.SHAPES`) with bf16 compute, f32
master weights and remat on, sharded FSDP over 8 CPU devices (mesh fsdp=8, as the 0.5B config's
`--dry_run` runs it), is lowered with abstract shapes (ShapeDtypeStructs: nothing is allocated)
and compiled, and XLA's per-device temporaries (`memory_analysis().temp_size_in_bytes`) are read
for three jitted functions:
- learn: `Learner.step` on one packed row of T tokens per device (8 rows), KL on (the batch
  carries reference log-probs), π_old recomputed, one micro-batch;
- logprobs: the reference / π_old log-prob pass over the same batch;
- prefill: the sampler's `prefill` of one T-token prompt per batch shard into its shard's pages
  (`lower_prefill`; on fsdp=8 one prompt per device), in
  chunks of PREFILL_CHUNK tokens over the pages; with `--attention dense` unchunked
  (prefill_chunk 0: dense attention over the whole prompt, the reference path).
The learner's two lowerings are `launch.dry_run`'s (`abstract_batch`, `Learner.lower_step`,
`Learner.lower_logprobs`): this bench only sweeps T. Arguments and outputs (parameters,
optimizer state, KV pages) are not counted: they are resident whatever T is, and `--dry_run`
reports them.

The growth exponent between the two longest lengths, log(temp[T2] / temp[T1]) / log(T2 / T1),
is 1 for memory linear in T and 2 for quadratic.
"""

from __future__ import annotations

import math
import time

import jax

from launch.bench.common import SHAPES, finish, integers, one_of, parse, parser, some_of
from launch.dry_run import abstract_batch
from models.config import ModelConfig
from models.sharding import (
    DEFAULT_RULES,
    abstract_model,
    make_mesh,
    state_shardings,
    with_shardings,
)
from rl.learner import Learner, LearnerConfig, batch_sharding
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


def _temp(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes) if m is not None else 0


def _compile(lowered) -> tuple[int, float]:
    start = time.perf_counter()
    compiled = lowered.compile()
    return _temp(compiled), time.perf_counter() - start


def measure(cfg: ModelConfig, t: int, mesh, phases=PHASES) -> dict:
    """Per-device temp bytes (and compile seconds) of each phase at T = t."""
    graphdef, shapes = abstract_model(cfg)
    shardings = state_shardings(shapes, mesh, DEFAULT_RULES)
    params = with_shardings(shapes, shardings)
    row = {"tokens": t}
    if {"learn", "logprobs"} & set(phases):
        learner = Learner(LearnerConfig(loss=LossConfig(kl_coef=0.04)), graphdef, shardings)
        batch = abstract_batch(mesh.size, t, batch_sharding(mesh, DEFAULT_RULES), ref_logp=True)
        if "learn" in phases:
            row["learn_temp_bytes"], row["learn_compile_s"] = _compile(
                learner.lower_step(params, batch)
            )
        if "logprobs" in phases:
            row["logprobs_temp_bytes"], row["logprobs_compile_s"] = _compile(
                learner.lower_logprobs(params, batch)
            )
    if "prefill" in phases:
        ecfg = EngineConfig(
            num_slots=mesh.size, page_size=PAGE_SIZE, max_prompt_len=t + 1, max_new_tokens=1,
            # A pool per batch shard, each with its null page: one prompt's pages on each.
            num_pages=mesh.size * (-(-(t + 2) // PAGE_SIZE) + 1), cache_dtype=cfg.dtype,
            prefill_chunk=0 if cfg.attention == "dense" else PREFILL_CHUNK,
        )  # fmt: skip
        engine = Engine(cfg, graphdef, ecfg, SamplingParams(), mesh=mesh, rules=DEFAULT_RULES)
        row["prefill_temp_bytes"], row["prefill_compile_s"] = _compile(
            lower_prefill(engine, params, rows=1, length=t)
        )
    return row


def exponent(rows: list[dict], key: str) -> float | None:
    """log(temp[T2] / temp[T1]) / log(T2 / T1) between the two longest lengths measured."""
    have = [r for r in rows if r.get(key)]
    if len(have) < 2:
        return None
    a, b = sorted(have, key=lambda r: r["tokens"])[-2:]
    return math.log(b[key] / a[key]) / math.log(b["tokens"] / a["tokens"])


def bench_memory(args) -> dict:
    mesh = make_mesh({"fsdp": DEVICES}, devices=cpu_devices())
    shape = dict(SHAPES[args.shape])
    shape["max_position_embeddings"] = max(shape.get("max_position_embeddings", 0), *args.tokens)
    cfg = ModelConfig(**shape, dtype="bfloat16", remat=True, attention=args.attention)
    r = {"shape": args.shape, "attention": args.attention, "devices": DEVICES}
    r["rows"] = []
    for t in args.tokens:
        r["rows"].append(measure(cfg, t, mesh, args.phases))
        print(table_row(r["rows"][-1]), flush=True)
    r["learn_exponent"] = exponent(r["rows"], "learn_temp_bytes")
    r["logprobs_exponent"] = exponent(r["rows"], "logprobs_temp_bytes")
    r["prefill_exponent"] = exponent(r["rows"], "prefill_temp_bytes")
    return r


def table_row(row: dict) -> str:
    cell = lambda k: f"{row[k] / GIB:10.3f}" if k in row else f"{'-':>10s}"
    secs = sum(v for k, v in row.items() if k.endswith("_compile_s"))
    return (f"{row['tokens']:>7d} {cell('learn_temp_bytes')} {cell('logprobs_temp_bytes')} "
            f"{cell('prefill_temp_bytes')}   ({secs:.0f} s to compile)")  # fmt: skip


HEADER = f"{'T':>7s} {'learn GiB':>10s} {'logp GiB':>10s} {'prefill GiB':>10s}  temp per device"


def table(r: dict) -> str:
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"
    lines = [f"{r['shape']}, attention {r['attention']}, mesh fsdp={r['devices']}", HEADER]
    lines += [table_row(row) for row in r["rows"]]
    lines.append(f"growth exponent (two longest T): learn {fmt(r['learn_exponent'])}, "
                 f"logprobs {fmt(r['logprobs_exponent'])}, prefill {fmt(r['prefill_exponent'])}")  # fmt: skip
    return "\n".join(lines)


def main(argv) -> int:
    p = parser("memory", __doc__)
    p.add_argument("--shape", type=one_of(SHAPES), default="qwen2_5_0_5b",
                   help=f"model shape: {', '.join(SHAPES)}")  # fmt: skip
    p.add_argument("--tokens", type=integers(), default="4096,8192,16384,32768",
                   help="comma-separated lengths T")  # fmt: skip
    p.add_argument("--attention", type=one_of(("auto", "dense", "blockwise")), default="auto",
                   help="learner attention: auto, dense or blockwise")  # fmt: skip
    p.add_argument("--phases", type=some_of(PHASES), default=",".join(PHASES),
                   help=f"comma-separated phases to compile: {', '.join(PHASES)}")  # fmt: skip
    args = parse(p, argv)
    r = bench_memory(args)
    return finish(args, r, table(r))
