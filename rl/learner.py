"""The GRPO train step: one optimizer update from a batch of scored completions, in place.

`Learner.step(state, batch)` is one jitted function:
- the parameters and optimizer state are donated and come back with the same NamedShardings
  (out_shardings = the shardings they were created with), so the sampler keeps reading the same
  arrays after the update;
- the batch rows are split into `micro_batches` accumulated with `lax.scan` inside the step;
- loss normalisers (valid tokens, sequences) are counted once over the whole step's batch, before
  the split, so every micro-batch and every data-parallel shard adds an exact contribution
  (`rl.losses.aggregate`); GSPMD turns the sums over the sharded batch axis into all-reduces;
- log-probs come from `rl.logprobs.token_logprobs`, chunked over the sequence, with the hidden
  states pinned to the batch's row sharding (`batch_sharding` of the `rules`) on a mesh;
- the weights' gradients are computed, and summed across the devices that hold the batch's rows,
  in `grad_reduce_dtype` (`models.transformer.weight_grads_in`): float32 by default, so a bf16
  model's gradients are not rounded to bf16 before they are summed.

Micro-batch m takes rows m, m+M, m+2M, ... (a strided split): with the batch sharded over
(data, fsdp) every device then holds its share of every micro-batch, and no rows move between
devices.

`Learner.learn(state, ref_params, rollout)` runs the μ inner iterations over one rollout:
μ passes (`num_iterations`), each split into `minibatches` optimizer steps. In TRL's words,
num_iterations = μ and steps_per_generation = minibatches. π_old is either recomputed by the
learner (`old_logp="recompute"`) or taken from the sampler (`old_logp="sampler"`, bypass mode).
With recompute, μ = 1 and one minibatch, the step uses stop_gradient(logp) as π_old, so the
ratio is exactly 1; otherwise π_old is computed once, before the first update of the rollout.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from models import lora
from models.attention import lowering_for
from models.sharding import DEFAULT_RULES, flatten, hashable_rules, spec_axes, with_shardings
from models.transformer import weight_grads_in
from rl import router
from rl.logprobs import TokenLogprobs, token_logprobs
from rl.losses import MAXIMA, LossConfig, combine_metrics, grpo_loss
from rl.optimizer import make_optimizer
from rl.segments import count_sequences, sequence_totals
from sampling.distribution import SamplingParams

GRAD_REDUCE_DTYPES = ("float32", "bfloat16", "float16")  # LearnerConfig.grad_reduce_dtype
ROUTING_REPLAY = ("none", "rollout")  # LearnerConfig.routing_replay
# A step's metrics that are maxima: over micro-batches and devices the step takes their max, and
# so does `rollout_metrics` over a rollout's optimizer steps (the other metrics: the mean).
MAX_METRICS = (*MAXIMA, "response_length_max")


def rollout_metrics(history: list[dict]) -> dict:
    """One rollout's metrics from its optimizer steps' (`Learner.learn`'s history), as floats:
    the max of MAX_METRICS, the mean of the others."""
    reduce = lambda k: np.max if k in MAX_METRICS else np.mean
    return {k: float(reduce(k)([h[k] for h in history])) for k in history[-1]}


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    learning_rate: float = 1e-6  # peak AdamW learning rate
    warmup_steps: int = 0  # linear warmup from 0
    decay_steps: int = 0  # cosine decay length after warmup (0 = constant after warmup)
    end_lr_fraction: float = 0.1  # cosine decays to this fraction of the peak
    weight_decay: float = 0.0  # AdamW decoupled decay, on matrices only (not norms or biases)
    b1: float = 0.9
    b2: float = 0.999
    max_grad_norm: float = 1.0  # global-norm clipping (0 = off)
    micro_batches: int = 1  # gradient accumulation chunks inside one step
    logprob_chunk: int = 128  # sequence positions per vocabulary projection
    num_iterations: int = 1  # μ: passes over one rollout
    minibatches: int = 1  # optimizer steps per pass
    old_logp: str = "recompute"  # π_old: "recompute" (learner) or "sampler" (bypass)
    sampling: SamplingParams = SamplingParams()  # the distribution the sampler drew from
    stop_ids: tuple[int, ...] = ()  # banned where Batch.stop_masked (the sampler's min_new_tokens)
    grad_reduce_dtype: str = "float32"  # weight gradients summed across devices in this dtype
    # MoE: "rollout" routes every learner pass by Batch.routes (the sampler's experts); "none"
    # lets the routers route and only compares them with Batch.route_digest (route_mismatch)
    routing_replay: str = "none"
    # MoE: the load-balancing loss's coefficient in the loss (rl/router.py); None: the
    # checkpoint's config.json router_aux_loss_coef (ModelConfig.router_aux_loss_coef); 0 = off
    router_aux_loss_coef: float | None = 0.0
    loss: LossConfig = LossConfig()

    def validate(self):
        if self.old_logp not in ("recompute", "sampler"):
            raise ValueError(f"old_logp={self.old_logp!r}: expected 'recompute' or 'sampler'")
        for name in ("micro_batches", "logprob_chunk", "num_iterations", "minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("warmup_steps", "decay_steps", "weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate={self.learning_rate}: must be > 0")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be in [0, 1)")
        if not 0 <= self.end_lr_fraction <= 1:
            raise ValueError(f"end_lr_fraction={self.end_lr_fraction}: must be in [0, 1]")
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise ValueError(
                f"grad_reduce_dtype={self.grad_reduce_dtype!r}: expected one of "
                f"{', '.join(GRAD_REDUCE_DTYPES)}"
            )
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(
                f"routing_replay={self.routing_replay!r}: expected one of {', '.join(ROUTING_REPLAY)}"
            )
        coef = self.router_aux_loss_coef
        if coef is not None and not (isinstance(coef, int | float) and coef >= 0):
            raise ValueError(
                f"router_aux_loss_coef={coef!r}: must be >= 0 (0 = off) or None (the checkpoint's)"
            )
        if not all(isinstance(i, int) and i >= 0 for i in self.stop_ids):
            raise ValueError(f"stop_ids={self.stop_ids}: must be token ids (ints >= 0)")
        self.loss.validate()


@struct.dataclass
class TrainState:
    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar


@struct.dataclass
class Batch:
    """One optimizer step's sequences (prompt + completion), one or several per row (packed by
    `rl.packing`). Per-token arrays score tokens[:, 1:]."""

    tokens: jax.Array  # int32 [B,T]
    positions: jax.Array  # int32 [B,T] position within its sequence
    segment_ids: jax.Array  # int32 [B,T] sequence of the row: 1, 2, ...; 0 = padding
    loss_mask: jax.Array  # f32 [B,T-1] 1 where tokens[:, 1:] is a completion token that counts
    advantages: jax.Array  # f32 [B,T-1] the advantage of the sequence of tokens[:, 1:]
    sampler_logp: jax.Array | None = None  # f32 [B,T-1]
    old_logp: jax.Array | None = None  # f32 [B,T-1]; None: stop_gradient(logp) (exact ratio 1)
    ref_logp: jax.Array | None = None  # f32 [B,T-1] tempered full softmax; None: KL off
    stop_masked: jax.Array | None = None  # bool [B,T-1] stop ids banned (min_new_tokens)
    # int8/int16 [B,T,L_moe,k] the sampler's experts of each token (rl.routing_replay="rollout"),
    # used by every learner pass in place of the routers' top-k; None: the routers route
    routes: jax.Array | None = None
    # uint16 [B,T,L_moe] the sampler's expert sets as `rl.router.digest`s (replay off, an MoE
    # run): compared with the loss pass's own for rollout/route_mismatch; None: not compared
    route_digest: jax.Array | None = None


def batch_sharding(mesh, rules) -> NamedSharding:
    """Rows over the mesh axes the rules give the logical `batch` axis (default data and fsdp)."""
    axes = dict(rules).get("batch")
    return NamedSharding(mesh, PartitionSpec(axes))


def _strided_split(x, m):
    """[B,...] -> [M, B/M, ...] with micro-batch i = rows i, i+M, ... (see module docstring)."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


class Learner:
    """Owns the optimizer and the jitted functions of the learn phase for one model graph."""

    def __init__(
        self,
        cfg: LearnerConfig,
        graphdef,
        param_shardings,
        base_graphdef=None,
        rules=DEFAULT_RULES,
    ):
        """`base_graphdef`: for a LoRA model (`models.lora`), the graph of the model without
        adapters. Then only the adapters are trained and have optimizer state, and the
        reference policy is the same arrays with the adapters off (`reference_logprobs`).
        `rules`: the logical axis rules the batch is sharded by (its `batch` axis)."""
        cfg.validate()
        self.cfg, self.graphdef, self.base_graphdef = cfg, graphdef, base_graphdef
        self.lora = base_graphdef is not None
        self.param_shardings = param_shardings
        mesh = getattr(jax.tree.leaves(param_shardings)[0], "mesh", None)
        rules = hashable_rules(rules)
        self._rows = batch_sharding(mesh, rules) if mesh is not None and mesh.size > 1 else None
        axes = spec_axes(dict(rules).get("batch"))
        self._row_shards = math.prod(mesh.shape[a] for a in axes) if self._rows else 1
        named = flatten(param_shardings)  # the unembedding: lm_head, or the tied embedding
        self._unembed = named.get("lm_head", named.get("embed")) if self._rows else None
        leaves, treedef = jax.tree.flatten(param_shardings)
        key = (cfg, graphdef, base_graphdef, rules, treedef, tuple(leaves))
        self._jit = _shared(key, self, (self._logprobs_impl, self._grads_impl, self._step_impl))
        self.tx = self._jit.tx

    def split(self, params) -> tuple[nnx.State, nnx.State]:
        """(trainable, frozen) parts of params: (all, empty), or with LoRA (adapters, base)."""
        if self.lora:
            return lora.split(params)
        return params, nnx.State({})

    def merge(self, trainable, frozen) -> nnx.State:
        return nnx.merge_state(trainable, frozen) if self.lora else trainable

    # --- state ------------------------------------------------------------------------------

    def build_step(self, params) -> None:
        """Shardings of the train state and the jitted step, from (abstract or real) params."""
        jit = self._jit
        if jit.step is None:
            abstract = jax.eval_shape(self.tx.init, self.split(params)[0])
            replicated = NamedSharding(
                jax.tree.leaves(self.param_shardings)[0].mesh, PartitionSpec()
            )
            opt_sh = optax.tree_map_params(
                self.tx,
                lambda _, s: s,
                abstract,
                self.split(self.param_shardings)[0],
                transform_non_params=lambda _: replicated,
            )
            jit.state_shardings = TrainState(self.param_shardings, opt_sh, replicated)
            jit.step = jax.jit(
                jit.step_impl, donate_argnums=0, out_shardings=(jit.state_shardings, None)
            )
            jit.init = jax.jit(self.tx.init, out_shardings=jit.state_shardings.opt_state)
        self.state_shardings = jit.state_shardings

    @property
    def _step(self):
        return self._jit.step

    @property
    def _logprobs(self):
        return self._jit.logprobs

    @property
    def _grads(self):
        return self._jit.grads

    def init_state(self, params) -> TrainState:
        """Optimizer state created directly in the parameters' shardings (moments mirror the
        trainable params)."""
        self.build_step(params)
        opt_state = self._jit.init(self.split(params)[0])
        # Commit every leaf to exactly the shardings the step returns, so that the first call and
        # all later ones share one compiled executable (parameters already there are not copied).
        return jax.device_put(
            TrainState(params, opt_state, jnp.zeros((), jnp.int32)), self.state_shardings
        )

    def lower_step(self, abstract_params, abstract_batch: Batch, platforms=None):
        """The step lowered for abstract (ShapeDtypeStruct) params and batch, nothing allocated:
        for --dry_run, and with `platforms` (e.g. ("tpu",)) to check another platform lowers."""
        self.build_step(abstract_params)
        shapes = jax.eval_shape(
            lambda p: TrainState(p, self.tx.init(self.split(p)[0]), jnp.zeros((), jnp.int32)),
            abstract_params,
        )
        state = with_shardings(shapes, self.state_shardings)
        with lowering_for(platforms):  # "auto" attention picks the lowered platform's kernel
            return self._step.trace(state, abstract_batch).lower(lowering_platforms=platforms)

    def lower_logprobs(self, abstract_params, abstract_batch: Batch, which: str = "full"):
        """The reference / π_old log-prob pass over a whole rollout, lowered: for --dry_run."""
        return self._logprobs.trace(abstract_params, abstract_batch, which, True).lower()

    # --- jitted pieces ----------------------------------------------------------------------

    def _token_logprobs(
        self, params, batch: Batch, adapters: bool = True, stats: bool = False
    ) -> TokenLogprobs:
        """The batch's log-probs; with `stats` on an MoE model also the experts used and the
        routers' statistics (rl.router). Batch.routes route the pass with routing_replay."""
        c = self.cfg
        model = (
            nnx.merge(self.graphdef, params)
            if adapters
            else nnx.merge(self.base_graphdef, lora.base(params))
        )
        # A micro-batch whose rows do not split evenly is left to GSPMD.
        rows = None if batch.tokens.shape[0] % self._row_shards else self._rows
        replay = None
        if c.routing_replay == "rollout" and batch.routes is not None:  # each sequence's last
            # token has no record (zeros): -1, its router routes it
            here = router.recorded(batch.segment_ids)[..., None, None]
            replay = jnp.where(here, batch.routes, jnp.asarray(-1, batch.routes.dtype))
        return token_logprobs(
            model,
            batch.tokens,
            batch.positions,
            batch.segment_ids,
            c.sampling,
            c.logprob_chunk,
            c.stop_ids,
            batch.stop_masked,
            rows,
            None if rows is None else self._unembed,
            replay,
            stats and model.cfg.num_moe_layers > 0,
        )

    def _logprobs_impl(self, params, batch: Batch, which: str, adapters: bool):
        """One forward over the rollout, a train step's micro-batch of rows at a time (a strided
        split, as in the step), so this pass needs no more memory than a step's forward."""
        rows = batch.tokens.shape[0]
        m = math.gcd(rows, self.cfg.minibatches * self.cfg.micro_batches)
        micro = jax.tree.map(lambda x: _strided_split(x, m), batch)
        fn = lambda mb: getattr(self._token_logprobs(params, mb, adapters), which)
        out = jax.lax.map(fn, micro)
        return out.swapaxes(0, 1).reshape(rows, -1)  # [M, B/M, T-1] -> [B, T-1], rows in order

    def _loss(self, trainable, frozen, mb: Batch, global_tokens, global_seqs, totals, aux_coef):
        tl = self._token_logprobs(self.merge(trainable, frozen), mb, stats=True)
        return self._objective(tl, mb, global_tokens, global_seqs, totals, aux_coef)

    def _objective(
        self, tl: TokenLogprobs, mb: Batch, global_tokens, global_seqs, totals=None, aux_coef=0.0
    ):
        """The GRPO loss and metrics of one micro-batch; on an MoE model (tl.router) plus
        aux_coef x the routers' load-balancing loss and the routers' metrics (rl.router), with
        `totals` the step's (real, recorded) token counts."""
        loss, metrics = self._grpo(tl, mb, global_tokens, global_seqs)
        if tl.router is None:
            return loss, metrics
        real, recorded = totals
        compare = mb.route_digest is not None and self.cfg.routing_replay == "none"
        aux, more = router.step_terms(
            tl.router,
            mb.segment_ids,
            real,
            tl.routes if compare else None,
            mb.route_digest if compare else None,
            recorded,
        )
        if aux_coef:  # a Python float: 0 leaves the loss's graph as it was
            loss = loss + aux_coef * aux
            metrics["loss"] = metrics["loss"] + aux_coef * jax.lax.stop_gradient(aux)
        return loss, {**metrics, **more}

    def _grpo(self, tl: TokenLogprobs, mb: Batch, global_tokens, global_seqs):
        old = jax.lax.stop_gradient(tl.logp) if mb.old_logp is None else mb.old_logp
        ent = tl.entropy if self.cfg.loss.entropy_coef > 0 else jax.lax.stop_gradient(tl.entropy)
        return grpo_loss(
            tl.logp,
            old,
            mb.sampler_logp,
            mb.ref_logp,
            mb.advantages,
            mb.loss_mask,
            self.cfg.loss,
            global_tokens=global_tokens,
            global_seqs=global_seqs,
            entropy=ent,
            full_logp=tl.full,
            segments=mb.segment_ids[:, 1:],
        )

    def _grads_impl(self, params, batch: Batch):
        """Gradient (of the trainable params) and metrics of the whole batch, accumulated over
        micro-batches, the weights' gradients in `grad_reduce_dtype`."""
        with weight_grads_in(self.cfg.grad_reduce_dtype):
            return self._grads_in(params, batch)

    def _grads_in(self, params, batch: Batch):
        m = self.cfg.micro_batches
        if batch.tokens.shape[0] % m:
            raise ValueError(
                f"batch of {batch.tokens.shape[0]} rows: not divisible by micro_batches={m}"
            )
        segments = batch.segment_ids[:, 1:]  # [B,T-1] the sequence of each scored token
        global_tokens = jnp.sum(batch.loss_mask)
        global_seqs = count_sequences(batch.loss_mask, segments)
        micro = jax.tree.map(lambda x: _strided_split(x, m), batch)
        model_cfg = nnx.merge(self.graphdef, params).cfg
        moe = model_cfg.num_moe_layers > 0
        coef = self.cfg.router_aux_loss_coef
        coef = float(model_cfg.router_aux_loss_coef if coef is None else coef) if moe else 0.0
        totals = None
        if moe:  # the step's real tokens and, to compare, those the sampler's record covers
            compare = batch.route_digest is not None and self.cfg.routing_replay == "none"
            totals = (
                jnp.sum(batch.segment_ids != 0),
                jnp.sum(router.recorded(batch.segment_ids)) if compare else None,
            )
        loss_fn = functools.partial(self._loss, totals=totals, aux_coef=coef)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        trainable, frozen = self.split(params)

        def body(carry, mb):
            grads, metrics = carry
            (_, new_metrics), new_grads = grad_fn(trainable, frozen, mb, global_tokens, global_seqs)
            return (
                jax.tree.map(jnp.add, grads, new_grads),
                combine_metrics(metrics, new_metrics),
            ), None

        # Zero carries (0 is neutral for the sums and for the maxima, which are non-negative), so
        # the scan covers every micro-batch and the loss graph is traced and compiled once. The
        # metrics' structure comes from the objective alone, without tracing the model again.
        first = jax.tree.map(lambda x: x[0], micro)
        tl = TokenLogprobs(first.loss_mask, first.loss_mask, first.loss_mask)
        if moe:
            shape = (*first.tokens.shape, model_cfg.num_moe_layers, model_cfg.experts_per_token)
            stats = router.placeholder(model_cfg.num_moe_layers, model_cfg.num_experts)
            tl = tl._replace(routes=jnp.zeros(shape, jnp.int32), router=stats)
        objective = functools.partial(self._objective, totals=totals, aux_coef=coef)
        shapes = jax.eval_shape(objective, tl, first, global_tokens, global_seqs)
        zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
        init = (jax.tree.map(jnp.zeros_like, trainable), zeros(shapes[1]))
        (grads, metrics), _ = jax.lax.scan(body, init, micro)
        metrics = {**{k: v for k, v in metrics.items() if k != "maxima"}, **metrics["maxima"]}
        metrics = router.finish(metrics)  # MoE: the experts' load summed over the micro-batches
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["tokens"] = global_tokens
        lengths = sequence_totals(batch.loss_mask, segments)  # [B,T] tokens per sequence
        metrics["response_length_mean"] = global_tokens / jnp.maximum(global_seqs, 1)
        metrics["response_length_max"] = jnp.max(lengths)
        return grads, metrics

    def _step_impl(self, state: TrainState, batch: Batch):
        grads, metrics = self._grads_impl(state.params, batch)
        trainable, frozen = self.split(state.params)
        # A non-finite loss or gradient skips the update: parameters, optimizer state and step
        # stay as they were (selected in place, no copy), and the step is counted as skipped.
        # Adam's moments are selected inside the optimizer, before the update is computed from
        # them (rl/optimizer.py: selected here they would need a copy of the old ones).
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        updates, opt_state = self.tx.update(grads, state.opt_state, trainable, finite=finite)
        new = (optax.apply_updates(trainable, updates), opt_state, state.step + 1)
        old = (trainable, state.opt_state, state.step)
        adam = lambda x: isinstance(x, optax.ScaleByAdamState)
        keep = lambda n, o: (
            n if adam(n) else jax.tree.map(lambda a, b: jnp.where(finite, a, b), n, o)
        )
        trainable, opt_state, step = jax.tree.map(keep, new, old, is_leaf=adam)
        metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        return TrainState(self.merge(trainable, frozen), opt_state, step), metrics

    # --- public API -------------------------------------------------------------------------

    def logprobs(self, params, batch: Batch, which: str = "logp"):
        """f32 [B,T-1] teacher-forced log-probs of the batch's tokens: which="logp" under the
        sampling distribution (π_old), "full" under the tempered full softmax (the reference
        model, and the policy side of KL-in-reward); see `rl.logprobs`."""
        return self._logprobs(params, batch, which, True)

    def reference_logprobs(self, params, ref_params, batch: Batch):
        """The reference policy's "full" log-probs: of `ref_params` (a frozen copy), or with
        LoRA and ref_params None, of the policy's `params` with the adapters off (no copy)."""
        if ref_params is not None:
            return self._logprobs(ref_params, batch, "full", True)
        if not self.lora:
            raise ValueError("no reference parameters: the KL term needs them without LoRA")
        return self._logprobs(params, batch, "full", False)

    def checkpointed(self, state: TrainState) -> TrainState:
        """What a checkpoint holds of the state: all of it, or with LoRA the adapters, their
        optimizer state and the step (the base weights are the starting checkpoint's)."""
        return state.replace(params=self.split(state.params)[0]) if self.lora else state

    def restored(self, state: TrainState, saved: TrainState) -> TrainState:
        """The state with a restored `checkpointed` state put in (the inverse of it)."""
        if not self.lora:
            return saved
        return saved.replace(params=self.merge(saved.params, self.split(state.params)[1]))

    def grads(self, params, batch: Batch):
        return self._grads(params, batch)

    def step(self, state: TrainState, batch: Batch):
        """One optimizer update; `state` is donated. Returns (new state, metrics of arrays). A
        step whose loss or gradient norm is not finite leaves the state unchanged
        (metrics["skipped"] = 1)."""
        if self._step is None:
            raise RuntimeError("call Learner.init_state(params) first")
        return self._step(state, batch)

    def learn(self, state: TrainState, ref_params, rollout: Batch):
        """μ passes of `minibatches` steps over one rollout. Returns (state, list of host metrics)."""
        cfg = self.cfg
        if cfg.loss.kl_coef > 0 and cfg.loss.kl_in == "loss" and rollout.ref_logp is None:
            ref = self.reference_logprobs(state.params, ref_params, rollout)
            rollout = rollout.replace(ref_logp=ref)
        exact_first_pass = cfg.num_iterations == 1 and cfg.minibatches == 1
        if cfg.old_logp == "sampler":
            rollout = rollout.replace(old_logp=rollout.sampler_logp)
        elif not exact_first_pass:
            rollout = rollout.replace(old_logp=self.logprobs(state.params, rollout))
        rows = rollout.tokens.shape[0]
        if rows % cfg.minibatches:
            raise ValueError(
                f"rollout of {rows} rows: not divisible by minibatches={cfg.minibatches}"
            )
        minibatches = jax.tree.map(lambda x: _strided_split(x, cfg.minibatches), rollout)
        history = []
        for _ in range(cfg.num_iterations):
            for i in range(cfg.minibatches):
                mb = jax.tree.map(lambda x, i=i: x[i], minibatches)
                start = time.perf_counter()
                state, metrics = self.step(state, mb)
                # Blocking every step: queued steps with collectives can deadlock on fake CPU devices.
                metrics = jax.device_get(metrics)
                metrics["learn_tokens_per_s"] = float(metrics["tokens"]) / (
                    time.perf_counter() - start
                )
                history.append(metrics)
        return state, history


@dataclasses.dataclass(eq=False)
class _Jitted:
    """The jitted functions of one learner key, traced once in a process (`_shared`)."""

    owner: Learner  # the Learner whose methods they trace
    tx: optax.GradientTransformation
    logprobs: object
    grads: object
    step_impl: object  # the owner's step, jitted as `step` once the state's shardings are known
    step: object = None  # built with the state's shardings (`Learner.build_step`)
    init: object = None
    state_shardings: TrainState | None = None


# Learners of one key (config, model graphs, rules, parameter shardings: all that their jitted
# functions read) share those functions, so a second Learner in a process (a run resumed in a
# notebook, the tests' many runs in one process) reuses the first one's traces and compiled
# programs instead of tracing the same step again (~2 s of CPU for the tiny test model). A few
# keys are kept, the least recently used dropped first.
_JITTED: collections.OrderedDict = collections.OrderedDict()
_JITTED_KEYS = 8


def _shared(key, learner: Learner, impls) -> _Jitted:
    """The jitted functions of `key`; new ones of learner's `impls` (its un-jitted log-probs,
    gradients and step methods) if none are kept."""
    jit = _JITTED.pop(key, None)
    if jit is None:
        logprobs, grads, step = impls
        jit = _Jitted(
            owner=learner,
            tx=make_optimizer(learner.cfg),
            logprobs=jax.jit(logprobs, static_argnums=(2, 3)),
            grads=jax.jit(grads),
            step_impl=step,
        )
    _JITTED[key] = jit  # most recent last
    while len(_JITTED) > _JITTED_KEYS:
        _JITTED.popitem(last=False)
    return jit
