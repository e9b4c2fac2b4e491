"""`launch.train` with LoRA (config.model.lora): the KL term's reference is the base with the
adapters off (no copy loaded), checkpoints hold the adapters alone and resume bitwise, both
exports read back. (--dry_run with LoRA: tests/launch/test_real_configs.py.)"""

import json
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy

from launch.build import load_run
from launch.cli import UsageError, parse_args
from launch.export import main as export
from launch.resume_compat import check_resumable
from launch.validate import engine_config, model_overrides, validate
from models import lora
from models.hf import load_hf
from models.sharding import flatten, on_devices
from tests.conftest import ROOT, train_here, train_metrics

ASSET = f"{ROOT}/configs/assets/arithmetic_sft"

# One device (tests.conftest.train_here): LoRA, not the mesh, is under test here (the 8 fake
# devices as data=8 cost ~0.9 s of CPU a tiny step against ~0.45 s on one).
ARGS = [
    "--config.model.lora.rank=4", "--config.rl.kl_coef=0.04",
    "--config.data.prompts_per_step=4", "--config.rl.num_generations=4",
    "--config.data.eval.num=8", "--config.eval.pass_k=0", "--config.eval_every=0",
    "--config.checkpoint_every=2", "--config.optim.learning_rate=2e-3",
    "--config.optim.warmup_steps=0",
]  # fmt: skip


def _run(workdir, steps, *extra):
    return train_here(ARGS + [f"--config.num_steps={steps}", f"--workdir={workdir}", *extra])


@pytest.mark.slow
def test_lora_run_resumes_bitwise_and_exports(tmp_path, capsys):
    straight, split = tmp_path / "straight", tmp_path / "split"
    ckpt = tmp_path / "base"  # the split run's own copy of the starting checkpoint
    shutil.copytree(ASSET, ckpt)
    assert _run(straight, 3) == 0
    assert _run(split, 2, f"--config.model.hf_checkpoint={ckpt}") == 0
    assert _run(split, 3, f"--config.model.hf_checkpoint={ckpt}") == 0
    assert "resumed from step 2" in capsys.readouterr().err
    a, b = json.load(open(straight / "summary.json")), json.load(open(split / "summary.json"))
    assert a["params_fingerprint"] == b["params_fingerprint"]
    assert train_metrics(straight) == train_metrics(split)
    kl = [m["kl"] for _, m in sorted(train_metrics(straight).items())]
    assert kl[0] == 0 and kl[-1] > 0  # B = 0 at first: the policy is the reference, then moves
    rows = [json.loads(x) for x in open(straight / "metrics.jsonl")]
    mismatch = [r["mismatch_abs_logp"] for r in rows if "loss" in r]
    assert max(mismatch) < 1e-5, mismatch  # the sampler decodes with the adapters applied
    with on_devices(jax.devices()[:1]):  # the run's device, so its programs are shared
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
    with on_devices(jax.devices()[:1]):
        assert export(["--workdir", str(straight), "--out", str(merged)]) == 0
        assert export(["--workdir", str(straight), "--out", str(adapter), "--adapter"]) == 0
    config = json.load(open(adapter / "adapter_config.json"))
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    cfg, _, got, _ = load_hf(str(merged), run.mesh)
    folded = flatten(lora.merge(run.model_cfg, run.state.params))
    for name, x in flatten(got).items():
        np.testing.assert_array_equal(x, folded[name])
    assert cfg == lora.base_config(run.model_cfg)
    # The base weights under the same path changed: the adapters no longer belong to them.
    params = dict(safetensors.numpy.load_file(ckpt / "model.safetensors"))
    params["model.norm.weight"] = params["model.norm.weight"] + 1.0
    safetensors.numpy.save_file(params, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert _run(split, 4, f"--config.model.hf_checkpoint={ckpt}") == 2
    assert "its weights differ from the base this LoRA run started from" in capsys.readouterr().err
    with pytest.raises(UsageError, match="differ from the base"), on_devices(jax.devices()[:1]):
        load_run(str(split))


@pytest.mark.slow
def test_kl_in_reward_with_lora(tmp_path):
    """The KL-in-reward path: the rollout's reference log-probs with the adapters off."""
    extra = [
        "--config.rl.kl_in=reward",
        "--config.rl.kl_estimator=k1",
        "--config.checkpoint_every=0",
    ]
    assert _run(tmp_path / "run", 3, *extra) == 0
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl") if '"loss"' in x]
    penalty = [r["reward/kl_penalty_mean"] for r in rows]
    assert penalty[0] == 0 and penalty[-1] != 0, penalty  # k1: a sample mean, either sign


def test_runs_saved_before_lora_existed_resume_with_lora_off():
    old = {"model": {"dtype": "float32"}, "num_steps": 2}
    check_resumable(old, {"model": {"dtype": "float32", "lora": {"rank": 0}}, "num_steps": 4})
    with pytest.raises(UsageError, match="model.lora"):
        check_resumable(old, {"model": {"dtype": "float32", "lora": {"rank": 4}}, "num_steps": 4})


def test_runs_saved_before_model_attention_existed_resume():
    old = {"model": {"dtype": "float32", "lora": {"rank": 0}}, "num_steps": 2}
    new = {"model": {"dtype": "float32", "lora": {"rank": 0}, "attention": "auto"}, "num_steps": 4}
    check_resumable(old, new)
    with pytest.raises(UsageError, match="model.attention"):
        check_resumable({**old, "model": {**old["model"], "attention": "dense"}}, new)
    # launch.eval / launch.export build such a run from its saved config.json: attention "auto".
    saved = parse_args([], {})[0]
    del saved.model["attention"]
    validate(saved, 1)
    assert model_overrides(saved)["attention"] == "auto"


def test_runs_saved_before_sampling_prefill_chunk_existed_resume():
    old = {"model": {"dtype": "float32"}, "sampling": {"page_size": 8}, "num_steps": 2}
    new = {"model": {"dtype": "float32"}, "sampling": {"page_size": 8, "prefill_chunk": 512}}
    check_resumable(old, {**new, "num_steps": 4})
    with pytest.raises(UsageError, match="sampling.prefill_chunk"):
        check_resumable({**old, "sampling": {"page_size": 8, "prefill_chunk": 0}}, new)
    # launch.eval / launch.export build such a run's engine from its saved config.json: unchunked.
    saved = parse_args([], {})[0]
    del saved.sampling["prefill_chunk"]
    validate(saved, 1)
    assert engine_config(saved, [0]).prefill_chunk == 0


@pytest.mark.parametrize("kernel", ["splash", "pallas_gpu"])
def test_a_kernel_attention_for_another_platform_is_refused_at_start_up(kernel):
    config = parse_args([f"--config.model.attention={kernel}"], {})[0]
    with pytest.raises(UsageError, match=rf"^config.model.attention='{kernel}': a \w+ kernel, but"):
        validate(config, 1)
