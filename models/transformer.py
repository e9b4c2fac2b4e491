"""Decoder-only transformer in Flax NNX: Llama 3.x, Qwen2/2.5 and Qwen3 from one `ModelConfig`.

Every parameter is an `nnx.Param` carrying `axes`, its logical axis names (`vocab`, `embed`, `mlp`,
`heads`, `kv_heads`, `head_dim`, `norm`). `models.sharding` maps them to mesh axes with the rules
table of the config. Weights are stored in `param_dtype` (float32 master weights) and cast to the
compute `dtype` where they are used, inside the caller's jit: no second resident copy.

Projection weights are stored in einsum-friendly shapes ([D,N,H] rather than HF's [N*H, D]) so the
head axes can be sharded by name; `models.hf` converts on import and export.

The gradients of the weights are computed in the compute dtype, or, inside `weight_grads_in(dtype)`
(the learner's `grad_reduce_dtype`), in `dtype`: with bf16 compute and float32 there, each weight's
gradient matmul returns f32 (`preferred_element_type`) and the per-token sums of biases and norm
scales run in f32, so the sum of the gradient over the devices that hold the batch's rows (the
all-reduce or reduce-scatter GSPMD puts after them) is an f32 sum, not a bf16 one. The forward pass
and the activations' gradients stay in the compute dtype. Outside the context, or when it names the
compute dtype, the ops are plain `einsum`s, as autodiff differentiates them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models import lora, quant
from models.attention import apply_rope, causal_hook, rope_inv_freq
from models.config import ModelConfig
from models.grad_dtype import weight_grad_dtype, weight_grads_in  # noqa: F401 (re-exported)
from models.moe import MoE, route_dtype
from models.order import after

_INIT = nnx.initializers.normal(0.02)


# Set by `shapes_only()`: parameters are made as zeros, not drawn, when only their shapes and
# dtypes are wanted (models.sharding.abstract_model traces the constructor under nnx.eval_shape;
# tracing each initializer's random draw made that ~2 s for a 0.6B model, ~0.1 s without).
_SHAPES_ONLY = contextvars.ContextVar("shapes_only", default=False)


@contextlib.contextmanager
def shapes_only():
    """Within the block, parameters are zeros of their shape and dtype: for abstract tracing
    only, never for values that are kept."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def _param(rngs, shape, axes, init=_INIT, dtype=jnp.float32):
    if _SHAPES_ONLY.get():
        return nnx.Param(jnp.zeros(shape, dtype), axes=axes)
    return nnx.Param(init(rngs.params(), shape, dtype), axes=axes)


def _cast(p, dtype):
    return p[...].astype(dtype)


def _matmul(spec: str, x, p, out=None):
    """einsum(spec, x, p) with the parameter p cast to x's dtype (see the module docstring); the
    product in `out` (e.g. f32, `preferred_element_type`) rather than x's dtype if given."""
    v = p.get_value() if isinstance(p, nnx.Variable) else p  # a Param, or an array (tests)
    if quant.quantized(v):  # an int8 / fp8 decode copy (sampling.decode_weights)
        return quant.einsum(spec, x, v, out)
    g = weight_grad_dtype(x.dtype)
    out = None if out is None or jnp.dtype(out) == x.dtype else out
    if g is None and out is None:
        return jnp.einsum(spec, x, _cast(p, x.dtype))
    # A wider product takes its backward in x's dtype, as a product in x's dtype would: autodiff
    # would widen the weights for dx, an f32 gather of each bf16 weight on a mesh.
    return _matmul_in(spec, g or x.dtype, out, x, p[...])


def _grad_dtype(y, compute):
    """The gradient dtype of a parameter applied to y in the compute dtype `compute` (None: y's):
    `weight_grad_dtype`'s, or the compute dtype where y is wider (the q and k of `Attention`,
    f32 in a bf16 model), so that its sum across devices is the one the model's others make."""
    compute = y.dtype if compute is None else jnp.dtype(compute)
    g = weight_grad_dtype(compute)
    return compute if g is None and compute != y.dtype else g


def _as(p, compute, dtype):
    """The parameter p as the compute dtype holds it (a bf16 decode copy holds it so: the
    sampler's and the learner's then add the same values), in dtype."""
    return p.astype(compute).astype(dtype)


def _add(y, p, compute=None):
    """y + p cast to y's dtype (through `compute`, the model's compute dtype where y is wider),
    p broadcast over y's leading axes."""
    g, c = _grad_dtype(y, compute), y.dtype if compute is None else jnp.dtype(compute)
    return y + _as(p[...], c, y.dtype) if g is None else _add_in(g, c, y, p[...])


def _scale(p, x, compute=None):
    """p cast to x's dtype (through `compute`, as `_add`) times x, p broadcast over x's leading
    axes."""
    g, c = _grad_dtype(x, compute), x.dtype if compute is None else jnp.dtype(compute)
    return _as(p[...], c, x.dtype) * x if g is None else _scale_in(g, c, x, p[...])


# The same three with the parameter's gradient in `g` (custom VJPs).


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _matmul_in(spec, g, out, x, w):
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=out)


def _matmul_in_fwd(spec, g, out, x, w):
    wc = w.astype(x.dtype)  # kept for dx: the same (gathered) weights, not gathered again
    return jnp.einsum(spec, x, wc, preferred_element_type=out), (x, wc, w)


def _matmul_in_bwd(spec, g, out, res, ct):
    x, wc, master = res
    (xs, ws), ys = spec.split("->")[0].split(","), spec.split("->")[1]
    dx = jnp.einsum(f"{ys},{ws}->{xs}", ct.astype(x.dtype), wc)
    dw = jnp.einsum(f"{xs},{ys}->{ws}", x, ct.astype(x.dtype), preferred_element_type=g)
    return dx, dw.astype(master.dtype)


_matmul_in.defvjp(_matmul_in_fwd, _matmul_in_bwd)


def _leading(x, p) -> tuple[int, ...]:
    return tuple(range(x.ndim - p.ndim))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _add_in(g, c, y, b):
    return y + _as(b, c, y.dtype)


def _add_in_fwd(g, c, y, b):
    return _add_in(g, c, y, b), b


def _sum_in(x, axes):
    """x summed over axes in x's own dtype (jnp.sum sums bf16 in f32, and the sum across devices
    would then be f32)."""
    return jax.lax.reduce(x, jnp.zeros((), x.dtype), jax.lax.add, axes)


def _add_in_bwd(g, c, b, ct):
    return ct, _sum_in(ct.astype(g), _leading(ct, b)).astype(b.dtype)


_add_in.defvjp(_add_in_fwd, _add_in_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scale_in(g, c, x, s):
    return _as(s, c, x.dtype) * x


def _scale_in_fwd(g, c, x, s):
    return _scale_in(g, c, x, s), (x, s)


def _scale_in_bwd(g, c, res, ct):
    x, s = res
    ds = _sum_in(ct.astype(g) * x.astype(g), _leading(x, s))
    return ct * _as(s, c, x.dtype), ds.astype(s.dtype)


_scale_in.defvjp(_scale_in_fwd, _scale_in_bwd)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, rngs: nnx.Rngs, dtype):
        self.eps = eps
        self.scale = _param(rngs, (dim,), ("norm",), nnx.initializers.ones, dtype)

    def __call__(self, x, compute=None):
        """compute: the model's compute dtype where x is wider (see `_grad_dtype`)."""
        # Normalise in f32 and cast back before the scale, as HF does, so fp32 parity is exact-ish.
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return _scale(self.scale, xf.astype(x.dtype), compute)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd = jnp.dtype(cfg.param_dtype)
        self.q = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), dtype=pd)
        self.k = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype=pd)
        self.v = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype=pd)
        self.o = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), dtype=pd)
        zeros = nnx.initializers.zeros
        if cfg.qkv_bias:
            self.q_bias = _param(rngs, (n, h), ("heads", "head_dim"), zeros, pd)
            self.k_bias = _param(rngs, (k, h), ("kv_heads", "head_dim"), zeros, pd)
            self.v_bias = _param(rngs, (k, h), ("kv_heads", "head_dim"), zeros, pd)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.norm_eps, rngs, pd)
            self.k_norm = RMSNorm(h, cfg.norm_eps, rngs, pd)
        lora.attach(self, cfg, lora.ATTENTION, rngs)
        self.cfg = cfg

    def __call__(self, x, positions, inv_freq, layer, attend):
        c = self.cfg
        # q and k stay f32 from their projection through bias, q/k norm and rope (each computes
        # in f32 anyway), rounded to the compute dtype once, before attention. Rounded after
        # each step, they were rounded where each program's XLA kept the round trip: with excess
        # precision allowed (XLA's default) the learner's fusions dropped some that the
        # sampler's kept, and in bf16 the two computed another q for the same token.
        f32 = jnp.float32
        q = lora.add(self, c, "q", x, _matmul("BTD,DNH->BTNH", x, self.q, f32))
        k = lora.add(self, c, "k", x, _matmul("BTD,DKH->BTKH", x, self.k, f32))
        v = lora.add(self, c, "v", x, _matmul("BTD,DKH->BTKH", x, self.v))
        if self.cfg.qkv_bias:
            q, k = _add(q, self.q_bias, x.dtype), _add(k, self.k_bias, x.dtype)
            v = _add(v, self.v_bias)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q, x.dtype), self.k_norm(k, x.dtype)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        q, k = q.astype(x.dtype), k.astype(x.dtype)
        out, attend = attend.attend(layer, q, k, v)  # [B,T,N,H]
        o = _matmul("BTNH,NHD->BTD", out, self.o)
        return lora.add(self, c, "o", out, o, in_axes=2), attend


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, pd = cfg.d_model, cfg.d_ff, jnp.dtype(cfg.param_dtype)
        self.gate = _param(rngs, (d, f), ("embed", "mlp"), dtype=pd)
        self.up = _param(rngs, (d, f), ("embed", "mlp"), dtype=pd)
        self.down = _param(rngs, (f, d), ("mlp", "embed"), dtype=pd)
        lora.attach(self, cfg, ("gate", "up", "down"), rngs)
        self.cfg = cfg

    def __call__(self, x):
        c = self.cfg
        g = lora.add(self, c, "gate", x, _matmul("BTD,DF->BTF", x, self.gate))
        u = lora.add(self, c, "up", x, _matmul("BTD,DF->BTF", x, self.up))
        a = jax.nn.silu(g) * u
        return lora.add(self, c, "down", a, _matmul("BTF,FD->BTD", a, self.down))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        """moe: the feed-forward block is the experts' (models/moe.py), not a dense MLP."""
        pd = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs, pd)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs, pd)
        self.mlp = MoE(cfg, rngs, _param) if moe else MLP(cfg, rngs)

    def __call__(self, x, positions, inv_freq, layer, attend, routes=None, mask=None):
        """-> (x [B,T,D], attend, the expert ids used int32 [B,T,k] or None for a dense MLP,
        the MoE router's `models.moe.RouterStats` over `mask` [B,T] or None); routes: recorded
        expert ids [B,T,k] for the MoE block (routing replay) or None."""
        a, attend = self.attn(self.attn_norm(x), positions, inv_freq, layer, attend)
        x = x + a
        if isinstance(self.mlp, MoE):
            y, ids, *stats = self.mlp.routed(self.mlp_norm(x), routes, mask)
            return x + y, attend, ids, (stats[0] if stats else None)
        return x + self.mlp(self.mlp_norm(x)), attend, None, None


def _remat_block(block, x, positions, inv_freq, layer, attend, ready, routes=None, mask=None):
    """The block rematerialised: only its inputs are kept for the backward pass (see `remat`).

    The block's weights go in as plain state: nnx.remat would tie the Module to the trace it was
    built in, which breaks when the model is called inside a lax loop (the sampler's decode).
    """
    graphdef, state = nnx.split(block)

    def run(state, x, rest):
        y, *aux = nnx.merge(graphdef, state)(x, *rest[:2], layer, *rest[2:])
        return y, tuple(aux)

    rest = (positions, inv_freq, attend, routes, mask)
    if x.shape[1] == 1 and not isinstance(block.mlp, MoE):  # a dense decode step: unordered
        y, aux = run(state, x, rest)  # (`remat`'s docstring says why)
    else:
        y, aux = remat(run, state, x, rest, ready)
    return (y, *aux)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def remat(fn, state, x, rest, ready):
    """fn(state, x, rest) -> (y, aux) with y like x [B,T,D] (a residual block), its weights
    `state` used only once `ready` [B,T,D] is computed, and recomputed in the backward pass from
    (state, x, rest) once the cotangent of y is there.

    A program that leaves the order to the scheduler gets what the scheduler likes. With
    `jax.checkpoint` the recomputation depends on nothing but the saved inputs, and FSDP's
    weight gathers on nothing but the parameters (loop-invariant in the micro-batch loop, so XLA
    also hoists them out of it): XLA:CPU ran every layer's recomputation at the start of the
    backward pass and gathered every layer's weights up front, and kept all of it alive. Here
    the order is data: the weights of layer i wait for the input of layer i-1 (`ready`: one
    layer of prefetch, so an all-gather can still overlap the previous layer), and the backward
    of layer i, its recomputation and gathers included, waits for its cotangent, i.e. for layer
    i+1's backward (`after`). One layer's activations and at most two layers' gathered weights
    exist at a time. Qwen2.5-0.5B shape, fsdp=8, bf16, one row per device, XLA:CPU temporaries
    of the train step (`launch.bench memory`): 11.18 -> 3.04 GiB at 4096 tokens, 70.92 -> 10.43
    GiB at 32,768. (Loop buffers that the attention initialises from constants are outside this
    order: XLA:CPU still makes every layer's at the start.)

    A mixture of experts' decode step (one token per row) is ordered too: in the sampler's
    decode loop the weights are loop-invariant, and XLA:CPU's while-loop-invariant code motion
    hoisted every layer's gathered experts out of it, all live for the whole call (Qwen3-30B-A3B
    on fsdp=4 x expert=2: a layer's experts in bf16, 0.56 GiB, 27 GiB at 48 layers;
    docs/performance.md). The price on XLA:CPU is `after`'s read-through, one elementwise pass
    over each layer's weights a step and an all-reduce of one scalar per layer on a mesh;
    elsewhere it is a barrier. A dense block's decode step is not ordered (`_remat_block`): its
    weights come gathered in the decode copy (`sampling.weights_layout="tensor"`), and the
    ordering would add that all-reduce to every decode step of the XLA:CPU programs that
    `launch.bench mesh` counts as the accelerators' (1 collective a step, 1 byte, without it).
    """
    return fn(after(state, ready), x, rest)


def _remat_fwd(fn, state, x, rest, ready):
    return fn(after(state, ready), x, rest), (state, x, rest)


def _remat_bwd(fn, saved, ct):
    state, x, rest = saved
    state, x = after((state, x), ct[0])
    _, vjp = jax.vjp(fn, state, x, rest)
    return (*vjp(ct), None)  # no cotangent for `ready`: it only orders


remat.defvjp(_remat_fwd, _remat_bwd)


class Transformer(nnx.Module):
    """tokens [B,T] + positions [B,T] -> logits [B,T,V] (see `__call__`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), dtype=pd)
        self.blocks = nnx.List(
            [Block(cfg, rngs, i in cfg.moe_layers) for i in range(cfg.num_layers)]
        )
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs, pd)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dtype=pd)

    def hidden(
        self,
        tokens,
        positions,
        valid=None,
        attend=None,
        routes=None,
        record=False,
        stats=False,
        place=None,
    ):
        """Final-norm hidden states h [B,T,D] in the compute dtype, and the attention hook.

        valid bool [B,T] marks real tokens (default: all), or int [B,T] gives the segment ids of
        packed rows (0 = padding; `models.attention.causal_mask`); it is used only by the default
        hook (dense or blockwise, `cfg.attention`). `attend` replaces that hook, e.g. with the
        sampler's paged KV cache.

        Routing replay (MoE models): `routes` int [B,T,L_moe,k] gives each token's experts in
        each MoE layer (in `cfg.moe_layers` order), used in place of the routers' top-k (the
        gate weights still come from the routers); None routes as the routers say. With
        `record` a third value is returned: the experts used, [B,T,L_moe,k] in
        `models.moe.route_dtype(E)` (int8 when E <= 128, else int16). With `stats` one more:
        the routers' `models.moe.RouterStats` over the real tokens (`valid` != 0, or all),
        stacked over the MoE layers ([L_moe, E] and [L_moe] sums), None for a dense model.

        `place`, if given, is applied to the embedded tokens [B,T,D]: the sampler's prefill
        constrains them to its rows' shards (`sampling.steps.prefill`).
        """
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        if attend is None:
            valid = jnp.ones(tokens.shape, bool) if valid is None else valid
            attend = causal_hook(valid, cfg.attention)
        inv_freq = jnp.asarray(rope_inv_freq(cfg))
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)  # [B,T,D]
        if place is not None:
            x = place(x)
        ready = x  # the input of the layer before (see `remat`)
        used, counted = [], []  # [B,T,k] and RouterStats per MoE layer
        mask = None
        if stats and cfg.num_moe_layers:  # the tokens the routers' statistics count
            mask = jnp.ones(tokens.shape, bool) if valid is None else valid != 0
        for layer, block in enumerate(self.blocks):
            r = None
            if routes is not None and layer in cfg.moe_layers:
                r = routes[:, :, len(used)]
            if cfg.remat:
                x_in = x
                x, attend, ids, st = _remat_block(
                    block, x, positions, inv_freq, layer, attend, ready, r, mask
                )
                ready = x_in
            else:
                x, attend, ids, st = block(x, positions, inv_freq, layer, attend, r, mask)
            if ids is not None:
                used.append(ids)
            if st is not None:
                counted.append(st)
        out = (self.final_norm(x), attend)
        if record:
            rec = jnp.stack(used, axis=2) if used else jnp.zeros((*tokens.shape, 0, 0), jnp.int32)
            out += (rec.astype(route_dtype(cfg.num_experts or 1)),)
        if stats:
            out += (jax.tree.map(lambda *a: jnp.stack(a), *counted) if counted else None,)
        return out

    def unembedding(self):
        """The output projection's master weights (param_dtype) and their einsum letters: the
        embedding [V,D] ("VD") when tied, else lm_head [D,V] ("DV")."""
        if self.cfg.tie_embeddings:
            return self.embed[...], "VD"
        return self.lm_head[...], "DV"

    def unembed_matrix(self):
        """f32-or-compute-dtype [D,V] output projection (the transposed embedding when tied)."""
        dt = jnp.dtype(self.cfg.dtype)
        return self.embed[...].T.astype(dt) if self.cfg.tie_embeddings else _cast(self.lm_head, dt)

    def logits(self, h):
        """h [B,T,D] -> f32 logits [B,T,V], accumulated in f32 and never rounded to the compute
        dtype (`rl.logprobs` computes the learner's alike)."""
        return jnp.einsum(
            "BTD,DV->BTV", h, self.unembed_matrix(), preferred_element_type=jnp.float32
        )

    def __call__(self, tokens, positions, valid=None, attend=None, routes=None, record=False):
        """-> (f32 logits [B,T,V], attend), and the routes record with `record` (`hidden`)."""
        out = self.hidden(tokens, positions, valid, attend, routes, record)
        return (self.logits(out[0]), *out[1:])
