"""Smoke test of `python -m launch.bench sampler` on a tiny model and workload (JSON keys only;
the numbers mean nothing at this size). HF is skipped so that it also runs without torch."""

import json

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
