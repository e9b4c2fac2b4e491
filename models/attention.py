"""Rotary embeddings, dense attention and the default attention hooks.

The transformer knows no KV cache layout. Each attention layer calls an `Attend` hook with its
projected q, k, v; the default hook is causal attention over the given sequence. The
sampler passes its own hook (a paged KV cache) through the same call, so there is one transformer
and the cache is just an argument.

Causality is by array index, not by position id: query i sees key j iff j <= i and key j is valid
(and, in a packed row, of the same sequence). That makes left padding (HF's convention for batched
prompts), right padding and packed rows all work, with positions supplied explicitly by the caller.

The default hooks compute the same function (`causal_hook` picks one from ModelConfig.attention):
`DenseCausal`, the reference, holds a [B,T,T] mask and materialises [B,K,R,T,T] scores;
`BlockwiseCausal` holds the segment ids [B,T] and calls `models.flash.blockwise_attention`, whose
memory is linear in T; `SegmentCausal` holds them too and runs `segment_attention`, for JAX's
Pallas kernels, "splash" on TPU and "pallas_gpu" on GPU (`models.attention_kernels`: linear
memory, inside a shard_map on a mesh), and for "auto".

"auto" resolves per layer from q's shapes and platform (`resolve_attention`): splash on TPU
(head_dim a multiple of 64), pallas_gpu on GPU (head_dim a power of two >= 16), else blockwise;
on CPU dense, but only for rows of at most AUTO_DENSE_MAX_T tokens: there its [T,T] scores are
small, and it compiles 1-2 s faster per layer, which is what short CPU runs (the demos, the test
suite) spend their time on. From there on blockwise is much faster on CPU too (fwd+bwd, B=1 N=14
K=2 H=64 f32: T=256 dense 14 ms, blockwise 8 ms; T=1024: 1480 ms vs 88 ms; T=128: about equal).
The platform is that of the mesh q is traced on (jit gives every array traced from sharded inputs
its abstract mesh). A CPU host may be lowering for TPU or GPU (jax.export, `Learner.lower_step`
with `platforms`), which tracing cannot see: the caller says so with `lowering_for(platforms)`
(a jit-cache-keyed context, so nothing traced for CPU is reused), and then "auto" is a
`lax.platform_dependent` over those platforms' choices, of which lowering keeps the one it lowers
for. The other branches are traced too (the kernels' trace, once per shape: `segment_attention` is
jitted) and their residuals appear in the lowered module as zeros that XLA removes (checked on
XLA:CPU: the same temp bytes as the chosen branch alone). Outside that context a CPU trace is
CPU's choice alone: tracing the kernels there cost the suite ~8% of the learner tests' time. A padding query's output differs between the
implementations (dense and the kernels: finite garbage; blockwise: 0); nothing reads it.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.attention_kernels import interpreting, kernel_attention
from models.config import ModelConfig
from models.flash import BLOCK, block_mask, blockwise_attention

AUTO_DENSE_MAX_T = 512  # "auto": dense on CPU up to this row length (see the docstring)
# The platforms a CPU host is lowering for; part of jax.jit's cache key (see `lowering_for`).
_LOWERING_FOR = jax.make_user_context(None)


def lowering_for(platforms):
    """Context manager: traces inside it are lowered for `platforms` (e.g. ("tpu",)), so that
    "auto" on a CPU host keeps each platform's choice (`auto_attention`). Wrap the trace and
    lowering of `jax.export(..., platforms=...)` or `.lower(lowering_platforms=...)` in it;
    None (no platforms given) is this host's own lowering."""
    return _LOWERING_FOR(tuple(platforms) if platforms else None)


class Attend(Protocol):
    """Per-layer attention hook: returns the attention output and the (possibly updated) hook."""

    def attend(self, layer: int, q, k, v) -> tuple[jax.Array, Attend]:  # q [B,T,N,H], k/v [B,T,K,H]
        ...


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies f32[H/2], with Llama 3 scaling when configured (HF's formula)."""
    h = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float32) / h))
    inv = inv.astype(np.float32)
    s = cfg.rope_scaling
    if s is None:
        return inv
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """Rotates x [B,T,#,H] by positions int[B,T] (HF's rotate-half convention)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B,T,H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attention_weights_to_output(scores, v, mask):
    """softmax(scores masked) @ v, in f32. scores [B,K,R,T,S], v [B,S,K,H], mask bool [B,1,1,T,S]."""
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("BKRTS,BSKH->BTKRH", probs, v.astype(jnp.float32))


def dense_attention(q, k, v, mask):
    """Grouped-query attention. q [B,T,N,H], k/v [B,S,K,H], mask bool [B,T,S] -> [B,T,N,H] in
    q's dtype (a cache of another dtype, sampling/state.py's continued prefill, no longer sets
    it). Scores and softmax are f32 whatever the inputs' dtype, as in the blockwise path, the
    paged decode and the kernels (bf16 scores would round |s| ~ 30 by 0.125), and P @ V takes
    f32 operands (at the platform's default matmul precision), as the blockwise path and the
    paged decode do. Its f32 scores and probabilities [B,K,R,T,S] are twice bf16's: this path is
    for short rows (CPU's "auto" up to AUTO_DENSE_MAX_T, the sampler's prefill chunks).

    R = N / K query heads share each KV head.
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)  # [B,T,K,R,H]
    scores = jnp.einsum("BTKRH,BSKH->BKRTS", qg, k, preferred_element_type=jnp.float32)
    out = attention_weights_to_output(scores * h**-0.5, v, mask[:, None, None])
    return out.reshape(b, t, n, h).astype(q.dtype)


def causal_mask(segments):
    """bool [B,T,T]: query i sees key j iff j <= i, key j is a real token and both are tokens of
    the same sequence. segments: bool [B,T] real tokens (one sequence per row), or int [B,T]
    segment ids of packed rows (1, 2, ... per sequence, 0 = padding), so that attention never
    crosses a sequence boundary. A padding query sees nothing (its output is finite garbage)."""
    s = segments.astype(jnp.int32)
    return block_mask(s, s)


@struct.dataclass
class DenseCausal:
    """The default hook: dense causal attention over the current sequence, no cache.

    Hooks are pytrees so that they pass through jit and remat like any other argument.
    """

    mask: jax.Array  # bool [B,T,T]

    @classmethod
    def from_valid(cls, valid):
        return cls(causal_mask(valid))

    def attend(self, layer, q, k, v):
        return dense_attention(q, k, v, self.mask), self


@struct.dataclass
class BlockwiseCausal:
    """The default hook with memory linear in T: blockwise (flash) attention over segment ids."""

    segments: jax.Array  # int32 [B,T] (1, 2, ... per sequence, 0 = padding)
    block_q: int = struct.field(pytree_node=False, default=BLOCK)
    block_k: int = struct.field(pytree_node=False, default=BLOCK)

    def attend(self, layer, q, k, v):
        return blockwise_attention(q, k, v, self.segments, self.block_q, self.block_k), self


def pallas_fits(kernel: str, head_dim: int) -> bool:
    """Whether "auto" may pick `kernel` for this head_dim (see `resolve_attention`)."""
    if kernel == "splash":
        return head_dim % 64 == 0
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0  # pallas_gpu: a power of two


def resolve_attention(
    attention: str, t: int, platform: str | None = None, head_dim: int | None = None
) -> str:
    """The attention to run for ModelConfig.attention, rows of t tokens and `platform` ("cpu",
    "tpu", "gpu", or jax.export's "cuda"/"rocm"; default jax.default_backend()). "auto" picks
    - tpu: "splash" when head_dim % 64 == 0 (the shipped models' 64 and 128), else blockwise;
    - gpu: "pallas_gpu" when head_dim is a power of two >= 16 (Triton's tiles), else blockwise;
    - cpu: "dense" for t <= AUTO_DENSE_MAX_T, else "blockwise" (see the module docstring);
    - anything else, or an unknown head_dim (None): "blockwise", which lowers everywhere."""
    if attention != "auto":
        return attention
    platform = platform or jax.default_backend()
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if platform == "cpu":
        return "dense" if t <= AUTO_DENSE_MAX_T else "blockwise"
    kernel = {"tpu": "splash", "gpu": "pallas_gpu"}.get(platform)
    fits = kernel is not None and head_dim is not None and pallas_fits(kernel, head_dim)
    return kernel if fits else "blockwise"


@functools.partial(jax.jit, static_argnames=("attention", "interpret"))
def segment_attention(q, k, v, segments, attention: str, interpret: bool = False):
    """Causal attention of packed rows: q [B,T,N,H], k/v [B,T,K,H], segments int [B,T] (or
    bool) -> [B,T,N,H], by `attention` (any of ATTENTION; "auto": `auto_attention`).

    One entry point for every implementation. Jitted so that the layers after the first (same
    shapes) reuse its trace: "auto" lowered for TPU or GPU from a CPU host traces the Pallas
    kernels (~0.2 s a layer).
    `interpret` runs the Pallas kernels in interpret mode (`models.attention_kernels.interpret`).
    """
    if attention == "auto":
        return auto_attention(q, k, v, segments, interpret)
    if attention == "dense":
        return dense_attention(q, k, v, causal_mask(segments))
    if attention == "blockwise":
        return blockwise_attention(q, k, v, segments)
    return kernel_attention(q, k, v, segments, attention, interpret)


def _trace_platform(q) -> str:
    """The platform of the mesh q is traced on (its devices'), else jax.default_backend()."""
    mesh = getattr(getattr(jax.typeof(q), "sharding", None), "mesh", None)
    device = getattr(mesh, "abstract_device", None) if mesh is not None and not mesh.empty else None
    return getattr(device, "platform", None) or jax.default_backend()


def auto_attention(q, k, v, segments, interpret: bool = False):
    """ "auto" for q's shapes. On an accelerator the platform is the mesh's. A CPU host may be
    lowering for TPU or GPU (inside `lowering_for(platforms)`), which tracing cannot see: there
    `lax.platform_dependent` defers the choice to lowering, which keeps only the branch of the
    platform lowered for (all branches are traced)."""
    t, h = q.shape[1], q.shape[3]
    platform = _trace_platform(q)
    run = lambda a: functools.partial(segment_attention, attention=a, interpret=interpret)
    targets = _LOWERING_FOR.value
    if platform != "cpu" or not targets:
        return run(resolve_attention("auto", t, platform, h))(q, k, v, segments)
    chosen = {p: resolve_attention("auto", t, p, h) for p in targets}
    fns = {a: run(a) for a in dict.fromkeys([*chosen.values(), "blockwise"])}
    branches = {p: fns[a] for p, a in chosen.items()}  # equal choices share one branch
    return jax.lax.platform_dependent(q, k, v, segments, **branches, default=fns["blockwise"])


@struct.dataclass
class SegmentCausal:
    """The default hook for "auto" and the kernels: `segment_attention` over segment ids."""

    segments: jax.Array  # int32 [B,T] (1, 2, ... per sequence, 0 = padding)
    attention: str = struct.field(pytree_node=False, default="auto")

    def attend(self, layer, q, k, v):
        out = segment_attention(q, k, v, self.segments, self.attention, interpreting())
        return out, self


def causal_hook(valid, attention: str = "auto"):
    """The default hook for valid bool [B,T] or segment ids int [B,T] (see `causal_mask`)."""
    if attention == "dense":
        return DenseCausal.from_valid(valid)
    if attention == "blockwise":
        return BlockwiseCausal(valid.astype(jnp.int32))
    return SegmentCausal(valid.astype(jnp.int32), attention)
