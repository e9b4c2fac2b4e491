"""`python -m launch.train --config X --dry_run`: will this config fit, before paying for a machine?

Builds the mesh, reads only the checkpoint's config.json (no weights), and lowers and compiles the
two jitted phases with abstract shapes: the learner's train step (one minibatch of B*G/minibatches
sequences) and the sampler's `generate` (all slots, `steps_per_call` decode steps). Prints XLA's
per-device memory analysis of each. Nothing is allocated or run.

The numbers are XLA's static estimates for one device: arguments (parameters, optimizer state,
KV pages, batch), outputs, and temporaries; donated inputs are aliased to outputs and counted once.
"""

from __future__ import annotations

import jax

from launch.validate import engine_config, learner_config, sampling_params
from models.hf_config import config_from_hf, generation_ids
from models.sharding import abstract_model, make_mesh, param_count, state_shardings, with_shardings
from rl.learner import Batch, Learner, batch_sharding
from sampling.engine import Engine


def _report(name: str, compiled) -> float:
    m = compiled.memory_analysis()
    if m is None:
        print(f"{name:10s} memory analysis unavailable on this backend")
        return 0.0
    mib = lambda b: b / 2**20
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    total -= m.alias_size_in_bytes
    print(
        f"{name:10s} args {mib(m.argument_size_in_bytes):10.1f} MiB  out {mib(m.output_size_in_bytes):10.1f} MiB"
        f"  temp {mib(m.temp_size_in_bytes):10.1f} MiB  aliased {mib(m.alias_size_in_bytes):10.1f} MiB"
        f"  => peak ~{mib(total):10.1f} MiB per device"
    )
    return total


def dry_run(config) -> int:
    mesh = make_mesh(dict(config.mesh))
    rules = tuple(tuple(r) for r in config.rules)
    m, s = config.model, config.sampling
    cfg = config_from_hf(m.hf_checkpoint, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat)
    ids = generation_ids(m.hf_checkpoint)
    graphdef, shapes = abstract_model(cfg)
    shardings = state_shardings(shapes, mesh, rules)
    params = with_shardings(shapes, shardings)
    print(f"{cfg.family}: {param_count(shapes) / 1e6:.1f}M parameters, mesh {dict(mesh.shape)}")

    rows = config.data.prompts_per_step * config.rl.num_generations // config.rl.minibatches
    t = s.max_prompt_len + s.max_new_tokens
    row_sh = batch_sharding(mesh, rules)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=row_sh)
    batch = Batch(
        tokens=spec((rows, t), "int32"),
        positions=spec((rows, t), "int32"),
        valid=spec((rows, t), "bool"),
        loss_mask=spec((rows, t - 1), "float32"),
        advantages=spec((rows,), "float32"),
        sampler_logp=spec((rows, t - 1), "float32"),
        old_logp=None if config.rl.old_logp == "recompute" else spec((rows, t - 1), "float32"),
        ref_logp=spec((rows, t - 1), "float32") if config.rl.kl_coef > 0 else None,
        stop_masked=spec((rows, t - 1), "bool") if s.min_new_tokens else None,
    )
    learner = Learner(learner_config(config, ids.eos_ids), graphdef, shardings)
    step = learner.lower_step(params, batch).compile()
    ecfg = engine_config(config, ids.eos_ids)
    engine = Engine(cfg, graphdef, ecfg, sampling_params(config), mesh=mesh, rules=rules)
    generate = engine.lower_generate(params).compile()
    learn = _report("learn", step)
    sample = _report("rollout", generate)
    phases = max(learn, sample) if s.release_kv_between_phases else learn + sample
    print(f"estimated peak per device: {phases / 2**20:.1f} MiB "
          f"({'max' if s.release_kv_between_phases else 'sum, an upper bound,'} of the two phases)")  # fmt: skip
    return 0
