"""The README's first quick-start command (run in-process on the 8 fake devices)."""

import os
import shlex

from launch.inspect import main
from tests.conftest import FIXTURES

FIXTURE = os.path.join(FIXTURES, "qwen3")


def test_inspect_prints_shardings_and_greedy(capsys):
    assert (
        main(["--hf_checkpoint", FIXTURE, "--mesh", "data=2,fsdp=2,tensor=2", "--steps", "3"]) == 0
    )
    out = capsys.readouterr().out
    assert "qwen3: 0." in out and "on mesh {'data': 2, 'fsdp': 2, 'expert': 1, 'tensor': 2}" in out
    assert "blocks.0.attn.q " in out and "P('fsdp', 'tensor', None)" in out
    assert out.strip().splitlines()[-1].startswith("greedy: [5, 17, 42, 7, ")


def test_inspect_bad_mesh_names_the_problem(capsys):
    assert main(["--hf_checkpoint", FIXTURE, "--mesh", "data=3"]) == 2
    assert capsys.readouterr().err == (
        "error: --mesh data=3: uses 3 devices but 8 are available; on a CPU, --fake_devices 3 "
        "splits it into 3\n"
    )
    assert main(["--hf_checkpoint", FIXTURE, "--mesh", "data"]) == 2
    assert capsys.readouterr().err == "error: --mesh: expected name=size, got 'data'\n"
    assert main(["--hf_checkpoint", "/nonexistent"]) == 2
    assert "--hf_checkpoint: /nonexistent is not a directory" in capsys.readouterr().err


def test_the_docstring_example_runs(capsys):
    """The example `--help` shows, as written (its --fake_devices 8 is this process's 8 fake
    devices already, which jax accepts once the backend is up)."""
    import launch.inspect

    example = launch.inspect.__doc__.split("\n\n")[1].replace("\\\n", " ")
    argv = shlex.split(example, comments=True)
    assert argv[:3] == ["python", "-m", "launch.inspect"] and "--fake_devices" in argv, argv
    assert main(argv[3:]) == 0
    out = capsys.readouterr().out
    assert (
        "on mesh {'data': 2, 'fsdp': 2, 'expert': 1, 'tensor': 2}" in out
        and "greedy: [5, 17, 42, 7, " in out
    )


def test_out_of_vocabulary_prompt_ids_are_refused(capsys):
    # the fixture's vocabulary is 256 tokens: 256 is one past it
    assert main(["--hf_checkpoint", FIXTURE, "--prompt_ids", "5,256,7"]) == 2
    out, err = capsys.readouterr()
    assert (
        err
        == (
            "error: --prompt_ids: 256 is not a token id of the checkpoint (its vocabulary is "
            "[0, 256))\n"
        )
        and not out
    )  # refused before anything is loaded or printed
    assert main(["--hf_checkpoint", FIXTURE, "--prompt_ids", "5,-1"]) == 2
    assert "--prompt_ids: -1 is not a token id" in capsys.readouterr().err
    assert main(["--hf_checkpoint", FIXTURE, "--prompt_ids", "5,x"]) == 2
    assert capsys.readouterr().err == (
        "error: --prompt_ids: expected comma-separated token ids, got '5,x'\n"
    )
    assert main(["--hf_checkpoint", FIXTURE, "--prompt_ids", "255", "--steps", "1"]) == 0
