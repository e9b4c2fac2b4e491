"""`python -m launch.bench mesh` on the tiny shape (compiled only, nothing runs; the real figures
come from the bench's own run, docs/performance.md), and `launch.bench.hlo`, the HLO reader it
counts collectives with, on small programs whose collectives are known.

Two of the bench's assertions are facts of the replicated page pool (d91e85b), which issue 34's
per-shard pools change on purpose: the KV bytes per device (then also / (data x fsdp)) and the
tensor=2 collective inside the page loop (then none). Each is marked where it is asserted."""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from launch.bench import hlo, main
from launch.bench.common import SHAPES
from models.sharding import make_mesh

SLOTS, PAGES, STEPS = 24, 64, 4  # 24: no tiny dimension (or a device's share of one) equals it


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    path = tmp_path_factory.mktemp("mesh") / "mesh.json"
    argv = ["mesh", "--shape=tiny", "--meshes=fsdp1,fsdp8,fsdp4xtensor2", f"--num_slots={SLOTS}",
            f"--num_pages={PAGES}", f"--steps_per_call={STEPS}", f"--output={path}"]  # fmt: skip
    assert main(argv) == 0
    return json.loads(path.read_text())


def test_bench_mesh_json(bench):
    r = bench
    assert (r["shape"], r["num_slots"], r["num_pages"], r["steps_per_call"]) == (
        "tiny",
        SLOTS,
        PAGES,
        STEPS,
    )
    assert r["config"] == "configs/qwen2_5_0_5b_code_32k.py" and r["cache_dtype"] == "bfloat16"
    assert r["collisions"] == []
    rows = {row["mesh"]: row for row in r["rows"]}
    assert list(rows) == ["fsdp1", "fsdp8", "fsdp4xtensor2"]
    assert rows["fsdp4xtensor2"]["shape"] == {"data": 1, "fsdp": 4, "tensor": 2}
    t = SHAPES["tiny"]
    for name, row in rows.items():
        tensor = row["shape"]["tensor"]
        # Replicated over data and fsdp, split over tensor (d91e85b; per-shard pools: / shards).
        kv = t["num_layers"] * t["num_kv_heads"] // tensor * PAGES * 32 * t["head_dim"] * 2 * 2
        assert row["kv_bytes"] == kv, name
        assert row["generate_peak_bytes"] >= row["kv_bytes"] > 0  # the pool is an argument
        assert row["rollout_peak_bytes"] > row["generate_peak_bytes"]  # + the optimizer state
        assert row["page_loops"] == t["num_layers"], name  # blockwise: one per layer
        for kind in (*hlo.KINDS, "total"):
            step, inside, out = (row[k][kind] for k in ("per_step", "decode_loop", "outside"))
            assert step["count"] == inside["count"] + out["count"] / STEPS
            assert step["bytes"] == inside["bytes"] + out["bytes"] / STEPS
    one = rows["fsdp1"]
    assert one["per_step"]["total"]["count"] == 0 and one["all_slot_bytes"] == 0
    for name in ("fsdp8", "fsdp4xtensor2"):
        row = rows[name]
        # Every decode step all-reduces partial sums of all slots, the logits [24, V / tensor]
        # among them (contracted over the fsdp-split model dimension).
        assert row["decode_loop"]["all-reduce"]["count"] > 0, name
        assert row["decode_loop"]["total"]["bytes"] >= row["all_slot_bytes"] > 0, name
        logits = f"all-reduce f32[{SLOTS},1,{t['vocab_size'] // row['shape']['tensor']}]"
        assert logits in {a["array"] for a in row["all_slot_shapes"]}, (
            name,
            row["all_slot_shapes"],
        )
    assert rows["fsdp8"]["page_loop"]["total"]["count"] == 0
    # tensor=2: the page gather of the replicated pool is an all-reduce per block of pages
    # (d91e85b; per-shard pools remove it).
    pl = rows["fsdp4xtensor2"]["page_loop"]["total"]
    assert pl["count"] > 0 and pl["bytes"] > 0
    assert len(rows["fsdp4xtensor2"]["page_loop_collectives"]) == pl["count"]


def test_bench_mesh_bad_mesh():
    assert main(["mesh", "--meshes=fsdp16"]) == 2  # more devices than the bench has
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
