"""docs/architecture.md's reader's list of a single-turn rollout is the files that rollout enters,
in that order (`tests/reader_trace.py`): a module the rollout starts to use, or one it stops
using, fails here until the list says so."""

import re

import pytest

from tests.conftest import ROOT, train_here
from tests.reader_trace import trace

pytestmark = pytest.mark.slow  # a three-step training run under a profiler


def _documented() -> list[str]:
    """The files of the single-turn table, in its order: the backticked paths of its second
    column, the table found by its header under its section's heading."""
    text = open(f"{ROOT}/docs/architecture.md").read()
    section = text.split("### A single-turn iteration (configs/default.py)", 1)[1]
    table = section.split("| # | file | what it does there |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[2] for line in table.strip().splitlines()[1:]]
    files = [f for row in rows for f in re.findall(r"`([\w/]+\.py)`", row)]
    assert files, "docs/architecture.md: no files in the single-turn table"
    return files


def test_the_single_turn_reader_list_is_the_traced_rollout(tmp_path):
    argv = [
        f"--config={ROOT}/configs/default.py",
        "--config.num_steps=3",
        "--config.eval_every=0",
        "--config.data.prompts_per_step=4",
        "--config.rl.num_generations=4",
        f"--workdir={tmp_path}",
    ]

    def run():
        assert train_here(argv) == 0

    files = trace(run)
    assert files == _documented()
