"""The sampler's jitted device functions over the donated `sampling.state.DecodeState`: prefill
(prompts into their pages), update (a round's inserts, resumes and releases, every slot at
once) and generate (up to k decode steps in one `lax.while_loop`, which stops early once every
slot is idle). `sampling.engine.Engine` is the host side that calls them, through the round's
`Plan`; see the engine's docstring for the design (key schedule, min_new_tokens, sharding).

Each takes `layout`, None on a single device or (mesh, rules), and pins its output state to
that layout, so donation keeps reusing the same buffers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.moe import route_dtype
from sampling import partitioned
from sampling.distribution import banned_stop_ids, sample
from sampling.state import DecodeState, PagedDecode, PagedPrefill, state_shardings


def _constrain(state: DecodeState, layout) -> DecodeState:
    """Pins the state to its layout (None: single device, let XLA place it; else (mesh, rules))."""
    if layout is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(state, *layout))


@functools.partial(jax.jit, static_argnums=(0, 6, 8, 9), donate_argnums=2)
def prefill(
    graphdef, params, state, tokens, lengths, page_rows, layout, starts=None, chunk=0, record=False
):
    """tokens int32[n,T] (n and T buckets), lengths int32[n] real tokens per row (0: padding),
    page_rows int32[n,pages_per_seq]. starts int32[n]: the cache position of each row's first
    token, whose earlier positions are already cached and attended to (a multi-turn episode's
    next observation); None: fresh prompts from position 0.

    chunk > 0 (`EngineConfig.prefill_chunk`): the rows go through the model `chunk` tokens at a
    time, in a `lax.scan` over the chunks. Each chunk writes its KV into its pages and attends
    over the pages (`PagedPrefill.paged`), so activations are [n,chunk,...] (or [n,T,...] for
    rows after cached tokens shorter than a chunk) and attention scores a chunk by a block of
    pages, whatever T is. A fresh prompt that fits one chunk keeps
    the dense path (the same function; faster for short prompts). chunk = 0: one pass over
    all T tokens, the reference.

    record (`EngineConfig.record_routes`, an MoE model): also returns the rows' experts,
    [n,T,L_moe,k] (`Engine.flush` reads them: a Prefix's or a resume's `Recorded`).
    """
    model = nnx.merge(graphdef, params)
    place = None
    if layout is not None and layout[0].size > 1:  # rows laid out by shard (`Engine`)
        rows = partitioned.specs(*layout, state.k_pages[0].shape[0])[1]
        split = lambda x: (
            None
            if x is None
            else jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(layout[0], rows))
        )
        tokens, lengths, page_rows, starts = map(split, (tokens, lengths, page_rows, starts))
        # The embedded rows stay on their shards. Without this, weights in the training layout
        # (`sampling.weights_layout`: D split over fsdp, as the embedding's) left the embedded
        # tokens split over D like the table, and every layer computed every shard's rows on
        # every device and all-reduced the products: Qwen2.5-7B on fsdp=8, 16 rows of 512
        # tokens a shard, 2.3 GiB an MLP product, 12.0 GiB of temporaries (2.1 GiB now). A
        # decode step keeps that split: its few tokens' products cost less than the weights.
        free = jax.sharding.PartitionSpec.UNCONSTRAINED
        on_rows = jax.sharding.NamedSharding(
            layout[0], jax.sharding.PartitionSpec(*rows, free, free)
        )
        place = lambda x: jax.lax.with_sharding_constraint(x, on_rows)
    n, t = tokens.shape
    base = jnp.zeros((n,), jnp.int32) if starts is None else starts
    paged = chunk > 0 and (starts is not None or t > chunk)
    # A paged batch no longer than a chunk is one chunk of its own length (T, a bucket): a short
    # observation after its history computes T positions, not a chunk's. Padded to 512 tokens,
    # a 5-token observation cost 100x its FLOPs, and on XLA:CPU the larger program's fusions
    # rounded the bf16 residual stream otherwise than a small learner pass (docs/performance.md,
    # "bf16 on XLA:CPU").
    c = min(chunk, t) if paged else t
    m = -(-t // c)  # chunks
    tokens = jnp.pad(tokens, ((0, 0), (0, m * c - t)))  # [n,m*c]
    valid = jnp.arange(m * c)[None] < lengths[:, None]
    positions = jnp.arange(m * c, dtype=jnp.int32)[None] + base[:, None]
    split = lambda x: jnp.moveaxis(x.reshape(n, m, c), 1, 0)  # [m,n,c]

    def one(pages, xs):  # one chunk: tokens, valid, positions [n,c] and its first position
        tok, val, pos, first = xs
        hook = PagedPrefill(*pages, page_rows, val, first if paged else starts, paged, layout)
        out = model.hidden(tok, pos, val, hook, record=record, place=place)
        hook = out[1]
        return (hook.k_pages, hook.v_pages), (out[2] if record else None)

    firsts = base[None] + c * jnp.arange(m, dtype=jnp.int32)[:, None]  # [m,n]
    xs = (split(tokens), split(valid), split(positions), firsts)
    pages = (state.k_pages, state.v_pages)
    if m == 1:
        pages, rec = one(pages, jax.tree.map(lambda x: x[0], xs))
    else:
        pages, rec = jax.lax.scan(one, pages, xs)  # rec [m,n,c,L_moe,k]
        rec = None if rec is None else jnp.moveaxis(rec, 0, 1).reshape(n, m * c, *rec.shape[3:])
    state = _constrain(state.replace(k_pages=pages[0], v_pages=pages[1]), layout)
    return state if rec is None else (state, rec[:, :t])  # rec [n,T,L_moe,k]: the rows' experts


def bucket_slots(n: int) -> int:
    """n rounded up to a power of two (0 stays 0): the page copies of `update` come in a few
    sizes, one compile each, not one per count a round happens to make."""
    return 1 << (n - 1).bit_length() if n else 0


@functools.partial(jax.jit, static_argnums=12, donate_argnums=0)
def update(
    state,
    put,
    off,
    lengths,
    last_token,
    max_new,
    min_new,
    request_id,
    sample_id,
    shared,
    copy_src,
    copy_dst,
    layout,
):
    """One round's slot changes, every slot at once (`sampling.engine.Plan`): slots put bool[B]
    start a sequence (an insert or a resume: cached `lengths`, fed `last_token`, budget `max_new`,
    stop ids banned for the first `min_new` tokens, PRNG stream `request_id` / `sample_id`, cascade
    `shared` prompt tokens; tokens and log-probs cleared), slots off bool[B] go idle (not put ones);
    pages copy_src -> copy_dst int32[S*C] are copied first, shard i's C copies in rows [i*C,
    (i+1)*C) in its local page ids ((0, 0): the null page onto itself). Every [B] input
    is split over the slots like the state, so each device changes only its own slots: a
    per-slot select, no scatter."""
    if layout is not None and layout[0].size > 1:
        copy = lambda pages: partitioned.copy_pages(pages, copy_src, copy_dst, *layout)
    else:
        # A quantised pool's scales move with its values (`sampling.kv_quant`).
        copy = lambda pages: jax.tree.map(lambda x: x.at[:, copy_dst].set(x[:, copy_src]), pages)
    new = lambda value, old: jnp.where(put, value, old)
    state = state.replace(
        k_pages=copy(state.k_pages),
        v_pages=copy(state.v_pages),
        lengths=new(lengths, state.lengths),
        last_token=new(last_token, state.last_token),
        active=put | (state.active & ~off),
        num_generated=new(0, state.num_generated),
        max_new=new(max_new, state.max_new),
        min_new=new(min_new, state.min_new),
        request_id=new(request_id, state.request_id),
        sample_id=new(sample_id, state.sample_id),
        shared_len=jnp.where(put, shared, jnp.where(off, 0, state.shared_len)),
        stopped=state.stopped & ~put,
        tokens=jnp.where(put[:, None], 0, state.tokens),
        logprobs=jnp.where(put[:, None], 0.0, state.logprobs),
    )
    return _constrain(state, layout)


def _write_at(row, col, value, write):
    """row [M] with row[col] = value where `write` (one slot; vmapped over the slots). A
    per-row update, not a scatter at [rows, col]: GSPMD keeps it on the device that holds the
    slot, where a scatter gathered every slot's indices and values per step."""
    old = jax.lax.dynamic_index_in_dim(row, col, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(row, jnp.where(write, value, old), col, 0)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6, 8, 9, 10, 11), donate_argnums=2)
def generate(
    graphdef,
    params,
    state,
    sampling,
    num_steps,
    stop_ids,
    backend,
    root,
    layout,
    group,
    interpret=False,
    record=False,
):
    """Up to `num_steps` decode steps of every active slot. Returns the state and what the host
    reads: active, num_generated, stopped, lengths, tokens, logprobs, with `record` (an MoE
    model's `EngineConfig.record_routes`) the experts of the token each slot fed at each step
    of this call ([B,num_steps,L_moe,k]: a slot's first num_generated - (its count before the
    call) columns; this call's only, so the state holds no record of whole episodes), and the
    steps run."""
    model = nnx.merge(graphdef, params)
    is_stop_id = banned_stop_ids(jnp.array(True), stop_ids, model.cfg.vocab_size)  # [V]
    m = state.tokens.shape[1]

    def key_of(req, g, pos):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(root, req), g), pos)

    def step(i, s: DecodeState, rec):
        hook = PagedDecode(
            s.k_pages,
            s.v_pages,
            s.page_indices,
            s.lengths,
            s.active,
            s.shared_len,
            backend,
            group,
            interpret,
            layout,
        )
        out = model(s.last_token[:, None], s.lengths[:, None], None, hook, record=record)
        logits, hook = out[0][:, 0], out[1]  # f32 [B,V]
        banned = banned_stop_ids(s.num_generated < s.min_new, stop_ids, logits.shape[-1])
        keys = None
        if sampling.temperature > 0:
            # Keyed by the cache position of the fed token: unique over an episode's turns.
            keys = jax.vmap(key_of)(s.request_id, s.sample_id, s.lengths)
        tok, tok_lp = sample(logits, sampling, banned, keys)  # int32 [B], f32 [B]
        a = s.active
        col = jnp.minimum(s.num_generated, m - 1)
        n = s.num_generated + a
        hit_stop = a & is_stop_id[tok]
        s = s.replace(
            k_pages=hook.k_pages,
            v_pages=hook.v_pages,
            lengths=s.lengths + a,
            last_token=jnp.where(a, tok, s.last_token),
            active=a & ~hit_stop & (n < s.max_new),
            num_generated=n,
            stopped=s.stopped | hit_stop,
            tokens=jax.vmap(_write_at)(s.tokens, col, tok, a),
            logprobs=jax.vmap(_write_at)(s.logprobs, col, tok_lp, a),
        )
        if record:  # the fed token's experts, at this call's step i
            fed = jnp.where(a[:, None, None], out[2][:, 0], 0).astype(rec.dtype)  # [B,L_moe,k]
            rec = jax.lax.dynamic_update_index_in_dim(rec, fed, i, 1)
        return _constrain(s, layout), _slots(rec, layout, s)

    def more(carry):  # stop early once no slot is active (the tail of a rollout)
        i, s, _ = carry
        return (i < num_steps) & s.active.any()

    rec = None
    if record:
        c = model.cfg
        shape = (state.active.shape[0], num_steps, c.num_moe_layers, c.experts_per_token)
        rec = _slots(jnp.zeros(shape, route_dtype(c.num_experts)), layout, state)
    steps, state, rec = jax.lax.while_loop(
        more, lambda c: (c[0] + 1, *step(*c)), (0, _constrain(state, layout), rec)
    )
    # What the host reads, as arrays of their own: the state itself is donated to the next call,
    # which the host may dispatch before it reads these. `steps` (decode steps run, replicated)
    # is every process's to read: slot-steps for the utilization.
    out = (state.active, state.num_generated, state.stopped, state.lengths, state.tokens)
    routes = () if rec is None else (rec,)
    return state, (*(jnp.copy(x) for x in (*out, state.logprobs)), *routes, steps)


def _slots(x, layout, state: DecodeState):
    """x [B,...] (None passes) split over the slots as the state's slot buffers are."""
    if x is None or layout is None:
        return x
    slots = partitioned.specs(*layout, state.k_pages[0].shape[0])[1]
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(layout[0], slots))
