"""`python -m launch.generate` end to end (in-process, 8 fake devices) on an HF fixture."""

import json
import os

import numpy as np

from launch.generate import main
from tests.conftest import FIXTURES

FIXTURE = os.path.join(FIXTURES, "qwen3")


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
