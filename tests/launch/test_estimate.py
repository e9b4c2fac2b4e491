"""`launch.estimate`, what `--dry_run` and `launch.bench memory` compile with: XLA:CPU's
all-reduce combiner and float normalization off for its compiles only (the process's own
compiles keep them), the figures read from XLA's buffer assignment equal to `memory_analysis()`
where XLA:CPU can generate the code, a bf16 program's buffers kept bf16 where it cannot, the
temporaries live at the peak named with their shapes and operations, sliced all-reduces counted
as reduce-scatters, the gradient reductions of a partitioned program picked out, and the chips a
figure fits."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from launch import estimate
from launch.bench import hlo
from models.sharding import make_mesh

GIB = 2**30


def _chained_all_reduces():
    """Four gradient-like all-reduces, each followed by the scalar sum of squares of the one
    before (the global norm's pattern): what cpu-all-reduce-combiner chains into one."""
    mesh = make_mesh({"fsdp": 8}, devices=jax.devices()[:8])
    rows, full = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())

    def f(x, ws):
        out, norm = [], 0.0
        for w in ws:  # each gradient summed over the rows' devices, kept as its shard
            g = jax.lax.with_sharding_constraint(jnp.einsum("bd,df->df", x, w), rows)
            norm = norm + jnp.sum(g * g)
            out.append(g)
        return out, norm

    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=rows)
    ws = [jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=full)] * 4
    return jax.jit(f).lower(x, ws)


def _count(text: str, opcode: str) -> int:
    return sum(1 for line in text.splitlines() if f" {opcode}(" in line and "=" in line)


def test_the_combiner_is_off_for_the_estimate_only():
    lowered = _chained_all_reduces()
    compiled = lowered.compile()
    default = compiled.as_text()
    est = estimate.compile(lowered)
    # the default pipeline merges them (fewer all-reduce instructions, tuple-shaped);
    # the estimate's keeps one per gradient and one per scalar
    assert _count(est.compiled.as_text(), "all-reduce") >= 8 > _count(default, "all-reduce")
    assert estimate.OPTIONS == {
        "xla_disable_hlo_passes": "cpu-all-reduce-combiner,"
        "float-normalization-bf16,all-reduce-promotion"
    }
    again = lowered.compile().as_text()  # nothing process-wide changed
    assert _count(again, "all-reduce") == _count(default, "all-reduce")
    # the figures read from the buffer assignment are memory_analysis()'s
    m = est.compiled.memory_analysis()
    assert (est.args, est.out, est.alias, est.temp) == (
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.alias_size_in_bytes,
        m.temp_size_in_bytes,
    )
    # each gradient is summed in full, then sliced to its shard: what a GPU or TPU turns into a
    # reduce-scatter (an eighth of the sum on each device)
    assert len(estimate.reduce_scattered(hlo.parse(est.compiled.as_text()))) == 4
    assert est.accelerator_temp <= est.live_temp <= est.temp


def test_a_bf16_program_stays_bf16():
    """XLA:CPU computes a bf16 dot in f32 and cannot emit one without its float normalization:
    the estimate reads the buffer assignment of the bf16 program (no f32 copy of the operands)."""

    def f(a, b):
        return jnp.tanh(a @ b) @ b.T  # bf16 [1024, 1024] operands and results

    s = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    lowered = jax.jit(f).lower(s, s)
    est, default = estimate.compile(lowered), lowered.compile()
    assert est.compiled is None  # no code: the figures come from the dump
    assert est.args == 2 * 1024 * 1024 * 2 and est.out == 1024 * 1024 * 2
    types = {b.type for b in est.peak}
    assert "bf16[1024,1024]" in types and "f32[1024,1024]" not in types, types
    assert est.temp < default.memory_analysis().temp_size_in_bytes


def test_the_peak_buffers_are_named_with_their_shape_and_operation():
    def f(a):  # a bf16 [4096, 4096]
        c = jnp.exp(a.astype(jnp.float32))  # f32 copies of it: 64 MiB each, live at the peak
        return (jnp.sort(c, axis=0) * c).sum(0)

    lowered = jax.jit(f).lower(jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16))
    est = estimate.compile(lowered)
    assert est.temp >= 128 * 2**20 and est.live_temp == est.accelerator_temp
    f32 = [b for b in est.peak if b.type == "f32[4096,4096]"]
    assert sorted(estimate.short_op(b.op_name) for b in f32) == ["exp", "sort"], f32
    assert all(b.bytes == 4096 * 4096 * 4 for b in f32)
    assert est.peak[0].bytes == max(b.bytes for b in est.peak)  # largest first
    assert est.large(at_least=60 * 2**20) == [b for b in est.peak if b.bytes >= 60 * 2**20]
    assert f32[0].describe().startswith("  0.06 GiB f32[4096,4096] "), f32[0].describe()
    assert est.partitioned is None  # one device: no SPMD partitioning


def test_short_op_drops_the_scaffolding():
    name = "jit(_step_impl)/while/body/closed_call/transpose(jvp(BTD,DF->BTF))/dot_general"
    assert estimate.short_op(name) == "transpose(jvp(BTD,DF->BTF))/dot_general"
    assert estimate.short_op("") == "-"


def test_gradient_reductions_are_the_parameter_shaped_ones():
    text = """HloModule m

ENTRY %main (p: f32[64,32]) -> f32[32,16] {
  %p = f32[64,32]{1,0} parameter(0)
  %a = f32[32,16]{1,0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
  %b = bf16[4,16]{1,0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
  %c = f32[] all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
  ROOT %d = bf16[32,16]{1,0} all-gather(%p), replica_groups={{0,1}}, dimensions={0}
}
"""
    grads = estimate.gradient_reductions(text, {(32, 16), (4, 16)})
    assert [c.name for c in grads] == ["a", "b"]
    assert estimate.by_dtype(grads) == {
        "f32": {"count": 1, "bytes": 32 * 16 * 4},
        "bf16": {"count": 1, "bytes": 4 * 16 * 2},
    }


def test_fits_and_slices():
    ok, no = estimate.fits(int(20 * GIB))
    assert ok == ["TPU v6e (32 GiB)", "H100 (80 GiB)", "TPU v5p (95 GiB)"]
    assert no == ["TPU v5e (16 GiB)"]
    assert estimate.fits(int(14.5 * GIB))[1] == ["TPU v5e (16 GiB)"]  # over 90% of 16 GiB
    assert estimate.fits(int(14.0 * GIB))[1] == []
    assert estimate.fits(int(90 * GIB)) == (
        [],
        ["TPU v5e (16 GiB)", "TPU v6e (32 GiB)", "H100 (80 GiB)", "TPU v5p (95 GiB)"],
    )
    assert "TPU v5e-8" in estimate.slices(8) and "TPU v5p-16" in estimate.slices(8)


def test_grouped_matmuls_trace_as_a_loop_with_a_grouped_matmuls_buffers():
    """Within estimate.grouped_matmuls() ragged_dot and the weight gradient's ragged_dot_general
    (models/moe.py's forms) give jax's values, padding rows past the groups zero, and hold no
    [G, M, K] buffer (XLA:CPU's own lowering does); outside it jax's own functions are back."""
    import numpy as np

    from models.moe import _DW

    rng = np.random.default_rng(0)
    m, k, n, g = 512, 64, 32, 16
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((g, k, n)).astype(np.float32)
    ct = rng.standard_normal((m, n)).astype(np.float32)
    sizes = jnp.asarray(rng.multinomial(480, np.ones(g) / g), jnp.int32)  # 32 padding rows
    fwd = lambda x, w, s: jax.lax.ragged_dot(x, w, s)
    dw = lambda x, c, s: jax.lax.ragged_dot_general(x, c, s, _DW)
    want = (fwd(x, w, sizes), dw(x, ct, sizes))
    with estimate.grouped_matmuls():
        got = (jax.jit(fwd)(x, w, sizes), jax.jit(dw)(x, ct, sizes))
        loop = estimate.compile(jax.jit(fwd).lower(x, w, sizes))
    assert jax.lax.ragged_dot is estimate._RAGGED[0]  # restored
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    assert not np.asarray(got[0][480:]).any()
    dense = estimate.compile(jax.jit(fwd).lower(x, w, sizes))
    group_buffer = g * m * k * 4  # XLA:CPU's dense lowering's [G, M, K] operand
    assert dense.temp >= group_buffer > 4 * loop.temp, (dense.temp, loop.temp)
