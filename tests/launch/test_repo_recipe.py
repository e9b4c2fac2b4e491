"""The README's repository-task recipe (the block after `<!-- repo tasks recipe -->`) as written,
on a small --num: its make_repo_tasks commands make the training and the held-out task files that
its launch.train command (configs/qwen3_0_6b_repo.py) reads; with either file missing, the
start-up check's one line gives the command that makes it, and that command works."""

import os
import shlex

import pytest

from launch import make_repo_tasks
from launch.cli import UsageError, parse_args
from launch.validate import check_sources
from tests.conftest import ROOT

MARK = "<!-- repo tasks recipe -->"
CONFIG = os.path.join(ROOT, "configs", "qwen3_0_6b_repo.py")


def _recipe(home: str) -> list[list[str]]:
    """The block's commands, `python -m` dropped, `~` and $HOME as `home`, --num made small."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split(MARK, 1)[1].split("```bash\n", 1)[1].split("```")[0]
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line.replace("$HOME", home).replace("~", home), comments=True)
        assert words[:2] == ["python", "-m"], line
        out.append(
            [
                w if not w.isdigit() or prev != "--num" else "4"
                for prev, w in zip(["", *words], words)
            ][2:]
        )
    return out


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    home = str(tmp_path / "home")
    monkeypatch.setenv("HOME", home)  # the config's default paths are under ~
    monkeypatch.chdir(ROOT)  # the commands' relative paths (configs/...)
    return _recipe(home)


def _config(argv: list[str]):
    assert argv[0] == "launch.train", argv
    return parse_args(argv[1:], {})[0]


def test_the_recipe_makes_both_task_sets_the_run_reads(recipe, capsys):
    makes = [c for c in recipe if c[0] == "launch.make_repo_tasks"]
    assert [c[c.index("--out") + 1].rsplit("/", 1)[1] for c in makes] == [
        "repo_tasks",
        "repo_tasks_eval",
    ]
    for argv in makes:
        assert make_repo_tasks.main(argv[1:]) == 0
    assert "wrote 4 tasks" in capsys.readouterr().out
    config = _config(recipe[-1])
    for split in ("train", "eval"):  # the README's paths, and the config's own defaults
        assert os.path.isfile(config.data[split].path), config.data[split].path
        assert (
            config.data[split].path
            == _config(["launch.train", "--config", CONFIG]).data[split].path
        )
    check_sources(config)  # the run's start-up check of both files passes


@pytest.mark.parametrize("split", ["eval", "train"])
def test_a_missing_task_file_names_the_command_that_makes_it(recipe, split):
    makes = [c for c in recipe if c[0] == "launch.make_repo_tasks"]
    for argv in makes:
        if argv[argv.index("--out") + 1].endswith("_eval") == (split == "train"):
            assert make_repo_tasks.main(argv[1:]) == 0  # the other split's file only
    config = _config(recipe[-1])
    with pytest.raises(UsageError) as e:
        check_sources(config)
    message = str(e.value)
    path = config.data[split].path
    what = "held-out" if split == "eval" else "training"
    assert message.startswith(
        f"config.data.{split}.path={path!r}: no jsonl file there (make the "
        f"{what} tasks with python -m launch.make_repo_tasks --out "
    )
    command = message.split("with python -m ", 1)[1].rstrip(")")
    argv = shlex.split(command.replace("--num 512", "--num 4").replace("--num 64", "--num 4"))
    assert argv[0] == "launch.make_repo_tasks"
    assert make_repo_tasks.main(argv[1:]) == 0  # the command the line gives makes the file
    check_sources(config)


def test_other_task_files_get_the_commands_of_their_names(tmp_path):
    config = _config(
        [
            "launch.train",
            "--config",
            CONFIG,
            f"--config.data.train.path={tmp_path}/v/valid.jsonl",
            f"--config.data.eval.path={tmp_path}/mine.jsonl",
        ]
    )
    with pytest.raises(UsageError) as e:
        check_sources(config)
    assert str(e.value).endswith(
        f"no jsonl file there (make it with python -m launch.make_repo_tasks --validate {tmp_path}/v)"
    )
    config.data.train.path = config.data.eval.path
    (tmp_path / "mine.jsonl").write_text("{}\n")
    config.data.eval.path = str(tmp_path / "other.jsonl")
    with pytest.raises(UsageError) as e:
        check_sources(config)
    assert str(e.value).endswith(
        "(make the held-out tasks with python -m launch.make_repo_tasks "
        "--out DIR --num 64 --seed 1, then set it to DIR/tasks.jsonl)"
    )
    config.env.name = "calculator"  # no hint for another environment's data
    assert str(_raises(config)).endswith("no jsonl file there")


def _raises(config) -> UsageError:
    with pytest.raises(UsageError) as e:
        check_sources(config)
    return e.value
