"""What each mesh costs the sampler, compiled and never run: `python -m launch.bench mesh
--shape qwen2_5_0_5b --meshes fsdp1,fsdp2,fsdp4,fsdp8,data2xfsdp4,fsdp4xtensor2
[--config configs/qwen2_5_0_5b_code_32k.py] [--num_slots N] [--num_pages P] [--page_size S]
[--steps_per_call K] [--weights_layout tensor|training] [--weights_dtype D] [--cache_dtype D]
[--output F.json]`.

For each mesh (axis sizes joined by "x": fsdp8, data2xfsdp4, fsdp4xtensor2, on the first
data*fsdp*tensor of 8 CPU devices) a registered model shape (`launch.bench.common.SHAPES`) gets
the config's model dtypes and rules, abstract parameters in their training shardings
(ShapeDtypeStructs: nothing is allocated), and the Engine `launch.build` makes for the config
(`launch.validate.engine_config`; --num_slots, --num_pages, --page_size, --steps_per_call and
--weights_layout override the config's sampling fields; slots and pages are totals for the mesh,
split over its `shards`, and must divide by them). ONE `generate` call (steps_per_call decode
steps) is lowered as `Engine.dispatch` runs it (`sampling.lowering.lower_generate`, on the
weights the rollout decodes from, `Engine.abstract_decode_params`) and compiled for the CPU.
Per mesh, per device:
- kv_bytes: the KV pool, each layer's k and v shard shape (`Engine.state_shardings`) x dtype,
  with an int8 / float8_e4m3fn cache (--cache_dtype) its bf16 scales [K,P,page_size] included;
  kv_scale_bytes: those scales alone (`sampling.kv_quant`; 0 for a float cache);
- generate_peak_bytes: the compiled call's arguments + outputs + temporaries - aliased
  (`launch.dry_run._report`), and rollout_peak_bytes: the rollout phase's peak as `--dry_run`
  bounds it with the decode call (that + optimizer state + the reference copy when the KL term
  is on, + the resident params when the call decodes from a copy of them; `--dry_run` also
  compiles the prefill calls and takes the larger). Compiled with XLA:CPU's own
  passes, unlike `--dry_run` (`launch.estimate`): the collectives below are XLA:CPU's, and so is
  the figure, its f32 copies of a bf16 KV pool included;
- per_rollout: the reshard the rollout makes once, before its first call (`Engine.decode_params`;
  weights_layout "tensor": a copy in the compute dtype split over tensor only; weights_dtype
  int8 / float8_e4m3fn: its block projections quantised, `models.quant`). copy_bytes is the
  copy's size per device (0: the call decodes from the params themselves), collectives
  those of that reshard compiled on its own (a jit of the cast with the copy's shardings as
  out_shardings, which is what the device_put of `decode_params` does): they run once per
  rollout, never per step, and are not in any per-step figure;
- collectives of the compiled HLO (`launch.bench.hlo`: count and result bytes per device, by
  kind), in three places: `decode_loop` (in the decode loop's body: once per decode step),
  `page_loop` (the part of those inside a paged-attention loop over pages: once per block of
  pages, per layer), `outside` (once per call). `per_step` = decode_loop + outside /
  steps_per_call: one decode step's share of a call.
- all_slot_bytes: the bytes per step of the decode loop's collective results that have a
  dimension equal to num_slots (the total), and their shapes (`all_slot_shapes`): arrays of every
  slot materialised on each device and sent between devices (logits [B, V], partial sums
  [B, 1, D], every slot's new k/v). A proxy: a dimension of another array that happens to equal
  num_slots counts too, so `collisions` lists the model and page dimensions that equal it, whole
  or as one device's share (d / k for k <= 8 devices): choose a num_slots that none has.

How the loops are found (XLA names them region_N / while.N, so not by name): the decode loop is
the outermost while (not nested in another) whose loop state carries a per-device KV pool array
[K, P, page_size, H] of the state shardings (a dtype of its own: XLA:CPU upcasts a bf16 pool);
a page loop is a while nested in it whose state carries the pool, as it is or flattened to the
rows [(K*P), page_size*H] that `sampling.paged_attention` gathers pages from (the blockwise
backend's `_online_softmax` and the cascade's shared-prefix pass). The sampler's other loops
(threefry hashing) carry only u32 state. No decode loop found is an error: the figures would
mean nothing.

Bytes are XLA:CPU's: it computes a bf16 model's dots, all-reduces included, in f32, so the
partial sums cross devices as f32 (an accelerator would send bf16 ones). The figures are
static: a collective in the decode loop counts once per step, one in the page loop once per
block; how many blocks a step runs depends on the sequences' lengths.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import time

import jax

from launch import estimate
from launch.bench import hlo
from launch.bench.common import SHAPES, finish, integer, one_of, parse, parser
from launch.bench.memory import DEVICES, cpu_devices
from launch.cli import UsageError, load_config_file
from launch.dry_run import _per_device_bytes, _report
from launch.validate import engine_config, learner_config, model_overrides, sampling_params
from models import quant
from models.config import ModelConfig
from models.sharding import MESH_AXES, abstract_model, make_mesh, state_shardings, with_shardings
from rl.learner import Learner, TrainState
from sampling.engine import Engine
from sampling.kv_quant import CACHE_DTYPES, QuantPages
from sampling.lowering import _abstract_state, lower_generate
from sampling.partitioned import num_shards
from sampling.requests import WEIGHTS_LAYOUTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "qwen2_5_0_5b_code_32k.py")
MESHES = "fsdp1,fsdp2,fsdp4,fsdp8,data2xfsdp4,fsdp4xtensor2"
GIB, MB = 2**30, 1e6
_PART = re.compile(r"^(" + "|".join(MESH_AXES) + r")(\d+)$")


def mesh_shape(name: str) -> dict[str, int]:
    """ "data2xfsdp4" -> {"data": 2, "fsdp": 4}; raises ValueError saying what is wrong."""
    shape = {}
    for part in name.split("x"):
        m = _PART.match(part)
        if m is None or int(m.group(2)) < 1:
            raise ValueError(f"{part!r} is not an axis and a size >= 1 ({', '.join(MESH_AXES)})")
        if m.group(1) in shape:
            raise ValueError(f"axis {m.group(1)} is given twice")
        shape[m.group(1)] = int(m.group(2))
    if math.prod(shape.values()) > DEVICES:
        raise ValueError(f"{math.prod(shape.values())} devices, at most {DEVICES}")
    return shape


def meshes(text: str) -> list[str]:
    """Flag type: comma-separated mesh names, each once."""
    out = [x.strip() for x in text.split(",") if x.strip()]
    allowed = f"comma-separated meshes such as {MESHES}"
    if not out:
        raise argparse.ArgumentTypeError(f"={text}: expected {allowed}")
    for i, name in enumerate(out):
        try:
            mesh_shape(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"={text}: {name}: {e} (expected {allowed})") from None
        if name in out[:i]:
            raise argparse.ArgumentTypeError(f"={text}: {name!r} is given twice ({allowed})")
    return out


def pool_shapes(engine: Engine) -> set[tuple[int, ...]]:
    """The per-device shapes of a layer's pool: [K, P, page, H] and its page rows [(K*P), page*H]."""
    state = _abstract_state(engine)
    out = set()
    for x in (*state.k_pages, *state.v_pages):
        x = x.values if isinstance(x, QuantPages) else x  # int8 / fp8: the values (kv_quant)
        k, p, s, h = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        out |= {(k, p, s, h), (k * p, s * h)}
    return out


def find_loops(module: hlo.Module, pools: set) -> tuple[hlo.While, list[hlo.While]]:
    """(decode loop, page loops) of a compiled generate call (see the module docstring)."""
    loops = hlo.while_loops(module)
    carries = lambda w: any(dims in pools for _, dims in w.shapes)
    decode = [w for w in loops if w.depth == 1 and carries(w)]
    if len(decode) != 1:
        raise RuntimeError(
            f"{len(decode)} outermost while loops carry the KV pool, expected 1 "
            "(the decode loop); the HLO is not the one this bench reads"
        )
    pages = [w for w in loops if decode[0].name in w.loops and carries(w)]
    return decode[0], pages


def collective_figures(text: str, pools: set, num_slots: int, steps: int) -> dict:
    """The collectives of one compiled generate call, by place (see the module docstring)."""
    module = hlo.parse(text)
    decode, pages = find_loops(module, pools)
    page_names = {w.name for w in pages}
    items = hlo.collectives(module)
    inside = [c for c in items if decode.name in c.loops]
    outside = [c for c in items if decode.name not in c.loops]
    in_pages = [c for c in inside if page_names & set(c.loops)]
    r = {
        "decode_loop": hlo.summarize(inside),
        "page_loop": hlo.summarize(in_pages),
        "outside": hlo.summarize(outside),
        "page_loops": len(pages),
    }
    r["per_step"] = {
        k: {f: r["decode_loop"][k][f] + r["outside"][k][f] / steps for f in ("count", "bytes")}
        for k in r["decode_loop"]
    }
    slot_arrays = [(c.kind, s) for c in inside for s in c.shapes if num_slots in s[1]]
    r["all_slot_bytes"] = hlo.nbytes([s for _, s in slot_arrays])
    by_shape: dict[str, list] = {}
    for kind, (dtype, dims) in slot_arrays:
        key = f"{kind} {dtype}[{','.join(map(str, dims))}]"
        by_shape.setdefault(key, [0, hlo.nbytes([(dtype, dims)])])[0] += 1
    r["all_slot_shapes"] = sorted(
        ({"array": k, "count": n, "bytes": n * b} for k, (n, b) in by_shape.items()),
        key=lambda x: -x["bytes"],
    )
    r["page_loop_collectives"] = [
        {
            "kind": c.kind,
            "shapes": [f"{d}[{','.join(map(str, s))}]" for d, s in c.shapes],
            "bytes": c.bytes,
            "op_name": c.op_name,
        }
        for c in in_pages
    ]
    return r


def _shape_dims(cfg: ModelConfig, ecfg) -> dict[str, int]:
    return dict(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        d_ff=cfg.d_ff,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_layers=cfg.num_layers,
        page_size=ecfg.page_size,
        num_pages=ecfg.num_pages,
        pages_per_seq=ecfg.pages_per_seq,
        max_new_tokens=ecfg.max_new_tokens,
    )


def collisions(dims: dict[str, int], num_slots: int) -> list[str]:
    """The dimensions (whole, or one device's share of them on up to DEVICES devices) equal to
    num_slots: arrays of those may pass for all-slot arrays."""
    shares = lambda v: {v // k for k in range(1, DEVICES + 1) if v % k == 0}
    return sorted(k for k, v in dims.items() if num_slots in shares(v))


def per_rollout(params, decode, weights_dtype: str = "", compute_dtype: str = "") -> dict:
    """The once-per-rollout reshard of the weights into the ones a rollout decodes from
    (`decode`, `Engine.abstract_decode_params(params)`): the copy's bytes per device and the
    collectives of the cast-and-reshard compiled on its own (module docstring)."""
    if decode is params:  # decoding from the params themselves: nothing is made
        return {"copy_bytes": 0, "collectives": hlo.summarize([]), "largest": []}
    target = jax.tree.map(lambda x: x.sharding, decode)
    cast = lambda p: jax.tree.map(lambda x, d: x.astype(d.dtype), p, decode)
    if weights_dtype in quant.DTYPES:  # quantise and reshard (one jit here, two in the engine)
        cast = lambda p: quant.quantize_params(p, weights_dtype, compute_dtype)
    items = hlo.collectives(jax.jit(cast, out_shardings=target).lower(params).compile().as_text())
    largest = sorted(items, key=lambda c: -c.bytes)[:3]
    return {
        "copy_bytes": _per_device_bytes(decode),
        "collectives": hlo.summarize(items),
        "largest": [
            {
                "kind": c.kind,
                "shapes": [f"{d}[{','.join(map(str, s))}]" for d, s in c.shapes],
                "bytes": c.bytes,
            }
            for c in largest
        ],
    }


def check_shards(config, cfg: ModelConfig, names) -> None:
    """UsageError unless num_slots and num_pages divide by every mesh's batch shards."""
    rules = tuple(tuple(r) for r in config.rules)
    for name in names:
        n = num_shards(mesh_shape(name), rules, cfg.num_kv_heads)
        for field in ("num_slots", "num_pages"):
            if config.sampling[field] % n:
                raise UsageError(
                    f"--{field}={config.sampling[field]}: a total for the mesh, split "
                    f"over the {n} batch shards of {name}: must divide by {n}"
                )


def measure(config, cfg: ModelConfig, name: str) -> dict:
    """The figures of mesh `name` (see the module docstring)."""
    shape = mesh_shape(name)
    mesh = make_mesh(shape, devices=cpu_devices()[: math.prod(shape.values())])
    rules = tuple(tuple(r) for r in config.rules)
    eos = (cfg.vocab_size - 1,)  # a stand-in end id: no tokenizer here
    graphdef, shapes = abstract_model(cfg)
    shardings = state_shardings(shapes, mesh, rules)
    params = with_shardings(shapes, shardings)
    ecfg = engine_config(config, eos)
    engine = Engine(cfg, graphdef, ecfg, sampling_params(config), mesh=mesh, rules=rules)
    state = _abstract_state(engine)
    row = {
        "mesh": name,
        "shape": {a: shape.get(a, 1) for a in MESH_AXES},
        "shards": engine.num_shards,
        "backend": engine.backend,
        "kv_bytes": _per_device_bytes((state.k_pages, state.v_pages)),
        "kv_scale_bytes": _per_device_bytes(
            [x.scales for x in (*state.k_pages, *state.v_pages) if isinstance(x, QuantPages)]
        ),
    }
    start = time.perf_counter()
    compiled = lower_generate(engine, params).compile()
    row["compile_s"] = time.perf_counter() - start
    decode = engine.abstract_decode_params(params)  # what lower_generate lowered on
    row["per_rollout"] = per_rollout(params, decode, ecfg.weights_dtype, cfg.dtype)
    with contextlib.redirect_stdout(io.StringIO()):  # its printed line: the JSON has the figures
        sample = int(_report("rollout", estimate.from_compiled(compiled)))
    # The rollout phase as launch.dry_run bounds it: beside the optimizer state, and the
    # reference copy when the KL term is on (with LoRA the reference is the base: no copy).
    learner = Learner(learner_config(config, eos), graphdef, shardings, None, rules)
    learner.build_step(params)  # its state_shardings (what lower_step does for --dry_run)
    train = jax.eval_shape(lambda p: TrainState(p, learner.tx.init(learner.split(p)[0]), 0), params)
    opt = _per_device_bytes(with_shardings(train, learner.state_shardings)) - _per_device_bytes(
        params
    )
    ref = _per_device_bytes(params) if config.rl.kl_coef > 0 and not cfg.lora_rank else 0
    # As launch.dry_run: a call on a decode copy holds the copy; the params stay resident.
    resident = opt + (_per_device_bytes(params) if decode is not params else 0)
    row.update(generate_peak_bytes=sample, rollout_peak_bytes=ref + resident + sample)
    row.update(
        collective_figures(
            compiled.as_text(), pool_shapes(engine), ecfg.num_slots, ecfg.steps_per_call
        )
    )
    return row


def bench_mesh(args) -> dict:
    config = load_config_file(args.config)
    fields = ("num_slots", "num_pages", "page_size", "steps_per_call", "weights_layout")
    for field in (*fields, "weights_dtype", "cache_dtype"):
        if getattr(args, field) is not None:
            config.sampling[field] = getattr(args, field)
    shape = dict(SHAPES[args.shape])
    cfg = ModelConfig(**shape, **model_overrides(config))
    ecfg = engine_config(config, (cfg.vocab_size - 1,))
    ecfg.validate()
    check_shards(config, cfg, args.meshes)
    dims = _shape_dims(cfg, ecfg)
    path = os.path.relpath(os.path.abspath(args.config), ROOT)
    r = {
        "shape": args.shape,
        "config": args.config if path.startswith("..") else path,
        "num_slots": ecfg.num_slots,
        "num_pages": ecfg.num_pages,
        "page_size": ecfg.page_size,
        "steps_per_call": ecfg.steps_per_call,
        "pages_per_seq": ecfg.pages_per_seq,
        "cache_dtype": ecfg.cache_dtype,
        "dtype": cfg.dtype,
        "param_dtype": cfg.param_dtype,
        "weights_layout": ecfg.weights_layout,
        "weights_dtype": ecfg.weights_dtype,
        "devices": DEVICES,
        "collisions": collisions(dims, ecfg.num_slots),
        "rows": [],
    }
    print(HEADER, flush=True)
    for name in args.meshes:
        r["rows"].append(measure(config, cfg, name))
        print(table_row(r["rows"][-1]), flush=True)
    return r


HEADER = (
    f"{'mesh':>19s} {'KV GiB':>7s} {'rollout':>8s} {'generate':>8s} | "
    f"{'AR n':>5s} {'AR MB':>8s} {'AG n':>5s} {'AG MB':>7s} {'other n':>7s} {'MB':>6s} "
    f"{'all MB':>8s} | {'all-slot MB':>11s} {'page-loop n':>11s} {'MB':>7s} || "
    f"{'copy GiB':>8s} {'n':>4s} {'MB':>8s}"
)


def table_row(row: dict) -> str:
    s, p, r = row["per_step"], row["page_loop"], row["per_rollout"]
    other = [k for k in hlo.KINDS if k not in ("all-reduce", "all-gather")]
    on = sum(s[k]["count"] for k in other)
    ob = sum(s[k]["bytes"] for k in other)
    return (
        f"{row['mesh']:>19s} {row['kv_bytes'] / GIB:7.2f} {row['rollout_peak_bytes'] / GIB:8.2f} "
        f"{row['generate_peak_bytes'] / GIB:8.2f} | "
        f"{s['all-reduce']['count']:5.0f} {s['all-reduce']['bytes'] / MB:8.2f} "
        f"{s['all-gather']['count']:5.0f} {s['all-gather']['bytes'] / MB:7.2f} "
        f"{on:7.0f} {ob / MB:6.2f} {s['total']['bytes'] / MB:8.2f} | "
        f"{row['all_slot_bytes'] / MB:11.2f} {p['total']['count']:11d} "
        f"{p['total']['bytes'] / MB:7.2f} || {r['copy_bytes'] / GIB:8.2f} "
        f"{r['collectives']['total']['count']:4d} {r['collectives']['total']['bytes'] / MB:8.1f}"
        f"   ({row['compile_s']:.0f} s)"
    )


def table(r: dict) -> str:
    lines = [
        f"{r['shape']} ({r['dtype']}, cache {r['cache_dtype']}), {r['num_slots']} slots, "
        f"{r['num_pages']} pages of {r['page_size']} (totals over each mesh's shards), "
        f"{r['steps_per_call']} steps per call, weights_layout {r['weights_layout']}"
        f"{', weights_dtype ' + r['weights_dtype'] if r['weights_dtype'] else ''}; "
        "GiB per device (KV pool, rollout phase peak, generate call), collectives per "
        "decode step per device (MB = 1e6 bytes); after ||: once per rollout, the decode "
        "copy per device and its reshard's collectives",
        HEADER,
    ]
    lines += [table_row(row) for row in r["rows"]]
    if r["collisions"]:
        lines.append(
            f"note: num_slots={r['num_slots']} equals {', '.join(r['collisions'])}: "
            "all-slot MB may count arrays of those dimensions too"
        )
    return "\n".join(lines)


def main(argv) -> int:
    p = parser("mesh", __doc__)
    p.add_argument("--config", default=CONFIG, help="the run config whose sampler is measured")
    p.add_argument(
        "--shape",
        type=one_of(SHAPES),
        default="qwen2_5_0_5b",
        help=f"model shape: {', '.join(SHAPES)}",
    )
    p.add_argument("--meshes", type=meshes, default=MESHES, help="comma-separated meshes")
    for field in ("num_slots", "num_pages", "page_size", "steps_per_call"):
        p.add_argument(
            f"--{field}",
            type=integer(),
            default=None,
            help=f"sampling.{field} (default: the config's)",
        )
    p.add_argument(
        "--weights_layout",
        type=one_of(WEIGHTS_LAYOUTS),
        default=None,
        help=f"sampling.weights_layout: {', '.join(WEIGHTS_LAYOUTS)} (default: the config's)",
    )
    p.add_argument(
        "--cache_dtype",
        type=one_of(CACHE_DTYPES),
        default=None,
        help=f"sampling.cache_dtype: {', '.join(CACHE_DTYPES)} (default: the config's)",
    )
    p.add_argument(
        "--weights_dtype",
        default=None,
        help="sampling.weights_dtype: '', the model dtype, int8 or float8_e4m3fn (default: "
        "the config's)",
    )
    args = parse(p, argv)
    r = bench_mesh(args)
    return finish(args, r, table(r))
