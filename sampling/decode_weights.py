"""The weights the sampler decodes from (`EngineConfig.weights_layout`, `weights_dtype`): a copy
in the compute dtype laid out for decoding, made once per rollout and dropped when it ends, or
the training arrays themselves. One `DecodeWeights` per engine (`Engine.weights`), made from the
engine's model config, engine config and layout.

`weights_dtype` "int8" / "float8_e4m3fn" (either layout): the copy holds the block projections
quantised per output channel (`models.quant`: qwix QArrays, a value and an f32 scale per output
channel) and every other floating leaf in the compute dtype. Quantised where the params lie (the
per-channel absmax reduces over the shard axes once), then resharded ("tensor"): the bytes that
move are the int8 / fp8 ones.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from models import quant
from models.config import ModelConfig
from models.sharding import spec_axes, spec_entry
from sampling.requests import EngineConfig


@functools.partial(jax.jit, static_argnums=1)
def _cast_floats(params, dtype: str):
    """A copy of params with floating leaves in dtype (others as they are), sharded alike."""
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.tree.map(cast, params)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(params, dtype: str, compute_dtype: str):
    return quant.quantize_params(params, dtype, compute_dtype)


def _scale_sharding(sh, x, contract: int):
    """The sharding of the scale of weight x (sharded sh): sh's spec, not split over the
    contracting axes (the scale's are 1 long)."""
    spec = tuple(sh.spec) + (None,) * (x.ndim - len(sh.spec))
    return NamedSharding(sh.mesh, PartitionSpec(*((None,) * contract + spec[contract:])))


def _quantized_shardings(params, shardings, dtype: str):
    """The shardings of `_quantize(params, dtype)` for params laid out as `shardings`: a
    weight's value as the weight, its scale as `_scale_sharding`."""
    qtype = jnp.dtype(dtype)
    return quant.map_params(
        lambda x, c, sh: quant.qarray(sh, _scale_sharding(sh, x, c), qtype),
        lambda x, sh: sh,
        params,
        shardings,
    )


def _recast(x, dtype) -> bool:
    """Whether the decode copy changes x's dtype (floating leaves go to the compute dtype)."""
    return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.dtype(dtype)


class DecodeWeights:
    """The decode copy of the weights of one engine (module docstring): `layout` is the engine's
    (mesh, rules), or None without a mesh; `shard_axes` the engine's batch-shard axes
    (`sampling.partitioned.shard_axes`), which the "tensor" layout does not split weights over."""

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, layout, shard_axes):
        self.cfg, self.ecfg, self.layout = cfg, ecfg, layout
        self.shard_axes = frozenset(shard_axes)

    def params(self, params):
        """The weights decoding reads, made once per rollout (`sampling.episodes` calls this at
        the start of every `run`) and dropped when it ends, before the learner runs:
        - weights_layout "tensor": a copy in the model's compute dtype laid out for decoding
          (`shardings`: split over tensor only, replicated over the shard axes), so each
          device computes its own slots with no collective over data or fsdp. The params
          themselves when they already are in that dtype and layout (one device, say);
        - "training": `params` themselves (zero copy), or with `weights_dtype` a copy in that
          dtype, sharded as they are.
        The model casts every weight to the compute dtype where it is used, so decoding from a
        copy in that dtype gives the same bits per matmul; what it saves is the f32 read and
        cast of every weight at every step (and, "tensor", the per-step all-slot collectives),
        for bytes(compute dtype) per parameter / tensor while the rollout runs."""
        e = self.ecfg
        if e.weights_dtype in quant.DTYPES:
            return self._quantized(params)
        if e.weights_layout == "training":
            dt = e.weights_dtype
            return params if dt in ("", self.cfg.param_dtype) else _cast_floats(params, dt)
        target, dt = self.shardings(params), self.cfg.dtype
        recast = any(_recast(x, dt) for x in jax.tree.leaves(params))
        if target is None:  # no mesh: only the dtype may change
            return _cast_floats(params, dt) if recast else params
        moved = jax.tree.map(
            lambda x, sh: not x.sharding.is_equivalent_to(sh, x.ndim), params, target
        )
        if not (recast or any(jax.tree.leaves(moved))):
            return params
        # Cast where the params lie (bytes halved before they move), then one reshard: each
        # device gathers its tensor shard of every weight over the shard axes.
        return jax.device_put(_cast_floats(params, dt), target)

    def _quantized(self, params):
        """The int8 / fp8 decode copy (module docstring), in the engine's layout."""
        dt, cdt = self.ecfg.weights_dtype, self.cfg.dtype
        if self.layout is None:
            return _quantize(params, dt, cdt)
        here = jax.tree.map(lambda x: x.sharding, params)
        copy = jax.jit(
            _quantize, static_argnums=(1, 2), out_shardings=_quantized_shardings(params, here, dt)
        )(params, dt, cdt)
        if self.ecfg.weights_layout == "training":
            return copy
        return jax.device_put(copy, _quantized_shardings(params, self.shardings(params), dt))

    def shardings(self, params):
        """Per leaf of params (arrays or sharded shape structs) its NamedSharding in the
        "tensor" decode layout: its own spec less the shard axes; None without a mesh."""
        if self.layout is None:
            return None
        mesh, drop = self.layout[0], self.shard_axes
        keep = lambda e: spec_entry(tuple(a for a in spec_axes(e) if a not in drop))
        return jax.tree.map(
            lambda x: NamedSharding(mesh, PartitionSpec(*map(keep, x.sharding.spec))), params
        )

    def abstract(self, abstract_params):
        """What `params` returns for abstract (sharded) params: shape structs."""
        if self.ecfg.weights_dtype in quant.DTYPES:
            return self._abstract_quantized(abstract_params)
        if self.ecfg.weights_layout == "training":
            dt = self.ecfg.weights_dtype
            if dt in ("", self.cfg.param_dtype):
                return abstract_params
            cast = lambda x: jnp.dtype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
            return jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, cast(x), sharding=x.sharding),
                abstract_params,
            )
        dt = lambda x: self.cfg.dtype if _recast(x, self.cfg.dtype) else x.dtype
        target = self.shardings(abstract_params)
        if target is None:
            target = jax.tree.map(lambda x: x.sharding, abstract_params)
        return jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, dt(x), sharding=sh), abstract_params, target
        )

    def _abstract_quantized(self, abstract_params):
        dt, cdt = self.ecfg.weights_dtype, jnp.dtype(self.cfg.dtype)
        cast = lambda x: cdt if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        if self.layout is None:
            return quant.map_params(
                lambda x, c: quant.abstract(x, dt, c),
                lambda x: jax.ShapeDtypeStruct(x.shape, cast(x)),
                abstract_params,
            )
        target = jax.tree.map(lambda x: x.sharding, abstract_params)
        if self.ecfg.weights_layout == "tensor":
            target = self.shardings(abstract_params)
        return quant.map_params(
            lambda x, c, sh: quant.abstract(x, dt, c, sh, _scale_sharding(sh, x, c)),
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, cast(x), sharding=sh),
            abstract_params,
            target,
        )
