"""`python -m launch.bench mesh` on the tiny shape (compiled only, nothing runs; the real figures
come from the bench's own run, docs/performance.md), and `launch.bench.hlo`, the HLO reader it
counts collectives with, on small programs whose collectives are known.

The facts asserted are those of issue 34's per-shard pools (sampling/partitioned.py) and decode
layout (`sampling.weights_layout`). At d91e85b the pool was replicated over data and fsdp (KV
bytes per device the same on every mesh), tensor=2 all-reduced page blocks inside the page loop,
and every step all-reduced partial sums of all slots (the logits [B, V] among them); those
figures are kept in docs/bench/*_d91e85b_baseline.json."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from launch.bench import hlo, main
from launch.bench.common import SHAPES
from models.config import ModelConfig
from models.sharding import abstract_model, make_mesh
from tests.conftest import ROOT

SLOTS, PAGES, STEPS = 24, 64, 4  # 24: no tiny dimension (or a device's share of one) equals it


def _argv(path, meshes, layout):
    return ["mesh", "--shape=tiny", f"--meshes={meshes}", f"--num_slots={SLOTS}",
            f"--num_pages={PAGES}", f"--steps_per_call={STEPS}", f"--weights_layout={layout}",
            f"--output={path}"]  # fmt: skip


@pytest.fixture(scope="module")
def _runs(tmp_path_factory):
    """Both bench runs (`python -m launch.bench mesh ...`, one per weights layout) in one
    subprocess, one interpreter start and JAX initialisation for the two, compiled with XLA:CPU's
    default fusion emitters, which the tests turn off in their own processes (tests/conftest.py):
    without them XLA expands the pool's scatters into while loops of its own, and the loop
    structure read here would not be that of the figures in docs/performance.md."""
    d = tmp_path_factory.mktemp("mesh")
    runs = {"tensor": "fsdp1,fsdp8,fsdp4xtensor2", "training": "fsdp8"}
    argvs = [_argv(d / f"{layout}.json", meshes, layout) for layout, meshes in runs.items()]
    code = ("import sys\nfrom launch.bench import main\n"
            f"for argv in {argvs!r}:\n    if main(argv):\n        sys.exit(1)\n")  # fmt: skip
    flags = os.environ["XLA_FLAGS"].replace("--xla_cpu_use_fusion_emitters=false", "")
    env = dict(os.environ, XLA_FLAGS=flags)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = {}
    for layout in runs:
        r = json.loads((d / f"{layout}.json").read_text())
        results[layout] = r, {row["mesh"]: row for row in r["rows"]}
    return results


@pytest.fixture(scope="module")
def bench(_runs):
    return _runs["tensor"]


@pytest.fixture(scope="module")
def training(_runs):
    return _runs["training"]


@pytest.mark.slow  # the benchmark on two meshes (module fixture, ~10 s)
def test_bench_mesh_json(bench):
    r, rows = bench
    assert (r["shape"], r["num_slots"], r["num_pages"], r["steps_per_call"]) == (
        "tiny",
        SLOTS,
        PAGES,
        STEPS,
    )
    assert r["config"] == "configs/qwen2_5_0_5b_code_32k.py" and r["cache_dtype"] == "bfloat16"
    assert r["weights_layout"] == "tensor" and r["collisions"] == []
    assert list(rows) == ["fsdp1", "fsdp8", "fsdp4xtensor2"]
    assert rows["fsdp4xtensor2"]["shape"] == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    # The shards: data x fsdp (tensor splits the 2 KV heads, not the pool's pages).
    assert {k: row["shards"] for k, row in rows.items()} == {"fsdp1": 1, "fsdp8": 8,
                                                             "fsdp4xtensor2": 4}  # fmt: skip
    t = SHAPES["tiny"]
    for name, row in rows.items():
        tensor, shards = row["shape"]["tensor"], row["shards"]
        # Each device: its shard's PAGES / shards pages of its KV heads (K / tensor).
        kv = t["num_layers"] * t["num_kv_heads"] // tensor * PAGES // shards * 32 * t["head_dim"]
        assert row["kv_bytes"] == kv * 2 * 2, name  # k and v, bf16
        assert row["generate_peak_bytes"] >= row["kv_bytes"] > 0  # the pool is an argument
        assert row["rollout_peak_bytes"] > row["generate_peak_bytes"]  # + the optimizer state
        assert row["page_loops"] == t["num_layers"], name  # blockwise: one per layer
        # Nothing inside the page loop is a collective, at tensor=1 and 2 (a shard_map).
        assert row["page_loop"]["total"] == {"count": 0, "bytes": 0}, name
        assert row["page_loop_collectives"] == []
        for kind in (*hlo.KINDS, "total"):
            step, inside, out = (row[k][kind] for k in ("per_step", "decode_loop", "outside"))
            assert step["count"] == inside["count"] + out["count"] / STEPS
            assert step["bytes"] == inside["bytes"] + out["bytes"] / STEPS
    one = rows["fsdp1"]
    assert one["per_step"]["total"]["count"] == 0 and one["all_slot_bytes"] == 0
    for name in ("fsdp8", "fsdp4xtensor2"):
        row = rows[name]
        # Each device computes its own slots' rows: no partial sums or logits of all slots, and
        # each slot's sampled token and log-prob is written into the [B, max_new] buffers where
        # the slot lies (no scatter gathering every slot's indices): no array of the total slot
        # count crosses devices. What a step still sends are the loop test's `active.any()`
        # (1 byte) and, at tensor=2, the head-split attention's partial sums of its own slots.
        assert row["all_slot_shapes"] == [] and row["all_slot_bytes"] == 0, name
    assert rows["fsdp8"]["per_step"]["total"] == {"count": 1, "bytes": 1}


@pytest.mark.slow  # the benchmark on two meshes (module fixture, ~10 s)
def test_bench_mesh_per_rollout(bench, training):
    _, rows = bench
    n = sum(x.size for x in jax.tree.leaves(abstract_model(ModelConfig(**SHAPES["tiny"]))[1]))
    # weights_layout "tensor": a bf16 copy; tensor=1 replicates it (2 bytes a parameter per
    # device), and tensor=2 splits some of it.
    assert rows["fsdp1"]["per_rollout"]["copy_bytes"] == 2 * n  # a cast, nothing moves
    assert rows["fsdp1"]["per_rollout"]["collectives"]["total"]["count"] == 0
    assert rows["fsdp8"]["per_rollout"]["copy_bytes"] == 2 * n
    assert n < rows["fsdp4xtensor2"]["per_rollout"]["copy_bytes"] < 2 * n
    for name in ("fsdp8", "fsdp4xtensor2"):
        c = rows[name]["per_rollout"]["collectives"]
        # The reshard gathers each weight over fsdp, once per rollout: at most the copy's bytes
        # (x 2: XLA:CPU sends bf16 as f32), and none of it in the generate call.
        assert c["all-gather"]["count"] > 0, name
        assert 0 < c["total"]["bytes"] <= 2 * rows[name]["per_rollout"]["copy_bytes"], name
    # "training": the call decodes from the params themselves (no copy, no reshard), and every
    # step all-reduces partial sums of all slots, the logits [24, 1, V] among them.
    _, old = training
    t, new = old["fsdp8"], rows["fsdp8"]
    assert (
        t["per_rollout"]["copy_bytes"] == 0
        and t["per_rollout"]["collectives"]["total"]["count"] == 0
    )
    assert f"all-reduce f32[{SLOTS},1,{SHAPES['tiny']['vocab_size']}]" in {
        a["array"] for a in t["all_slot_shapes"]
    }
    assert t["page_loop"]["total"]["count"] == 0
    # No weight moves in the generate call: a step's collectives are < 2% of the reshard's.
    assert (
        new["per_step"]["total"]["bytes"] * 50 < new["per_rollout"]["collectives"]["total"]["bytes"]
    )
    # The decode layout: per-step collective bytes fall by more than 10x.
    assert new["per_step"]["total"]["bytes"] * 10 < t["per_step"]["total"]["bytes"]
    assert new["all_slot_bytes"] * 10 < t["all_slot_bytes"]
    # The copy sits beside the resident params in the rollout phase.
    assert new["rollout_peak_bytes"] - new["generate_peak_bytes"] > (
        t["rollout_peak_bytes"] - t["generate_peak_bytes"]
    )


def test_bench_mesh_bad_mesh():
    assert main(["mesh", "--meshes=fsdp16"]) == 2  # more devices than the bench has
    # A pool that does not split over fsdp8's 8 shards, refused before anything compiles.
    assert main(["mesh", "--shape=tiny", "--meshes=fsdp2,fsdp8", "--num_pages=68"]) == 2
    assert main(["mesh", "--shape=tiny", "--weights_layout=replicated"]) == 2
    assert main(["mesh", "--meshes=fsdp2xfsdp2"]) == 2
    assert main(["mesh", "--meshes=fsdp8,fsdp8"]) == 2


def _loops(x, n):
    """On each device: an outer loop of n trips, each a psum of the carry and an inner loop of
    n trips with an all-gather in it; one psum after the loops."""

    def inner(_, c):
        return c + jax.lax.all_gather(c, "fsdp").sum(0)

    def outer(_, c):
        c = jax.lax.psum(c * 2.0, "fsdp") / 8.0  # depends on the carry: not hoisted
        return jax.lax.fori_loop(0, n, inner, c)

    return jax.lax.psum(jax.lax.fori_loop(0, n, outer, x), "fsdp")


def test_hlo_collectives_in_nested_loops():
    mesh = make_mesh({"fsdp": 8})
    f = jax.shard_map(_loops, mesh=mesh, in_specs=(P("fsdp"), P()), out_specs=P(), check_vma=False)
    x = jax.ShapeDtypeStruct((8 * 4, 16), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    n = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    text = jax.jit(f).lower(x, n).compile().as_text()
    module = hlo.parse(text)
    loops = {w.name: w for w in hlo.while_loops(module)}
    outer = [w for w in loops.values() if w.depth == 1]
    inner = [w for w in loops.values() if w.depth == 2]
    assert len(outer) == 1 and len(inner) == 1, [(w.name, w.depth) for w in loops.values()]
    assert inner[0].loops == (outer[0].name,)
    assert ("f32", (4, 16)) in outer[0].shapes  # its state: the per-device carry
    found = hlo.collectives(module)
    by_depth = {d: [c for c in found if len(c.loops) == d] for d in (0, 1, 2)}
    # The psum after the loops, the one in the outer loop, the all-gather in the inner one.
    assert [c.kind for c in by_depth[0]] == ["all-reduce"], by_depth
    assert [c.kind for c in by_depth[1]] == ["all-reduce"], by_depth
    assert [c.kind for c in by_depth[2]] == ["all-gather"], by_depth
    assert by_depth[1][0].loops == (outer[0].name,)
    assert by_depth[2][0].loops == (outer[0].name, inner[0].name)
    assert by_depth[1][0].bytes == 4 * 16 * 4  # one device's [4,16] f32
    assert by_depth[2][0].shapes == [("f32", (8, 4, 16))]  # the gathered result
    s = hlo.summarize(found)
    assert s["all-reduce"] == {"count": 2, "bytes": 2 * 4 * 16 * 4}
    assert s["all-gather"] == {"count": 1, "bytes": 8 * 4 * 16 * 4}
    assert s["total"]["count"] == 3 and s["reduce-scatter"]["count"] == 0


TEXT = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[32]{0}}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %ars = f32[4]{0} all-reduce-start(%x), channel_id=1, to_apply=%add
  %ard = f32[4]{0} all-reduce-done(%ars)
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %ard)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4]) -> f32[32] {
  %a = f32[4]{0} parameter(0)
  %w = (s32[], f32[4]{0}) while(%t0), condition=%cond, body=%body, metadata={op_name="jit(f)/while"}
  %ags = ((f32[4]{0}), bf16[8,4]{1,0}) all-gather-start(%a), channel_id=2, dimensions={0}
  %agd = bf16[8,4]{1,0} all-gather-done(%ags)
  ROOT %cp = f32[32]{0} collective-permute(%b), channel_id=3, source_target_pairs={{0,1}}
}
"""


def test_hlo_async_forms_and_tuples():
    module = hlo.parse(TEXT)
    assert module.entry == "main"
    (w,) = hlo.while_loops(module)
    assert (w.body, w.condition, w.op_name, w.depth) == ("body", "cond", "jit(f)/while", 1)
    assert w.shapes == [("s32", ()), ("f32", (4,))]
    found = {c.name: c for c in hlo.collectives(module)}
    assert set(found) == {"ars", "ags", "cp"}  # the -done halves are not counted again
    assert (found["ars"].kind, found["ars"].loops, found["ars"].bytes) == ("all-reduce", ("w",), 16)
    assert (found["ags"].kind, found["ags"].shapes) == ("all-gather", [("bf16", (8, 4))])
    assert (found["cp"].kind, found["cp"].loops, found["cp"].bytes) == (
        "collective-permute",
        (),
        128,
    )
    assert hlo.nbytes([("pred", (3,)), ("s4", (2,)), ("c64", ())]) == 3 + 2 + 8


def test_hlo_needs_an_entry():
    with pytest.raises(ValueError, match="no ENTRY"):
        hlo.parse("HloModule m\n")


def test_hlo_replica_groups_in_each_form():
    """The device groups of each spelling XLA prints, and whether they span two hosts."""
    cp = "%c = s32[2,1,1] collective-permute(%x), source_target_pairs={{0,0},{1,2},{2,1},{7,7}}, "
    assert hlo.replica_groups(cp + 'metadata={op_name="g"}') == [[0, 0], [1, 2], [2, 1], [7, 7]]
    assert hlo.replica_groups("all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%a") == [
        [0, 1],
        [2, 3],
    ]
    iota = "all-gather(%x), replica_groups=[4,2]<=[2,2,2]T(1,0,2), dimensions={0}"
    assert hlo.replica_groups(iota) == [[0, 1], [4, 5], [2, 3], [6, 7]]
    named = "all-reduce(%x), replica_groups=mesh['a'=2,'b'=4] {'a'}, to_apply=%add"
    assert hlo.replica_groups(named) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo.replica_groups("all-reduce(%x), to_apply=%add") is None
    host = lambda d: d // 4  # devices 0-3 on one host, 4-7 on the other
    c = lambda line: hlo.Collective("x", "c", "main", [], (), "", hlo.replica_groups(line))
    assert not c(cp).spans(host) and not c(iota).spans(host) and c(named).spans(host)
    assert c("all-reduce(%x), to_apply=%add").spans(host)  # no groups: every device
