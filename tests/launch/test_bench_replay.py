"""`python -m launch.bench replay` on a checkpoint: the MoE demo's warm start in bf16."""

import json
import os

import pytest

from launch.bench.replay import main
from tests.conftest import ROOT

ASSETS = os.path.join(ROOT, "configs", "assets")


@pytest.mark.slow  # a sampler and three learner passes compiled (~9 s of CPU)
def test_replay_bench_on_a_trained_checkpoint(tmp_path, capsys):
    """With replay every recorded token's experts are the sampler's (no mismatch), decode replay
    leaves at most the prompt's, and a dense checkpoint is refused in one line."""
    out = tmp_path / "r.json"
    argv = ["--hf_checkpoint", os.path.join(ASSETS, "arithmetic_moe_sft"), "--num_prompts", "8",
            "--new_tokens", "4", "--seeds", "0", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["setting"]: r for r in result["rows"]}
    replayed = rows["replay"]["kl_k3"]  # 0 where the replayed log-probs are the sampler's
    assert result["kl_falls"] == {"0": rows["off"]["kl_k3"] / replayed if replayed else None}
    assert set(rows) == {"off", "own routes", "decode replay", "replay"}
    assert rows["own routes"]["route_mismatch"] == rows["off"]["route_mismatch"]
    assert rows["replay"]["route_mismatch"] == 0.0
    assert rows["decode replay"]["route_mismatch"] <= rows["off"]["route_mismatch"]
    assert all(r["kl_k3"] >= 0 and r["max_abs_r"] < 20 for r in rows.values())
    assert "| 0 | replay | 0.0000 | 0.0000 |" in capsys.readouterr().out
    dense = os.path.join(ASSETS, "arithmetic_sft")
    with pytest.raises(SystemExit, match="a dense model"):
        main(["--hf_checkpoint", dense, "--seeds", "0", "--output", str(out)])


def test_replay_bench_refuses_a_top_k_above_the_experts():
    """The random model's routing shape is checked, in one line, before anything is built."""
    from launch.cli import UsageError

    with pytest.raises(UsageError, match="^--experts_per_token 8 > --num_experts 4$"):
        main(["--num_experts", "4", "--experts_per_token", "8"])
    with pytest.raises(UsageError, match="^--num_experts: shape the random model; --hf_checkpoint"):
        main(["--hf_checkpoint", os.path.join(ASSETS, "arithmetic_moe_sft"), "--num_experts", "4"])


@pytest.mark.slow  # a sampler and four learner passes compiled
def test_replay_bench_with_qwen3_30b_a3b_routing(tmp_path):
    """128 experts, top-8 (int8 route records, ids up to 127): without replay some tokens'
    experts in the learner's pass differ from the sampler's, with it none (read from the pass's
    own record, so a replay that did not reach the routers would show), and the KL falls."""
    out = tmp_path / "r.json"
    argv = ["--num_experts", "128", "--experts_per_token", "8", "--num_prompts", "4",
            "--new_tokens", "8", "--seeds", "0", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["setting"]: r for r in result["rows"]}
    assert "num_experts=128" in result["model"] and "experts_per_token=8" in result["model"]
    assert rows["off"]["route_mismatch"] > 0 and rows["replay"]["route_mismatch"] == 0.0
    assert rows["replay"]["kl_k3"] < rows["off"]["kl_k3"]
