"""`launch.bench loop --lengths skewed --num_slots N [--num_pages P]` (launch/bench/capacity.py):
KV pages on demand against budget reservation on one pool, tiny shape. The figures of record
come from the bench-small run (docs/performance.md)."""

import json

from launch.bench import main


def test_capacity_bench_compares_demand_with_budget(tmp_path):
    out = tmp_path / "capacity.json"
    argv = ["loop", "--quick", "--lengths=skewed", "--num_slots=8", "--reps=1", f"--output={out}"]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert (r["num_slots"], r["num_pages"], r["budget_tokens"]) == (8, 21, 32)
    assert r["pool_full_budgets"] == 2.0  # the pool holds 2 sequences' whole budget
    b, d = r["budget"], r["demand"]
    # Budget reservation admits one group of 2 at a time: at most 2 sequences decode together.
    assert 1 <= b["mean_concurrency"] <= 2 and b["preemptions"] == 0
    assert d["mean_concurrency"] > b["mean_concurrency"]
    assert r["concurrency_ratio"] == d["mean_concurrency"] / b["mean_concurrency"]
    assert r["tokens_equal"]  # each sample stopped at its drawn length, with the same tokens


def test_capacity_bench_bad_flags():
    assert main(["loop", "--quick", "--num_slots=8"]) == 2  # needs --lengths skewed
    assert main(["loop", "--quick", "--lengths=skewed", "--num_pages=5"]) == 2  # < one group
    assert main(["loop", "--quick", "--lengths=skewed", "--num_slots=0"]) == 2
