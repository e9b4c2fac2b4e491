"""`--dry_run` of the repository config as a newcomer runs it (issue 49 item 4): Qwen/Qwen3-0.6B
from a Hub cache that holds its config.json alone, the task files the README's recipe makes,
8 CPU devices, one try. It fetches nothing more, compiles the programs as an accelerator would get
them (`launch.estimate`) and prints each phase's figure per device and the chips that hold it."""

import os
import re

import pytest
from huggingface_hub import scan_cache_dir

from launch.train import main
from tests.hub_cache import add_snapshot, offline_hub

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hub_configs")
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a stand-in: the cache's own commit


@pytest.mark.slow  # the 0.6B model's six programs at 16k-token episodes: ~1-3 min of CPU
def test_repo_config_dry_run_from_a_hub_cache_holding_config_json(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "hub"
    config = os.path.join(FIXTURES, "qwen3_0_6b.json")  # Qwen/Qwen3-0.6B's, as published
    add_snapshot(cache, "Qwen/Qwen3-0.6B", {"config.json": config}, COMMIT)
    offline_hub(monkeypatch, cache)
    home = tmp_path / "home"  # the tasks the README's recipe makes, where the config reads them
    for split in ("repo_tasks", "repo_tasks_eval"):
        os.makedirs(home / "data" / split)
        (home / "data" / split / "tasks.jsonl").write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)

    assert main([f"--config={ROOT}/configs/qwen3_0_6b_repo.py", "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert (
        "qwen3: 596.0M parameters, mesh {'data': 1, 'fsdp': 8, 'expert': 1, 'tensor': 1}" in out
    ), out
    assert "cpu-all-reduce-combiner, float-normalization-bf16, all-reduce-promotion off" in out
    phases = dict(re.findall(r"^(learn|rollout) phase +([\d.]+) MiB per device: fits", out, re.M))
    assert set(phases) == {"learn", "rollout"}, out
    # the rollout holds its bf16 pool as bf16: XLA:CPU's f32 copies made it 48 GiB before
    assert 8 * 1024 < float(phases["rollout"]) < 24 * 1024, out
    # Each program's peak; the rollout phase holds the largest of the decode call and the
    # prefill calls (the longest dense prompt chunk, the longest prompt, 2,048 tokens, in
    # chunks, and a whole 16k history after cached tokens, a preempted sequence's restore),
    # beside the resident state and the decode copy of the weights.
    programs = dict(re.findall(r"^(\w+(?: \d+)?) +args .*=> peak ~ *([\d.]+) MiB", out, re.M))
    rollout = ("generate", "prefill 512", "prefill 2048", "extend 16384")
    assert set(programs) == {"learn", "logprobs", *rollout}, out
    state, ref = map(float, re.search(r"optimizer ([\d.]+) MiB, reference ([\d.]+)", out).groups())
    sample = max(float(programs[k]) for k in rollout)
    assert abs(float(phases["rollout"]) - (ref + state + sample)) < 0.2, out
    peak = re.search(
        r"estimated peak per device: ([\d.]+) MiB .*: fits (.*); this mesh's 8 "
        r"devices: TPU v5e-8, TPU v6e-8, TPU v5p-16",
        out,
    )
    assert peak and float(peak[1]) == max(map(float, phases.values())), out
    assert "H100 (80 GiB)" in peak[2] and "not TPU v5e (16 GiB)" in peak[2], peak[2]
    # nothing fetched beside config.json
    files = {f.file_name for r in scan_cache_dir(cache).repos for v in r.revisions for f in v.files}
    assert files == {"config.json"}, files
