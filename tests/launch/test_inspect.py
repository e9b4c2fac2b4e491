"""The README's first quick-start command (run in-process on the 8 fake devices)."""

import os

from launch.inspect import main
from tests.conftest import FIXTURES

FIXTURE = os.path.join(FIXTURES, "qwen3")


def test_inspect_prints_shardings_and_greedy(capsys):
    assert (
        main(["--hf_checkpoint", FIXTURE, "--mesh", "data=2,fsdp=2,tensor=2", "--steps", "3"]) == 0
    )
    out = capsys.readouterr().out
    assert "qwen3: 0." in out and "on mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in out
    assert "blocks.0.attn.q " in out and "P('fsdp', 'tensor', None)" in out
    assert out.strip().splitlines()[-1].startswith("greedy: [5, 17, 42, 7, ")


def test_inspect_bad_mesh_names_the_problem(capsys):
    assert main(["--hf_checkpoint", FIXTURE, "--mesh", "data=3"]) == 2
    assert "3 devices but 8 are available" in capsys.readouterr().err
    assert main(["--hf_checkpoint", "/nonexistent"]) == 2
    assert "--hf_checkpoint: /nonexistent is not a directory" in capsys.readouterr().err
