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
    restores it, sampled on the run's mesh with its tokenizer: greedy, the same completions as
    from its export (launch.export), and not the starting checkpoint's log-probs."""
    workdir = tmp_path / "run"
    run = [
        "--config.num_steps=1",
        "--config.data.prompts_per_step=4",
        "--config.data.eval.num=8",
        "--config.eval.pass_k=0",
        "--config.optim.warmup_steps=0",  # (warmup: lr 0 at step 0)
        "--config.optim.learning_rate=1e-3",
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
    exported, start = generate(tmp_path / "hf"), generate(ASSET)
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
