"""Smoke tests of `python -m launch.bench sampler|loop|learn` on a tiny model and workload (JSON
keys only; the numbers mean nothing at this size). HF is skipped so that it also runs without
torch."""

import json

import pytest

from launch.bench import main


def test_bench_sampler_small(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["sampler", "--small_test", "--no_hf", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["hf_generate_tokens_per_s"] is None
    for key in (
        "tokens_per_s", "compute_floor_fraction_256", "attention_free_fraction_256",
        "peak_pages", "dense_pages",
    ):  # fmt: skip
        assert r[key] > 0, key
    assert r["peak_pages"] <= r["dense_pages"]
    assert "engine / attention-free" in capsys.readouterr().out


@pytest.mark.parametrize("lengths", ["fixed", "skewed"])
def test_bench_loop_quick(tmp_path, capsys, lengths):
    out = tmp_path / "loop.json"
    assert main(["loop", "--quick", "--reps=2", f"--lengths={lengths}", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    keys = ["iteration_seconds", "rollout_seconds", "reference_seconds", "learn_seconds",
            "tokens_per_s"]  # fmt: skip
    if lengths == "skewed":
        keys += ["static_rollout_seconds", "padded_learn_seconds"]
    for key in keys:
        assert r[key] > 0, key
    assert "rollout seconds" in capsys.readouterr().out


def test_bench_learn_quick(tmp_path):
    out = tmp_path / "learn.json"
    assert main(["learn", "--quick", "--reps=1", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in ("tokens_per_s", "flops_per_token", "mfu", "packed_tokens_per_s",
                "padded_tokens_per_s"):  # fmt: skip
        assert r[key] > 0, key
    assert r["packed_rows"] < r["padded_rows"]
