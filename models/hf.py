"""Import and export of HF-format checkpoints (config.json + safetensors) to and from sharded params.

Import reads one tensor at a time: it checks the tensor's shape from the safetensors header before
reading any data, converts it to our layout and the param dtype on the host, and `device_put`s it
straight into its target sharding. The host never holds more than one tensor, and no device holds
an unsharded parameter (beyond what its own shard needs). A mixture of experts' stacked weights
are read as one layer's projection at a time (E tensors of the Hub's per-expert layout, stacked).

Export gathers one parameter at a time to the host and writes safetensors in HF's layout, in the
param dtype by default (float32 master weights keep the round trip bitwise) or a requested dtype.
Single-process only: a multi-host export would first need `process_allgather` per tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models import lora
from models.config import ModelConfig
from models.hf_config import (
    CheckpointError,
    GenerationIds,
    config_from_hf,
    config_to_hf,
    generation_config_to_hf,
    generation_ids,
)
from models.sharding import (
    DEFAULT_RULES,
    abstract_model,
    init_adapters,
    is_var,
    path_name,
    state_shardings,
)

_DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _mapping(cfg: ModelConfig) -> dict[str, tuple[Any, tuple[int, ...], Callable, Callable]]:
    """Our param path -> (HF tensor name, HF shape, to_ours(hf_array), to_hf(our_array)). A
    mixture of experts' stacked weights [E,...] have a tuple of E names (the Hub's layout, one
    tensor per expert), the shape and conversions those of one expert's."""
    n, k, h, d, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_model, cfg.d_ff
    ident = (lambda x: x, lambda x: x)
    transpose = (lambda x: x.T, lambda x: x.T)

    def heads_in(m):  # HF [m*H, D] <-> ours [D, m, H]
        return (
            (m * h, d),
            lambda x: x.reshape(m, h, d).transpose(2, 0, 1),
            lambda x: x.transpose(1, 2, 0).reshape(m * h, d),
        )

    def bias(m):  # HF [m*H] <-> ours [m, H]
        return ((m * h,), lambda x: x.reshape(m, h), lambda x: x.reshape(m * h))

    heads_out = (  # HF [D, N*H] <-> ours [N, H, D]
        (d, n * h),
        lambda x: x.reshape(d, n, h).transpose(1, 2, 0),
        lambda x: x.transpose(2, 0, 1).reshape(d, n * h),
    )
    m = {
        "embed": ("model.embed_tokens.weight", (cfg.vocab_size, d), *ident),
        "final_norm.scale": ("model.norm.weight", (d,), *ident),
    }
    if not cfg.tie_embeddings:
        m["lm_head"] = ("lm_head.weight", (cfg.vocab_size, d), *transpose)
    for i in range(cfg.num_layers):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        m[ours + "attn_norm.scale"] = (hf + "input_layernorm.weight", (d,), *ident)
        m[ours + "mlp_norm.scale"] = (hf + "post_attention_layernorm.weight", (d,), *ident)
        m[ours + "attn.q"] = (hf + "self_attn.q_proj.weight", *heads_in(n))
        m[ours + "attn.k"] = (hf + "self_attn.k_proj.weight", *heads_in(k))
        m[ours + "attn.v"] = (hf + "self_attn.v_proj.weight", *heads_in(k))
        m[ours + "attn.o"] = (hf + "self_attn.o_proj.weight", *heads_out)
        if cfg.qkv_bias:
            m[ours + "attn.q_bias"] = (hf + "self_attn.q_proj.bias", *bias(n))
            m[ours + "attn.k_bias"] = (hf + "self_attn.k_proj.bias", *bias(k))
            m[ours + "attn.v_bias"] = (hf + "self_attn.v_proj.bias", *bias(k))
        if cfg.qk_norm:
            m[ours + "attn.q_norm.scale"] = (hf + "self_attn.q_norm.weight", (h,), *ident)
            m[ours + "attn.k_norm.scale"] = (hf + "self_attn.k_norm.weight", (h,), *ident)
        if i in cfg.moe_layers:  # stacked experts <- one HF tensor per expert (a tuple of names)
            fe, experts = cfg.expert_d_ff, range(cfg.num_experts)
            m[ours + "mlp.router"] = (hf + "mlp.gate.weight", (cfg.num_experts, d), *transpose)
            for p, shape in (("gate", (fe, d)), ("up", (fe, d)), ("down", (d, fe))):
                names = tuple(f"{hf}mlp.experts.{j}.{p}_proj.weight" for j in experts)
                m[ours + "mlp." + p] = (names, shape, *transpose)
            continue
        m[ours + "mlp.gate"] = (hf + "mlp.gate_proj.weight", (f, d), *transpose)
        m[ours + "mlp.up"] = (hf + "mlp.up_proj.weight", (f, d), *transpose)
        m[ours + "mlp.down"] = (hf + "mlp.down_proj.weight", (d, f), *transpose)
    return m


def _tensor_files(ckpt_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file, from the index when the checkpoint is sharded."""
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        return {name: os.path.join(ckpt_dir, file) for name, file in weight_map.items()}
    single = os.path.join(ckpt_dir, "model.safetensors")
    if not os.path.exists(single):
        raise CheckpointError(
            f"{ckpt_dir}: neither model.safetensors nor model.safetensors.index.json"
        )
    try:
        with safe_open(single, "np") as f:
            return {name: single for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{single}: unreadable safetensors file ({e})") from None


def load_hf(ckpt_dir: str, mesh, rules=DEFAULT_RULES, seed: int = 0, **config_overrides: Any):
    """Reads an HF checkpoint directory into sharded params.

    Returns (cfg, graphdef, params, GenerationIds). `config_overrides` sets ModelConfig fields that
    config.json does not decide, e.g. dtype="bfloat16", param_dtype, remat, lora_rank. With
    LoRA the checkpoint gives the base weights and the adapters start fresh (from `seed`).
    """
    cfg = config_from_hf(ckpt_dir, **config_overrides)
    ids = generation_ids(ckpt_dir)
    params = _load_base(ckpt_dir, lora.base_config(cfg), mesh, rules)
    graphdef = abstract_model(cfg)[0]
    if cfg.lora_rank:
        params = nnx.merge_state(init_adapters(cfg, mesh, rules, seed), params)
    return cfg, graphdef, params, ids


def _load_base(ckpt_dir: str, cfg: ModelConfig, mesh, rules):
    """The params State of a model without adapters, read from the checkpoint."""
    abstract = abstract_model(cfg)[1]
    shardings = state_shardings(abstract, mesh, rules)
    files = _tensor_files(ckpt_dir)
    mapping = _mapping(cfg)
    _refuse_unread(ckpt_dir, cfg, files, mapping)
    target = _DTYPES[cfg.param_dtype]
    handles: dict[str, Any] = {}

    def read(path, var, sharding):
        names, expected, to_ours, _ = mapping[path_name(path)]
        if isinstance(names, tuple):  # experts: one HF tensor each, stacked on a new axis 0
            x = np.stack([read_one(n, expected, to_ours) for n in names])
        else:
            x = read_one(names, expected, to_ours)
        return var.replace(jax.device_put(x, sharding.get_value()))

    def read_one(name, expected, to_ours):
        file = files.get(name)
        if file is None:
            raise CheckpointError(f"{ckpt_dir}: missing tensor {name!r} (needed for {cfg.family})")
        try:
            if file not in handles:
                handles[file] = safe_open(file, "np")
            sl = handles[file].get_slice(name)
            hf_shape = tuple(sl.get_shape())
            if hf_shape != expected:
                raise CheckpointError(
                    f"{file}: tensor {name!r} has shape {hf_shape}, expected {expected} from config.json"
                )
            if sl.get_dtype() not in _SAFETENSORS_DTYPES:
                raise CheckpointError(
                    f"{file}: tensor {name!r} has unsupported dtype {sl.get_dtype()}"
                )
            x = handles[file].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(
                f"{file}: cannot read tensor {name!r} ({e}); is the file truncated?"
            ) from None
        return np.ascontiguousarray(to_ours(x).astype(target))

    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_var)
    flat_sh = jax.tree.leaves(shardings, is_leaf=is_var)
    leaves = [read(path, var, sh) for (path, var), sh in zip(flat, flat_sh)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _refuse_unread(ckpt_dir: str, cfg: ModelConfig, files: dict[str, str], mapping) -> None:
    """A tensor of the computed model that the mapping would not read (a shared expert, a
    router bias, a projection's bias the config does not announce) means the checkpoint is a
    model this one would compute otherwise: refused, named, before anything is read. Names
    outside the blocks the model runs (layers past num_hidden_layers, other heads), rotary
    tables (`rotary_emb.inv_freq`) and a tied model's own lm_head.weight are left alone."""
    read = {
        n
        for names, *_ in mapping.values()
        for n in (names if isinstance(names, tuple) else (names,))
    }
    ours = ("model.norm.", "model.embed_tokens.", "lm_head.")
    ours += tuple(f"model.layers.{i}." for i in range(cfg.num_layers))
    for name in sorted(files):
        if name in read or not name.startswith(ours) or name.endswith("rotary_emb.inv_freq"):
            continue
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue
        raise CheckpointError(
            f"{files[name]}: tensor {name!r} is not a weight of the {cfg.family} model its "
            "config.json describes (models/hf.py would not read it): the checkpoint holds a part "
            "this model does not compute"
        )


def save_hf(
    out_dir: str,
    cfg: ModelConfig,
    params,
    ids: GenerationIds,
    dtype: str | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Writes an HF checkpoint directory that transformers loads (see module docstring). LoRA
    adapters are folded into the weights (`models.lora.merge`)."""
    dtype = _export_dtype(dtype, cfg)
    if cfg.lora_rank:
        params, cfg = lora.merge(cfg, params), lora.base_config(cfg)
    os.makedirs(out_dir, exist_ok=True)
    mapping = _mapping(cfg)
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for path, var in flat:
        names, _, _, to_hf = mapping[path_name(path)]
        value = np.asarray(jax.device_get(var.get_value()))
        if isinstance(names, tuple):  # stacked experts -> one HF tensor per expert
            tensors = [(n, to_hf(value[j])) for j, n in enumerate(names)]
        else:
            tensors = [(names, to_hf(value))]
        for name, x in tensors:
            x = np.ascontiguousarray(x.astype(_DTYPES[dtype]))
            if shards[-1] and size + x.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = x
            size += x.nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata=meta)
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, file), metadata=meta)
            weight_map.update({name: file for name in shard})
            total += sum(x.nbytes for x in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)
    _write_json(os.path.join(out_dir, "config.json"), config_to_hf(cfg, dtype))
    _write_json(os.path.join(out_dir, "generation_config.json"), generation_config_to_hf(ids))


def save_adapter(
    out_dir: str, cfg: ModelConfig, params, base_model: str, dtype=None, revision=None
) -> None:
    """Writes a LoRA run's adapters as `peft` saves them: adapter_config.json (the base and, for
    a Hub id, its commit `revision`) and adapter_model.safetensors (`models.lora.peft_tensors`)."""
    dtype = _export_dtype(dtype, cfg)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.astype(_DTYPES[dtype]) for k, v in lora.peft_tensors(cfg, params).items()}
    save_file(
        tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"}
    )
    _write_json(
        os.path.join(out_dir, "adapter_config.json"), lora.peft_config(cfg, base_model, revision)
    )


def _export_dtype(dtype: str | None, cfg: ModelConfig) -> str:
    """The dtype to write (default: the param dtype), or ValueError."""
    dtype = dtype or cfg.param_dtype
    if dtype not in _DTYPES:
        raise ValueError(f"export dtype {dtype!r}: expected one of {sorted(_DTYPES)}")
    return dtype


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
