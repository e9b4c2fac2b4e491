"""`python -m launch.train --config X --dry_run`: will this config fit, before paying for a machine?

Builds the mesh, reads only the checkpoint's config.json (no weights), and lowers and compiles the
jitted functions with abstract shapes: the learner's train step (one minibatch of
B*G/minibatches sequences), its reference / π_old log-prob pass over the whole rollout, the
sampler's `generate` (all slots, `steps_per_call` decode steps) and its `prefill` (a call's
prompts per batch shard at the longest dense length and, for prompts longer than
`sampling.prefill_chunk`, at the longest: `sampling.lowering.prefill_lengths`; and "extend", the
prefill of rows after cached tokens at the longest history a preempted or carried sequence
prefills again: `extend_length`). Prints XLA's per-device memory analysis of each, what stays
resident (train state, reference parameters), an upper bound on the peak of each phase, and the
chips whose memory holds it. Nothing is allocated or run.

What the figures are: XLA:CPU's static estimates for one device of the SPMD-partitioned programs
every backend receives (arguments: parameters, optimizer state, KV pages, batch; outputs;
temporaries; donated inputs are aliased to outputs and counted once), compiled as
`launch.estimate` compiles them: without the XLA:CPU passes that no accelerator runs and that
change the buffers or how long they live (`launch.estimate.CPU_ONLY_PASSES`, printed: the
all-reduce combiner, and the float normalization that made XLA:CPU hold bf16 weights and a bf16
KV pool in f32), read from XLA's buffer assignment, with each all-reduce that is only sliced
counted as the reduce-scatter an accelerator makes of it. The temporaries are printed as that
estimate and as XLA:CPU's own allocation. The temporaries of 1 GiB or more live at each
program's peak are named. What the figures still do not model (the accelerator's scheduler,
fusion and layouts, fragmentation, the runtime's reserve, JAX's GPU preallocation):
`launch.estimate`'s docstring. A chip "fits" a phase when the phase's per-device figure is at
most 90% of its HBM.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from launch import estimate
from launch.pin import model_dir
from launch.validate import (
    engine_config,
    learner_config,
    model_overrides,
    records_routes,
    sampling_params,
)
from models import lora
from models.config import ModelConfig
from models.hf_config import config_from_hf, generation_ids
from models.moe import route_dtype
from models.sharding import (
    abstract_model,
    base_graphdef,
    make_mesh,
    param_count,
    state_shardings,
    with_shardings,
)
from rl.learner import Batch, Learner, TrainState, batch_sharding
from sampling.engine import Engine
from sampling.lowering import extend_length, lower_generate, lower_prefill, prefill_lengths

MIB = 2**20
SHOWN = 4  # buffers of 1 GiB or more named per program


def _report(name: str, est: estimate.Estimate) -> float:
    """Prints one program's figures (and the temporaries of 1 GiB or more at its peak); returns
    its peak per device (arguments + outputs + temporaries - aliased)."""
    print(
        f"{name:13s} args {est.args / MIB:10.1f} MiB  out {est.out / MIB:10.1f} MiB  temp "
        f"{est.accelerator_temp / MIB:10.1f} MiB (XLA:CPU {est.temp / MIB:.1f})  aliased "
        f"{est.alias / MIB:10.1f} MiB  => peak ~{est.total / MIB:10.1f} MiB per device"
    )
    large = est.large()
    for b in large[:SHOWN]:
        print(f"{'':13s} at its peak: {b.describe()}")
    if len(large) > SHOWN:
        rest = sum(b.bytes for b in large[SHOWN:]) / 2**30
        print(f"{'':13s} at its peak: {len(large) - SHOWN} more of 1 GiB or more, {rest:.2f} GiB")
    return est.total


def _fits(peak: float) -> str:
    ok, no = estimate.fits(peak)
    return f"fits {', '.join(ok) or 'none'}" + (f"; not {', '.join(no)}" if no else "")


def _per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    leaves = jax.tree.leaves(tree)
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves
    )


def abstract_batch(
    rows: int,
    t: int,
    sharding,
    old_logp: bool = False,
    ref_logp: bool = False,
    stop_masked: bool = False,
    routes: tuple | None = None,
    digest_layers: int = 0,
) -> Batch:
    """A learner Batch of `rows` rows of t tokens as sharded ShapeDtypeStructs (nothing allocated);
    the optional per-token fields are present when asked for, `routes` as (L_moe, k, dtype): the
    sampler's recorded experts [rows, t, L_moe, k] (replayed), `digest_layers` L_moe > 0: their
    digests [rows, t, L_moe] (compared)."""
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    per_token = lambda dtype="float32": spec((rows, t - 1), dtype)
    return Batch(
        tokens=spec((rows, t), "int32"),
        positions=spec((rows, t), "int32"),
        segment_ids=spec((rows, t), "int32"),
        loss_mask=per_token(),
        advantages=per_token(),
        sampler_logp=per_token(),
        old_logp=per_token() if old_logp else None,
        ref_logp=per_token() if ref_logp else None,
        stop_masked=per_token("bool") if stop_masked else None,
        routes=None if routes is None else spec((rows, t, *routes[:2]), routes[2]),
        route_digest=spec((rows, t, digest_layers), "uint16") if digest_layers else None,
    )


def _batch(config, cfg: ModelConfig, rows, sharding) -> Batch:
    """The learner's batch of `rows` rows as the run makes it: with the sampler's record of the
    experts on a mixture of experts (`launch.validate.records_routes`: the ids replayed, or their
    digests compared for rollout/route_mismatch)."""
    s = config.sampling
    recorded = records_routes(config, cfg.num_experts) and cfg.num_moe_layers
    replay = recorded and config.rl.get("routing_replay", "none") == "rollout"
    return abstract_batch(
        rows,
        s.max_prompt_len + s.max_new_tokens,
        sharding,
        old_logp=config.rl.old_logp != "recompute",
        ref_logp=config.rl.kl_coef > 0,
        stop_masked=bool(s.min_new_tokens),
        routes=(
            (cfg.num_moe_layers, cfg.experts_per_token, route_dtype(cfg.num_experts))
            if replay
            else None
        ),
        digest_layers=cfg.num_moe_layers if recorded and not replay else 0,
    )


def dry_run(config) -> int:
    mesh = make_mesh(dict(config.mesh))
    rules = tuple(tuple(r) for r in config.rules)
    s = config.sampling
    path = model_dir(config, weights=False)  # a Hub id: its config files only
    cfg = config_from_hf(path, **model_overrides(config))
    ids = generation_ids(path)
    graphdef, shapes = abstract_model(cfg)
    shardings = state_shardings(shapes, mesh, rules)
    params = with_shardings(shapes, shardings)
    print(f"{cfg.family}: {param_count(shapes) / 1e6:.1f}M parameters, mesh {dict(mesh.shape)}")

    rollout_rows = config.data.prompts_per_step * config.rl.num_generations
    row_sh = batch_sharding(mesh, rules)
    base = base_graphdef(cfg) if cfg.lora_rank else None
    learner = Learner(learner_config(config, ids.eos_ids), graphdef, shardings, base, rules)
    with estimate.grouped_matmuls():  # an MoE's ragged_dot as an accelerator holds it
        step = learner.lower_step(
            params, _batch(config, cfg, rollout_rows // config.rl.minibatches, row_sh)
        )
        logp = learner.lower_logprobs(params, _batch(config, cfg, rollout_rows, row_sh))
    ecfg = engine_config(config, ids.eos_ids, cfg.num_experts)
    engine = Engine(cfg, graphdef, ecfg, sampling_params(config), mesh=mesh, rules=rules)
    with estimate.grouped_matmuls():
        generate = lower_generate(engine, params)
        prefills = {
            f"prefill {t}": lower_prefill(engine, params, length=t) for t in prefill_lengths(ecfg)
        }
        t = extend_length(ecfg)  # restore / refresh / resume: rows after cached tokens
        prefills[f"extend {t}"] = lower_prefill(engine, params, length=t, resume=True)
    state_shapes = jax.eval_shape(
        lambda p: TrainState(p, learner.tx.init(learner.split(p)[0]), 0), params
    )
    state = _per_device_bytes(with_shardings(state_shapes, learner.state_shardings))
    # With LoRA the reference is the policy's own base weights: nothing more is resident.
    ref = _per_device_bytes(params) if config.rl.kl_coef > 0 and not cfg.lora_rank else 0
    opt = state - _per_device_bytes(params)
    print(f"resident   params + optimizer {state / MIB:.1f} MiB, reference {ref / MIB:.1f} MiB")
    if cfg.lora_rank:
        _compare_full(learner, params, cfg, config.rl.kl_coef > 0)
    print(
        f"compiled as for an accelerator: XLA:CPU's passes {', '.join(estimate.CPU_ONLY_PASSES)} "
        "off (bf16 stays bf16), all-reduces that are only sliced counted as reduce-scatters; "
        "launch/estimate.py says what the figures do not model"
    )
    learn = _report("learn", estimate.compile(step))
    logprobs = _report("logprobs", estimate.compile(logp))  # reference and π_old: one params copy
    sample = _report("generate", estimate.compile(generate))
    # The rollout's other call: the same arguments (weights, KV pool), other temporaries.
    for name, lowered in prefills.items():
        sample = max(sample, _report(name, estimate.compile(lowered)))
    # Upper bounds: the learn phase holds the reference; the log-prob pass runs beside the train
    # state; the rollout beside the optimizer state (and the KV cache stays when not released).
    # (The log-prob pass's arguments hold the very parameter arrays the state holds: once.)
    learn_phase = ref + max(learn, state + logprobs - _per_device_bytes(params))
    # The rollout's compiled arguments hold the weights it decodes from: the params themselves,
    # or (sampling.weights_layout="tensor", weights_dtype) a copy made for the rollout, beside
    # the resident params and optimizer state.
    copied = engine.abstract_decode_params(params) is not params
    rollout_phase = ref + (state if copied else opt) + sample
    kv_kept = not s.release_kv_between_phases or config.rl.get("partial_rollouts", False)
    peak = (learn_phase + sample) if kv_kept else max(learn_phase, rollout_phase)
    print(f"learn phase   {learn_phase / MIB:10.1f} MiB per device: {_fits(learn_phase)}")
    print(f"rollout phase {rollout_phase / MIB:10.1f} MiB per device: {_fits(rollout_phase)}")
    print(
        f"estimated peak per device: {peak / MIB:.1f} MiB (learn phase {learn_phase / MIB:.1f}, "
        f"rollout phase {rollout_phase / MIB:.1f}{', KV cache kept across both' if kv_kept else ''})"
        f": {_fits(peak)}; this mesh's {mesh.size} devices: {estimate.slices(mesh.size)}"
    )
    return 0


def _compare_full(learner: Learner, params, cfg, kl: bool) -> None:
    """The LoRA run's trainable share, and what the full fine-tune would keep resident."""
    trainable, base = lora.split(params)
    replicated = jax.sharding.NamedSharding(learner.state_shardings.step.mesh, P())
    opt = optax.tree_map_params(  # the moments in their parameters' shardings
        learner.tx,
        lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.sharding),
        jax.eval_shape(learner.tx.init, base),
        base,
        transform_non_params=lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
    )
    weights = _per_device_bytes(base)
    full = weights + _per_device_bytes(opt)
    print(
        f"LoRA       rank {cfg.lora_rank}: {param_count(trainable) / 1e6:.2f}M trainable of "
        f"{param_count(params) / 1e6:.1f}M; a full fine-tune holds params + optimizer "
        f"{full / MIB:.1f} MiB, reference {weights * kl / MIB:.1f} MiB"
    )
