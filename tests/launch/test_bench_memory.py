"""`python -m launch.bench memory` on the tiny shape at short lengths (compiled only, nothing runs;
the real figures come from the bench's own run): the JSON's keys, positive byte counts and
exponents, and blockwise attention's learner temporaries below dense's. Each learner compile of
the tiny model on the 8-device mesh takes ~9 s on a 2-core CPU, so the key check compiles the
cheap phases at two lengths and the learner at one."""

import json

import pytest

from launch.bench import main


def _run(tmp_path, name, *args):
    path = tmp_path / f"{name}.json"
    assert main(["memory", "--shape=tiny", *args, f"--output={path}"]) == 0
    return json.loads(path.read_text())


def test_bench_memory_json(tmp_path):
    r = _run(
        tmp_path, "r", "--tokens=128,256", "--attention=blockwise", "--phases=logprobs,prefill"
    )
    assert r["attention"] == "blockwise"
    assert [row["tokens"] for row in r["rows"]] == [128, 256]
    for row in r["rows"]:
        for key in ("logprobs_temp_bytes", "prefill_temp_bytes"):
            assert row[key] > 0, (row["tokens"], key)
        assert "learn_temp_bytes" not in row
    assert isinstance(r["logprobs_exponent"], float)
    assert isinstance(r["prefill_exponent"], float)
    assert r["learn_exponent"] is None  # not measured


@pytest.mark.slow  # moved out of the fast tier (pytest -m 'not slow' < 5 min cold)
def test_bench_memory_learn_blockwise_below_dense(tmp_path):
    temp = {}
    for attention in ("dense", "blockwise"):
        r = _run(tmp_path, attention, "--tokens=256", f"--attention={attention}", "--phases=learn")
        temp[attention] = r["rows"][0]["learn_temp_bytes"]
    assert 0 < temp["blockwise"] < temp["dense"], temp


@pytest.mark.slow  # two learner compiles of the tiny MoE on fsdp=4 x expert=2: ~30 s
def test_bench_memory_moe_learner_grows_by_less_than_one_dispatch_buffer_a_layer(tmp_path):
    """The tiny MoE (8 experts, 2 a token) on fsdp=4 x expert=2, 1 and 3 layers: a layer more
    adds less than one of its dispatch buffers ([expert x tokens x k, D] bf16 on each device) to
    the learner step's peak. Before models/moe.py's `_take` every layer's dispatch and
    backward-scatter buffers were live at once: 2.59 MB a layer here, now 0.14 MB."""
    r = _run(
        tmp_path,
        "moe",
        "--shape=tiny_moe",
        "--expert=2",
        "--tokens=1024",
        "--layers=1,3",
        "--phases=learn",
    )
    assert r["mesh"] == {"fsdp": 4, "expert": 2}
    assert [row["layers"] for row in r["rows"]] == [1, 3]
    rows = 1024 // 2 * 2 * 2  # a batch shard's row over 2 expert devices, k = 2, expert = 2
    buffer = rows * 64 * 2  # [expert * tokens * k, D] bf16
    growth = r["learn_per_layer_bytes"]["1024"]
    assert 0 < growth < buffer, (growth, buffer)
