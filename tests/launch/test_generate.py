"""`python -m launch.generate` end to end (in-process, 8 fake devices) on an HF fixture."""

import json
import os

import numpy as np
import pytest

from launch.export import main as export_main
from launch.generate import main
from tests.conftest import FIXTURES, ROOT, train_here

FIXTURE = os.path.join(FIXTURES, "qwen3")
ASSET = os.path.join(ROOT, "configs", "assets", "arithmetic_sft")  # the CPU demo's warm start


def test_greedy_generate_writes_the_hf_continuations(tmp_path, capsys):
    ref = np.load(os.path.join(FIXTURE, "reference.npz"))
    prompts = [ids[mask > 0].tolist() for ids, mask in zip(ref["input_ids"], ref["attention_mask"])]
    (tmp_path / "p.jsonl").write_text(
        "".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts)
    )
    out = tmp_path / "out.jsonl"
    argv = ["--hf_checkpoint", FIXTURE, "--prompts", str(tmp_path / "p.jsonl"), "--output", str(out),
            "--temperature", "0", "--max_new_tokens", "48", "--num_slots", "4", "--page_size", "8"]  # fmt: skip
    assert main(argv) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["prompt_index"], x["sample_index"]) for x in lines] == [(0, 0), (1, 0), (2, 0)]
    for x, greedy in zip(lines, ref["greedy"]):
        assert x["token_ids"] == greedy.tolist()
        assert x["finish_reason"] == "length" and len(x["logprobs"]) == 48
        assert all(lp <= 0 for lp in x["logprobs"])
    assert "sequences: 100%" in capsys.readouterr().err  # the progress bar


def test_quantised_generate_reads_its_flags(tmp_path, capsys):
    """--cache_dtype / --weights_dtype int8: the greedy draw runs on int8 KV pages and an int8
    decode copy (log-probs off the float32 run's, within quantisation error, while the tokens
    agree); a dtype the engine does not know fails in one line naming the field."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt_ids": [5, 9, 17, 3]}) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["--hf_checkpoint", FIXTURE, "--prompts", str(tmp_path / "p.jsonl"), "--output", str(out),
            "--temperature", "0", "--max_new_tokens", "8", "--num_slots", "1", "--page_size", "8"]  # fmt: skip
    runs = {}
    for name, flags in (
        ("f32", []),
        ("int8", ["--cache_dtype", "int8", "--weights_dtype", "int8"]),
    ):
        assert main(argv + flags) == 0
        runs[name] = json.loads(out.read_text())
    a, b = runs["f32"], runs["int8"]
    same = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y), 8)
    assert same > 0  # the first token agrees, so there is a log-prob to compare
    diff = np.abs(np.subtract(a["logprobs"][:same], b["logprobs"][:same]))
    assert 1e-6 < diff.max() < 0.5, diff
    capsys.readouterr()
    assert main(argv + ["--cache_dtype", "int4"]) == 2
    assert "cache_dtype='int4': must be one of" in capsys.readouterr().err


def test_bad_prompts_file_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1, 2]}\n{"text": "no prompt field"}\n')
    argv = ["--hf_checkpoint", FIXTURE, "--prompts", str(bad), "--output", str(tmp_path / "o")]
    assert main(argv) == 2
    assert f"{bad}:2: expected a 'prompt' or 'prompt_ids' field" in capsys.readouterr().err
    assert main(["--hf_checkpoint", FIXTURE, "--prompts", "/nope.jsonl", "--output", "o"]) == 2
    assert "--prompts: /nope.jsonl does not exist" in capsys.readouterr().err


@pytest.mark.slow  # a one-step training run, its export and three generations (~30 s of CPU)
def test_generate_from_a_training_workdir_samples_its_checkpoint(tmp_path, capsys):
    """--hf_checkpoint a launch.train workdir: its latest checkpoint restored as launch.eval
    restores it, sampled on the run's mesh with its tokenizer and its sampler's int8 KV pages:
    greedy, the same completions as from its export (launch.export) with --cache_dtype int8, not
    the float32 pages' log-probs, and not the starting checkpoint's."""
    workdir = tmp_path / "run"
    run = [
        "--config.num_steps=1",
        "--config.data.prompts_per_step=4",
        "--config.data.eval.num=8",
        "--config.eval.pass_k=0",
        "--config.optim.warmup_steps=0",  # (warmup: lr 0 at step 0)
        "--config.optim.learning_rate=1e-3",
        "--config.sampling.cache_dtype=int8",
        f"--workdir={workdir}",
    ]
    assert train_here(run) == 0
    assert export_main(["--workdir", str(workdir), "--out", str(tmp_path / "hf")]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("12+34=", "5+7=")))

    def generate(checkpoint, *flags):
        out = tmp_path / f"{os.path.basename(checkpoint)}.jsonl"
        argv = [
            "--hf_checkpoint",
            str(checkpoint),
            "--prompts",
            str(prompts),
            "--output",
            str(out),
            "--temperature",
            "0",
            "--max_new_tokens",
            "6",
            *flags,
        ]
        assert main(argv) == 0, capsys.readouterr().err
        return [json.loads(x) for x in out.read_text().splitlines()]

    from_run = generate(workdir)
    assert f"sampling from step 1 of the run in {workdir}\n" in capsys.readouterr().err
    exported, start = generate(tmp_path / "hf", "--cache_dtype", "int8"), generate(ASSET)
    wide = generate(workdir, "--cache_dtype", "float32")  # not the run's own pages
    diff = [np.subtract(a["logprobs"], w["logprobs"]) for a, w in zip(from_run, wide)]
    assert max(np.max(np.abs(d)) for d in diff) > 1e-6
    assert [r["text"] for r in from_run] == [r["text"] for r in exported]
    assert all(r["text"] for r in from_run)  # the run's tokenizer decodes them
    for a, b, s in zip(from_run, exported, start):
        assert a["token_ids"] == b["token_ids"]
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5)
        if a["token_ids"] == s["token_ids"]:  # the trained weights, not the starting ones
            assert np.max(np.abs(np.subtract(a["logprobs"], s["logprobs"]))) > 1e-4

    argv = ["--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]
    capsys.readouterr()
    assert main(["--hf_checkpoint", str(workdir), "--step", "7", *argv]) == 2
    assert capsys.readouterr().err == (
        f"error: --hf_checkpoint {workdir}: no checkpoint at step 7 (have [1])\n"
    )
    assert main(["--hf_checkpoint", ASSET, "--step", "1", *argv]) == 2
    assert capsys.readouterr().err == (
        "error: --step: only with a training run's workdir as --hf_checkpoint\n"
    )
