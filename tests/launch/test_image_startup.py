"""`launch.train` probes each image of its repo records once at start-up (issue 48): an image
whose python or pytest cannot grade (no pytest in it; a python that is not one) would mask every
episode, so the run is refused before it starts, in one `error: ` line naming the record, the
image and what the probe found, exit 2, no traceback, no workdir made."""

import json
import os
import shutil

import pytest

from tests.conftest import ROOT, train_here
from tests.rl.image_helpers import python_image

TESTBED = {"calc/__init__.py": b"", "tests/test_ops.py": b"def test_add():\n    assert 1\n"}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """An image without pytest (its site-packages empty), unpacked as `nopytest`."""
    from rl.sandbox.oci import unpack

    if shutil.which("bwrap") is None:
        pytest.skip("image tasks need bubblewrap")
    top = tmp_path_factory.mktemp("startup")
    (top / "empty").mkdir()
    python_image(str(top / "oci"), TESTBED, b'WHERE = "image"\n', site=str(top / "empty"))
    unpack(str(top / "oci"), str(top / "images"), ("nopytest",))
    return str(top / "images")


@pytest.mark.parametrize(
    "python, found",
    [
        (
            "",
            "ModuleNotFoundError: No module named 'pytest' (found no pytest, no pluggy, python 3.",
        ),
        ("/usr/bin/true", "the probe ended (ok, exit status 0) without a word"),
    ],
    ids=["no pytest", "not a python"],
)
def test_an_image_that_cannot_grade_is_refused_at_start_up(
    images, tmp_path, monkeypatch, capsys, python, found
):
    monkeypatch.chdir(tmp_path)
    record = {
        "instance_id": "calc__calc-1",
        "image": "nopytest",
        "problem": "add is wrong",
        "fail_to_pass": ["tests/test_ops.py::test_add"],
        "pass_to_pass": [],
    }
    if python:
        record["python"] = python
    (tmp_path / "tasks.jsonl").write_text(json.dumps(record) + "\n")
    asset = os.path.join(ROOT, "configs", "assets", "repo_fix_sft")
    argv = [
        "--config.mesh.data=8",
        f"--config.model.hf_checkpoint={asset}",
        "--config.env.name=repo",
        "--config.env.isolation=bwrap",
        f"--config.env.images_dir={images}",
        "--config.data.train.type=jsonl",
        "--config.data.train.path=tasks.jsonl",
        "--config.data.train.prompt_field=problem",
        "--config.data.eval.type=jsonl",
        "--config.data.eval.path=tasks.jsonl",
        "--config.data.eval.prompt_field=problem",
        "--config.rl.num_generations=2",
        "--config.num_steps=1",
        "--workdir",
        "run",
    ]
    rc = train_here(argv, devices=8)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    want = (
        f"error: repo record 'calc__calc-1': image 'nopytest' "
        f"({python or '/opt/miniconda3/envs/testbed/bin/python'}): "
    )
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(want) and found in lines[0], lines[0]
    assert lines[0].endswith(": it cannot grade (every episode would be masked)"), lines[0]
    assert not os.path.exists("run")
    print("\n" + lines[0])
