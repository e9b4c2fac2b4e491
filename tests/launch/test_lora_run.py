"""`launch.train` with LoRA (config.model.lora): the KL term's reference is the base with the
adapters off (no copy loaded), checkpoints hold the adapters alone and resume bitwise, both
exports read back, and --dry_run compares the run with a full fine-tune."""

import json
import re

import numpy as np
import pytest

from launch.build import load_run
from launch.export import main as export
from launch.train import main
from models import lora
from models.hf import load_hf
from models.sharding import flatten
from tests.conftest import train_metrics

ARGS = [
    "--config.mesh.data=8", "--config.model.lora.rank=4", "--config.rl.kl_coef=0.04",
    "--config.data.prompts_per_step=4", "--config.rl.num_generations=4",
    "--config.data.eval.num=8", "--config.eval.pass_k=0", "--config.eval_every=0",
    "--config.checkpoint_every=2", "--config.optim.learning_rate=2e-3",
    "--config.optim.warmup_steps=0",
]  # fmt: skip


def _run(workdir, steps):
    assert main(ARGS + [f"--config.num_steps={steps}", f"--workdir={workdir}"]) == 0


def test_lora_run_resumes_bitwise_and_exports(tmp_path, capsys):
    straight, split = tmp_path / "straight", tmp_path / "split"
    _run(straight, 3)
    _run(split, 2)
    _run(split, 3)
    assert "resumed from step 2" in capsys.readouterr().err
    a, b = json.load(open(straight / "summary.json")), json.load(open(split / "summary.json"))
    assert a["params_fingerprint"] == b["params_fingerprint"]
    assert train_metrics(straight) == train_metrics(split)
    kl = [m["kl"] for _, m in sorted(train_metrics(straight).items())]
    assert kl[0] == 0 and kl[-1] > 0  # B = 0 at first: the policy is the reference, then moves
    run, step = load_run(str(straight))
    assert step == 3 and run.ref_params is None and run.learner.lora
    params = flatten(run.state.params)
    start = flatten(load_hf(run.config.model.hf_checkpoint, run.mesh)[2])
    for name, x in start.items():  # the base never moved; the adapters did
        np.testing.assert_array_equal(params[name], x)
    b_norm = sum(float(np.abs(np.asarray(v)).sum()) for k, v in params.items() if "lora_b" in k)
    assert b_norm > 0
    # The checkpoint holds the adapters, not the base weights.
    meta = json.load(open(straight / "checkpoints" / "3" / "state" / "_METADATA"))
    saved = [k for k in meta["tree_metadata"] if k.startswith("('params'")]
    assert saved and all("_lora'" in k for k in saved), saved
    # Exports: merged (a plain checkpoint our importer reads) and the PEFT adapter directory.
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert export(["--workdir", str(straight), "--out", str(merged)]) == 0
    assert export(["--workdir", str(straight), "--out", str(adapter), "--adapter"]) == 0
    config = json.load(open(adapter / "adapter_config.json"))
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    cfg, _, got, _ = load_hf(str(merged), run.mesh)
    folded = flatten(lora.merge(run.model_cfg, run.state.params))
    for name, x in flatten(got).items():
        np.testing.assert_array_equal(x, folded[name])
    assert cfg == lora.base_config(run.model_cfg)


def test_dry_run_compares_lora_with_full_fine_tune(capsys):
    assert main(ARGS[:1] + ["--config.model.lora.rank=8", "--config.rl.kl_coef=0.04",
                            "--dry_run"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    lora_mib = float(re.search(r"params \+ optimizer ([\d.]+) MiB, reference ([\d.]+)", out)[1])
    full = re.search(
        r"full fine-tune holds params \+ optimizer ([\d.]+) MiB, reference ([\d.]+)", out
    )
    assert full, out
    assert lora_mib < float(full[1])  # LoRA with KL below the full fine-tune without a reference
    assert "reference 0.0 MiB" in out


@pytest.mark.parametrize("field, value, words", [
    ("model.lora.targets", "('q', 'qq')", "config.model.lora.targets"),
    ("model.lora.dropout", "0.1", "config.model.lora.dropout"),
])  # fmt: skip
def test_bad_lora_fields_are_named(field, value, words, capsys):
    assert main(ARGS[:2] + [f"--config.{field}={value}", "--dry_run"]) == 2
    assert words in capsys.readouterr().err
