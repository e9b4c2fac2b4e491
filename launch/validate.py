"""Semantic validation of a training config, before anything is built or written.

Every check names the config field and the reason in one line (a `UsageError`), so a bad run
fails in a second instead of after compiling, and never touches an existing workdir.
"""

from __future__ import annotations

import glob
import math
import os

import ml_collections

from launch.cli import UsageError
from rl.advantages import MODES as ADVANTAGE_MODES
from rl.learner import LearnerConfig
from rl.losses import LossConfig
from sampling.distribution import SamplingParams
from sampling.engine import EngineConfig

BUILTIN_SOURCES = ("arithmetic",)

# Fields that cannot change the trajectory of a run: a resumed run may change them.
RESUMABLE_CHANGES = (
    "num_steps", "checkpoint_every", "keep_checkpoints", "resume", "log_every", "eval_every",
    "num_samples_logged", "distributed", "eval.", "data.eval.",
)  # fmt: skip


def _need(cond: bool, field: str, value, reason: str) -> None:
    if not cond:
        raise UsageError(f"config.{field}={value!r}: {reason}")


def group_pages(prompt_len: int, max_new: int, page_size: int, g: int) -> int:
    """KV pages one group needs at most: shared prompt pages + per sample a copied partial page
    and its decode pages."""
    return math.ceil(prompt_len / page_size) + g * (1 + math.ceil(max_new / page_size))


def loss_config(c: ml_collections.ConfigDict) -> LossConfig:
    rl = c.rl
    return LossConfig(
        policy_loss=rl.policy_loss, eps_low=rl.eps_low, eps_high=rl.eps_high,
        kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator, entropy_coef=rl.entropy_coef,
        aggregation=rl.aggregation, max_new_tokens=c.sampling.max_new_tokens,
        is_correction=rl.is_correction,
    )  # fmt: skip


def sampling_params(c: ml_collections.ConfigDict) -> SamplingParams:
    s = c.sampling
    return SamplingParams(s.temperature, s.top_k, s.top_p)


def engine_config(c: ml_collections.ConfigDict, stop_ids) -> EngineConfig:
    s = c.sampling
    return EngineConfig(
        num_slots=s.num_slots, page_size=s.page_size, num_pages=s.num_pages,
        max_prompt_len=s.max_prompt_len, max_new_tokens=s.max_new_tokens,
        min_new_tokens=s.min_new_tokens, steps_per_call=s.steps_per_call,
        stop_ids=tuple(stop_ids), backend=s.backend, cache_dtype=c.model.dtype,
    )  # fmt: skip


def learner_config(c: ml_collections.ConfigDict) -> LearnerConfig:
    o, rl = c.optim, c.rl
    return LearnerConfig(
        learning_rate=o.learning_rate, warmup_steps=o.warmup_steps, decay_steps=o.decay_steps,
        weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm, micro_batches=rl.micro_batches,
        num_iterations=rl.num_iterations, minibatches=rl.minibatches, old_logp=rl.old_logp,
        sampling=sampling_params(c), loss=loss_config(c),
    )  # fmt: skip


def validate(c: ml_collections.ConfigDict, device_count: int) -> None:
    g, b = c.rl.num_generations, c.data.prompts_per_step
    _need(g >= 2, "rl.num_generations", g, "GRPO needs G >= 2 completions per prompt")
    _need(b >= 1, "data.prompts_per_step", b, "must be >= 1")
    mesh = {a: c.mesh[a] for a in ("data", "fsdp", "tensor")}
    size = math.prod(mesh.values())
    _need(
        size == device_count, "mesh", mesh, f"uses {size} devices but {device_count} are available"
    )
    batch_shards = mesh["data"] * mesh["fsdp"]
    _need(
        (b * g) % batch_shards == 0, "data.prompts_per_step", b,
        f"the global batch B*G = {b * g} is not divisible by the batch shards data*fsdp = {batch_shards}",
    )  # fmt: skip
    mb = c.rl.minibatches * c.rl.micro_batches
    _need((b * g) % mb == 0, "rl.micro_batches", c.rl.micro_batches,
          f"B*G = {b * g} is not divisible by minibatches*micro_batches = {mb}")  # fmt: skip
    s = c.sampling
    _need(g <= s.num_slots, "sampling.num_slots", s.num_slots, f"fewer slots than G = {g}")
    need = group_pages(s.max_prompt_len, s.max_new_tokens, s.page_size, g)
    _need(
        s.num_pages - 1 >= need, "sampling.num_pages", s.num_pages,
        f"one group of G = {g} needs up to {need} pages (+ the null page)",
    )  # fmt: skip
    _need(s.max_new_tokens >= 1, "sampling.max_new_tokens", s.max_new_tokens, "must be >= 1")
    _need(c.rl.advantage in ADVANTAGE_MODES, "rl.advantage", c.rl.advantage,
          f"expected one of {ADVANTAGE_MODES}")  # fmt: skip
    _need(c.eval.pass_k <= c.eval.pass_n, "eval.pass_k", c.eval.pass_k,
          f"pass@k needs k <= eval.pass_n = {c.eval.pass_n}")  # fmt: skip
    for field in ("num_steps", "checkpoint_every", "eval_every", "log_every"):
        _need(c[field] >= 0, field, c[field], "must be >= 0")
    path = c.model.hf_checkpoint
    _need(os.path.isdir(path), "model.hf_checkpoint", path, "not a directory")
    _need(
        os.path.exists(os.path.join(path, "config.json")), "model.hf_checkpoint", path,
        "has no config.json",
    )  # fmt: skip
    for split in ("train", "eval"):
        src = c.data[split]
        if src.type in ("jsonl", "parquet"):
            found = glob.glob(src.path) if src.path else []
            _need(bool(found), f"data.{split}.path", src.path, f"no {src.type} file there")
        else:
            _need(src.type in BUILTIN_SOURCES, f"data.{split}.type", src.type,
                  f"expected jsonl, parquet or one of {BUILTIN_SOURCES}")  # fmt: skip
    try:
        learner_config(c).validate()
    except ValueError as e:
        raise UsageError(f"config.rl / config.optim: {e}") from None


def changed_fields(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two config dicts."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_fields(a, b, name + ".")
        elif a != b:
            out.append(name)
    return out


def check_resumable(old: dict, new: dict) -> None:
    """Refuses a resume whose config changes a field that can change the trajectory."""
    diff = [f for f in changed_fields(old, new) if not f.startswith(RESUMABLE_CHANGES)]
    if diff:
        details = ", ".join(f"{f}: {_get(old, f)!r} -> {_get(new, f)!r}" for f in diff)
        raise UsageError(f"cannot resume with a changed config ({details}); use a new --workdir")


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d
