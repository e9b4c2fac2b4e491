"""Semantic validation of a training config, before anything is built or written.

Every check names the config field and the reason in one line (a `UsageError`), so a bad run
fails in a second instead of after compiling, and never touches an existing workdir. Which
config changes a resumed run may make is `launch/resume_compat.py` (`prepare_workdir` calls it).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import sys

import jax
import ml_collections
import numpy as np

import rl.envs  # noqa: F401  (registers the built-in environments, their rewards and sources)
from launch.cli import UsageError, config_json
from launch.pin import model_dir
from launch.resume_compat import check_resumable
from models.config import ATTENTION
from models.hf_config import CheckpointError, config_from_hf
from models.hub import HubError, shadowing
from models.lora import ATTENTION as LORA_ATTENTION
from models.lora import TARGETS as LORA_TARGETS
from models.sharding import MESH_AXES
from rl.advantages import MODES as ADVANTAGE_MODES
from rl.data import reward_inputs
from rl.learner import LearnerConfig
from rl.losses import LossConfig
from rl.mismatch import CORRECTIONS, QUANTISED_DTYPES, resolve_correction
from rl.rewards import CODE_REWARDS, REWARDS
from rl.sandbox import ISOLATIONS, isolation_of
from rl.sources import SourceError, builtin_types, hub_dataset_dir, load_records
from sampling.distribution import SamplingParams
from sampling.engine import EngineConfig
from sampling.partitioned import num_shards
from sampling.requests import group_pages

FILE_SOURCES = ("jsonl", "parquet", "hf")
DTYPES = ("float32", "bfloat16", "float16")

# The repo environment's fields (configs/default.py) and the least value each may take; their
# defaults, launch.resume_compat.REPO_ENV_DEFAULTS, let a run saved without them resume.
REPO_ENV_MINIMA = {
    "command_timeout_s": 0.1,
    "max_tool_calls": 1,
    "workspace_bytes": 1 << 20,
    "test_timeout_s": 1.0,
    "per_test_timeout_s": 1,
    "setup_timeout_s": 1.0,
    "sandbox_memory_bytes": 64 << 20,
    "sandbox_processes": 1,
}


def _need(cond: bool, field: str, value, reason: str) -> None:
    if not cond:
        raise UsageError(f"config.{field}={value!r}: {reason}")


def from_config(cls, c: ml_collections.ConfigDict, sections: tuple[str, ...], **given):
    """cls(**fields) with every field not `given` read from the first of `sections` of the config
    that has a field of that name: the one place where config fields meet the dataclasses.

    A dataclass field that no section holds is a bug in the config file, named in the error; a
    value the dataclass refuses is reported as the config field it came from.
    """
    kwargs, origin = dict(given), {}
    for f in dataclasses.fields(cls):
        where = next((s for s in sections if f.name in c[s]), None)
        if f.name in kwargs:
            if where is not None:  # derived from that field (e.g. stop_ids, cache_dtype)
                origin[f.name] = f"config.{where}.{f.name}"
            continue
        if where is None:
            raise UsageError(f"config.{'/'.join(sections)} has no field {f.name} ({cls.__name__})")
        value = c[where][f.name]
        kwargs[f.name] = tuple(value) if isinstance(value, list) else value
        origin[f.name] = f"config.{where}.{f.name}"
    try:
        obj = cls(**kwargs)
        if hasattr(obj, "validate"):
            obj.validate()
    except ValueError as e:
        msg = str(e)
        field = msg.split("=")[0].split(".")[-1]
        if field in origin:
            msg = (
                f"{origin[field]}{msg[msg.index('=') :]}"
                if "=" in msg
                else f"{origin[field]}: {msg}"
            )
        raise UsageError(msg) from None
    return obj


def sampling_params(c: ml_collections.ConfigDict) -> SamplingParams:
    return from_config(SamplingParams, c, ("sampling",))


def loss_config(c: ml_collections.ConfigDict) -> LossConfig:
    return from_config(LossConfig, c, ("rl", "sampling"), is_correction=is_correction(c))


def is_correction(c: ml_collections.ConfigDict) -> str:
    """config.rl.is_correction with "auto" resolved: tis for a quantised rollout, else none
    (`rl.mismatch.resolve_correction`). A resumed run resolves it as it did, as the sampling
    dtypes and old_logp it reads cannot change on resume."""
    s = c.sampling
    dtypes = (s.get("cache_dtype", ""), s.get("weights_dtype", ""))
    return resolve_correction(c.rl.is_correction, *dtypes, c.rl.old_logp)


def mismatch_warning(c: ml_collections.ConfigDict) -> str | None:
    """The one-line warning for a quantised rollout whose mismatch correction was turned off."""
    s = c.sampling
    quantised = [
        f"sampling.{f}={s.get(f, '')!r}"
        for f in ("cache_dtype", "weights_dtype")
        if s.get(f, "") in QUANTISED_DTYPES
    ]
    if c.rl.is_correction != "none" or not quantised or c.rl.old_logp != "recompute":
        return None
    return (
        f"warning: config.rl.is_correction='none' with a quantised rollout ({', '.join(quantised)}):"
        f" the sampler's log-probs differ from the learner's and nothing corrects for it "
        f"(the default 'auto' uses tis, is_cap={c.rl.is_cap})"
    )


def stop_ids(c: ml_collections.ConfigDict, eos_ids) -> tuple[int, ...]:
    """The tokenizer's end ids and config.sampling.stop_ids, each once."""
    return tuple(dict.fromkeys([*eos_ids, *c.sampling.stop_ids]))


def records_routes(c: ml_collections.ConfigDict, num_experts: int) -> bool:
    """Whether the sampler records each token's experts: on every mixture of experts' run, for
    routing replay or, with replay off, for rollout/route_mismatch (rl/router.py): a decode
    call's [slots, steps_per_call, L_moe, k] on the device and each episode's [T, L_moe, k] on
    the host, int8 up to 128 experts (`models.moe.route_dtype`), in single-turn, multi-turn and
    partial-rollout runs alike; the learner gets the ids (replay) or their 16-bit digests
    (`rl.router.digest`)."""
    return bool(num_experts) or c.rl.get("routing_replay", "none") == "rollout"


def engine_config(c: ml_collections.ConfigDict, eos_ids, num_experts: int = 0) -> EngineConfig:
    """The sampler's EngineConfig; num_experts: the checkpoint's (`records_routes`)."""
    dtype = c.sampling.cache_dtype or c.model.dtype
    # interpret (Pallas kernels run op by op on a CPU) is for tests, not a run's config. A run
    # saved before sampling.prefill_chunk existed prefilled unchunked (0), and one saved before
    # sampling.weights_layout decoded from the training layout, and one saved before
    # sampling.reserve reserved each episode's budget.
    return from_config(
        EngineConfig,
        c,
        ("sampling",),
        stop_ids=stop_ids(c, eos_ids),
        cache_dtype=dtype,
        interpret=False,
        prefill_chunk=c.sampling.get("prefill_chunk", 0),
        weights_layout=c.sampling.get("weights_layout", "training"),
        reserve=c.sampling.get("reserve", "budget"),
        kv_watermark=c.sampling.get("kv_watermark", 0.01),
        record_routes=records_routes(c, num_experts),
    )


def learner_config(c: ml_collections.ConfigDict, eos_ids) -> LearnerConfig:
    return from_config(
        LearnerConfig,
        c,
        ("optim", "rl"),
        sampling=sampling_params(c),
        loss=loss_config(c),
        stop_ids=stop_ids(c, eos_ids),
    )


def model_overrides(c: ml_collections.ConfigDict) -> dict:
    """The ModelConfig fields the run's config sets (config.json of the checkpoint decides the
    rest): dtypes, remat, attention and LoRA (config.model.lora; absent = off)."""
    m = c.model
    # A run saved before config.model.attention existed has none: "auto".
    attention = m.get("attention", "auto")
    out = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat, attention=attention)
    lo = m.get("lora")
    if lo is not None and lo.rank:
        out.update(
            lora_rank=lo.rank,
            lora_alpha=float(lo.alpha),
            lora_dropout=float(lo.dropout),
            lora_targets=tuple(lo.targets),
        )
    return out


def _check_lora(c: ml_collections.ConfigDict) -> None:
    lo = c.model.get("lora")
    if lo is None:
        return
    rank_ok = isinstance(lo.rank, int) and not isinstance(lo.rank, bool) and lo.rank >= 0
    _need(rank_ok, "model.lora.rank", lo.rank, "must be an integer >= 0 (0 = off)")
    if not lo.rank:
        return
    _need(lo.alpha > 0, "model.lora.alpha", lo.alpha, "must be > 0")
    _need(
        lo.dropout == 0,
        "model.lora.dropout",
        lo.dropout,
        "only 0 is implemented (the adapters see no dropout)",
    )
    targets = tuple(lo.targets)
    bad = [t for t in targets if t not in LORA_TARGETS]
    _need(
        bool(targets) and not bad,
        "model.lora.targets",
        targets,
        f"expected a non-empty subset of {LORA_TARGETS}",
    )


def check_lora_targets(c: ml_collections.ConfigDict, model) -> None:
    """LoRA on a mixture of experts adapts the attention projections only: the experts (and the
    router) stay frozen, and a dense layer's gate/up/down beside them is not adapted either, so
    that "gate", "up", "down" mean one thing. `model`: the checkpoint's ModelConfig."""
    lo = c.model.get("lora")
    if lo is None or not lo.rank or not model.moe_layers:
        return
    targets = tuple(lo.targets)
    experts = [t for t in targets if t not in LORA_ATTENTION]
    _need(
        not experts,
        "model.lora.targets",
        targets,
        f"{tuple(experts)} are the experts' projections in this mixture of experts "
        f"(frozen; no adapters on experts): use attention targets {LORA_ATTENTION}",
    )


def check_expert_mesh(c: ml_collections.ConfigDict, num_experts: int) -> None:
    """The expert axis splits the experts of a mixture-of-experts model (models/moe.py): it must
    divide their number, and a dense model has none to split."""
    ep = c.mesh.get("expert", 1)
    _need(
        num_experts > 0 or ep == 1,
        "mesh.expert",
        ep,
        "splits a mixture of experts' experts; the checkpoint is a dense model (use 1)",
    )
    _need(
        ep < 1 or not num_experts or num_experts % ep == 0,
        "mesh.expert",
        ep,
        f"does not divide the checkpoint's num_experts = {num_experts}",
    )


def check_routing_replay(c: ml_collections.ConfigDict, num_experts: int) -> None:
    """rl.routing_replay="rollout" replays a mixture of experts' recorded routes: refused on a
    dense model. Every episode carries its record (`sampling.episodes`): multi-turn ones their
    observations' (prefilled on resume), partial rollouts across steps, preemption and
    refresh."""
    replay = c.rl.get("routing_replay", "none")
    _need(
        replay in ("none", "rollout"), "rl.routing_replay", replay, "expected 'none' or 'rollout'"
    )
    if replay == "none":
        return
    _need(
        num_experts > 0,
        "rl.routing_replay",
        replay,
        "replays a mixture of experts' routes; the checkpoint is a dense model (use 'none')",
    )


def check_isolation(c: ml_collections.ConfigDict, probe: bool = True) -> None:
    """A run that executes model-written code (an environment that `runs_code`, or a reward of
    CODE_REWARDS without one) starts only where its sandbox works under config.env.isolation:
    bubblewrap for "auto" and "bwrap" (else the one-line refusal of rl.sandbox), and for the
    repo environment pytest importable inside. Sets the python_tests reward's isolation. Runs
    that execute no code probe nothing, and nor does `probe=False` (a path that runs no model
    code: launch.train --dry_run, launch.export), which checks the field's value alone. First
    in `validate`, and `launch.build.load_run` calls it (launch.eval, launch.export)."""
    env = c.get("env", {})
    iso = isolation_of(env)
    _need(
        iso in ISOLATIONS,
        "env.isolation",
        iso,
        f"expected one of {ISOLATIONS} (auto: "
        "bubblewrap, else refuse to run model-written code; rlimits: the weak mode)",
    )
    if not probe:
        return
    if name := env.get("name", ""):
        from rl.envs import ENVIRONMENTS

        cls = ENVIRONMENTS.get(name)
        if cls is None or not cls.runs_code:
            return
        what, problem = f"env {name!r}", cls.check_sandbox(c)
    else:
        from rl.envs.code_rewards import use_isolation

        code = [n for n in dict.fromkeys([*c.rl.rewards, c.eval.reward]) if n in CODE_REWARDS]
        if not code:
            return
        what, problem = f"reward {code[0]!r}", use_isolation(iso)
    _need(not problem, "env.isolation", iso, f"{what} runs model-written code; {problem}")


def validate(
    c: ml_collections.ConfigDict, device_count: int, runs_code: bool = True, sources: bool = True
) -> None:
    """Every check of the config (`runs_code`: whether this path will execute model-written
    code, so whether the sandbox is probed; launch.train --dry_run will not). Without
    `sources` a Hub dataset is not fetched: launch.train calls `check_sources` for it after the
    resume check, so that a refused resume fetches no dataset file."""
    check_isolation(c, runs_code)  # first: it says whether this machine may run the config at all
    g, b = c.rl.num_generations, c.data.prompts_per_step
    _need(g >= 2, "rl.num_generations", g, "GRPO needs G >= 2 completions per prompt")
    _need(b >= 1, "data.prompts_per_step", b, "must be >= 1")
    mesh = {a: c.mesh.get(a, 1) for a in MESH_AXES}
    size = math.prod(mesh.values())
    _need(
        size == device_count,
        "mesh",
        mesh,
        f"uses {size} devices but {device_count} are available"
        f" (on a CPU host, JAX_NUM_CPU_DEVICES={size} makes {size})",
    )
    batch_shards = mesh["data"] * mesh["fsdp"]
    _need(
        (b * g) % batch_shards == 0,
        "data.prompts_per_step",
        b,
        f"the global batch B*G = {b * g} is not divisible by the batch shards data*fsdp = {batch_shards}",
    )
    _need(
        (b * g) % c.rl.minibatches == 0,
        "rl.minibatches",
        c.rl.minibatches,
        f"B*G = {b * g} is not divisible by the minibatches",
    )
    mb = c.rl.minibatches * c.rl.micro_batches
    _need(
        (b * g) % mb == 0,
        "rl.micro_batches",
        c.rl.micro_batches,
        f"B*G = {b * g} is not divisible by minibatches*micro_batches = {mb}",
    )
    _need(
        not c.rl.pack or (b * g) % (batch_shards * mb) == 0,
        "rl.pack",
        c.rl.pack,
        f"packed rows come in multiples of data*fsdp*minibatches*micro_batches = "
        f"{batch_shards * mb}, which does not divide B*G = {b * g}: change "
        "data.prompts_per_step or set rl.pack=False",
    )
    _need(
        c.rl.is_correction in (*CORRECTIONS, "auto"),
        "rl.is_correction",
        c.rl.is_correction,
        f"must be one of {', '.join(CORRECTIONS)}, auto",
    )
    _need(
        is_correction(c) == "none" or c.rl.old_logp == "recompute",
        "rl.is_correction",
        c.rl.is_correction,
        "corrects pi_old against the sampler, which old_logp='sampler' "
        "makes the same distribution: use old_logp='recompute'",
    )
    warning = mismatch_warning(c)
    if warning:
        print(warning, file=sys.stderr)
    _need(
        c.rl.partial_rollouts or not c.rl.refresh_kv_on_update,
        "rl.refresh_kv_on_update",
        True,
        "re-prefills carried episodes: set rl.partial_rollouts=True too",
    )
    if c.rl.partial_rollouts:
        from rl.partial import check_partial

        if c.rl.is_correction == "auto":  # (check_partial refuses an explicit none)
            _need(
                is_correction(c) != "none",
                "rl.is_correction",
                "auto",
                "means none on an unquantised rollout, and partial rollouts train on tokens of "
                "older policies: set tis, mis or icepop (decoupled PPO's behaviour weight)",
            )
        for field, value, why in check_partial(c):
            _need(False, field, value, why)
    _need(c.rl.advantage_eps >= 0, "rl.advantage_eps", c.rl.advantage_eps, "must be >= 0")
    _need(
        c.rl.dynamic_sampling_max_tries >= 1,
        "rl.dynamic_sampling_max_tries",
        c.rl.dynamic_sampling_max_tries,
        "must be >= 1",
    )
    _need(
        0 <= c.rl.overlong_buffer <= c.sampling.max_new_tokens,
        "rl.overlong_buffer",
        c.rl.overlong_buffer,
        f"must be in [0, sampling.max_new_tokens = {c.sampling.max_new_tokens}] (0 = off)",
    )
    env = c.get("env", {}).get("name", "")
    if env:
        from rl.envs import ENVIRONMENTS

        v = c.env
        _need(
            env in ENVIRONMENTS,
            "env.name",
            env,
            f'no such environment; registered: {sorted(ENVIRONMENTS)} ("" = single-turn)',
        )
        _need(v.max_turns >= 1, "env.max_turns", v.max_turns, "must be >= 1")
        _need(
            0 <= v.max_turn_tokens <= c.sampling.max_new_tokens,
            "env.max_turn_tokens",
            v.max_turn_tokens,
            f"must be in [0, sampling.max_new_tokens = "
            f"{c.sampling.max_new_tokens}] (0 = the whole budget)",
        )
        _need(v.max_tool_seconds > 0, "env.max_tool_seconds", v.max_tool_seconds, "must be > 0")
        _need(v.tool_workers >= 1, "env.tool_workers", v.tool_workers, "must be >= 1")
        _need(
            v.tool_answer_calls >= 0,
            "env.tool_answer_calls",
            v.tool_answer_calls,
            "must be >= 0 (0 = each answer as soon as it is done)",
        )
        _need(
            c.sampling.min_new_tokens == 0,
            "sampling.min_new_tokens",
            c.sampling.min_new_tokens,
            "must be 0 with an environment (the sampler would ban stop ids at the start of "
            "every turn, the learner only at the start of the episode)",
        )
        _need(
            v.max_observation_chars >= 1,
            "env.max_observation_chars",
            v.max_observation_chars,
            "must be >= 1",
        )
        _need(
            c.rl.overlong_buffer == 0,
            "rl.overlong_buffer",
            c.rl.overlong_buffer,
            "must be 0 with an environment (the episode's reward is the environment's)",
        )
        for name, low in REPO_ENV_MINIMA.items():
            if name in v:
                _need(v[name] >= low, f"env.{name}", v[name], f"must be >= {low}")
        images = v.get("images_dir") or ""
        _need(
            not images or os.path.isdir(os.path.expanduser(images)),
            "env.images_dir",
            images,
            "no such directory (unpack images there: python -m launch.images unpack SRC --out DIR)",
        )
    _need(
        c.rl.get("reward_timeout_s", 0) >= 0,
        "rl.reward_timeout_s",
        c.rl.get("reward_timeout_s", 0),
        "must be >= 0 (0 = no limit)",
    )
    for name in ([] if env else list(c.rl.rewards)) + [c.eval.reward] * (not env):
        _need(
            name in REWARDS,
            "rl.rewards" if name != c.eval.reward else "eval.reward",
            name,
            f"no such reward; registered: {sorted(REWARDS)}",
        )
    _need(0 <= c.seed < 2**31, "seed", c.seed, "must be in [0, 2**31)")
    _need(c.keep_checkpoints >= 1, "keep_checkpoints", c.keep_checkpoints, "must be >= 1")
    for field in ("dtype", "param_dtype"):
        _need(c.model[field] in DTYPES, f"model.{field}", c.model[field], f"one of {DTYPES}")
    attention = c.model.get("attention", "auto")  # absent in runs saved before it existed
    _need(attention in ATTENTION, "model.attention", attention, f"expected one of {ATTENTION}")
    kernel_platform = {"splash": "tpu", "pallas_gpu": "gpu"}.get(attention)
    _need(
        kernel_platform in (None, jax.default_backend()),
        "model.attention",
        attention,
        f"a {kernel_platform} kernel, but this run is on {jax.default_backend()}; "
        f"use auto (picks it where it runs) or blockwise",
    )
    _check_lora(c)
    s = c.sampling
    _need(g <= s.num_slots, "sampling.num_slots", s.num_slots, f"fewer slots than G = {g}")
    _need(
        s.temperature > 0,
        "sampling.temperature",
        s.temperature,
        "a rollout needs temperature > 0 (0 is greedy: G identical completions, no signal)",
    )
    _need(
        0 <= s.min_new_tokens <= s.max_new_tokens,
        "sampling.min_new_tokens",
        s.min_new_tokens,
        f"must be in [0, sampling.max_new_tokens = {s.max_new_tokens}]",
    )
    engine_config(c, ())  # the sampler's own fields first: the page counts below divide by them
    grads = c.optim.grad_reduce_dtype
    _need(
        grads in ("float32", c.model.dtype),
        "optim.grad_reduce_dtype",
        grads,
        f"must be 'float32' or model.dtype = {c.model.dtype!r}",
    )
    _need(
        s.weights_dtype in ("", c.model.dtype, "int8", "float8_e4m3fn"),
        "sampling.weights_dtype",
        s.weights_dtype,
        f"a decode copy must be in model.dtype = {c.model.dtype!r}, int8 or float8_e4m3fn "
        "(or '' for none)",
    )
    # Slots and pages are totals for the mesh, split evenly over its batch shards, each with
    # its own null page; a group lives on one shard (`sampling.partitioned`). The KV heads are
    # assumed to divide their axes here; the engine checks the exact count.
    shards = num_shards(mesh, tuple(tuple(r) for r in c.rules), size)
    per = f"the {shards} batch shards" if shards > 1 else "one shard"
    for field in ("num_slots", "num_pages"):
        _need(
            s[field] % shards == 0,
            f"sampling.{field}",
            s[field],
            f"a total for the mesh, split evenly over {per} (data x fsdp): must divide by {shards}",
        )
    _need(
        b % shards == 0,
        "data.prompts_per_step",
        b,
        f"a step's prompts are split evenly over {per} (data x fsdp), each sampling, "
        f"refilling and packing its own groups: must divide by {shards}",
    )
    per_shard = b // shards * g
    _need(
        c.rl.pack or per_shard % c.rl.minibatches == 0,
        "rl.minibatches",
        c.rl.minibatches,
        f"with rl.pack=False each of {per} fills one learner row per sequence, "
        f"B/{shards}*G = {per_shard} rows, which the minibatches must divide (or set "
        "rl.pack=True)",
    )
    if c.rl.partial_rollouts:
        _need(
            c.rl.extra_groups % shards == 0,
            "rl.extra_groups",
            c.rl.extra_groups,
            f"groups in flight beyond B are split evenly over {per}: must divide by {shards}",
        )
    _need(
        g <= s.num_slots // shards,
        "sampling.num_slots",
        s.num_slots,
        f"a group of G = {g} decodes on one of {per}, which has {s.num_slots // shards} slots",
    )
    need = group_pages(s.max_prompt_len, s.max_new_tokens, s.page_size, g)
    _need(
        s.num_pages // shards - 1 >= need,
        "sampling.num_pages",
        s.num_pages,
        f"one group of G = {g} needs up to {need} pages (+ the null page) on one of {per}"
        + (f", which holds num_pages / {shards} = {s.num_pages // shards}" if shards > 1 else ""),
    )
    _need(s.max_new_tokens >= 1, "sampling.max_new_tokens", s.max_new_tokens, "must be >= 1")
    _need(
        c.rl.advantage in ADVANTAGE_MODES,
        "rl.advantage",
        c.rl.advantage,
        f"expected one of {ADVANTAGE_MODES}",
    )
    e = c.eval
    _need(
        0 <= e.pass_k <= e.pass_n,
        "eval.pass_k",
        e.pass_k,
        f"pass@k needs 0 <= k <= eval.pass_n = {e.pass_n} (0 = off)",
    )
    _need(e.temperature >= 0, "eval.temperature", e.temperature, "must be >= 0")
    if e.pass_k:
        _need(
            e.pass_n <= s.num_slots,
            "eval.pass_n",
            e.pass_n,
            f"more samples per prompt than sampling.num_slots = {s.num_slots}",
        )
        need = group_pages(s.max_prompt_len, s.max_new_tokens, s.page_size, e.pass_n)
        _need(
            s.num_pages // shards - 1 >= need,
            "eval.pass_n",
            e.pass_n,
            f"a group of {e.pass_n} needs up to {need} KV pages, more than sampling.num_pages"
            + (f" / {shards} shards" if shards > 1 else ""),
        )
    _need(c.max_nonfinite_steps >= 1, "max_nonfinite_steps", c.max_nonfinite_steps, "must be >= 1")
    m = c.env
    _need(
        0 < m.max_masked_fraction <= 1,
        "env.max_masked_fraction",
        m.max_masked_fraction,
        "must be in (0, 1]",
    )
    _need(m.max_masked_steps >= 1, "env.max_masked_steps", m.max_masked_steps, "must be >= 1")
    for field in ("num_steps", "checkpoint_every", "eval_every", "log_every"):
        _need(c[field] >= 0, field, c[field], "must be >= 0")
    every = c.log.progress_every
    _need(every >= 1, "log.progress_every", every, "must be >= 1")
    path = model_dir(c, weights=False)
    _need(
        os.path.exists(os.path.join(path, "config.json")),
        "model.hf_checkpoint",
        c.model.hf_checkpoint,
        "has no config.json" + shadowing(c.model.hf_checkpoint),
    )
    check_sources(c, fetch=sources)
    if c.get("log", {}).get("wandb"):
        try:
            import wandb  # noqa: F401
        except ImportError:
            _need(
                False,
                "log.wandb",
                True,
                "needs the wandb library: pip install -e '.[wandb]' (or pip install wandb)",
            )
    try:
        model = config_from_hf(path)
    except CheckpointError as e:
        raise UsageError(
            f"config.model.hf_checkpoint={c.model.hf_checkpoint!r}: {e}"
            + shadowing(c.model.hf_checkpoint)
        ) from None
    vocab = model.vocab_size
    check_expert_mesh(c, model.num_experts)
    check_routing_replay(c, model.num_experts)
    check_lora_targets(c, model)
    stops = c.sampling.stop_ids
    _need(
        all(isinstance(i, int) and 0 <= i < vocab for i in stops),
        "sampling.stop_ids",
        stops,
        f"must be token ids in [0, {vocab}) (the checkpoint's vocabulary)",
    )
    learner_config(c, ())
    engine_config(c, ())
    check_rewards(c)


def check_sources(c: ml_collections.ConfigDict, fetch: bool = True) -> None:
    """The train and held-out data sources exist; with `fetch` an "hf" source's Hub id is
    fetched (at the commit pin_data recorded) and its subset, split and prompt field checked."""
    for split in ("train", "eval"):
        src = c.data[split]
        if src.type in ("jsonl", "parquet"):
            found = glob.glob(src.path) if src.path else []
            _need(
                bool(found),
                f"data.{split}.path",
                src.path,
                f"no {src.type} file there" + _tasks_hint(c, split),
            )
        elif src.type == "hf":
            _need(
                bool(src.path),
                f"data.{split}.path",
                src.path,
                "a Hub dataset id, a directory of data files or a save_to_disk directory",
            )
            try:
                import datasets  # noqa: F401
            except ImportError:
                _need(
                    False,
                    f"data.{split}.type",
                    "hf",
                    "needs the datasets library: pip install -e '.[hub]'",
                )
            try:  # a Hub id is fetched now; its subset, split and prompt field checked
                if fetch:
                    load_source(c, split)  # (datasets caches what it reads)
            except UsageError:
                raise
            except (ValueError, OSError):  # an empty or unreadable dataset: launch.train.prepare
                pass  # reports it, as it does a jsonl file's
        else:
            _need(
                src.type in builtin_types(),
                f"data.{split}.type",
                src.type,
                f"expected jsonl, parquet, hf or one of {builtin_types()}",
            )


def _tasks_hint(c: ml_collections.ConfigDict, split: str) -> str:
    """The command that makes env repo's missing tasks file, as the README's recipe makes it
    (planted-bug tasks; a --validate'd valid.jsonl from its directory's tasks.jsonl)."""
    if c.env.get("name") != "repo":
        return ""
    path = c.data[split].path
    out = os.path.dirname(path) or "."
    if os.path.basename(path) == "valid.jsonl":
        return f" (make it with python -m launch.make_repo_tasks --validate {out})"
    what, num, seed = ("training", 512, 0) if split == "train" else ("held-out", 64, 1)
    if os.path.basename(path) == "tasks.jsonl":
        make = f"--out {out} --num {num} --seed {seed}"
    else:  # make_repo_tasks names its file
        make = f"--out DIR --num {num} --seed {seed}, then set it to DIR/tasks.jsonl"
    return f" (make the {what} tasks with python -m launch.make_repo_tasks {make})"


def load_source(c: ml_collections.ConfigDict, split: str):
    """load_records(config.data.<split>), an "hf" source's errors (a Hub id or revision that
    does not resolve, a bad subset, split or prompt field) one-line UsageErrors naming
    config.data.<split>.<field>; a Hub id is read at data.<split>.hf_commit where pin_data
    recorded it. Other errors (an empty or unreadable dataset) are raised as they are."""
    src = c.data[split]
    if src.type == "hf":
        try:  # the Hub id resolved here, so that its errors name the fields
            rev = src.get("hf_commit") or src.get("revision", "")  # pin_data's commit
            hub_dataset_dir(
                src.path,
                rev,
                src.get("name") or None,
                field=f"config.data.{split}.path",
                revision_field=f"config.data.{split}.revision",
            )
        except HubError as e:
            raise UsageError(str(e)) from None
        except SourceError as e:  # a subset the card does not hold, before any data file
            raise UsageError(f"config.data.{split}.{e}") from None
    try:
        return load_records(src)
    except SourceError as e:  # "split='x': ..." -> config.data.train.split='x': ...
        raise UsageError(f"config.data.{split}.{e}{shadowing(src.path)}") from None


def check_rewards(c: ml_collections.ConfigDict) -> None:
    """Calls each reward once on the first record of its split with G empty completions: a reward
    that does not return one number per completion fails here, before the workdir is touched,
    not at the first rollout (nor, for eval.reward, silently in the accuracy). A reward that
    raises is left to the run, which scores such calls 0; a data source that cannot be read is
    left to `launch.train.prepare`, which names its file and line."""
    if c.env.name:  # the environment scores episodes
        return
    g = c.rl.num_generations
    for split, field, names in (
        ("train", "rl.rewards", list(c.rl.rewards)),
        ("eval", "eval.reward", [c.eval.reward]),
    ):
        src = c.data[split]
        try:
            prompts, fields = reward_inputs(load_records(src)[:1], g, src.prompt_field)
        except (ValueError, OSError, KeyError):
            continue
        for name in names:
            try:
                raw = REWARDS[name](prompts, [""] * g, **fields)
            except Exception:
                continue
            try:
                shape = np.shape(np.asarray(raw, np.float32))
            except (TypeError, ValueError):
                shape = None
            got = f"a {type(raw).__name__}" if shape is None else f"shape {shape}"
            _need(
                shape == (g,),
                field,
                name,
                f"returned {got} for {g} completions of the "
                f"first data.{split} record; a reward returns one number per completion",
            )


def check_writable_dir(flag: str, path: str) -> None:
    """`path`, or the nearest directory above it that exists, is a directory this process may
    write to. The run writes there only once it is built (minutes for a big model): check now.
    os.access: as root only a read-only filesystem fails (root writes past the mode bits)."""
    up = os.path.normpath(path)
    while not os.path.lexists(up):
        up = os.path.dirname(up) or "."
    if not os.path.isdir(up):
        raise UsageError(f"{flag} {path}: {up} is not a directory")
    if not os.access(up, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {up} is not writable")


def prepare_workdir(config, workdir: str) -> bool:
    """Checks the resume settings against the workdir; returns whether to resume. Writes nothing."""
    check_writable_dir("--workdir", workdir)
    saved = os.path.join(workdir, "config.json")
    ckpts = os.path.join(workdir, "checkpoints")
    has_ckpt = os.path.isdir(ckpts) and any(d.isdigit() for d in os.listdir(ckpts))
    if config.resume is False and os.path.exists(saved):
        raise UsageError(f"--workdir {workdir} already holds a run and config.resume=False")
    if config.resume is True and not has_ckpt:
        raise UsageError(f"config.resume=True but {workdir} has no checkpoint")
    if has_ckpt:
        latest = max(int(d) for d in os.listdir(ckpts) if d.isdigit())
        if config.num_steps < latest:
            raise UsageError(
                f"config.num_steps={config.num_steps} is below step {latest} of the checkpoint "
                f"in {workdir}: nothing to resume; use a new --workdir or a larger num_steps"
            )
    if os.path.exists(saved):
        try:
            with open(saved) as f:
                old = json.load(f)
        except (OSError, ValueError) as e:  # (runs write it whole since; an older one cut short)
            raise UsageError(
                f"--workdir {workdir}: its config.json cannot be read ({type(e).__name__}: {e}); "
                "delete it to resume from the checkpoints, or use a new --workdir"
            ) from None
        check_resumable(old, config_json(config))
    return has_ckpt
