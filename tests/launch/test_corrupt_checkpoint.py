"""`python -m launch.train` resuming from a damaged checkpoint: a garbled latest step is skipped
with one line and the run resumes from the previous one; with none usable, one `error:` line and
the checkpoint files left as they were."""

import glob
import os

import pytest

from tests.conftest import train_here

pytestmark = pytest.mark.slow  # training runs and restores

# in this process on one device (tests.conftest.train_here): the run a one-device subprocess makes
ARGS = ["--config.data.prompts_per_step=2", "--config.data.eval.num=8", "--config.eval.pass_k=0",
        "--config.eval_every=0", "--config.checkpoint_every=1"]  # fmt: skip


def _garble_data(step_dir):
    """Flips one byte in the middle of the largest array data file of a checkpoint."""
    path = max(glob.glob(f"{step_dir}/state/**/d/*", recursive=True), key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x55
    open(path, "wb").write(bytes(data))


def _snapshot(root):
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_garbled_checkpoint_is_skipped_and_none_usable_stops_cleanly(tmp_path, capsys):
    workdir = tmp_path / "run"
    checkpoints = workdir / "checkpoints"
    run = ARGS + [f"--workdir={workdir}"]
    assert train_here(run + ["--config.num_steps=3"]) == 0
    assert sorted(os.listdir(checkpoints)) == ["2", "3"]  # keep_checkpoints=2
    _garble_data(checkpoints / "3")
    capsys.readouterr()

    assert train_here(run + ["--config.num_steps=4"]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("checkpoint step 3 "))
    assert line.startswith(f"checkpoint step 3 in {checkpoints} is unusable (")
    assert line.endswith(f"; kept as {checkpoints}/3.unusable); resuming from step 2"), line
    assert f"resumed from step 2 in {workdir}" in err and "Traceback" not in err
    assert sorted(os.listdir(checkpoints)) == ["3", "3.unusable", "4"]

    for step in ("3", "4"):
        _garble_data(checkpoints / step)
    before = _snapshot(checkpoints)
    assert train_here(run + ["--config.num_steps=5"]) != 0
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: no usable checkpoint in {checkpoints} (step 4: ")
    assert errors[0].endswith("its files are left as they are")
    assert _snapshot(checkpoints) == before
