"""Quantised KV pages: int8 or float8_e4m3fn values with one scale per (token, KV head).

`sampling.cache_dtype` = "int8" or "float8_e4m3fn" makes every layer's pool a `QuantPages`
instead of a plain [K,P,page_size,H] array: the values in the cache dtype, in the same layout,
and beside them the scales [K,P,page_size] in bfloat16, split over the devices like the pages
(the same per-shard pools, `sampling.partitioned`). Whatever moves pages moves their scales:
both have the page axis second, so a page copy, a shared prompt page, a parked or preempted
sequence treat the pair as one pool (a pytree of two arrays).

Symmetric quantisation, as the serving engines do it for KV: token t of head k is stored as
round(x / s) with s = max|x[t, k, :]| / QMAX (127 for int8, 448, e4m3's largest finite, for
fp8), and read back as values * s. The scale is rounded to bfloat16 *before* the values are
divided by it, so its rounding adds no error (a value may reach QMAX * (1 + 2^-8) and is
clipped). A row of zeros (the null page, an unwritten slot) has s = 0 and reads back as zeros.

Bytes per (token, KV head): H values of 1 byte and one 2-byte scale, against 2H for bfloat16.
At head_dim 64 (Qwen2.5-0.5B) the scales add 1/32 of the int8 pool (a pool of 0.516x the bf16
one), at head_dim 128 1/64 (0.508x). A scale per page would be smaller still, but one outlier
token would then coarsen its whole page; per (token, head) is what vLLM, tpu-inference and the
Pallas GPU kernel (`k_scales_pages` [K,P,page_size]) use.

The attention paths read `values` and `scales` in place and dequantise one block of pages at a
time (`sampling.paged_attention`); nothing makes a wider copy of a pool.

Stored as bits: a float8_e4m3fn pool holds its values as uint8 and every pool its bf16 scales
as uint16 (`storage_dtype`), converted back by a bitcast of each gathered block or written row.
XLA:CPU has no fp8 or bf16 gather or scatter: it widened a whole pool to read a block of it,
and a bitcast of a whole pool in the decode loop became a copy of it per layer at the 32k
config's size (6.2 GiB of temporaries per device in its --dry_run). Integer pools are gathered
and scattered in place on every backend. int8 values are stored as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

QUANT_DTYPES = ("int8", "float8_e4m3fn")  # sampling.cache_dtype values that quantise
CACHE_DTYPES = ("float32", "bfloat16", "float16", *QUANT_DTYPES)  # all of sampling.cache_dtype
SCALE_DTYPE = jnp.bfloat16  # one per (token, KV head): 2 bytes


@struct.dataclass
class QuantPages:
    """One layer's quantised pool, stored as bits (module docstring). `shape` is the values'
    and `dtype` the cache dtype, so code that asks a pool for its page shape or cache dtype
    reads a QuantPages as it reads an array; `logical()` gives the arrays in their own dtypes."""

    values: jax.Array  # int8, or float8_e4m3fn as uint8 bits [K,P,page_size,H]
    scales: jax.Array  # bf16 as uint16 bits [K,P,page_size]: values * scales[..., None] is the KV
    kind: str = struct.field(pytree_node=False, default="int8")  # the cache dtype's name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return jnp.dtype(self.kind)

    def logical(self):
        """(values in the cache dtype, scales in bf16): bitcasts of the stored bits."""
        return from_bits(self.values, self.dtype), from_bits(self.scales, SCALE_DTYPE)


def is_quantized(dtype) -> bool:
    """Whether cache dtype `dtype` (a name or a dtype) is stored with scales."""
    return jnp.dtype(dtype).name in QUANT_DTYPES


def qmax(dtype) -> float:
    """The largest magnitude a quantised value takes: 127 (int8), 448 (float8_e4m3fn)."""
    dtype = jnp.dtype(dtype)
    return 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)


def quantize(x, dtype):
    """x [..., H] -> (values [..., H] in `dtype`, scales [...] bf16), symmetric, one scale per
    row of H (module docstring)."""
    x = x.astype(jnp.float32)
    q = qmax(dtype)
    scale = (jnp.max(jnp.abs(x), axis=-1) / q).astype(SCALE_DTYPE)
    s = scale.astype(jnp.float32)
    y = x * jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)[..., None]
    y = jnp.clip(y, -q, q)
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale


def dequantize(values, scales, dtype=jnp.float32, kind=None):
    """values [..., H] and scales [...] -> values * scales in `dtype` (for a gathered block or
    rows, never a whole pool). With `kind` (the cache dtype) they may be stored bits."""
    if kind is not None:
        values, scales = from_bits(values, kind), from_bits(scales, SCALE_DTYPE)
    return (values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)


def as_stored(x, dtype):
    """x [..., H] as a pool of cache dtype `dtype` reads it back: quantised and dequantised
    (in x's dtype) for int8 / fp8, else x unchanged (the pool's own cast is the caller's)."""
    if not is_quantized(dtype):
        return x
    return dequantize(*quantize(x, dtype), x.dtype)


def storage_dtype(dtype):
    """How values of `dtype` are stored: unsigned ints of its width for a float of 16 bits or
    fewer (bf16, fp8), else `dtype` itself."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize <= 2:
        return jnp.dtype(f"uint{8 * dtype.itemsize}")
    return dtype


def to_bits(x):
    """x in its storage dtype (a bitcast; `storage_dtype`)."""
    store = storage_dtype(x.dtype)
    return x if store == x.dtype else jax.lax.bitcast_convert_type(x, store)


def from_bits(x, dtype):
    """Stored x back in `dtype` (a bitcast; x itself when already in it)."""
    dtype = jnp.dtype(dtype)
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def widen(x, dtype):
    """A gathered block, stored (`to_bits`) or in `dtype`, as f32."""
    return from_bits(x, dtype).astype(jnp.float32)


def pack(values, scales) -> QuantPages:
    """A QuantPages of values (int8 / fp8 [K,P,page_size,H]) and bf16 scales [K,P,page_size]."""
    kind = jnp.dtype(values.dtype).name
    return QuantPages(to_bits(jnp.asarray(values)), to_bits(jnp.asarray(scales)), kind)


def zeros(shape: tuple[int, ...], dtype):
    """An empty layer pool [K,P,page_size,H] of cache dtype `dtype`: a zero array, or a
    QuantPages of zero values and zero scales (reads back as zeros: finite, as kernels need)."""
    if is_quantized(dtype):
        kind = jnp.dtype(dtype).name
        scales = jnp.zeros(shape[:-1], storage_dtype(SCALE_DTYPE))
        return QuantPages(jnp.zeros(shape, storage_dtype(dtype)), scales, kind)
    return jnp.zeros(shape, dtype)


def bytes_per_token_head(dtype, head_dim: int) -> int:
    """Bytes one (token, KV head) takes in a pool of cache dtype `dtype`: H values, plus a
    bf16 scale when quantised."""
    dtype = jnp.dtype(dtype)
    extra = jnp.dtype(SCALE_DTYPE).itemsize if is_quantized(dtype) else 0
    return head_dim * dtype.itemsize + extra
