"""`python -m launch.train`: bad inputs fail fast without touching a workdir; exact resume."""

import json
import os
import subprocess
import sys

import pytest

from launch.cli import config_json, parse_args
from launch.train import FLAGS, main
from tests.conftest import ROOT, train_metrics

EIGHT = ["--config.mesh.data=8"]  # the in-process tests run on the 8 fake devices


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config.rl.num_generation=4"], "--config.rl.num_generation: no such config field; did you mean 'rl.num_generations'?"),
        (["--config.mesh.data=3"], "config.mesh={'data': 3, 'fsdp': 1, 'tensor': 1}: uses 3 devices but 8 are available"),
        (EIGHT + ["--config.data.train.type=jsonl", "--config.data.train.path=/nope/train.jsonl"], "config.data.train.path='/nope/train.jsonl': no jsonl file there"),
        (EIGHT + ["--config.rl.num_generations=1"], "config.rl.num_generations=1: GRPO needs G >= 2"),
        (EIGHT + ["--config.model.hf_checkpoint=/nope"], "config.model.hf_checkpoint='/nope': not a directory"),
        (["--config=/nope.py"], "--config: /nope.py does not exist"),
    ],
)  # fmt: skip
def test_bad_inputs_fail_with_one_line_and_leave_the_workdir_alone(args, message, tmp_path, capsys):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text("{}")  # stands for an existing good run
    assert main(args + ["--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert os.listdir(workdir) == ["config.json"] and (workdir / "config.json").read_text() == "{}"


TINY = [
    "--config.data.prompts_per_step=4", "--config.rl.num_generations=4", "--config.rl.kl_coef=0.04",
    "--config.data.eval.num=8", "--config.eval.pass_k=2", "--config.eval.pass_n=2",
    "--config.eval_every=0", "--config.checkpoint_every=3", "--config.sampling.num_slots=16",
    "--config.sampling.num_pages=64", "--config.rl.dynamic_sampling=True",
    "--config.sampling.release_kv_between_phases=False",
]  # fmt: skip


def _train(workdir, steps):
    cmd = [
        sys.executable,
        "-m",
        "launch.train",
        "--workdir",
        str(workdir),
        f"--config.num_steps={steps}",
    ]
    out = subprocess.run(cmd + TINY, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_resume_is_exact(tmp_path):
    """6 steps straight == 3 steps, then a new process that resumes and runs 3 more (with DAPO
    dynamic sampling and a decode state kept across rollouts, the paths with the most state)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(straight, 6)
    _train(split, 3)
    resumed = _train(split, 6)
    assert "resumed from step 3" in resumed.stderr
    a, b = json.load(open(straight / "summary.json")), json.load(open(split / "summary.json"))
    assert a["params_fingerprint"] == b["params_fingerprint"]
    assert (
        a["accuracy_before"] == b["accuracy_before"] and a["accuracy_after"] == b["accuracy_after"]
    )
    assert train_metrics(straight) == train_metrics(split)
    assert sorted(train_metrics(split)) == [1, 2, 3, 4, 5, 6]
    for name in (
        "config.json",
        "metrics.jsonl",
        "samples.jsonl",
        "summary.json",
        "tensorboard",
        "checkpoints",
    ):
        assert (straight / name).exists(), name
    keys = {"accuracy_before", "accuracy_after", "steps", "wall_seconds", "rollout_tokens_per_s",
            "learn_tokens_per_s", "rollout_seconds", "learn_seconds", "params_fingerprint"}  # fmt: skip
    assert keys <= set(a)


def test_resume_refuses_a_changed_config(tmp_path, capsys):
    workdir = tmp_path / "run"
    workdir.mkdir()
    config, _, _ = parse_args(EIGHT, FLAGS)
    (workdir / "config.json").write_text(json.dumps(config_json(config)))
    assert main(EIGHT + ["--workdir", str(workdir), "--config.optim.learning_rate=0.1"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume with a changed config (optim.learning_rate: 0.0002 -> 0.1)" in err
