"""What `python -m launch.train` prints: --help, the config (the fields set on the command line
and where config.json is, the whole config only with --print_config), progress lines instead of
a bar where stderr is no terminal, and a summary.json without null or NaN metrics."""

import json
import os
import re
import subprocess
import sys

import pytest

import launch.train
from launch.cli import UsageError, parse_args, split_args
from launch.train import FLAGS, Progress, config_lines, main
from launch.validate import validate
from tests.conftest import ROOT, train_here

# The CPU demo at the tiny shapes of tests/launch/test_train.py, pass@k off (pass@0 is no metric).
SMALL = [
    "--config.data.prompts_per_step=4",
    "--config.rl.num_generations=4",
    "--config.data.eval.num=8",
    "--config.eval.pass_k=0",
    "--config.eval_every=0",
    "--config.checkpoint_every=2",
    "--config.sampling.num_slots=32",
    "--config.sampling.num_pages=128",
]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_the_docstring(flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--config.rl.num_generations=4", flag, "--nope"])  # answered before anything else
    assert e.value.code == 0
    out, err = capsys.readouterr()
    assert (
        out.startswith("usage: python -m launch.train [--config FILE] [--workdir DIR] ") and not err
    )
    for flag in (
        "--config FILE",
        "--workdir DIR",
        "--config.<field>=<value>",
        "--dry_run",
        "--print_config",
        "--help",
    ):
        assert f"\n  {flag} " in out, flag
    assert launch.train.__doc__.strip() in out


def test_an_unknown_option_points_at_help():
    with pytest.raises(UsageError) as e:
        split_args(["--nope"], FLAGS)
    assert str(e.value) == (
        "unknown option --nope (known: --config, --workdir, --dry_run, --print_config, "
        "--config.<field>=<value>; --help explains them)"
    )


def test_the_config_is_printed_in_a_few_lines_however_many_fields_are_set():
    _, overrides, _ = split_args(
        [f"--config.data.train.path=/data/set{i}/train.jsonl" for i in range(60)], FLAGS
    )
    lines = config_lines("configs/default.py", overrides, "runs/x").splitlines()
    assert len(lines) == 17 and all(len(x) <= 100 for x in lines), lines
    assert lines[0].startswith("config configs/default.py; set on the command line: data.train")
    shown = " ".join(lines[:-1]).count("data.train.path=")
    assert lines[-1] == (
        f"{60 - shown} more set; every field: runs/x/config.json (--print_config prints them here)"
    )
    assert " ".join(lines).endswith(f"set{shown - 1}/train.jsonl {lines[-1]}")
    lines = config_lines("c.py", overrides[:3], "w").splitlines()
    assert lines == [
        "config c.py; set on the command line: data.train.path=/data/set0/train.jsonl",
        "    data.train.path=/data/set1/train.jsonl data.train.path=/data/set2/train.jsonl",
        "every field: w/config.json (--print_config prints them here)",
    ]
    assert (
        config_lines("c.py", [], "w").splitlines()[0]
        == "config c.py; set on the command line: none"
    )


def test_progress_every_is_at_least_one():
    config = parse_args(["--config.log.progress_every=0", "--config.mesh.data=8"], {})[0]
    with pytest.raises(UsageError) as e:
        validate(config, 8, runs_code=False, sources=False)
    assert str(e.value) == "config.log.progress_every=0: must be >= 1"


def test_progress_lines_every_n_steps_and_at_the_last(capsys):
    progress = Progress(start=3, total=10, every=4, enabled=True)
    for step in range(4, 11):
        progress.step(step, {"reward_mean": step / 10, "loss": 0.5})
    lines = capsys.readouterr().err.splitlines()
    assert [x.split(" (")[0] for x in lines] == [
        "step 4/10: reward 0.400 loss 0.5000",
        "step 8/10: reward 0.800 loss 0.5000",
        "step 10/10: reward 1.000 loss 0.5000",
    ]
    assert all(re.fullmatch(r".* \(\d+\.\d s/step\)", x) for x in lines), lines
    Progress(0, 10, 1, enabled=False).step(10, {"reward_mean": 0.0, "loss": 0.0})  # a bar instead
    assert capsys.readouterr().err == ""


def _no_nan(text: str):
    raise AssertionError(f"summary.json holds {text}")


@pytest.mark.slow  # a training run as a subprocess (~10 s of CPU), then a resumed one in-process
def test_a_redirected_run_logs_lines_not_frames(tmp_path, capsys):
    """stdout and stderr into one file (nohup): no carriage-return frame of a progress bar, the
    config in a few lines, a progress line every log.progress_every steps, and a summary.json
    without null or NaN. A resume with --print_config prints every field."""
    workdir, log = tmp_path / "run", tmp_path / "log.txt"
    argv = [f"--workdir={workdir}", "--config.num_steps=4", "--config.log.progress_every=2", *SMALL]
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "launch.train", *argv],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=600,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text and "grpo:" not in text  # no tqdm bar
    lines = text.splitlines()
    end = next(i for i, x in enumerate(lines) if x.startswith("every field: "))
    assert lines[end] == f"every field: {workdir}/config.json (--print_config prints them here)"
    start = next(i for i, x in enumerate(lines) if x.startswith("config "))
    assert end - start + 1 < 20, lines[start : end + 1]
    assert " ".join(lines[start : end + 1]).count("rl.num_generations=4") == 1
    assert "num_generations: 4" not in text  # not the whole config
    steps = [x for x in lines if x.startswith("step ")]
    assert [x.split(":")[0] for x in steps] == ["step 2/4", "step 4/4"], steps
    summary = json.loads((workdir / "summary.json").read_text(), parse_constant=_no_nan)
    assert None not in summary.values() and not any(k.startswith("pass@") for k in summary)
    assert summary["steps"] == 4 and 0 <= summary["accuracy_after"] <= 1

    # resumed in this process (stderr is pytest's capture, no terminal): the whole config
    capsys.readouterr()
    assert train_here([*argv, "--config.num_steps=5", "--print_config"]) == 0
    out, err = capsys.readouterr()
    assert "num_generations: 4" in out and "every field: " not in out
    assert [x.split(":")[0] for x in err.splitlines() if x.startswith("step ")] == ["step 5/5"]
    assert "\r" not in out + err
    assert json.loads(open(os.path.join(workdir, "config.json")).read())["num_steps"] == 5
