"""The parts of a training run, built from its config: mesh, tokenizer, policy (and reference),
learner, train state, sampler engines and the rollout. `launch.train` builds them once, with
its data iterator (`prepare`), and resumes with `restore_latest`; `load_run` rebuilds them for a finished run's checkpoint
(`launch.eval`, `launch.export`).

The reference policy, when the KL term is on, is a second frozen copy of the starting checkpoint
loaded in the same shardings (no optimizer state); with LoRA (`config.model.lora.rank` > 0) it is
the policy's own base weights with the adapters off, and no copy is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import jax
import ml_collections
from jax.sharding import Mesh, NamedSharding

from launch.cli import UsageError
from launch.distributed import init_distributed
from launch.pin import model_dir
from launch.resume_compat import with_saved_defaults
from launch.validate import (
    check_isolation,
    engine_config,
    learner_config,
    model_overrides,
    sampling_params,
)
from models import lora
from models.config import ModelConfig
from models.hf import load_hf
from models.hf_config import GenerationIds
from models.sharding import base_graphdef, make_mesh, run_devices, spec_axes, state_shardings
from models.tokenizer import Tokenizer, load_tokenizer
from rl.checkpoint import Checkpointer, checksums
from rl.data import make_prompt_stream, tokenize_prompts
from rl.envs import Environment, make_env
from rl.evaluation import evaluate
from rl.learner import Learner, TrainState, batch_sharding
from rl.rollout import Rollouts
from rl.sources import load_records
from sampling import partitioned
from sampling.distribution import SamplingParams
from sampling.engine import Engine


@dataclasses.dataclass
class Run:
    config: ml_collections.ConfigDict
    mesh: Mesh
    model_cfg: ModelConfig
    ids: GenerationIds  # pad / bos / eos ids of the checkpoint
    tokenizer: Tokenizer
    learner: Learner
    state: TrainState  # params + optimizer state, sharded
    ref_params: object  # frozen reference parameters; None without a KL term or with LoRA
    engines: dict[str, Engine]  # "rollout", "greedy" (held-out accuracy), "eval" (pass@k)
    batch_sharding: NamedSharding  # learner batch rows over the batch mesh axes
    env: Environment | None = None  # multi-turn episodes (config.env.name), else single-turn

    def rollouts(self) -> Rollouts:
        return Rollouts(
            self.config,
            self.engines["rollout"],
            self.tokenizer,
            self.learner,
            self.ref_params,
            self.batch_sharding,
            self.ids.pad_id,
            self.env,
        )

    def evaluate(self, params, records) -> dict:
        """Held-out greedy accuracy and pass@k of params (rl.evaluation)."""
        e, c = self.engines, self.config
        return evaluate(
            e["greedy"], e["eval"], params, records, self.tokenizer, c, c.seed, self.env
        )


def build(config, with_reference: bool = True, with_env: bool = True) -> Run:
    """The run's parts; the reference copy only when the KL term needs it (and with_reference),
    the environment (and its sandboxes) only with_env."""
    mesh = make_mesh(dict(config.mesh))
    rules = tuple(tuple(r) for r in config.rules)
    path = model_dir(config)  # a local directory, or a Hub id's snapshot at its pinned commit
    overrides = model_overrides(config)
    model_cfg, graphdef, params, ids = load_hf(path, mesh, rules, seed=config.seed, **overrides)
    ref_params = None  # with LoRA the reference is the policy's own base weights (no copy)
    if config.rl.kl_coef > 0 and with_reference and not model_cfg.lora_rank:
        ref_params = load_hf(path, mesh, rules, **overrides)[2]
    tokenizer = load_tokenizer(path)  # char_tokenizer.json or the HF tokenizer files
    shardings = state_shardings(params, mesh, rules)
    base = base_graphdef(model_cfg) if model_cfg.lora_rank else None
    learner = Learner(learner_config(config, ids.eos_ids), graphdef, shardings, base, rules)
    env = make_env(config.env.name, tokenizer, config) if config.env.name and with_env else None
    # A turn also ends on the environment's stop ids (a tool-call close).
    ecfg = engine_config(
        config, ids.eos_ids + (env.stop_ids() if env else ()), model_cfg.num_experts
    )
    engine = lambda sampling: Engine(model_cfg, graphdef, ecfg, sampling, mesh=mesh, rules=rules)
    engines = {
        "rollout": engine(sampling_params(config)),
        "greedy": engine(SamplingParams(temperature=0.0)),
        "eval": engine(SamplingParams(temperature=config.eval.temperature)),
    }
    check_hosts(mesh, rules, model_cfg.num_kv_heads, config.sampling.weights_layout)
    return Run(
        config,
        mesh,
        model_cfg,
        ids,
        tokenizer,
        learner,
        learner.init_state(params),
        ref_params,
        engines,
        batch_sharding(mesh, rules),
        env,
    )


def check_hosts(mesh, rules, kv_heads: int, weights_layout: str = "training") -> None:
    """A multi-process run packs each batch shard's groups into that shard's learner rows on its
    own process (`rl.rollout`): the learner's batch axes must be the sampler's shard axes
    (ValueError otherwise, one line; each shard on one process is the engine's check). On CPU
    it decodes from the training layout: the per-rollout reshard of `weights_layout="tensor"`
    (`sampling.decode_weights`) hung XLA:CPU's gloo runtime now and then (one process launching
    it, its peer past it; 1 run in 3 to 8 of a 2 x 4 run here), never the training layout."""
    if jax.process_count() == 1:
        return
    shape = dict(mesh.shape)
    if mesh.devices.flat[0].platform == "cpu" and weights_layout == "tensor":
        raise ValueError(
            "config.sampling.weights_layout='tensor': a multi-process run on CPU decodes from "
            "the training layout (the per-rollout reshard of 'tensor' hangs XLA:CPU's gloo "
            "collectives now and then); set --config.sampling.weights_layout=training"
        )
    shards = partitioned.shard_axes(shape, rules, kv_heads)
    batch = tuple(a for a in spec_axes(dict(rules).get("batch")) if shape[a] > 1)
    if shards != batch:
        raise ValueError(
            f"mesh {shape}: the KV heads are split over {sorted(set(batch) - set(shards))}, an "
            "axis of the batch: a multi-process run needs the learner's batch axes to be the "
            "sampler's batch shards (split the KV heads over tensor only)"
        )


def prepare(config) -> tuple[Run, object, list]:
    """The run's parts, its data iterator and held-out records. Every prompt is made once here,
    as the rollout and the evaluation make it (with an environment, its first prompt: for env
    `repo` the instructions and tool schemas through the chat template), so a prompt over
    sampling.max_prompt_len, or one the tokenizer cannot encode, fails now (one line naming the
    record), before the workdir is written, not at the first evaluation or hours into the run."""
    run = build(config)
    data = make_prompt_stream(
        config.data.train, batch_size=config.data.prompts_per_step, seed=config.seed
    )
    try:
        eval_records = check_prompts(config, run)
    except Exception:
        if hasattr(run.env, "shutdown"):  # the repo environment's sandboxes (their threads)
            run.env.shutdown()
        raise
    return run, data, eval_records


def check_prompts(config, run: Run) -> list:
    """Every train and held-out record's prompt made once (`prepare`); the held-out records."""
    eval_records = load_records(config.data.eval)
    for split, records in (("train", load_records(config.data.train)), ("eval", eval_records)):
        if config.env.get("name") == "repo":  # refuse unsupported record fields at load time
            from rl.envs.repo import check_records

            check_records(records, config.env)  # image records: isolation, images probed at once
        field = config.data[split].prompt_field  # checked, not kept (an "hf" source may be large)
        tokenize_prompts(
            records, run.tokenizer, config, field, keep=False, env=run.env, split=split
        )
    return eval_records


def check_base(run: Run, meta: dict, base: dict | None) -> None:
    """A LoRA checkpoint holds the adapters only; the base weights come from
    config.model.hf_checkpoint again. Refuses (UsageError) when they (`base`, this run's
    `base_checksums`) are not the ones the run started from (every checkpoint's meta has them)."""
    if not run.learner.lora or meta.get("base") == base:
        return
    raise UsageError(
        f"config.model.hf_checkpoint={run.config.model.hf_checkpoint!r}: its weights differ from "
        "the base this LoRA run started from (the checkpoints hold only the adapters); restore "
        "that checkpoint directory or start a new --workdir"
    )


def restore_latest(
    run: Run, ckpt: Checkpointer, base: dict | None, data
) -> tuple[TrainState, int, dict]:
    """(train state, step, summary) of the latest usable checkpoint, with the data iterator
    `data` set back to where that step left it. Later steps that cannot be read are set aside,
    each named in one line on stderr; raises CheckpointError when no step is usable and
    UsageError when a LoRA run's base weights changed (`check_base`) or the checkpoint was
    written under another seed (`check_seed`)."""
    saved, meta, skipped = ckpt.restore_latest(run.learner.checkpointed(run.state), set_aside=True)
    check_base(run, meta, base)
    check_seed(run.config.seed, meta, ckpt.directory)
    state = run.learner.restored(run.state, saved)
    for bad, why in skipped:
        print(
            f"checkpoint step {bad} in {ckpt.directory} is unusable ({why}); resuming from "
            f"step {meta['step']}",
            file=sys.stderr,
        )
    data.set_state(meta["data"])
    return state, meta["step"], meta["summary"]


def seed_key(seed: int) -> list[int]:
    """The key data of the root key of config.seed, as a checkpoint's meta holds it."""
    return jax.random.key_data(jax.random.key(seed)).tolist()


def check_seed(seed: int, meta: dict, directory: str) -> None:
    """Refuses (UsageError) a checkpoint written under another seed: the resumed steps would draw
    from another root key (fold_in(seed, step)), so the run would be neither run. The saved seed
    is named when the key data gives it back (a threefry key holds the seed itself)."""
    if meta["key"] == seed_key(seed):
        return
    old = meta["key"][-1] if meta["key"] else None  # config.seed is in [0, 2**31)
    if isinstance(old, int) and 0 <= old < 2**31 and seed_key(old) == meta["key"]:
        raise UsageError(
            f"config.seed={seed}: the checkpoint in {directory} was written with "
            f"seed {old}; resume with --config.seed={old} or use a new --workdir"
        )
    raise UsageError(
        f"config.seed={seed}: the checkpoint in {directory} was written with another "
        "seed; resume with that run's seed or use a new --workdir"
    )


def base_checksums(run: Run) -> dict | None:
    """Checksums of a LoRA run's frozen base weights (None without LoRA)."""
    return checksums(lora.base(run.state.params)) if run.learner.lora else None


def load_run(
    workdir: str, step: int | None = None, runs_code: bool = True, flag: str = "--workdir"
) -> tuple[Run, int]:
    """(run with its state restored from the checkpoint at `step` (default: the latest), step),
    for evaluating or exporting a run: without the reference copy, and on the devices at hand
    (the training mesh when it fits them, else fsdp over all of them; orbax reshards).
    `runs_code=False` (launch.export: no episode runs) builds no environment and probes no
    sandbox, so a code run exports on a host where its sandbox would be refused. Errors name
    the workdir as `flag` (launch.generate: --hf_checkpoint)."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise UsageError(f"{flag} {workdir}: no config.json (not a training run)")
    with open(path) as f:
        config = ml_collections.ConfigDict(with_saved_defaults(json.load(f)))
    init_distributed(config)
    count = len(run_devices())
    if math.prod(config.mesh.values()) != count:
        config.mesh.update(data=1, fsdp=count, tensor=1)
    ckpt = Checkpointer(workdir)
    steps = ckpt.manager.all_steps()
    if not steps or (step is not None and step not in steps):
        raise UsageError(f"{flag} {workdir}: no checkpoint at step {step} (have {list(steps)})")
    check_isolation(config, runs_code)  # code rewards or an environment that cannot run here
    run = build(config, with_reference=False, with_env=runs_code)
    saved, meta = ckpt.restore(run.learner.checkpointed(run.state), step)
    check_base(run, meta, base_checksums(run))
    run.state = run.learner.restored(run.state, saved)
    ckpt.close()
    return run, meta["step"]
