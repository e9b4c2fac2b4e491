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
