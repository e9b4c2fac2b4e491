"""HF `config.json` / `generation_config.json` <-> `ModelConfig` and stop/pad token ids.

Reads both layouts that exist on disk: transformers 4.x (`rope_theta`, `rope_scaling`) and
transformers 5 (`rope_parameters`). Writes the 4.x layout, which both versions load.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from models.config import ARCHITECTURES, ModelConfig, RopeScaling

HF_ARCH = {family: arch for arch, family in ARCHITECTURES.items()}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read; the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class GenerationIds:
    """Special token ids the sampler needs: stop ids (Llama 3 lists several) and the pad id."""

    eos_ids: tuple[int, ...]
    pad_id: int
    bos_id: int | None = None


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def _rope(hf: dict[str, Any], path: str) -> tuple[float, RopeScaling | None]:
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type") else None)
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{path}: rope scaling type {kind!r} is not supported (only llama3)")
    try:
        return theta, RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: llama3 rope scaling lacks field {e.args[0]!r}") from None


def config_from_hf(ckpt_dir: str, **overrides: Any) -> ModelConfig:
    """ModelConfig from `ckpt_dir/config.json`; `overrides` sets e.g. dtype, param_dtype, remat."""
    path = os.path.join(ckpt_dir, "config.json")
    hf = read_json(path)
    archs = hf.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise CheckpointError(
            f"{path}: architectures={archs} is not supported; expected one of {sorted(ARCHITECTURES)}"
        )
    family = ARCHITECTURES[known[0]]
    # transformers builds the model from model_type (AutoConfig), not from architectures: both
    # must name the family whose weights are loaded, or the checkpoint is not what it claims.
    model_type = hf.get("model_type", family)
    if model_type != family:
        supported = ", ".join(f"{a} ({f})" for a, f in ARCHITECTURES.items())
        raise CheckpointError(
            f"{path}: model_type={model_type!r} with architectures={archs} is not supported "
            f"(that architecture's model_type is {family!r}); supported: {supported}"
        )
    for flag in ("mlp_bias",) + (("attention_bias",) if family == "llama" else ()):
        if hf.get(flag):
            raise CheckpointError(f"{path}: {flag}=true is not supported for {known[0]}")
    if family == "qwen3" and hf.get("attention_bias"):
        raise CheckpointError(f"{path}: attention_bias=true is not supported for {known[0]}")

    def need(key):
        if key not in hf:
            raise CheckpointError(f"{path}: missing field {key!r}")
        return hf[key]

    heads = int(need("num_attention_heads"))
    theta, scaling = _rope(hf, path)
    fields = dict(
        family=family,
        vocab_size=int(need("vocab_size")),
        d_model=int(need("hidden_size")),
        d_ff=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or need("hidden_size") // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """config.json contents for `cfg` (transformers 4.x layout, which transformers 5 also reads)."""
    if cfg.family == "qwen2" and cfg.head_dim * cfg.num_heads != cfg.d_model:
        raise CheckpointError("Qwen2 requires head_dim * num_heads == d_model to export")
    hf: dict[str, Any] = {
        "architectures": [HF_ARCH[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "torch_dtype": dtype,
    }
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    if cfg.family in ("llama", "qwen3"):
        hf["attention_bias"] = False
    if cfg.family == "llama":
        hf["mlp_bias"] = False
    return hf


def _ids(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(int(i) for i in x) if isinstance(x, list | tuple) else (int(x),)


def generation_ids(ckpt_dir: str) -> GenerationIds:
    """Stop and pad ids: generation_config.json where present, else config.json.

    The pad id falls back to the first stop id (what HF generate does when none is set).
    """
    hf = read_json(os.path.join(ckpt_dir, "config.json"))
    gpath = os.path.join(ckpt_dir, "generation_config.json")
    gen = read_json(gpath) if os.path.exists(gpath) else {}
    eos = _ids(gen.get("eos_token_id", hf.get("eos_token_id")))
    if not eos:
        raise CheckpointError(
            f"{ckpt_dir}: no eos_token_id in generation_config.json or config.json"
        )
    pad = gen.get("pad_token_id", hf.get("pad_token_id"))
    bos = gen.get("bos_token_id", hf.get("bos_token_id"))
    return GenerationIds(
        eos, eos[0] if pad is None else int(pad), None if bos is None else int(bos)
    )


def generation_config_to_hf(ids: GenerationIds) -> dict[str, Any]:
    out: dict[str, Any] = {
        "eos_token_id": list(ids.eos_ids) if len(ids.eos_ids) > 1 else ids.eos_ids[0],
        "pad_token_id": ids.pad_id,
    }
    if ids.bos_id is not None:
        out["bos_token_id"] = ids.bos_id
    return out
