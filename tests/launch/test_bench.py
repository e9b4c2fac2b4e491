"""Smoke tests of `python -m launch.bench sampler|loop|learn` on a tiny model and workload (JSON
keys only; the numbers mean nothing at this size), and of the plots drawn from them. HF is
skipped so that it also runs without torch. The roofline sampler bench (`--shape`) is checked
against a byte count recomputed here from the shape."""

import json

import pytest

from launch.bench import main

pytestmark = pytest.mark.slow  # the benchmarks end to end


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The four benchmarks of docs/performance.md on the tiny shapes: {name: (path, JSON)}."""
    d = tmp_path_factory.mktemp("bench")
    runs = {
        "sampler": ["sampler", "--small_test", "--no_hf", "--batch_sweep", "2,4"],
        "learn": ["learn", "--quick", "--reps=1"],
        # One timed iteration after the warm-up (two before): the keys are what is checked.
        "loop": ["loop", "--quick", "--reps=1"],
        "loop_skewed": ["loop", "--quick", "--reps=1", "--lengths=skewed"],
        "loop_partial": [
            "loop",
            "--quick",
            "--reps=1",
            "--lengths=skewed",
            "--partial_rollouts",
            "--max_staleness=1",
        ],
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


def test_bench_loop_partial_quick(results):
    r = results["loop_partial"][1]
    for name in ("sync", "partial"):
        for key in ("iteration_seconds", "rollout_seconds", "learned_tokens_per_s"):
            assert r[name][key] > 0, (name, key)
        assert 0 < r[name]["slot_utilization"] <= 1
        trace = r[name]["utilization_trace"]
        assert trace and all(0 <= u <= 1 for u in trace)
    assert r["rollout_speedup"] > 0 and r["learned_tokens_speedup"] > 0
    assert r["slot_step_speedup"] > 0
    assert 1 <= r["learned_tokens_speedup_at_utilization_1"] <= 1 / r["sync"]["slot_utilization"]


def test_bench_learn_quick(results):
    r = results["learn"][1]
    for key in ("tokens_per_s", "flops_per_token", "mfu", "packed_tokens_per_s",
                "padded_tokens_per_s"):  # fmt: skip
        assert r[key] > 0, key
    assert r["packed_rows"] < r["padded_rows"]


def test_plots(results, tmp_path):
    pytest.importorskip("matplotlib")
    from launch.bench.plots import main as plots

    files = [f"--{name}={results[name][0]}" for name in results if name != "loop_partial"]
    files.append(f"--partial={results['loop_partial'][0]}")
    assert plots([*files, f"--out={tmp_path}"]) == 0
    for name in ("sampler_batch.png", "learner_packing.png", "iteration_split.png",
                 "partial_utilization.png"):  # fmt: skip
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG", name


@pytest.fixture(scope="module")
def roofline(tmp_path_factory):
    """JSON of the roofline sampler bench on the tiny shape, 4 sequences (2 prompts x 2)."""
    path = tmp_path_factory.mktemp("roofline") / "sampler_shape.json"
    args = ["sampler", "--shape=tiny", "--num_seqs=4", "--num_samples=2", "--prompt_len=8",
            "--new_tokens=8", "--steps_per_call=4", "--page_size=4", "--reps=1",
            "--decode_copy"]  # fmt: skip
    assert main([*args, "--output", str(path)]) == 0
    return json.loads(path.read_text())


def test_bench_sampler_shape_tiny(roofline):
    r = roofline
    assert r["shape"] == "tiny" and r["dtype"] == "float32" and r["num_seqs"] == 4
    assert r["tokens_per_s"] > 0
    # Independently of the bench's param_count: qwen2 with qkv bias, tied, f32.
    m = r["model"]
    v, d, f, n, k, h = (m[x] for x in ("vocab_size", "d_model", "d_ff", "num_heads",
                                        "num_kv_heads", "head_dim"))  # fmt: skip
    layer = 2 * d * n * h + 2 * d * k * h + n * h + 2 * k * h + 3 * d * f + 2 * d
    params = v * d + m["num_layers"] * layer + d
    assert r["params"] == params
    kv = 4 * (8 + 7 / 2) * m["num_layers"] * k * h * 2 * 4  # B x mean len x L x K x H x 2 x f32
    total = params * 4 + kv + 4 * v * 4
    assert r["bytes_per_step"]["total"] == pytest.approx(total, rel=1e-12)
    achieved = total * 8 / r["seconds"]  # 8 decode steps in the run
    assert r["hbm_fraction_measured"] == pytest.approx(achieved / r["copy_bytes_per_s"])
    assert 0 < r["hbm_fraction_measured"] <= 1
    assert r["table_bytes_per_s"] is None and r["hbm_fraction_table"] is None  # CPU
    # --decode_copy on CPU: f32 masters and an f32 copy (the decode dtype), both timed.
    c = r["decode_copy"]
    assert c["extra_bytes"] == params * 4 and c["tokens_per_s_masters"] > 0
    assert c["tokens_per_s_copy"] == pytest.approx(r["tokens_per_s"])


def test_bench_quant_qwen2_fixture(tmp_path):
    """launch.bench quant on the qwen2 fixture, 4 prompts of 8 tokens: the f32 row is the f32
    sampler (same greedy tokens, its log-probs the teacher-forced ones to f32 rounding); int8
    weights move them a little, not more, and by what the float64 fake-quant reference says."""
    path = tmp_path / "quant.json"
    argv = ["quant", "--models", "qwen2", "--rows", "f32,weights_int8", "--num_prompts", "4"]
    assert main([*argv, "--new_tokens", "8", "--output", str(path)]) == 0
    f32, int8 = json.loads(path.read_text())["rows"]
    assert (f32["row"], f32["greedy_identical"], f32["greedy_agree_tokens"]) == ("f32", 1.0, 8)
    assert f32["kl_k3"] < 1e-10 and f32["max_abs_diff"] < 1e-4
    assert (int8["weights"], int8["kv"]) == ("int8", "float32")
    assert 0 < int8["kl_k3"] < 1e-2 and 0 < int8["max_abs_diff"] < 0.5
    assert f32["ref_max_abs_diff"] < 1e-4 and f32["ref_kl_k3"] < 1e-10
    assert int8["ref_median_abs_diff"] < 1e-5
    assert int8["ref_kl_k3"] == pytest.approx(int8["kl_k3"], rel=0.1)
    # No stop ids on a fixture: the columns through the stop are the 32-token ones.
    assert int8["greedy_identical_stop"] == int8["greedy_identical"]
    assert int8["kl_k3_stop"] == int8["kl_k3"]


def test_roofline_counts_the_quantized_projections():
    from launch.bench.roofline import projections
    from models.sharding import abstract_model
    from tests.conftest import CFG

    _, shapes = abstract_model(CFG)
    d, f, n, k, h, layers = 32, 64, 4, 2, 8, 2  # CFG's
    weights = layers * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f)
    scales = layers * (n * h + 2 * k * h + d + 2 * f + d)  # one per output channel
    assert projections(shapes) == (weights, scales)


def test_sampler_decode_step_bytes():
    from launch.bench.roofline import decode_step_bytes, hbm_peak, mean_kv_len
    from models.config import ModelConfig

    kw = dict(family="qwen2", vocab_size=10, d_model=4, d_ff=8, num_layers=2, num_heads=2,
              num_kv_heads=1, head_dim=2)  # fmt: skip
    tied = ModelConfig(**kw, tie_embeddings=True, param_dtype="bfloat16")
    # weights 100 x 2; KV 3 seqs x 5.5 x (2 L x 1 K x 2 H x 2 x 2 bytes = 16); logits 3 x 10 x 4.
    b = decode_step_bytes(tied, 100, 3, 5.5, "bfloat16")
    assert b == dict(weights=200, kv=264.0, logits=120, total=584.0)
    # Untied: the embedding's 40 parameters are read for 3 gathered rows of 4 only: 72 x 4.
    b = decode_step_bytes(ModelConfig(**kw), 100, 3, 5.5, "float32")
    assert b == dict(weights=288, kv=528.0, logits=120, total=936.0)
    # int8 weights: 60 of the tied 100 in 1 byte with 6 f32 scales, 40 in bf16; int8 KV: 2 L x
    # 1 K x 2 x (2 H x 1 byte + a 2-byte scale) = 16 bytes a token again, fp8 alike.
    b = decode_step_bytes(tied, 100, 3, 5.5, "int8", "int8", (60, 6))
    assert b == dict(weights=80 + 60 + 24, kv=264.0, logits=120, total=548.0)
    b = decode_step_bytes(tied, 100, 3, 5.5, "float8_e4m3fn", "float8_e4m3fn", (60, 6))
    assert (b["weights"], b["kv"]) == (164, 264.0)
    assert mean_kv_len(8, 8) == 11.5  # steps attend to 8, 9, ..., 15 tokens
    kinds = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA A100-SXM4-40GB":
             1.555e12, "TPU v5 lite": 8.19e11, "TPU v5": 2.765e12, "cpu": None}  # fmt: skip
    assert {kind: hbm_peak(kind) for kind in kinds} == kinds
