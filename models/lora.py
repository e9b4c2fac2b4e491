"""LoRA adapters on the transformer's projections, with flax's own `nnx.LoRA`.

A targeted projection W (e.g. attention q, [D,N,H]) gets an `nnx.LoRA` module beside it,
`<name>_lora`, holding A [in, r] and B [r, out] as `nnx.LoRAParam` (a subclass of `nnx.Param`):

    y = x W + (alpha / r) * (x_flat A) B        (x_flat: x with the projection's input axes flattened)

B starts at zero, so a fresh adapter leaves the model unchanged; A is drawn as PEFT draws it,
and the scaling is PEFT's (`use_rslora=False`). Only `nnx.LoRAParam`s are trained (`rl.learner`,
trainable filter `ADAPTERS`) and only they have optimizer state.

Adapters off: `base(params)` drops the LoRAParams. What is left has exactly the structure of the
same model without LoRA, so `nnx.merge(base_graphdef(cfg), base(params))` is the starting model on
the very same arrays: the KL term's reference policy costs no second copy of the weights.
(`base_graphdef` and `init_adapters`, which build the whole model, are in `models.sharding` next
to `abstract_model` and `init_params`: the transformer imports this module, not the reverse.)

Why `nnx.LoRA` rather than qwix: the model calls its projections as einsums on raw `nnx.Param`s
(so that head axes can be sharded by name), not as `nnx.Linear` modules that qwix's provider would
intercept by module path; an explicit `nnx.LoRA` per projection is a few lines, visible in the
model code, and its parameters carry our logical axes for sharding.

`merge(cfg, params)` folds the adapters into the weights (export as a plain HF checkpoint);
`peft_tensors` gives them in PEFT's layout (`launch.export --adapter`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # every projection of a block
ATTENTION = ("q", "k", "v", "o")
ADAPTERS = nnx.LoRAParam  # filter: the trainable parameters of a LoRA run
# PEFT's A: torch's kaiming_uniform_(a=sqrt(5)), uniform in +-1/sqrt(in) (variance 1/(3 in)), so
# learning rates tuned with PEFT carry over. nnx.LoRA's default (he_uniform) is 2.45x wider.
PEFT_A_INIT = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
# HF module names (PEFT's target_modules) of our projections.
HF_NAMES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, str | None, str | None]]:
    """name -> (in features, out features, logical axis of in, of out) of each projection."""
    d, f, n, k, h = cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # The flattened N*H (K*H) axis is named by its heads: over the tensor axis it splits into
    # whole heads (when N divides), as the weight's own head axis does.
    return {
        "q": (d, n * h, "embed", "heads"),
        "k": (d, k * h, "embed", "kv_heads"),
        "v": (d, k * h, "embed", "kv_heads"),
        "o": (n * h, d, "heads", "embed"),
        "gate": (d, f, "embed", "mlp"),
        "up": (d, f, "embed", "mlp"),
        "down": (f, d, "mlp", "embed"),
    }


def attach(module: nnx.Module, cfg: ModelConfig, names, rngs: nnx.Rngs) -> None:
    """Gives `module` an adapter `<name>_lora` for each of `names` that cfg.lora_targets names."""
    if not cfg.lora_rank:
        return
    table, r = shapes(cfg), cfg.lora_rank
    for name in names:
        if name not in cfg.lora_targets:
            continue
        fin, fout, ax_in, ax_out = table[name]
        adapter = nnx.LoRA(
            fin,
            r,
            fout,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.param_dtype),
            a_initializer=PEFT_A_INIT,
            rngs=rngs,
            a_metadata={"axes": (ax_in, None)},
            b_metadata={"axes": (None, ax_out)},
        )
        setattr(module, f"{name}_lora", adapter)


def add(module: nnx.Module, cfg: ModelConfig, name: str, x, y, in_axes: int = 1):
    """y + the adapter's (alpha / r) x A B, reshaped to y; y itself without an adapter. x's last
    `in_axes` axes are the projection's input (2 for o: [B,T,N,H])."""
    adapter = getattr(module, f"{name}_lora", None)
    if adapter is None:
        return y
    x_flat = x.reshape(*x.shape[: x.ndim - in_axes], -1)
    delta = adapter(x_flat) * jnp.asarray(cfg.lora_alpha / cfg.lora_rank, y.dtype)
    return y + delta.reshape(y.shape).astype(y.dtype)


def base_config(cfg: ModelConfig) -> ModelConfig:
    """cfg without LoRA (every lora_ field at its default): the model the adapters sit on."""
    fields = {
        f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name.startswith("lora_")
    }
    return dataclasses.replace(cfg, **fields)


def split(params) -> tuple[nnx.State, nnx.State]:
    """(adapters, base) of a params State."""
    return nnx.split_state(params, ADAPTERS, ...)


def base(params) -> nnx.State:
    """params without the adapters: the state of the model without LoRA, same arrays."""
    return split(params)[1]


def _adapter(params, layer: int, name: str):
    """(A [in, r], B [r, out]) of one projection's adapter as host arrays, or None."""
    module = params["blocks"][layer]["attn" if name in ATTENTION else "mlp"]
    if f"{name}_lora" not in module:
        return None
    ab = module[f"{name}_lora"]
    return tuple(np.asarray(jax.device_get(ab[k].get_value())) for k in ("lora_a", "lora_b"))


def merge(cfg: ModelConfig, params) -> nnx.State:
    """The base params with every adapter folded in (W + (alpha / r) A B), for the model without
    LoRA (`base_config(cfg)`): a plain checkpoint. Host arithmetic in float64, one weight at a time."""
    merged = base(params)
    for i in range(cfg.num_layers):
        for name in TARGETS:
            ab = _adapter(params, i, name)
            if ab is None:
                continue
            a, b = (x.astype(np.float64) for x in ab)
            module = merged["blocks"][i]["attn" if name in ATTENTION else "mlp"]
            w = module[name]
            host = np.asarray(jax.device_get(w.get_value()))
            delta = (cfg.lora_alpha / cfg.lora_rank) * (a @ b)
            new = (host.astype(np.float64) + delta.reshape(host.shape)).astype(host.dtype)
            module[name] = w.replace(jax.device_put(new, w.get_value().sharding))
    return merged


def peft_tensors(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
    """{PEFT tensor name: array} of every adapter: lora_A.weight [r, in], lora_B.weight [out, r]
    (torch's Linear layout), named as PEFT saves a LoRA of an HF causal LM."""
    out = {}
    for i in range(cfg.num_layers):
        for name in TARGETS:
            ab = _adapter(params, i, name)
            if ab is None:
                continue
            prefix = f"base_model.model.model.layers.{i}.{HF_NAMES[name]}"
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(ab[0].T)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(ab[1].T)
    return out


def peft_config(cfg: ModelConfig, base_model: str, revision: str | None = None) -> dict:
    """adapter_config.json of `peft_tensors`; `revision` the base's Hub commit (peft's
    AutoPeftModel loads the base at it; None: a local directory, or the default branch)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "revision": revision,
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "target_modules": [HF_NAMES[n].split(".")[1] for n in TARGETS if n in cfg.lora_targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
