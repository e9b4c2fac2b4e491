"""notebooks/quickstart.ipynb runs end to end in a real kernel (nbclient), kept small by its
environment variables: a few GRPO steps and a few held-out problems, in a workdir under tmp_path.

The kernel inherits this process's environment (JAX_COMPILATION_CACHE_DIR from tests/conftest.py,
the QUICKSTART_* settings below), but not its 8 fake devices: the notebook's subprocesses run on
the one CPU device that configs/default.py's mesh asks for.
"""

import json
import os

import pytest

from tests.conftest import ROOT

nbformat = pytest.importorskip("nbformat", reason="the notebook test needs nbformat (test extra)")
nbclient = pytest.importorskip("nbclient", reason="the notebook test needs nbclient (test extra)")
pytest.importorskip("ipykernel", reason="the notebook test needs ipykernel (test extra)")
pytest.importorskip("matplotlib", reason="the notebook plots with matplotlib (test extra)")

NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
STEPS = 2  # the plot and the before / after table need no more (3 steps and 16 prompts before)
EVAL_PROMPTS = 8
PROBLEMS = 8  # the notebook's before / after table


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in _code_cells(nb):
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


def _real_model_dry_run(tmp_path, monkeypatch) -> bool:
    """The real-model section runs its --dry_run only, offline, against a Hub cache holding the
    tiny stand-ins under its ids (tests/launch/test_hub.py) and test_real_configs' sizes; without
    the `hub` extra it is skipped. Returns whether it runs."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        monkeypatch.setenv("QUICKSTART_REAL", "skip")
        return False
    from tests.hub_cache import add_directory, offline_hub
    from tests.launch.test_hub import DATASET, MODEL, TINY, A, D, gsm8k_repo
    from tests.launch.test_real_configs import DATA, _stand_in

    ckpt, _ = _stand_in("qwen2", tmp_path)
    gsm8k_repo(tmp_path / "gsm8k", DATA)
    add_directory(tmp_path / "hub", MODEL, ckpt, A)
    add_directory(tmp_path / "hub", DATASET, tmp_path / "gsm8k", D, repo_type="dataset")
    offline_hub(monkeypatch, tmp_path / "hub")
    sizes = [f for f in TINY if not f.startswith("--config.mesh.")]  # the notebook sets the mesh
    monkeypatch.setenv("QUICKSTART_REAL", "dry_run")
    monkeypatch.setenv("QUICKSTART_REAL_FLAGS", " ".join(sizes))
    return True


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    monkeypatch.setenv("QUICKSTART_STEPS", str(STEPS))
    monkeypatch.setenv("QUICKSTART_EVAL_PROMPTS", str(EVAL_PROMPTS))
    monkeypatch.setenv("QUICKSTART_WORKDIR", str(workdir))
    real = _real_model_dry_run(tmp_path, monkeypatch)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=300,  # per cell
        resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}},  # the kernel's cwd
    )
    client.execute()  # a cell that raises fails here, with its traceback

    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, STEPS]

    cells = _code_cells(nb)
    plots = [c for c in cells if "plt.show()" in c.source]
    assert len(plots) == 1
    images = [o for o in plots[0].outputs if "image/png" in o.get("data", {})]
    assert [o.output_type for o in images] == ["display_data"]
    assert f"{summary['accuracy_after']:.3f} after {STEPS} steps" in _text(plots[0])

    # The before / after table: a header and one line per problem, with both columns filled.
    for name in ("before", "after"):
        completions = (workdir / f"{name}.jsonl").read_text().splitlines()
        assert len(completions) == PROBLEMS
    after = next(c for c in cells if "show(before=before, after=after)" in c.source)
    table = _text(after).splitlines()[-(PROBLEMS + 1) :]
    assert table[0].split() == ["problem", "answer", "before", "after"]
    for line in table[1:]:
        assert line.split()[0].endswith("=") and line.count("✓") + line.count("✗") == 2, line

    # The real-model section: its --dry_run by the Hub ids (one device here), no training.
    dry = next(c for c in cells if '"--dry_run"' in c.source)
    if real:
        assert "estimated peak per device" in _text(dry), _text(dry)[-2000:]
        assert "--config.model.hf_checkpoint" not in _text(dry)  # by the config's own ids
    assert not any("GSM8K held-out greedy accuracy" in _text(c) for c in cells)
