"""Compiling for a memory estimate on a CPU host: what `--dry_run` and `launch.bench memory` read.

Every backend receives the same SPMD-partitioned program; what follows partitioning is the
backend's own. XLA:CPU runs passes there that no accelerator runs and that change the buffers
and how long they live, so its memory analysis of the program as it compiles it by default
describes XLA:CPU, not the TPU or GPU the estimate is for. `compile` switches those passes off
for the one compile it makes (`compiler_options`, never a process-wide flag: the run's own
programs keep them), `CPU_ONLY_PASSES`:
- `cpu-all-reduce-combiner` merges all-reduces with no byte limit. In a train step it merged
  each weight gradient's all-reduce with the scalar sum of squares of the gradient before it
  (the global norm for clipping), which chained every gradient all-reduce into one sequence
  after the last weight-gradient matmul: every layer's full-size gradient was live at once
  (Qwen2.5-7B shape, 512 tokens a device: 27.2 GiB of temporaries). GPU and TPU combine within
  a byte threshold.
- `float-normalization-bf16` makes XLA:CPU's bf16 dots, scatters and collectives f32 (it has no
  bf16 kernels for them): a bf16 weight gathered for a matmul was gathered and held in f32 and
  in both layouts, a bf16 KV pool converted to f32 around each write (a 0.6B model's rollout
  overstated 2.3x), a bf16 gradient sum widened to f32.
- `all-reduce-promotion`, the same for all-reduces.
Without float normalization XLA:CPU cannot emit a bf16 dot: the compile stops in code generation,
after buffer assignment, so the figures are read from XLA's dumps (to a temporary directory,
removed afterwards) of that buffer assignment, not from a compiled executable: the temporaries
(the preallocated temp allocation), arguments, outputs and aliased bytes as `memory_analysis()`
counts them, the live ranges at the peak (`Estimate.peak`: the buffers live there, largest first,
each named by its instruction, per-device shape and the JAX operation it comes from), and the
program after SPMD partitioning, before any backend pass (`Estimate.partitioned`: the
collectives every backend receives, and in which dtype). A program without bf16 dots compiles.

One rewrite no pass switch restores: GPU and TPU turn an all-reduce whose result is only sliced
into a reduce-scatter (each device gets its shard; the full sum never exists), XLA:CPU never does,
and where its fusion reads the slices inside later fusions (an f32 weight gradient's shard read
by the optimizer update at the end of the step) it keeps every full-size sum alive until then.
`Estimate.accelerator_temp` is the temporaries less what that costs at the peak: XLA's live
ranges swept with each such all-reduce's result counted at its slice's size.

The experts' grouped matmuls (`jax.lax.ragged_dot`, models/moe.py) are the other thing XLA:CPU
lowers as no accelerator does: a dense masked dot over every group, whose [G, M, K] operands it
materialises (Qwen3-30B-A3B on fsdp=4 x expert=2 at 16k tokens a device: f32[64,262144,2048],
128 GiB a buffer, 523 GiB of temporaries in the train step), where TPU's and GPU's grouped matmul
kernels read the sorted rows and the [G, K, N] weights in place and write [M, N]. The programs an
estimate is for are traced within `grouped_matmuls()`, which makes each ragged_dot a loop over
the groups holding what a grouped matmul holds: its operands, its output and one group's product
(the weight gradient: one group's masked rows of the narrower operand, in the operands' dtype:
XLA:CPU would make f32 copies of both whole operands for a bf16 dot with an f32 result, 2 GiB
each at that shape, which a kernel that accumulates in f32 does not). Its FLOPs are G times a
grouped matmul's; it is compiled for the buffers, never run.

What the figures still do not model: the accelerator's own scheduler (the latency-hiding
schedulers of XLA:TPU and XLA:GPU overlap collectives with compute and so keep a gathered weight
or a gradient alive a little longer), its fusion and layouts (XLA:CPU materialises some
intermediates an accelerator fuses away, e.g. a matmul's output before it is added to an
accumulator, and the other way round), allocator fragmentation and the runtime's reserve (a few
hundred MiB on a TPU; JAX on a GPU preallocates 75% of its memory unless
XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise), and anything outside the compiled programs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import math
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # the persistent cache's threshold, as a context

from launch.bench import hlo

CPU_ONLY_PASSES = ("cpu-all-reduce-combiner", "float-normalization-bf16", "all-reduce-promotion")
OPTIONS = {"xla_disable_hlo_passes": ",".join(CPU_ONLY_PASSES)}
GIB, MIB = 2**30, 2**20

# HBM per chip (GiB, as the vendors list it); a figure fits a chip when it is at most FIT of it,
# leaving room for the runtime's reserve and the estimate's error.
CHIPS = (("TPU v5e", 16), ("TPU v6e", 32), ("H100", 80), ("TPU v5p", 95))
FIT = 0.9


def _rows_of(group_sizes, m: int, g):
    """bool [M]: the rows of group g (rows sorted by group, group_sizes [G])."""
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(m)
    return (row >= ends[g] - group_sizes[g]) & (row < ends[g])


def _ragged_dot_loop(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, **_):
    """lhs [M,K] @ rhs [G,K,N] per group -> [M,N], a loop over the G groups."""
    m, dtype = lhs.shape[0], preferred_element_type or jnp.result_type(lhs, rhs)

    def body(g, out):
        y = jnp.dot(lhs, rhs[g], precision=precision, preferred_element_type=dtype)
        return jnp.where(_rows_of(group_sizes, m, g)[:, None], y, out)

    # group 0 outside the loop: the carry then varies over a shard_map's axes as its output does
    return jax.lax.fori_loop(1, rhs.shape[0], body, body(0, jnp.zeros((), dtype)))


def _ragged_dot_general_loop(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, **kw):
    """The weight gradient's form only ([M,K] x [M,N] -> [G,K,N], rows summed per group), a loop
    over the groups; other dimension numbers go to jax's own."""
    dims = ragged_dot_dimension_numbers
    if not (
        tuple(map(tuple, dims.dot_dimension_numbers[0])) == ((0,), (0,))
        and not dims.dot_dimension_numbers[1][0]
        and tuple(dims.lhs_ragged_dimensions) == (0,)
        and not dims.rhs_group_dimensions
    ):
        return _RAGGED[1](lhs, rhs, group_sizes, dims, **kw)
    m, g_count = lhs.shape[0], group_sizes.shape[0]
    dtype = kw.get("preferred_element_type") or jnp.result_type(lhs, rhs)
    narrow = lhs.shape[1] <= rhs.shape[1]  # mask the narrower operand: the smaller copy

    def product(g):
        # In the operands' dtype, then cast: XLA:CPU would otherwise make f32 copies of both
        # whole [M, .] operands for a bf16 x bf16 -> f32 dot (a grouped matmul kernel reads
        # them as they are and accumulates in f32); this loop is never run, so its precision
        # does not matter, only its buffers.
        rows = _rows_of(group_sizes, m, g)[:, None]
        a, b = (jnp.where(rows, lhs, 0), rhs) if narrow else (lhs, jnp.where(rows, rhs, 0))
        return jnp.einsum("MK,MN->KN", a, b).astype(dtype)

    def body(g, out):
        return out.at[g].set(product(g))

    # Group 0's product broadcast, not zeros: a buffer made from constants may be scheduled at
    # the start of the program, every layer's at once (models/order.py); this one waits for
    # its operands.
    first = product(0)
    return jax.lax.fori_loop(1, g_count, body, jnp.broadcast_to(first, (g_count, *first.shape)))


_RAGGED = (jax.lax.ragged_dot, jax.lax.ragged_dot_general)


@contextlib.contextmanager
def grouped_matmuls():
    """Within the block, jax.lax.ragged_dot and ragged_dot_general trace as loops over the groups
    with a grouped matmul's buffers (module docstring), for the memory estimate of the programs
    traced there. Not for programs that are run or exported: jax's caches are cleared on the way
    in and out, so that no trace made within is reused outside, nor one from outside within."""
    jax.clear_caches()
    jax.lax.ragged_dot, jax.lax.ragged_dot_general = _ragged_dot_loop, _ragged_dot_general_loop
    try:
        yield
    finally:
        jax.lax.ragged_dot, jax.lax.ragged_dot_general = _RAGGED
        jax.clear_caches()


_RANGE = re.compile(r"^\s+(\S+?)\{([\d,]*)\}:(\d+)-(\d+)$")
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$")
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),")
_NAME = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass
class Buffer:
    """One buffer live at the peak."""

    name: str  # the instruction that defines it
    index: tuple[int, ...]  # its place in a tuple result (() = the whole result)
    bytes: int
    type: str  # "f32[3584,152064]" (or the instruction's whole type where it is not found)
    op_name: str  # the JAX operation it comes from ("" for what XLA added)

    def describe(self) -> str:
        return f"{self.bytes / GIB:6.2f} GiB {self.type} {self.name} ({short_op(self.op_name)})"


@dataclasses.dataclass
class Estimate:
    """One program's figures per device (bytes), as `memory_analysis()` counts them."""

    args: int
    out: int
    alias: int
    temp: int  # XLA:CPU's temporaries: the size of its preallocated temp allocation
    live_temp: int  # the most bytes of temporaries live at once (no fragmentation)
    accelerator_temp: int  # that, the sums a reduce-scatter would not make taken off
    peak: list[Buffer]  # the temporaries live at accelerator_temp's peak, largest first
    partitioned: str | None  # the HLO after SPMD partitioning (None: one device)
    compiled: object = None  # the executable, where XLA:CPU could generate code for it

    @property
    def total(self) -> int:
        """Arguments + outputs + temporaries - aliased: the call's peak on an accelerator."""
        return self.args + self.out + self.accelerator_temp - self.alias

    def large(self, at_least: int = GIB) -> list[Buffer]:
        return [b for b in self.peak if b.bytes >= at_least]


def compile(lowered) -> Estimate:
    """Compiles `lowered` without CPU_ONLY_PASSES and reads its figures (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="xla_estimate_") as d:
        # A persistent compilation cache (JAX_COMPILATION_CACHE_DIR) ignores the dump options in
        # its keys: a hit would dump nothing. An option of the key that changes nothing (the
        # emitters whose debug info is dumped: none) makes this compile its own, and it is not
        # written to the cache (the dumps are what it is for).
        options = dict(
            OPTIONS,
            xla_dump_to=d,
            xla_dump_hlo_pass_re="spmd-partitioning",
            xla_dump_emitter_re=f"^{os.path.basename(d)}$",
        )
        compiled, failure = None, None
        with jax_config.persistent_cache_min_compile_time_secs(math.inf), _stderr_to(d):
            try:
                compiled = lowered.compile(compiler_options=options)
            except Exception as e:  # noqa: BLE001 (code generation of bf16 dots: see above)
                failure = e
        assignment = _read(d, "*cpu_after_optimizations-buffer-assignment.txt", failure)
        live = _read(d, "*cpu_after_optimizations-live-range.txt", failure)
        optimized = _read(d, "*cpu_after_optimizations.txt", failure)
        partitioned = _read(d, "*after_spmd-partitioning*.txt", None, required=False)
    args, out, alias, temp = allocations(assignment)
    module = hlo.parse(optimized)
    live_temp, accelerator_temp, peak = sweep(
        live, module, temp_values(assignment), reduce_scattered(module)
    )
    return Estimate(
        args, out, alias, temp, live_temp, accelerator_temp, peak, partitioned, compiled
    )


@contextlib.contextmanager
def _stderr_to(directory: str):
    """The process's stderr (file descriptor 2: XLA logs the code generation's failure there,
    with a stack trace) into a file of `directory` for the block; printed if the block raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.path.join(directory, "stderr.txt"), "w+b") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            f.seek(0)
            sys.stderr.write(f.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def from_compiled(compiled) -> Estimate:
    """The figures of a program compiled as usual (XLA:CPU's own passes: its f32 copies, no
    reduce-scatters), from its `memory_analysis()`, without peak buffers."""
    m = compiled.memory_analysis()
    temp = int(m.temp_size_in_bytes)
    return Estimate(
        int(m.argument_size_in_bytes),
        int(m.output_size_in_bytes),
        int(m.alias_size_in_bytes),
        temp,
        temp,
        temp,
        [],
        None,
        compiled,
    )


def _read(directory: str, pattern: str, failure, required: bool = True) -> str | None:
    paths = glob.glob(os.path.join(directory, pattern))
    if not paths and not required:  # e.g. no SPMD partitioning of a one-device program
        return None
    if not paths:
        if failure is not None:  # the compile failed before buffer assignment
            raise failure
        raise RuntimeError(f"XLA wrote no {pattern} to {directory}: the dump this reads changed")
    with open(max(paths, key=os.path.getsize)) as f:  # the module compiled (one per compile)
        return f.read()


def allocations(assignment: str) -> tuple[int, int, int, int]:
    """(arguments, outputs, aliased, temporaries) in bytes from XLA's buffer-assignment dump, as
    `memory_analysis()` counts them: parameter allocations, allocations that may be live out
    (the output tuple's table included), parameters among those, the preallocated temp."""
    args = out = alias = temp = 0
    for line in assignment.splitlines():
        m = _ALLOCATION.match(line)
        if m is None:
            continue
        size, rest = int(m.group(1)), m.group(2)
        is_param, live_out = rest.startswith("parameter "), "maybe-live-out" in rest
        args += size * is_param
        out += size * live_out
        alias += size * (is_param and live_out)
        temp += size * rest.startswith("preallocated-temp")
    return args, out, alias, temp


def _by_name(module: hlo.Module) -> dict[str, hlo.Instruction]:
    return {i.name: i for instructions in module.computations.values() for i in instructions}


def _array(ins: hlo.Instruction | None, index: tuple[int, ...]):
    """(dtype, dims) of the buffer at `index` of an instruction's result, or None."""
    if ins is None:
        return None
    shapes = ins.shapes
    if not index and len(shapes) == 1 and not ins.type.startswith("("):
        return shapes[0]
    if len(index) == 1 and ins.type.startswith("(") and index[0] < len(shapes):
        return shapes[index[0]]  # a flat tuple (nested ones are left out: index only)
    return None


def _type(dtype: str, dims: tuple[int, ...]) -> str:
    return f"{dtype}[{','.join(map(str, dims))}]"


def short_op(op_name: str) -> str:
    """The JAX operation of an op_name, without the jit and loop scaffolding around it."""
    skip = {"while", "body", "cond", "closed_call", "checkpoint", "remat"}
    parts = [p for p in op_name.split("/") if p and p not in skip and not p.startswith("jit(")]
    return "/".join(parts[-2:]) or "-"


def _operands(ins: hlo.Instruction) -> list[str]:
    """The names of an instruction's operands (its text between `opcode(` and the `)`)."""
    at = ins.line.find(f" {ins.opcode}(")
    if at < 0:
        return []
    text, depth = ins.line[at + len(ins.opcode) + 2 :], 1
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return _NAME.findall(text[:i])
    return _NAME.findall(text)


def reduce_scattered(module: hlo.Module) -> dict[str, int]:
    """{all-reduce: the bytes of the slice every user takes of it}: the all-reduces a GPU or TPU
    would make reduce-scatters, those whose every user is a dynamic-slice of the result or a
    fusion that dynamic-slices it (module docstring)."""
    by_name, users = _by_name(module), {}
    for instructions in module.computations.values():
        for ins in instructions:
            for name in _operands(ins) if ins.opcode not in ("parameter", "constant") else ():
                users.setdefault(name, []).append(ins)
    out = {}
    for ins in by_name.values():
        if ins.opcode != "all-reduce" or ins.type.startswith("(") or not ins.shapes:
            continue
        dtype, dims = ins.shapes[0]
        taken = [_slice_of(u, dims, module) for u in users.get(ins.name, [])]
        if taken and all(t is not None for t in taken) and max(taken) < math.prod(dims):
            out[ins.name] = hlo.nbytes([(dtype, ())]) * max(taken)
    return out


def _slice_of(user: hlo.Instruction, dims: tuple[int, ...], module: hlo.Module) -> int | None:
    """Elements of an all-reduce result of `dims` that `user` reads: a dynamic-slice's, or a
    fusion's whose computation dynamic-slices an array of those dims; None for any other use."""
    if user.opcode == "dynamic-slice":
        return math.prod(user.shapes[0][1])
    if user.opcode != "fusion":
        return None
    called = dict(user.calls).get("calls")
    slices = [
        math.prod(i.shapes[0][1])
        for i in module.computations.get(called, [])
        if i.opcode == "dynamic-slice" and _sliced_dims(i, module, called) == dims
    ]
    return max(slices) if slices else None


def _sliced_dims(ins: hlo.Instruction, module: hlo.Module, computation: str):
    operand = _operands(ins)[0]
    for i in module.computations.get(computation, []):
        if i.name == operand and len(i.shapes) == 1:
            return i.shapes[0][1]
    return None


def temp_values(assignment: str) -> dict[tuple[str, str], int]:
    """{(instruction, tuple index): bytes} of the values XLA placed in the preallocated temp
    allocation (its buffer-assignment dump)."""
    out, inside = {}, False
    for line in assignment.splitlines():
        if line.startswith("allocation "):
            inside = "preallocated-temp" in line
            continue
        m = _VALUE.match(line) if inside else None
        if m is not None:
            name, _, index = m.group(1).partition("{")
            key = (name, index.rstrip("}"))
            out[key] = max(out.get(key, 0), int(m.group(2)))
    return out


def sweep(live_ranges: str, module: hlo.Module, temps: dict, sizes: dict[str, int]):
    """(peak, peak with the buffers of `sizes` at those sizes, the buffers live at the second
    peak, largest first) of the temporaries (`temps`, `temp_values`) live at once over XLA's
    schedule (its `BufferLiveRange`s): no fragmentation, unlike the allocation's size."""
    by_name = _by_name(module)
    ranges = []  # (start, end, bytes, adjusted bytes, Buffer)
    for line in live_ranges.splitlines():
        m = _RANGE.match(line)
        if m is None or (m.group(1), m.group(2)) not in temps:
            continue
        name, index = m.group(1), tuple(int(x) for x in m.group(2).split(",") if x)
        size = temps[(name, m.group(2))]
        smaller = min(size, sizes.get(name, size)) if not index else size
        ins = by_name.get(name)
        array = _array(ins, index)
        typ = _type(*array) if array else (ins.type if ins is not None else "?")
        buffer = Buffer(name, index, smaller, typ, ins.op_name if ins is not None else "")
        ranges.append((int(m.group(3)), int(m.group(4)), size, smaller, buffer))
    events: dict[int, list[int]] = {}
    for start, end, size, smaller, _ in ranges:
        for t, sign in ((start, 1), (end + 1, -1)):
            e = events.setdefault(t, [0, 0])
            e[0] += sign * size
            e[1] += sign * smaller
    live, peaks, at = [0, 0], [0, 0], 0
    for t in sorted(events):
        live = [live[0] + events[t][0], live[1] + events[t][1]]
        peaks[0] = max(peaks[0], live[0])
        if live[1] > peaks[1]:
            peaks[1], at = live[1], t
    there = [r[4] for r in ranges if r[0] <= at <= r[1] and r[3]]
    return peaks[0], peaks[1], sorted(there, key=lambda b: -b.bytes)


def gradient_reductions(partitioned: str, shapes: set[tuple[int, ...]]) -> list[hlo.Collective]:
    """The all-reduces and reduce-scatters of the partitioned program whose result has the shape
    of a parameter (whole or one device's shard, `shapes`; its dimensions in any order, as
    autodiff may sum a transposed gradient): the weight gradients' sums across the devices that
    hold the batch's rows. A proxy: an activation of the same dimensions would count too."""
    dims = {tuple(sorted(d)) for d in shapes if d}
    return [
        c
        for c in hlo.collectives(partitioned)
        if c.kind in ("all-reduce", "reduce-scatter")
        and any(tuple(sorted(d)) in dims for _, d in c.shapes)
    ]


def by_dtype(items) -> dict[str, dict[str, int]]:
    """{dtype: {"count", "bytes"}} of collectives' results."""
    out: dict[str, dict[str, int]] = {}
    for c in items:
        for dtype, dims in c.shapes:
            row = out.setdefault(dtype, {"count": 0, "bytes": 0})
            row["count"] += 1
            row["bytes"] += hlo.nbytes([(dtype, dims)])
    return out


def fits(peak: int) -> tuple[list[str], list[str]]:
    """(chips whose HBM holds `peak` bytes within FIT, the others), as "TPU v5e (16 GiB)"."""
    names = [(f"{chip} ({gib} GiB)", peak <= FIT * gib * GIB) for chip, gib in CHIPS]
    return [n for n, ok in names if ok], [n for n, ok in names if not ok]


def slices(devices: int) -> str:
    """The accelerator slices / hosts of `devices` chips, by their product names."""
    return (
        f"TPU v5e-{devices}, TPU v6e-{devices}, TPU v5p-{2 * devices} ({devices} chips; a "
        f"v5p slice is named by its TensorCores), {devices} x H100"
    )
