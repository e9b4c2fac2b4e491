"""Smoke tests of `python -m launch.bench sampler|loop|learn` on a tiny model and workload (JSON
keys only; the numbers mean nothing at this size), and of the plots drawn from them. HF is
skipped so that it also runs without torch."""

import json

import pytest

from launch.bench import main


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The four benchmarks of docs/performance.md on the tiny shapes: {name: (path, JSON)}."""
    d = tmp_path_factory.mktemp("bench")
    runs = {
        "sampler": ["sampler", "--small_test", "--no_hf", "--batch_sweep", "2,4"],
        "learn": ["learn", "--quick", "--reps=1"],
        "loop": ["loop", "--quick", "--reps=2"],
        "loop_skewed": ["loop", "--quick", "--reps=2", "--lengths=skewed"],
    }
    out = {}
    for name, args in runs.items():
        path = d / f"{name}.json"
        assert main([*args, "--output", str(path)]) == 0
        out[name] = (path, json.loads(path.read_text()))
    return out


def test_bench_sampler_small(results):
    r = results["sampler"][1]
    assert r["hf_generate_tokens_per_s"] is None
    for key in (
        "tokens_per_s", "compute_floor_fraction_256", "attention_free_fraction_256",
        "peak_pages", "dense_pages",
    ):  # fmt: skip
        assert r[key] > 0, key
    assert r["peak_pages"] <= r["dense_pages"]
    assert [s["num_seqs"] for s in r["batch_sweep"]] == [2, 4]


@pytest.mark.parametrize("name", ["loop", "loop_skewed"])
def test_bench_loop_quick(results, name):
    r = results[name][1]
    keys = ["iteration_seconds", "rollout_seconds", "reference_seconds", "learn_seconds",
            "tokens_per_s"]  # fmt: skip
    if name == "loop_skewed":
        keys += ["static_rollout_seconds", "padded_learn_seconds"]
    for key in keys:
        assert r[key] > 0, key


def test_bench_learn_quick(results):
    r = results["learn"][1]
    for key in ("tokens_per_s", "flops_per_token", "mfu", "packed_tokens_per_s",
                "padded_tokens_per_s"):  # fmt: skip
        assert r[key] > 0, key
    assert r["packed_rows"] < r["padded_rows"]


def test_plots(results, tmp_path):
    pytest.importorskip("matplotlib")
    from launch.bench_plots import main as plots

    files = [f"--{name}={results[name][0]}" for name in results]
    assert plots([*files, f"--out={tmp_path}"]) == 0
    for name in ("sampler_batch.png", "learner_packing.png", "iteration_split.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG", name
