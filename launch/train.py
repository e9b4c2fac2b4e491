"""GRPO training: `python -m launch.train [--config configs/X.py] [--workdir DIR] [--config.a.b=v]`.

One SPMD program holds the policy (and, when the KL term is on, a frozen reference) sharded over
one mesh, and alternates two phases on the same parameter arrays:

    rollout   engine.generate_all(state.params)  -> completions + sampler log-probs
              rewards (host) -> group advantages -> learner Batch          (rl/rollout.py)
    learn     learner.learn(state, ref_params, batch) -> new state, donated (rl/learner.py)

Everything else here is bookkeeping: config validation, workdir, orbax checkpoints with exact
resume (state, PRNG, data iterator), evaluation, logging. `--dry_run` lowers the learner step and
the sampler's generate with abstract shapes and prints XLA's per-device memory estimate.

Simplifications: evaluation runs on process 0's view of the full held-out set (every process runs
it identically); the rollout key of step s is fold_in(seed, s), so resuming needs no RNG state
beyond the step (the key data is still saved, and checked on resume).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import sys
import time

import jax
import numpy as np

from launch.cli import UsageError, fail, parse_args
from launch.validate import (
    check_resumable,
    engine_config,
    learner_config,
    sampling_params,
    validate,
)

FLAGS = {"workdir": "", "dry_run": False}


def init_distributed(config) -> None:
    """Multi-process runs: `jax.distributed.initialize()` on TPU / GPU clusters (it finds the
    coordinator itself) when config.distributed is set, or from the environment variables
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (e.g. CPU processes on one
    machine, with JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo)."""
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address:
        jax.distributed.initialize(
            address, int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
        )
    elif config.distributed:
        jax.distributed.initialize()


def _workdir(config_path: str, given: str) -> str:
    if given:
        return given
    name = os.path.splitext(os.path.basename(config_path))[0]
    return os.path.join("runs", f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


def _config_json(config) -> dict:
    return json.loads(config.to_json())


def prepare_workdir(config, workdir: str) -> bool:
    """Validates resume settings against the workdir; returns whether to resume. Writes nothing."""
    saved = os.path.join(workdir, "config.json")
    has_ckpt = os.path.isdir(os.path.join(workdir, "checkpoints")) and any(
        d.isdigit() for d in os.listdir(os.path.join(workdir, "checkpoints"))
    )
    if config.resume is False and os.path.exists(saved):
        raise UsageError(f"--workdir {workdir} already holds a run and config.resume=False")
    if config.resume is True and not has_ckpt:
        raise UsageError(f"config.resume=True but {workdir} has no checkpoint")
    if os.path.exists(saved):
        with open(saved) as f:
            check_resumable(json.load(f), _config_json(config))
    return has_ckpt


def setup(config):
    """Mesh, tokenizer, policy (+ reference), learner, engines. Returns a namespace of parts."""
    from types import SimpleNamespace

    from models.hf import load_hf
    from models.sharding import make_mesh, state_shardings
    from models.tokenizer import load_tokenizer
    from rl.learner import Learner
    from sampling.distribution import SamplingParams
    from sampling.engine import Engine

    mesh = make_mesh(dict(config.mesh))
    rules = tuple(tuple(r) for r in config.rules)
    m = config.model
    overrides = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat)
    cfg, graphdef, params, ids = load_hf(m.hf_checkpoint, mesh, rules, **overrides)
    ref_params = None
    if config.rl.kl_coef > 0:  # a second, frozen copy: the reference policy (no optimizer state)
        ref_params = load_hf(m.hf_checkpoint, mesh, rules, **overrides)[2]
    tok_spec = config.tokenizer.to_dict()
    tokenizer = load_tokenizer(m.hf_checkpoint if tok_spec["type"] == "hf" else tok_spec)
    learner = Learner(learner_config(config), graphdef, state_shardings(params, mesh, rules))
    state = learner.init_state(params)
    ecfg = engine_config(config, ids.eos_ids)
    engine = lambda sampling: Engine(cfg, graphdef, ecfg, sampling, mesh=mesh, rules=rules)
    engines = {
        "rollout": engine(sampling_params(config)),
        "greedy": engine(SamplingParams(temperature=0.0)),
        "eval": engine(SamplingParams(temperature=config.eval.temperature)),
    }
    return SimpleNamespace(
        mesh=mesh, cfg=cfg, graphdef=graphdef, ids=ids, ref_params=ref_params,
        tokenizer=tokenizer, learner=learner, state=state, engines=engines, rules=rules,
    )  # fmt: skip


def _records_prompts(records, parts, config, prompt_field):
    from rl.data import format_prompt

    prompts = [
        format_prompt(r, parts.tokenizer, config.data.use_chat_template,
                      config.data.system_prompt or None, prompt_field,
                      config.data.chat_template_kwargs.to_dict())
        for r in records
    ]  # fmt: skip
    too_long = [len(p) for p in prompts if len(p) > config.sampling.max_prompt_len]
    if too_long:
        raise UsageError(
            f"a prompt has {max(too_long)} tokens > config.sampling.max_prompt_len="
            f"{config.sampling.max_prompt_len}"
        )
    return prompts


def rollout_phase(step, parts, params, data, config, pool, decode_state):
    """Scored groups of this step (rl/rollout.py), with DAPO dynamic sampling when configured:
    groups whose G rewards are all equal are dropped and fresh prompts are sampled to refill, at
    most `rl.dynamic_sampling_max_tries` rounds (rl/dynamic_sampling.py)."""
    from rl import rollout as ro
    from rl.data import global_batch
    from rl.dynamic_sampling import fill_groups

    engine = parts.engines["rollout"]
    root = jax.random.fold_in(jax.random.key(config.seed), step)
    first = [global_batch(next(data))]
    tries = []

    def sample(n):
        nonlocal decode_state
        records = (first.pop() if first else global_batch(next(data)))[:n]
        prompts = _records_prompts(records, parts, config, config.data.train.prompt_field)
        seed = int(jax.random.randint(jax.random.fold_in(root, len(tries)), (), 0, 2**31 - 1))
        # Request ids (PRNG streams) unique over steps and refill rounds: at most B prompts a round.
        base = (
            step * config.rl.dynamic_sampling_max_tries + len(tries)
        ) * config.data.prompts_per_step
        tries.append(n)
        state = engine.init_state() if decode_state is None else decode_state
        groups, state = ro.sample_groups(
            engine, params, state, records, prompts, config, parts.tokenizer, seed,
            [base + i for i in range(len(records))], pool,
        )  # fmt: skip
        if not config.sampling.release_kv_between_phases:
            decode_state = state  # keep the pages allocated for the next rollout
        return groups, np.concatenate([grp.rewards for grp in groups])

    b, g = config.data.prompts_per_step, config.rl.num_generations
    if not config.rl.dynamic_sampling:
        return sample(b)[0], {}, decode_state
    groups, _, stats = fill_groups(sample, b, g, config.rl.dynamic_sampling_max_tries)
    return groups, stats, decode_state


def _evaluate(parts, params, eval_records, config, seed):
    from rl.evaluation import evaluate

    prompts = _records_prompts(eval_records, parts, config, config.data.eval.prompt_field)
    e = parts.engines
    return evaluate(
        e["greedy"], e["eval"], params, prompts, eval_records, parts.tokenizer, config, seed
    )


def _fingerprint(params) -> str:
    """sha256 of every parameter's bytes in a fixed order (equal iff bitwise equal params)."""
    import hashlib

    from models.sharding import flatten
    from sampling.engine import host_values

    h = hashlib.sha256()
    for name, x in sorted(flatten(params).items()):
        h.update(name.encode())
        h.update(np.ascontiguousarray(host_values(x)).tobytes())
    return h.hexdigest()


def train(config, workdir: str, resume: bool) -> int:
    import tqdm

    from launch.logger import RunLogger
    from rl import rollout as ro
    from rl.checkpoint import Checkpointer
    from rl.data import load_records, make_prompt_iterator

    main_process = jax.process_index() == 0
    os.makedirs(workdir, exist_ok=True)
    if main_process:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(_config_json(config), f, indent=2)
        print(config)
    parts = setup(config)
    learner, state = parts.learner, parts.state
    data = make_prompt_iterator(
        config.data.train, batch_size=config.data.prompts_per_step, seed=config.seed,
        process_index=jax.process_index(), process_count=jax.process_count(),
    )  # fmt: skip
    eval_records = load_records(config.data.eval)
    ckpt = Checkpointer(workdir, keep=config.keep_checkpoints)
    root = jax.random.key(config.seed)
    start, summary = 0, {}
    if resume:
        state, meta = ckpt.restore(state)
        data.set_state(meta["data"])
        if meta["key"] != jax.random.key_data(root).tolist():
            raise UsageError("checkpoint PRNG key differs from config.seed")
        start, summary = meta["step"], meta["summary"]
        print(f"resumed from step {start} in {workdir}", file=sys.stderr)
    log = RunLogger(workdir, enabled=main_process)
    if start == 0:
        before = _evaluate(parts, state.params, eval_records, config, config.seed)
        summary["accuracy_before"] = before["accuracy"]
        log.scalars(0, {f"eval/{k}": v for k, v in before.items() if k != "example"})
        print(f"held-out greedy accuracy before GRPO: {before['accuracy']:.3f}", file=sys.stderr)
    t_len = config.sampling.max_prompt_len + config.sampling.max_new_tokens
    totals = {
        k: summary.get(k, 0.0)
        for k in ("rollout_seconds", "learn_seconds", "rollout_tokens", "learn_tokens")
    }
    wall0 = time.perf_counter() - summary.get("wall_seconds", 0.0)
    # Reward functions run on this thread while the device decodes (rl/rollout.py).
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    decode_state = None  # kept across steps only when release_kv_between_phases is False
    bar = tqdm.tqdm(range(start, config.num_steps), initial=start, total=config.num_steps,
                    desc="grpo", file=sys.stderr, disable=not main_process)  # fmt: skip
    for step in bar:
        # --- rollout: the sampler reads the learner's current arrays -----------------------
        t0 = time.perf_counter()
        groups, ds_stats, decode_state = rollout_phase(
            step, parts, state.params, data, config, pool, decode_state
        )
        rollout = ro.finish(groups, config, t_len, parts.ids.pad_id)
        t1 = time.perf_counter()
        # --- learn: μ passes of minibatch steps; params and optimizer state donated ------------
        batch = jax.device_put(rollout.batch, _batch_sharding(parts))
        state, history = learner.learn(state, parts.ref_params, batch)
        t2 = time.perf_counter()
        new_tokens = sum(c.length for grp in groups for c in grp.completions)
        totals["rollout_seconds"] += t1 - t0
        totals["learn_seconds"] += t2 - t1
        totals["rollout_tokens"] += new_tokens
        totals["learn_tokens"] += sum(float(h["tokens"]) for h in history)
        metrics = {
            **{k: float(np.mean([h[k] for h in history])) for k in history[-1]},
            **rollout.stats,
            **ds_stats,
        }
        metrics.update(rollout_seconds=t1 - t0, learn_seconds=t2 - t1,
                       rollout_tokens_per_s=new_tokens / (t1 - t0))  # fmt: skip
        if config.log_every and (step + 1) % config.log_every == 0:
            log.scalars(step + 1, metrics)
            n = config.num_samples_logged
            field = config.data.train.prompt_field
            rows = [(grp.record[field], t) for grp in groups for t in grp.texts][:n]
            log.texts(step + 1, [p for p, _ in rows], [t for _, t in rows], rollout.rewards[:n])
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", loss=f"{metrics['loss']:.4f}")
        if (
            config.eval_every
            and (step + 1) % config.eval_every == 0
            and step + 1 < config.num_steps
        ):
            ev = _evaluate(parts, state.params, eval_records, config, config.seed)
            log.scalars(step + 1, {f"eval/{k}": v for k, v in ev.items() if k != "example"})
            if main_process:
                bar.write(f"step {step + 1}: held-out greedy accuracy {ev['accuracy']:.3f}")
        last = step + 1 == config.num_steps
        if last or (config.checkpoint_every and (step + 1) % config.checkpoint_every == 0):
            summary.update(totals, wall_seconds=time.perf_counter() - wall0)
            meta = {"step": step + 1, "data": data.get_state(), "summary": summary,
                    "key": jax.random.key_data(root).tolist()}  # fmt: skip
            ckpt.save(step + 1, state, meta)
    bar.close()
    pool.shutdown()
    ckpt.close()
    after = _evaluate(parts, state.params, eval_records, config, config.seed)
    log.scalars(config.num_steps, {f"eval/{k}": v for k, v in after.items() if k != "example"})
    wall = time.perf_counter() - wall0
    summary.update(
        accuracy_after=after["accuracy"], steps=config.num_steps, wall_seconds=wall,
        rollout_seconds=totals["rollout_seconds"], learn_seconds=totals["learn_seconds"],
        rollout_tokens_per_s=totals["rollout_tokens"] / max(totals["rollout_seconds"], 1e-9),
        learn_tokens_per_s=totals["learn_tokens"] / max(totals["learn_seconds"], 1e-9),
        params_fingerprint=_fingerprint(state.params), **{f"pass@{config.eval.pass_k}": after.get(f"pass@{config.eval.pass_k}")},
    )  # fmt: skip
    if main_process:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"held-out greedy accuracy: before {summary.get('accuracy_before', float('nan')):.3f}, "
              f"after {after['accuracy']:.3f} ({config.num_steps} steps, {wall:.0f} s); {workdir}")  # fmt: skip
    log.close()
    return 0


def load_run(workdir: str, step: int | None = None):
    """(config, parts, state, step) of a training run, restored from its checkpoint at `step`
    (default: the latest). Used by launch.export and launch.eval."""
    import ml_collections

    from rl.checkpoint import Checkpointer

    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise UsageError(f"--workdir {workdir}: no config.json (not a training run)")
    with open(path) as f:
        config = ml_collections.ConfigDict(json.load(f))
    ckpt = Checkpointer(workdir)
    steps = ckpt.manager.all_steps()
    if not steps or (step is not None and step not in steps):
        raise UsageError(f"--workdir {workdir}: no checkpoint at step {step} (have {list(steps)})")
    parts = setup(config)
    state, meta = ckpt.restore(parts.state, step)
    ckpt.close()
    return config, parts, state, meta["step"]


def _batch_sharding(parts):
    from rl.learner import batch_sharding

    return batch_sharding(parts.mesh, parts.rules)


def main(argv=None) -> int:
    try:
        config, config_path, opts = parse_args(sys.argv[1:] if argv is None else argv, FLAGS)
        init_distributed(config)
        validate(config, jax.device_count())
        workdir = _workdir(config_path, opts["workdir"])
        resume = prepare_workdir(config, workdir)
    except UsageError as e:
        return fail(str(e))
    if opts["dry_run"]:
        from launch.dry_run import dry_run

        return dry_run(config)
    return train(config, workdir, resume)


if __name__ == "__main__":
    sys.exit(main())
