"""HF `config.json` / `generation_config.json` <-> `ModelConfig` and stop/pad token ids.

Reads both layouts that exist on disk: transformers 4.x (`rope_theta`, `rope_scaling`) and
transformers 5 (`rope_parameters`). Writes the 4.x layout, which both versions load.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from models.config import ARCHITECTURES, MOE_FAMILIES, ModelConfig, RopeScaling

HF_ARCH = {family: arch for arch, family in ARCHITECTURES.items()}

# Mixture-of-experts fields of other families' configs that Qwen3-MoE's block does not have
# (shared experts, grouped routing, scaled or sigmoid routing, dense leading layers): a config
# that sets one describes a model this block would compute wrongly, so it is refused, named.
UNSUPPORTED_MOE_FIELDS = (
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "num_shared_experts",
    "moe_shared_expert_intermediate_size",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "scoring_func",
    "topk_method",
    "moe_layer_freq",
    "use_sliding_window",
)
# The mixture-of-experts fields of Qwen3MoeConfig this reader uses or that do not change the
# forward pass (output_router_logits: transformers returns the router logits). Any other field
# of a Qwen3-MoE config.json whose name speaks of experts or routing (MOE_WORDS) is a part this
# block does not have, refused with its name, as UNSUPPORTED_MOE_FIELDS are.
KNOWN_MOE_FIELDS = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
    "output_router_logits",
)
MOE_WORDS = ("expert", "router", "moe", "topk", "top_k", "routed", "routing")


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
    if family in ("qwen3", "qwen3_moe") and hf.get("attention_bias"):
        raise CheckpointError(f"{path}: attention_bias=true is not supported for {known[0]}")

    def need(key):
        if key not in hf:
            raise CheckpointError(f"{path}: missing field {key!r}")
        return hf[key]

    heads = int(need("num_attention_heads"))
    theta, scaling = _rope(hf, path)
    moe = _experts(hf, path, int(need("num_hidden_layers"))) if family in MOE_FAMILIES else {}
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
        qk_norm=family in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        **moe,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def _experts(hf: dict[str, Any], path: str, layers: int) -> dict[str, Any]:
    """The ModelConfig fields of a Qwen3-MoE config.json (its experts and which layers have
    them: transformers' rule, not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)."""
    for key in UNSUPPORTED_MOE_FIELDS:
        if hf.get(key):
            raise CheckpointError(
                f"{path}: {key}={hf[key]!r} is not supported (models/moe.py's Qwen3-MoE block has no such part)"
            )
    for key in hf:
        known = key in KNOWN_MOE_FIELDS or key in UNSUPPORTED_MOE_FIELDS  # checked above
        if not known and any(w in key.lower() for w in MOE_WORDS):
            raise CheckpointError(
                f"{path}: {key}={hf[key]!r} is not a Qwen3-MoE field this reader knows "
                f"(models/moe.py's block reads {', '.join(KNOWN_MOE_FIELDS[:7])})"
            )

    def need(key, *aliases):
        for k in (key, *aliases):
            if k in hf:
                return hf[k]
        raise CheckpointError(f"{path}: missing field {key!r}")

    e = int(need("num_experts", "num_local_experts"))
    k = int(need("num_experts_per_tok"))
    if e < 1:
        raise CheckpointError(f"{path}: num_experts={e}: a mixture of experts needs >= 1")
    if not 1 <= k <= e:
        raise CheckpointError(f"{path}: num_experts_per_tok={k}: must be in [1, num_experts = {e}]")
    step = int(hf.get("decoder_sparse_step", 1))  # 0 is refused (transformers divides by it)
    if step < 1:
        raise CheckpointError(f"{path}: decoder_sparse_step={step}: must be >= 1")
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(not isinstance(i, int) for i in dense):
        raise CheckpointError(
            f"{path}: mlp_only_layers={dense!r}: expected a list of layer indices"
        )
    return dict(
        num_experts=e,
        experts_per_token=k,
        expert_d_ff=int(need("moe_intermediate_size")),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        # transformers' Qwen3MoeConfig default where config.json has none
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


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
    if cfg.family in ("llama", "qwen3", "qwen3_moe"):
        hf["attention_bias"] = False
    if cfg.family in MOE_FAMILIES:  # which layers have experts: those not in mlp_only_layers
        hf.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            moe_intermediate_size=cfg.expert_d_ff,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(cfg.num_layers) if i not in cfg.moe_layers],
            router_aux_loss_coef=cfg.router_aux_loss_coef,
        )
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
