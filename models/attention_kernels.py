"""JAX's own flash-attention kernels for the learner: splash (TPU) and Pallas Triton (GPU).

Both compute `models.attention.dense_attention` under `causal_mask` for q [B,T,N,H], k/v
[B,T,K,H] and segment ids int [B,T] (1, 2, ... per packed sequence, 0 = padding), with memory
linear in T, and both have a flash-style custom VJP of their own (Pallas backward kernels).

- "splash": `jax.experimental.pallas.ops.tpu.splash_attention`, `make_splash_mha` with a causal
  mask on every head and `SegmentIds`, vmapped over the batch, as MaxText's attention_op.py
  runs it. GQA is native: k/v [K,T,H] and query head n reads KV head n // R. The kernel does not
  scale scores, so q is scaled by H**-0.5 first (in q's dtype: exact for H = 64 or 256, one
  rounding in bf16 for H = 128). Mosaic tiles the sequence by 128 (the lane width): T is padded
  to a multiple of 128, blocks are the largest of 512/256/128 that divide it. head_dim need not
  be a multiple of 128 (a block's last dim may equal the array's): head_dim 64 lowers for TPU
  (tests/models/test_attention_kernels.py; lowered from a CPU host, not compiled on a TPU).
- "pallas_gpu": `jax.experimental.pallas.ops.gpu.attention.mha` (causal, segment ids,
  sm_scale). It has no GQA (k, v must have N heads), so K/V heads are repeated R = N/K times
  inside this call, just before the kernel: a [B,T,N,H] copy of k and v per layer, linear in T
  (the repeat's VJP sums the R gradients back). Triton blocks are powers of two: T is padded to
  a power of two >= 16 up to 128 and to a multiple of 128 beyond. The kernel pads head_dim to a
  power of two itself; "auto" still asks for one >= 16 (`models.attention.pallas_fits`).

Masking differs from the model's rule only on padding. Both kernels mask "same segment and
causal", so a padding token (segment 0, and the pad to the block multiple, which is segment 0
too) attends to earlier padding. No real query sees padding (its segment is >= 1), so real
outputs and gradients are the dense ones; padding outputs are finite garbage, as dense's are,
sliced off or never read.

On a device mesh a Pallas kernel is opaque to GSPMD (JAX refuses to partition a Mosaic call; a
Triton call would run on gathered operands), so it runs inside `jax.shard_map` over the batch
axes and the heads axes, each device on its own rows and heads. The mesh is the one jit attaches
to every array traced from sharded inputs (`jax.typeof(q).sharding.mesh`, an AbstractMesh), or
else the context mesh (`jax.set_mesh`): the learner, which jits with NamedShardings, needs no
plumbing. Heads go over the mesh axis "tensor" (the default rules' `heads`/`kv_heads`), rows
over the other axes (the default rules' `batch`), each only where it divides the array; a
config whose rules differ still computes the same result (shard_map moves the data at its
boundary).

`interpret()` runs both kernels in Pallas interpret mode (for CPU tests). It applies to kernels
traced under it (`models.attention.segment_attention` takes it as a static argument), so to
jitted functions called inside it that were not traced outside it before.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

LANES = 128  # Mosaic's tile of the sequence axis (splash's NUM_LANES)
SPLASH_BLOCKS = (512, 256, 128)  # splash block_q = block_kv: the largest that divides T
HEAD_AXES = ("tensor",)  # mesh axes of the heads of q, k, v (DEFAULT_RULES' heads, kv_heads)

_state = threading.local()


@contextlib.contextmanager
def interpret(on: bool = True):
    """Kernels traced inside run in Pallas interpret mode (on CPU too: the tests)."""
    prev = getattr(_state, "interpret", False)
    _state.interpret = on
    try:
        yield
    finally:
        _state.interpret = prev


def interpreting() -> bool:
    """Whether kernels traced now run in interpret mode (inside `interpret()`)."""
    return getattr(_state, "interpret", False)


def _pad_to(x, t: int, axis: int):
    extra = t - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)  # zeros: segment 0 (padding) for the segment ids


def _splash_kernel(t: int, n: int, block: int, interpret: bool):
    # Built per call (its mask processing is cached inside JAX): one kernel object reused by a
    # later trace with another head_dim failed with "Too many leaves for PyTreeDef" (jax 0.10.2).
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    blocks = sa.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = sa.MultiHeadMask([sa.CausalMask((t, t))] * n)
    return sa.make_splash_mha(
        mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def _splash_local(q, k, v, segments, interpret: bool):
    """Splash on one device's rows and heads: q [B,T,N,H], k/v [B,T,K,H], segments int32 [B,T]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    b, t, n, h = q.shape
    tp = -(-t // LANES) * LANES
    block = next(s for s in SPLASH_BLOCKS if tp % s == 0)
    kernel = _splash_kernel(tp, n, block, interpret)
    scale = jnp.asarray(h**-0.5, q.dtype)
    head_major = lambda x: _pad_to(x, tp, 1).transpose(0, 2, 1, 3)  # [B,#,Tp,H]
    seg = _pad_to(segments, tp, 1)
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=SegmentIds(s, s)))(
        head_major(q * scale), head_major(k), head_major(v), seg
    )  # [B,N,Tp,H]
    return out.transpose(0, 2, 1, 3)[:, :t]


def _gpu_length(t: int) -> int:
    return max(16, 1 << (t - 1).bit_length()) if t <= LANES else -(-t // LANES) * LANES


def _pallas_gpu_local(q, k, v, segments, interpret: bool):
    """The Triton kernel on one device's rows and heads (same arguments as `_splash_local`)."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    t, n, h = q.shape[1], q.shape[2], q.shape[3]
    r = n // k.shape[2]
    tp = _gpu_length(t)
    k, v = (jnp.repeat(x, r, axis=2) if r > 1 else x for x in (k, v))  # no GQA in the kernel
    q, k, v, seg = (_pad_to(x, tp, 1) for x in (q, k, v, segments))
    out = gpu_attention.mha(q, k, v, seg, sm_scale=h**-0.5, causal=True, interpret=interpret)
    return out[:, :t]


LOCAL = {"splash": _splash_local, "pallas_gpu": _pallas_gpu_local}


def _mesh(q):
    """The (abstract) mesh q is traced on: its aval's, else the context mesh; None if no mesh."""
    sharding = getattr(jax.typeof(q), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def mesh_axes(mesh, b: int, kh: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(batch axes, head axes) of the shard_map: heads over HEAD_AXES where they divide the KV
    heads, rows over the other axes of size > 1 while their product divides the rows."""
    shape = dict(mesh.shape)
    heads, size = [], 1
    for a in HEAD_AXES:
        if shape.get(a, 1) > 1 and kh % (size * shape[a]) == 0:
            heads.append(a)
            size *= shape[a]
    rows, size = [], 1
    for a in mesh.axis_names:
        if a not in heads and shape[a] > 1 and b % (size * shape[a]) == 0:
            rows.append(a)
            size *= shape[a]
    return tuple(rows), tuple(heads)


def kernel_attention(q, k, v, segments, kernel: str, interpret: bool | None = None):
    """Causal attention of packed rows with `kernel` ("splash" or "pallas_gpu"): q [B,T,N,H],
    k/v [B,T,K,H], segments int [B,T] (or bool: one sequence per row) -> [B,T,N,H] in q's dtype.
    Inside a shard_map when q is traced on a multi-device mesh (see the module docstring).
    interpret: Pallas interpret mode; None = `interpreting()`."""
    interpret = interpreting() if interpret is None else interpret
    local = functools.partial(LOCAL[kernel], interpret=interpret)
    segments = segments.astype(jnp.int32)
    mesh = _mesh(q)
    if mesh is None or mesh.size == 1:
        return local(q, k, v, segments)
    rows, heads = mesh_axes(mesh, q.shape[0], k.shape[2])
    entry = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes
    b, h = entry(rows), entry(heads)
    act = P(b, None, h, None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(act, act, act, P(b, None)),
        out_specs=act,
        check_vma=False,  # the kernels are opaque: their outputs carry no varying-axes info
    )(q, k, v, segments)
