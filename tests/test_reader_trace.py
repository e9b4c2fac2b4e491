"""docs/architecture.md's reader's lists of a single-turn and a multi-turn rollout are the files
those rollouts enter, in that order (`tests/reader_trace.py`): a module a rollout starts to use,
or one it stops using, fails here until the list says so."""

import re

import pytest

from tests.conftest import ROOT, train_here
from tests.reader_trace import trace

pytestmark = pytest.mark.slow  # three-step training runs under a profiler


def _documented(heading: str) -> list[str]:
    """The files of the table under `heading`, in its order: the backticked paths of its second
    column, the table found by its header under its section's heading."""
    text = open(f"{ROOT}/docs/architecture.md").read()
    section = text.split(heading, 1)[1]
    table = section.split("| # | file | what it does there |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[2] for line in table.strip().splitlines()[1:]]
    files = [f for row in rows for f in re.findall(r"`([\w/]+\.py)`", row)]
    assert files, f"docs/architecture.md: no files in the table under {heading!r}"
    return files


# What a program compiling in the traced step may enter while JAX traces it: the model's and the
# kernels' files (a resumed turn's observation prefill enters nine of them; a full retrace more).
# A host module that ran only under a JAX transform would land there too, unlisted: not allowed.
DEVICE = (
    "models/",
    "sampling/state.py",
    "sampling/paged_attention.py",
    "sampling/kv_quant.py",
    "sampling/partitioned.py",
    "sampling/distribution.py",
    "sampling/cpu_attention.py",
    "sampling/steps.py",
    "sampling/kernels/",
)


@pytest.mark.parametrize(
    "config, argv, heading",
    [
        (
            "default",
            ["--config.data.prompts_per_step=4", "--config.rl.num_generations=4"],
            "### A single-turn iteration (configs/default.py)",
        ),
        ("calc_tool", [], "### A multi-turn iteration (configs/calc_tool.py)"),
    ],
    ids=["single-turn", "multi-turn"],
)
def test_the_reader_lists_are_the_traced_rollouts(config, argv, heading, tmp_path):
    """The host files in first-entry order; the files a program that compiles in the traced step
    enters while JAX traces it (a multi-turn resume's new prefill length, which depends on when
    the tools answer) are listed apart by the tracer and not in the tables."""
    args = [
        f"--config={ROOT}/configs/{config}.py",
        "--config.num_steps=3",
        "--config.eval_every=0",
        *argv,
        f"--workdir={tmp_path}",
    ]

    def run():
        assert train_here(args) == 0

    found = trace(run)
    assert found.host == _documented(heading)
    assert all(f.startswith(DEVICE) for f in found.traced), found.traced
