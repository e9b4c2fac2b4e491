"""The mixture-of-experts feed-forward block (Qwen3-MoE): router, top-k, experts' grouped matmuls.

x [B,T,D] -> [B,T,D]. Tokens are N = B*T rows. The router is a linear map [D,E] and a softmax in
f32 over its logits; each token goes to the k experts of highest probability (dropless: no
capacity, every token reaches its k experts), with gate weights those k probabilities,
renormalised to sum to 1 when `norm_topk_prob`, cast back to the compute dtype (as transformers'
Qwen3MoeTopKRouter does). Expert e is a SwiGLU block, down(silu(x @ gate[e]) * (x @ up[e])),
with gate/up [E,D,F] and down [E,F,D] (F = `expert_d_ff`), and a token's output is the
gate-weighted sum of its k experts' outputs.

The experts' matmuls are grouped: the N*k (token, expert) pairs are sorted by expert and each
projection is one `jax.lax.ragged_dot` over the sorted rows with the group sizes (tokens per
expert), so the FLOPs are those of N*k rows, not N*E (no dense one-hot dispatch). XLA:CPU lowers
ragged_dot densely (a masked dot over every expert: E/k times the FLOPs); TPU and GPU lower it
to a grouped matmul (`chlo.ragged_dot`), which is what the exported programs hold.

On a device mesh (the mesh jit attaches to x, else the context mesh) the block runs inside a
`jax.shard_map` over every mesh axis, so nothing in it is left to GSPMD:
- tokens: rows split over the mesh axes other than `tensor` (data, fsdp, expert; padded to a
  multiple of their product), each device routing its own rows with the whole router;
- experts: split over the `expert` axis (device j of it holds experts [j*E/ep, (j+1)*E/ep)) and
  their width F over `tensor` where it divides, and enter the shard_map as master-weight shards
  (the model dimension D over fsdp where it divides): each is cast to the compute dtype and then
  gathered over fsdp inside (bf16 gathers for a bf16 model, as FSDP gathers every weight for its
  layer), and its gradient is computed with `preferred_element_type` = the learner's
  grad_reduce_dtype (`models.transformer.weight_grads_in`), reduce-scattered over fsdp and summed
  over the axes its shard is replicated over in that dtype (custom VJPs `_grouped`,
  `_router_logits`); the router likewise;
- dispatch: each device sorts its pairs by expert, so by the device holding it, packs them into
  a [ep, N_loc*k, D] buffer (slot j: the rows for device j, at the front) and one
  `jax.lax.all_to_all` over `expert` delivers them; the receiver sorts what it got by its local
  expert, runs the grouped matmuls (rows past the group sizes are padding, never read), and a
  second all_to_all returns each row to its sender, which weights and sums them per token; the
  partial sums over the tensor-split F are summed last (`psum` over tensor). Dropless with static
  shapes: the buffers are sized for the worst case (all of a device's pairs to one expert
  device), ep times the rows that travel. (XLA:CPU has no `ragged_all_to_all`, which would send
  only the rows; the dense all_to_all is used on every platform.)

Routing replay: `experts` int [B,T,k] (recorded expert ids) replaces the top-k; the gate weights
are then this router's probabilities at those ids (renormalised as `norm_topk_prob` says), so
the router still gets gradients; a token whose ids are -1 (not recorded: the learner marks each
sequence's last token so, `rl.router.recorded`) is routed by the router's own top-k. A model
passes one [B,T,k] slice of a [B,T,L_moe,k] record per MoE layer;
`MoE.routed` also returns the ids it used, which `models.transformer` stacks into that record
(int8 when E <= 128, else int16: `route_dtype`).

Router statistics: given a token mask, the block also returns `RouterStats`, sums over the
marked tokens of the router's softmax, its own top-k choices, the experts used and the softmax
entropy, summed over every device's rows (rl/router.py reads them: the load-balancing loss and
the routers' logs).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.grad_dtype import weight_grad_dtype

EXPERT_AXIS = "expert"  # the mesh axis that splits the experts
TENSOR_AXIS = "tensor"  # the mesh axis that splits each expert's width F
FSDP_AXIS = "fsdp"  # the mesh axis that splits the model dimension D of the block's weights


_DW = jax.lax.RaggedDotDimensionNumbers(  # [M,D] x [M,F] -> [G,D,F]: rows summed per group
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


class Weights(NamedTuple):
    """How the block uses its master weights: cast to the compute dtype `dtype`, gathered over
    the mesh axis `fsdp` (None: not split) along axis 1 (gate, up: D) or 2 (down: D) of the
    experts and 0 of the router, and their gradients computed and reduce-scattered in `grad`."""

    dtype: Any
    grad: Any
    fsdp: str | None = None


def _gather(w, spec: Weights, axis: int):
    """A master weight shard -> the compute-dtype weight the block uses (cast, then gathered)."""
    w = w.astype(spec.dtype)
    if spec.fsdp is None:
        return w
    if axis == 0:
        return jax.lax.all_gather(w, spec.fsdp, axis=0, tiled=True)
    # Gathered along a new leading axis, then moved into place (the same values). Gathered along
    # D in place, XLA:CPU laid the f32 master shard out with D major first, and in the sampler's
    # decode loop (the weights loop-invariant) it made that copy of every layer's shard before
    # the loop, all live through it: 288 MiB a layer of Qwen3-30B-A3B's experts on fsdp=4 x
    # expert=2 (docs/performance.md). Now the copy is the gathered bf16 weight's, in its turn.
    g = jax.lax.all_gather(w, spec.fsdp, axis=0)  # [S, ...w.shape]
    return jnp.moveaxis(g, 0, axis).reshape(*w.shape[:axis], -1, *w.shape[axis + 1 :])


def _summed(ct, like):
    """ct summed over the manual mesh axes it varies over and `like` does not: a gradient of an
    operand replicated over axes whose devices used it on different rows (what autodiff puts
    there, here in ct's own dtype)."""
    axes = tuple(sorted(_varying(ct) - _varying(like)))
    return jax.lax.psum(ct, axes) if axes else ct


def _varying(x) -> frozenset:
    """The manual mesh axes x varies over inside a shard_map (jax's check_vma type)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)  # jax 0.10; `vma` before
    return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


def _scatter(dw, spec: Weights, axis: int, like):
    """The gradient of the gathered weight (in spec.grad) -> that of the master shard `like`
    (its dtype and varying axes): reduce-scattered over fsdp, summed over the axes the shard is
    replicated over, in spec.grad."""
    if spec.fsdp is not None:
        dw = jax.lax.psum_scatter(dw, spec.fsdp, scatter_dimension=axis, tiled=True)
    return _summed(dw, like).astype(like.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _router_logits(spec: Weights, x, w):
    """x [N,D] (compute dtype) @ the router's master [D,E] shard -> f32 logits [N,E], never
    rounded to the compute dtype: a round trip that one program's fusions drop and another's
    keep routes the same token otherwise (the sampler's decode kept it, the learner's dropped it)."""
    return jnp.einsum("ND,DE->NE", x, _gather(w, spec, 0), preferred_element_type=jnp.float32)


def _router_fwd(spec, x, w):
    wc = _gather(w, spec, 0)
    return jnp.einsum("ND,DE->NE", x, wc, preferred_element_type=jnp.float32), (x, wc, w[:0])


def _router_bwd(spec, res, ct):
    x, wc, like = res
    ct = ct.astype(x.dtype)
    dw = jnp.einsum("ND,NE->DE", x, ct, preferred_element_type=spec.grad)
    return _summed(jnp.einsum("NE,DE->ND", ct, wc), x), _scatter(dw, spec, 0, like)


_router_logits.defvjp(_router_fwd, _router_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped(spec: Weights, axis: int, x, w, sizes):
    """x [M,K] sorted by group @ the master shard of w [G,K,J] (gathered along `axis`) ->
    [M,J] with `jax.lax.ragged_dot`; w's gradient in spec.grad (`preferred_element_type`)."""
    return jax.lax.ragged_dot(x, _gather(w, spec, axis), sizes)


def _grouped_fwd(spec, axis, x, w, sizes):
    wc = _gather(w, spec, axis)
    return jax.lax.ragged_dot(x, wc, sizes), (x, wc, sizes, w[:0])


def _grouped_bwd(spec, axis, res, ct):
    x, wc, sizes, like = res
    dx = _summed(jax.lax.ragged_dot(ct, jnp.swapaxes(wc, 1, 2), sizes), x)
    dw = jax.lax.ragged_dot_general(x, ct, sizes, _DW, preferred_element_type=spec.grad)
    return dx, _scatter(dw, spec, axis, like), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


class RouterStats(NamedTuple):
    """One MoE layer's router over the tokens a mask marks, as sums over them (so micro-batches
    and devices add up): what the load-balancing loss and the router's logs read (rl/router.py).
    Stacked over the MoE layers by `models.transformer` ([L_moe, E] and [L_moe])."""

    probs: jax.Array  # f32 [E] the router's softmax summed (with its gradient: the loss's P)
    chosen: jax.Array  # f32 [E] tokens whose router's own top-k holds the expert (the loss's f)
    load: jax.Array  # f32 [E] tokens sent to the expert (the ids used: replayed, else chosen)
    entropy: jax.Array  # f32 [] the router's softmax entropy (nats) summed, no gradient


def route(
    x, router, k: int, norm_topk_prob: bool, experts=None, spec: Weights | None = None, mask=None
):
    """x [N,D] (compute dtype), router [D,E] (master) -> (gate weights [N,k] in x's dtype,
    expert ids int32 [N,k]). `experts` [N,k]: use these ids (routing replay; a token's -1s:
    not recorded, routed by this router), weights from this router. mask f32 [N]: also the
    RouterStats of the tokens it marks (a third value)."""
    spec = spec or Weights(x.dtype, x.dtype)
    logits = _router_logits(spec, x, router)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if experts is None:
        top, experts = jax.lax.top_k(probs, k)
        chosen = experts
    else:  # a token whose ids are negative has no record: this router's top-k routes it
        chosen = jax.lax.top_k(jax.lax.stop_gradient(probs), k)[1]
        experts = experts.astype(jnp.int32)
        experts = jnp.where(experts < 0, chosen, experts)
        top = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    out = (top.astype(x.dtype), experts.astype(jnp.int32))
    if mask is None:
        return out
    return (*out, _router_stats(logits, probs, chosen, out[1], mask))


def _router_stats(logits, probs, chosen, used, mask) -> RouterStats:
    """logits [N,E], probs f32 [N,E], chosen / used int32 [N,k], mask f32 [N] -> RouterStats."""
    e = probs.shape[-1]

    def count(ids):  # f32 [E]: the marked tokens whose ids hold each expert
        w = jnp.broadcast_to(mask[:, None], ids.shape).reshape(-1)
        return jnp.zeros((e,), jnp.float32).at[ids.reshape(-1)].add(w)

    logp = jax.nn.log_softmax(jax.lax.stop_gradient(logits).astype(jnp.float32), axis=-1)
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)  # [N]
    return RouterStats(mask @ probs, count(chosen), count(used), mask @ entropy)


def grouped_ffn(x, sizes, gate, up, down, spec: Weights | None = None):
    """x [M,D] sorted by group, sizes int32 [G] (rows past their sum are padding), gate/up
    [G,D,F], down [G,F,D] (master shards, see Weights) -> [M,D]: each row through its group's
    SwiGLU block."""
    spec = spec or Weights(x.dtype, x.dtype)
    g = _grouped(spec, 1, x, gate, sizes)
    u = _grouped(spec, 1, x, up, sizes)
    return _grouped(spec, 2, jax.nn.silu(g) * u, down, sizes)


def _sort_pairs(experts):
    """experts int32 [N,k] -> (order [N*k]: the pairs sorted by expert (stable), token [N*k] of
    each sorted pair, expert [N*k] of each sorted pair)."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, order // k, flat[order]


def local_moe(x, weights, experts, gate, up, down, spec: Weights | None = None):
    """All experts here: x [N,D], weights [N,k], experts int32 [N,k] -> [N,D]."""
    order, token, expert = _sort_pairs(experts)
    sizes = jnp.bincount(expert, length=gate.shape[0]).astype(jnp.int32)
    y = grouped_ffn(x[token], sizes, gate, up, down, spec)  # [N*k, D]
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _take(fan: int, src, idx, ok, inv, inv_ok):
    """Rows of src [S,D]: out[i] = src[idx[i]] where ok[i], else 0 (idx, ok [M]). Each src row
    is taken by `fan` out rows, listed in inv [S*fan] (only those where inv_ok), so the gradient
    is a gather too (ct[inv], summed over the fan), not autodiff's scatter into a zeroed [S,D]
    buffer: zeros made from constants, which XLA:CPU scheduled at the start of the program for
    every layer at once (`models.order`)."""
    return jnp.where(ok[:, None], src[idx], 0)


def _take_fwd(fan, src, idx, ok, inv, inv_ok):
    return _take(fan, src, idx, ok, inv, inv_ok), (inv, inv_ok, src[:0])


def _take_bwd(fan, res, ct):
    inv, inv_ok, like = res
    d = jnp.where(inv_ok[:, None], ct[inv], 0)
    d = d.reshape(-1, fan, d.shape[-1]).sum(1) if fan > 1 else d
    return _summed(d, like).astype(like.dtype), None, None, None, None


_take.defvjp(_take_fwd, _take_bwd)


def _dispatch_moe(x, weights, experts, gate, up, down, ep: int, spec: Weights):
    """Inside the shard_map: this device's rows x [n,D] with their weights/experts [n,k], its
    experts gate/up [E/ep,D,F'] and down [E/ep,F',D] -> [n,D] (see the module docstring).

    In chunks of at most CHUNK rows (`_chunks`), one after the other, each rematerialised: the
    dispatch's buffers are sized by the chunk (ep x CHUNK x k rows of D), not by the device's
    rows, so a 32k-token row's layer holds a chunk's, not the row's (Qwen3-30B-A3B on fsdp=4 x
    expert=2: 256 MiB a buffer, not 1 GiB). The price: the experts' weights are gathered over
    fsdp (and their gradients reduce-scattered) once per chunk."""
    n = x.shape[0]
    c = _chunks(n)
    if c == 1:
        return _dispatch_chunk(x, weights, experts, gate, up, down, ep, spec)
    return _chunked(c, ep, spec, x, weights, experts, gate, up, down)


def _chunk_loop(c: int, ep: int, spec: Weights, x, weights, experts, gate, up, down):
    """`_dispatch_moe` in c chunks of rows, one after the other: each chunk's output rows are
    written into a loop carry that starts as x (every row is written over). Not lax.map: its
    stacked output is zeros made from constants, and XLA:CPU made every layer's at the start of
    the program (`models.order`), 1 GiB a layer in a 32k log-prob pass of 8 rows a device. The
    carry varies over the mesh axes the chunks' outputs do (tensor: partial sums over a split F)."""
    size = x.shape[0] // c
    one = lambda *a: _dispatch_chunk(*a, gate, up, down, ep, spec)

    def chunk(i, out):
        rows = lambda a: jax.lax.dynamic_slice_in_dim(a, i * size, size)
        y = one(rows(x), rows(weights), rows(experts))
        return jax.lax.dynamic_update_slice_in_dim(out, y, i * size, 0)

    first = jax.eval_shape(one, x[:size], weights[:size], experts[:size])
    mat = getattr(first, "manual_axis_type", None)  # jax 0.10; `vma` before
    axes = frozenset(mat.varying if mat is not None else getattr(first, "vma", ()))
    axes = tuple(sorted(axes - _varying(x)))
    return jax.lax.fori_loop(0, c, chunk, jax.lax.pcast(x, axes, to="varying") if axes else x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked(c: int, ep: int, spec: Weights, x, weights, experts, gate, up, down):
    """`_chunk_loop`, with a backward pass of the same chunks (`_chunked_bwd`) that keeps only
    its inputs and allocates nothing from constants."""
    return _chunk_loop(c, ep, spec, x, weights, experts, gate, up, down)


def _chunked_fwd(c, ep, spec, x, weights, experts, gate, up, down):
    out = _chunk_loop(c, ep, spec, x, weights, experts, gate, up, down)
    return out, (x, weights, experts, gate, up, down)


def _chunked_bwd(c, ep, spec, saved, ct):
    """Each chunk recomputed and differentiated on its own, last chunk first (the order, and so
    the weight gradients' sums, of autodiff's transposed loop). Autodiff's loop (a jax.checkpoint
    per chunk in a fori_loop) accumulated into zeros made from constants: the rows' cotangent
    [n,D], each weight's f32 gradient, and the forward's stacked chunk inputs [c,n/c,D], which
    XLA:CPU made for every layer at the start of the learner step (Qwen3-30B-A3B on fsdp=4 x
    expert=2, 16k rows a device: 416 MiB a layer). Here the carries start from data: the last
    chunk's gradients, and x / weights for the rows' cotangents (every row is written over)."""
    x, weights, experts, gate, up, down = saved
    size = x.shape[0] // c

    def grads(i):
        rows = lambda a: jax.lax.dynamic_slice_in_dim(a, i * size, size)
        e = rows(experts)
        f = lambda xr, wr, g, u, d: _dispatch_chunk(xr, wr, e, g, u, d, ep, spec)
        _, vjp = jax.vjp(f, rows(x), rows(weights), gate, up, down)
        return vjp(rows(ct))

    def put(i, full, part):
        return jax.lax.dynamic_update_slice_in_dim(full, part.astype(full.dtype), i * size, 0)

    dx, dw, *dwts = grads(c - 1)
    carry = (put(c - 1, x, dx), put(c - 1, weights, dw), *dwts)

    def step(j, carry):
        i = c - 2 - j
        dx, dw, *dwts = grads(i)
        full_x, full_w, *acc = carry
        acc = [a + b for a, b in zip(acc, dwts, strict=True)]
        return (put(i, full_x, dx), put(i, full_w, dw), *acc)

    dx, dw, dg, du, dd = jax.lax.fori_loop(0, c - 1, step, carry)
    return dx, dw, None, dg, du, dd


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


CHUNK = 4096  # the most rows (tokens) a device sends through its experts at once


def _chunks(n: int) -> int:
    """How many equal chunks of at most CHUNK rows n rows make (the fewest that divide n)."""
    c = -(-n // CHUNK)
    while n % c:
        c += 1
    return c


def _dispatch_chunk(x, weights, experts, gate, up, down, ep: int, spec: Weights):
    """`_dispatch_moe` for one chunk of rows, x [n,D] with weights/experts [n,k].

    Every move of rows is a `_take` (a gather whose gradient is a gather): the send buffer
    [ep*m, D] (slot (j, r): the r-th pair for expert device j, zeros past its count), the
    receiver's sort by local expert and its inverse, and each pair's row of what comes back; the
    k rows of a token are then summed with its gate weights. No scatter into a zeroed buffer of
    the worst-case size, in the forward pass or the backward."""
    n, d = x.shape
    k = experts.shape[1]
    e_loc = gate.shape[0]
    m = n * k
    order, _, expert = _sort_pairs(experts)  # order [m]: the (token-major) pair sorted there
    dest = expert // e_loc  # [m] the expert-axis device of each sorted pair (non-decreasing)
    counts = jnp.bincount(dest, length=ep)
    starts = jnp.cumsum(counts) - counts
    r = jnp.arange(m)
    ok = (r[None, :] < counts[:, None]).reshape(-1)  # [ep*m] the slots that hold a pair
    at = jnp.minimum(starts[:, None] + r[None, :], m - 1).reshape(-1)  # [ep*m] its sorted pair
    pair = order[at]  # [ep*m] the (token-major) pair in each slot
    slot = jnp.zeros(m, jnp.int32).at[order].set(dest * m + r - starts[dest])  # [m] pair's slot
    every_pair = jnp.ones(m, bool)
    send = _take(k, x, pair // k, ok, slot, every_pair)  # [ep*m, D]
    send_e = jnp.where(ok, expert[at] % e_loc, e_loc)  # [ep*m] local expert; e_loc = padding
    recv = jax.lax.all_to_all(send.reshape(ep, m, d), EXPERT_AXIS, 0, 0).reshape(ep * m, d)
    recv_e = jax.lax.all_to_all(send_e.reshape(ep, m), EXPERT_AXIS, 0, 0).reshape(ep * m)
    order2 = jnp.argsort(recv_e, stable=True)
    inv2 = jnp.zeros(ep * m, jnp.int32).at[order2].set(jnp.arange(ep * m, dtype=jnp.int32))
    sizes = jnp.bincount(recv_e, length=e_loc + 1)[:e_loc].astype(jnp.int32)
    every = jnp.ones(ep * m, bool)
    y = grouped_ffn(_take(1, recv, order2, every, inv2, every), sizes, gate, up, down, spec)
    y = _take(1, y, inv2, every, order2, every).reshape(ep, m, d)  # back in received order
    back = jax.lax.all_to_all(y, EXPERT_AXIS, 0, 0).reshape(ep * m, d)  # as this device sent
    rows = _take(1, back, slot, every_pair, pair, ok).reshape(n, k, d)  # each pair's result
    return jnp.einsum("NKD,NK->ND", rows, weights)


def _mesh(x):
    """The (abstract) mesh x is traced on: its aval's, else the context mesh; None if none."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def route_dtype(num_experts: int):
    """The integer dtype of a routes record: int8 when the expert ids (0..E-1, and the -1 the
    learner marks an unrecorded token with) fit, as Qwen3-30B-A3B's 128 do, else int16."""
    return jnp.int8 if num_experts <= 128 else jnp.int16


def check_expert_axis(num_experts: int, expert_axis: int, field: str = "mesh.expert") -> None:
    """ValueError (one line naming `field`) unless the expert axis divides the experts."""
    if expert_axis > 1 and num_experts % expert_axis:
        raise ValueError(
            f"{field}={expert_axis}: does not divide the model's num_experts={num_experts} "
            "(each device of the expert axis holds num_experts / expert of them)"
        )


def moe_ffn(
    x, router, gate, up, down, k: int, norm_topk_prob: bool, experts=None, grad=None, mask=None
):
    """x [N,D] (compute dtype) -> ([N,D], the expert ids used int32 [N,k]): the block on one
    device or, on a mesh, in a shard_map (module docstring). router, gate, up, down: master
    weights (cast to x's dtype where used; their gradients computed and summed across devices in
    `grad`, default x's dtype); experts: recorded ids [N,k] or None (this router's top-k);
    mask f32 [N]: also the RouterStats of the tokens it marks, summed over every device's rows
    (a third value)."""
    grad = jnp.dtype(grad or x.dtype)
    mesh = _mesh(x)
    if mesh is None or mesh.size == 1:
        spec = Weights(x.dtype, grad)
        w, ids, *stats = route(x, router, k, norm_topk_prob, experts, spec, mask)
        return (local_moe(x, w, ids, gate, up, down, spec), ids, *stats)
    shape = dict(mesh.shape)
    ep = shape.get(EXPERT_AXIS, 1)
    check_expert_axis(gate.shape[0], ep)
    split_f = shape.get(TENSOR_AXIS, 1) > 1 and gate.shape[2] % shape[TENSOR_AXIS] == 0
    fsdp = FSDP_AXIS if shape.get(FSDP_AXIS, 1) > 1 and x.shape[1] % shape[FSDP_AXIS] == 0 else None
    spec = Weights(x.dtype, grad, fsdp)
    rows = tuple(a for a in mesh.axis_names if shape[a] > 1 and (a != TENSOR_AXIS or not split_f))
    shards = math.prod(shape[a] for a in rows)
    n = x.shape[0]
    pad = -n % shards
    ids = experts
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        ids = None if ids is None else jnp.pad(ids, ((0, pad), (0, 0)))
        mask = None if mask is None else jnp.pad(mask, (0, pad))  # padding rows: not counted
    tp = TENSOR_AXIS if split_f else None
    ex = EXPERT_AXIS if ep > 1 else None
    row = P(rows if rows else None, None)
    given = {"ids": ids, "mask": mask}  # the optional inputs, split over the rows as x is
    given = {name: a for name, a in given.items() if a is not None}

    def body(x, router, gate, up, down, *rest):
        rest = dict(zip(given, rest))
        w, ids, *stats = route(
            x, router, k, norm_topk_prob, rest.get("ids"), spec, rest.get("mask")
        )
        if ep == 1:
            out = local_moe(x, w, ids, gate, up, down, spec)
        else:
            out = _dispatch_moe(x, w, ids, gate, up, down, ep, spec)
        if stats and rows:  # each device's rows' sums -> the whole batch's, on every device
            stats = [jax.lax.psum(stats[0], rows)]
        return ((jax.lax.psum(out, TENSOR_AXIS) if split_f else out), ids, *stats)

    specs = (row, P(fsdp, None), P(ex, fsdp, tp), P(ex, fsdp, tp), P(ex, tp, fsdp))
    given_specs = tuple(row if name == "ids" else P(row[0]) for name in given)
    outs = (row, row) + ((RouterStats(P(), P(), P(), P()),) if mask is not None else ())
    out, ids, *stats = jax.shard_map(
        body, mesh=mesh, in_specs=(*specs, *given_specs), out_specs=outs
    )(x, router, gate, up, down, *given.values())
    return ((out[:n], ids[:n]) if pad else (out, ids)) + tuple(stats)


class MoE(nnx.Module):
    """The experts' feed-forward block of one layer (see the module docstring)."""

    def __init__(self, cfg, rngs: nnx.Rngs, param):
        """`param(rngs, shape, axes, dtype=...)` makes a parameter (models.transformer's)."""
        d, f, e = cfg.d_model, cfg.expert_d_ff, cfg.num_experts
        pd = jnp.dtype(cfg.param_dtype)
        self.router = param(rngs, (d, e), ("embed", None), dtype=pd)
        self.gate = param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"), dtype=pd)
        self.up = param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"), dtype=pd)
        self.down = param(rngs, (e, f, d), ("experts", "expert_mlp", "embed"), dtype=pd)
        self.k = cfg.experts_per_token
        self.norm_topk_prob = cfg.norm_topk_prob

    def __call__(self, x, experts=None):
        """x [B,T,D] -> [B,T,D]; experts: recorded expert ids int [B,T,k] (routing replay)."""
        return self.routed(x, experts)[0]

    def routed(self, x, experts=None, mask=None):
        """x [B,T,D] -> ([B,T,D], the expert ids used int32 [B,T,k]); experts: recorded ids
        int [B,T,k] used in place of the top-k (routing replay), or None; mask [B,T] (tokens to
        count): also this layer's RouterStats over them (a third value)."""
        b, t, d = x.shape
        w = [p[...] for p in (self.router, self.gate, self.up, self.down)]
        ids = None if experts is None else experts.reshape(b * t, -1)
        grad = weight_grad_dtype(x.dtype)
        m = None if mask is None else mask.reshape(b * t).astype(jnp.float32)
        y, ids, *stats = moe_ffn(x.reshape(b * t, d), *w, self.k, self.norm_topk_prob, ids, grad, m)
        return (y.reshape(b, t, d), ids.reshape(b, t, -1), *stats)
