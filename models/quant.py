"""Decode weights in int8 or fp8 (`sampling.weights_dtype` "int8" / "float8_e4m3fn"), with
google's qwix (`qwix.quantize`, `qwix.einsum`, its `QArray`).

The sampler's per-rollout decode copy (`sampling.decode_weights`) holds every block projection
(attention q, k, v, o; MLP gate, up, down) as a `QArray`: the weight in int8 or float8_e4m3fn
with an f32 scale per output channel (absmax over the contracting axes, / 127 for int8, / 448
for fp8: `CALIBRATION`; a q [D,N,H] weight has a scale [1,N,H], o [N,H,D] one [1,1,D]). Everything else (embedding, norms, biases, the logits
projection, LoRA adapters, a mixture's router and experts) stays in the compute dtype. The
model's `_matmul` sees a `QArray` where it expects a weight and calls `einsum` here: the
activations are quantised per token, dynamically (absmax over the contracted axes), and the
dot runs int8 x int8 -> int32 (fp8 x fp8 -> f32) in `jax.lax.dot_general`, scaled by both
scales afterwards, then cast to the compute dtype (to f32 for the q and k of a bf16 model,
which the model rounds once after their bias, norm and rope, as it does unquantised). That is the W8A8 scheme of the serving
engines (tpu-inference quantises its JAX models with qwix; vLLM's per-channel int8/fp8).

Why qwix, and only its core: it is google's maintained JAX quantisation library (the AQT
successor), and its `quantize` / `einsum` are exactly the two ops needed, with the int8 and
fp8 numerics (absmax calibration, rounding and clipping, the accumulator types) maintained
upstream. Its model-level providers (`quantize_model`, PtqProvider) intercept `jnp.einsum`
per module path and swap parameters on the first call; the model here reads raw `nnx.Param`s
through one `_matmul` and the decode copy is a plain params tree made once per rollout, so the
core API fits and the providers would add indirection for nothing. qwix is imported only where
a quantised copy is made or used (~55 ms import after jax and flax).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

DTYPES = ("int8", "float8_e4m3fn")  # the quantised sampling.weights_dtype values
# qwix's calibration of each type: plain absmax maps a row's absmax to qwix's symmetric bound
# (448 for fp8, a finite e4m3 value: exact); for int8 that bound is 127.5, where the absmax
# entry lands on a rounding tie and is stored as 127 or -128 as the f32 division falls: half a
# step of error on the row's largest entry. Scaled by 127.5 / 127 it maps to 127 (values in
# [-127, 127], the scheme of vLLM's and SmoothQuant's per-token int8), stored exactly: on the
# demo's trained model the int8 weights' log-prob KL against f32 fell 2.3x (5.3e-4 -> 2.3e-4,
# float64 fake-quant reference, 32 prompts), 5-8 % on the random fixtures.
CALIBRATION = {"int8": f"absmax,{127.5 / 127}", "float8_e4m3fn": "absmax"}

# Projections quantised: name -> (ndim, leading contracting axes) of its weight. A weight of
# another rank under the same name (a mixture's stacked experts [E,D,F]) is left alone.
PROJECTIONS = {
    "q": (3, 1),  # [D,N,H]
    "k": (3, 1),  # [D,K,H]
    "v": (3, 1),  # [D,K,H]
    "o": (3, 2),  # [N,H,D]
    "gate": (2, 1),  # [D,F]
    "up": (2, 1),  # [D,F]
    "down": (2, 1),  # [F,D]
}


def quantized(w) -> bool:
    """Whether w, a parameter's value, is a quantised weight (a qwix QArray), not an array."""
    return not isinstance(w, (jax.Array, np.ndarray))


def contracting(name, ndim: int) -> int:
    """The number of leading contracting axes of a parameter called `name` of rank `ndim` if
    it is a projection weight to quantise, else 0."""
    rank, contract = PROJECTIONS.get(name, (None, 0))
    return contract if rank == ndim else 0


def quantize(w, dtype: str, contract: int):
    """w [..] as a QArray in dtype with an f32 scale per output channel (the axes after the
    first `contract`)."""
    import qwix

    return qwix.quantize(
        w.astype(jnp.float32),
        jnp.dtype(dtype),
        channelwise_axes=tuple(range(contract, w.ndim)),
        calibration_method=CALIBRATION[jnp.dtype(dtype).name],
        scale_dtype=jnp.float32,
    )


def qarray(value, scale, dtype):
    """A QArray of dtype from its parts (arrays, shape structs or shardings: a tree of the
    same structure as `quantize`'s)."""
    import qwix

    return qwix.QArray(qvalue=value, scale=scale, qtype=jnp.dtype(dtype))


def abstract(x, dtype: str, contract: int, sharding=None, scale_sharding=None):
    """What `quantize` returns for x [..] (an array or shape struct): a QArray of shape
    structs, the value laid out as `sharding`, the scale as `scale_sharding`."""
    shape = (1,) * contract + tuple(x.shape[contract:])
    return qarray(
        jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=sharding),
        jax.ShapeDtypeStruct(shape, jnp.float32, sharding=scale_sharding),
        dtype,
    )


def map_params(on_weight, on_other, params, *rest):
    """params (a params tree of Variables) with each projection weight's value x replaced by
    on_weight(x, contract, *r) and every other leaf's by on_other(x, *r), where r are the
    corresponding leaves of the trees `rest` (of params' structure, e.g. its shardings)."""
    value = lambda v: v.get_value() if isinstance(v, nnx.Variable) else v

    def one(path, v, *r):
        r = tuple(map(value, r))
        if not isinstance(v, nnx.Variable):
            return on_other(v, *r)
        x = v.get_value()
        c = contracting(getattr(path[-1], "key", None), len(x.shape))
        return v.replace(value=on_weight(x, c, *r) if c else on_other(x, *r))

    is_var = lambda x: isinstance(x, nnx.Variable)
    return jax.tree_util.tree_map_with_path(one, params, *rest, is_leaf=is_var)


def quantize_params(params, dtype: str, compute_dtype: str):
    """The decode copy's values: projection weights quantised to dtype (`quantize`), other
    floating leaves in compute_dtype, the rest as they are."""
    cast = lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return map_params(lambda x, c: quantize(x, dtype, c), cast, params)


def einsum(spec: str, x, w, out=None):
    """einsum(spec, x, w) for a quantised weight w (`quantize`): x quantised per token (a scale
    per entry of the axes it keeps, absmax over the axes it contracts) to w's type, the dot in
    that type with an int32 (int8) or f32 (fp8) accumulator, scaled back, in `out` (x's dtype
    if None; f32 for the q and k of a bf16 model, rounded where the unquantised model rounds
    them)."""
    import qwix

    lhs, result = spec.split("->")[0].split(",")[0], spec.split("->")[1]
    keep = tuple(i for i, a in enumerate(lhs) if a in result)
    qx = qwix.quantize(
        x.astype(jnp.float32),
        w.qtype,
        channelwise_axes=keep,
        calibration_method=CALIBRATION[jnp.dtype(w.qtype).name],
        scale_dtype=jnp.float32,
    )
    y = qwix.einsum(spec, qx, w, preferred_element_type=jnp.float32)
    return y.astype(x.dtype if out is None else out)
