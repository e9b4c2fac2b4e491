"""Whether a saved run may resume under a new config: which fields may change, and the defaults
that stand in for fields a run saved before they existed never had.

`launch.validate.prepare_workdir` calls `check_resumable` with the workdir's config.json and the
run's config; a field that can change the trajectory and differs refuses the resume, naming it.
"""

from __future__ import annotations

import glob
import json
import os

from launch.cli import UsageError
from rl.mismatch import resolve_correction
from rl.sandbox import isolation_of

# Fields that cannot change the trajectory of a run: a resumed run may change them (model.revision
# may, as the commit it resolves to, model.hf_commit, is checked itself). env.isolation
# is host policy (how model-written code is contained on this machine), not part of the
# trajectory: a run moved to a host without bubblewrap resumes with --config.env.isolation=rlimits.
# env.images_dir is where this host keeps the unpacked images (the records name them).
# env.max_masked_* only say when a run that trains on nothing stops.
RESUMABLE_CHANGES = (
    "num_steps",
    "checkpoint_every",
    "keep_checkpoints",
    "resume",
    "log_every",
    "eval_every",
    "num_samples_logged",
    "distributed",
    "heartbeat_timeout_s",
    "eval.",
    "data.eval.",
    "env.isolation",
    "env.images_dir",
    "log.",
    "model.revision",
    "env.max_masked_fraction",
    "env.max_masked_steps",
)

# Fields added with Hub ids (models/hub.py, rl/sources.py's "hf" sources): a run saved before them
# resumes while they hold these values (a local checkpoint directory), and data.train.name and
# revision whatever they hold while data.train.type is not "hf" (they are read by "hf" only).
# data.train.hf_commit (launch.pin.pin_data) is compared as model.hf_commit is, the revision
# then free to change; a run saved before it existed resumes unchecked.
HUB_DEFAULTS = (("model", "revision", ""), ("model", "hf_commit", ""))
DATA_DEFAULTS = {"name": "", "revision": ""}


# The repo environment's fields' defaults (configs/default.py): the values rl/envs/repo/env.py used
# before they were config fields, so a run saved without them resumes when they still hold those
# values (check_resumable). Their least values are launch.validate.REPO_ENV_MINIMA.
REPO_ENV_DEFAULTS = {
    "command_timeout_s": 30.0,
    "max_tool_calls": 40,
    "workspace_bytes": 256 << 20,
    "test_timeout_s": 300.0,
    "per_test_timeout_s": 30,
    "setup_timeout_s": 300.0,
    "sandbox_memory_bytes": 4 << 30,
    "sandbox_processes": 64,
}


# The trust region's fields (issue 53), off in a run saved before them.
TRUST_REGION_DEFAULTS = {"trust_region": "none", "trust_region_low": 0.2, "trust_region_high": 0.2}
# Rollout routing replay (issue 52 item 4): the routers route in a run saved before it, and no
# load-balancing loss was in its loss.
REPLAY_DEFAULTS = {"routing_replay": "none", "router_aux_loss_coef": 0.0}


PARTIAL_DEFAULTS = {
    "partial_rollouts": False,
    "extra_groups": 4,
    "max_staleness": 4,
    "refresh_kv_on_update": False,
}


def with_saved_defaults(saved: dict) -> dict:
    """A saved run's config.json with the fields it predates filled in with the values that run
    had (the defaults above; optim.grad_reduce_dtype: its model.dtype), so that it can be built
    again by this code (`launch.build.load_run`: launch.eval, launch.export, launch.generate)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    fills = [("rl", {**TRUST_REGION_DEFAULTS, **REPLAY_DEFAULTS, **PARTIAL_DEFAULTS})]
    fills += [("env", REPO_ENV_DEFAULTS)] if "env" in out else []
    fills += [(section, {field: default}) for section, field, default in HUB_DEFAULTS]
    dtype = out.get("model", {}).get("dtype", "float32")
    fills += [("optim", {"grad_reduce_dtype": dtype})]  # summed in the compute dtype before
    for section, defaults in fills:
        if section in out:
            out[section] = {**defaults, **out[section]}
    return out


def changed_fields(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two config dicts."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_fields(a, b, name + ".")
        elif a != b:
            out.append(name)
    return out


def check_resumable(old: dict, new: dict, hint: bool = True) -> None:
    """Refuses a resume whose config changes a field that can change the trajectory. A run
    saved before config.model.lora existed had none: it resumes with LoRA off. One saved before
    config.model.attention existed ran dense attention: it resumes with the attention asked for
    (the same function; "auto" may round differently on rows over one block). Likewise one
    saved before sampling.prefill_chunk existed prefilled unchunked: it resumes chunked, and one
    saved before sampling.weights_layout decoded from the training layout: it resumes with the
    layout asked for (the same weights, the matmuls partitioned otherwise), and one saved before
    sampling.reserve and kv_watermark reserved budgets: it resumes with the reserve asked for. One
    saved before the partial-rollout fields existed resumes with them at their defaults
    (partial rollouts off). One saved before env.tool_answer_calls existed took each tool answer
    as soon as it was done (0): it resumes with the value asked for, as a partial run under
    that rule never repeated itself (its carry followed the tools' latency), so no trajectory of
    it is lost, and a synchronous one does not depend on it. One saved with env.sandbox_bwrap (renamed env.isolation) resumes
    with the isolation it meant (None: "auto", True: "bwrap", False: "rlimits"), and one saved
    before either existed with "auto"; env.isolation itself may change (RESUMABLE_CHANGES).
    One saved before optim.grad_reduce_dtype existed summed its gradients in model.dtype: it
    resumes with that value (a bf16 run asked to resume in float32 is refused, the flag named).
    With `hint`, a refusal names the flags that restore the saved values where they let it resume
    (a GSM8K run from before its config read openai/gsm8k: its checkpoint directory and jsonl
    files). Such a run is not resumed on the Hub ids by itself: a local jsonl file need not hold
    the Hub's rows in the Hub's order, nor a local directory the Hub's weights."""
    if "optim" in old and "grad_reduce_dtype" not in old["optim"]:  # summed in the compute dtype
        dtype = old.get("model", {}).get("dtype", "float32")
        old = {**old, "optim": {**old["optim"], "grad_reduce_dtype": dtype}}
    saved, asked = old, new
    if "env" in old and "isolation" not in old["env"]:
        env = {k: v for k, v in old["env"].items() if k != "sandbox_bwrap"}
        old = {**old, "env": {**env, "isolation": isolation_of(old["env"])}}
    if "lora" not in old.get("model", {}) and not new.get("model", {}).get("lora", {}).get("rank"):
        new = _without(new, "model", "lora")
    for section, field in (
        ("model", "attention"),
        ("sampling", "prefill_chunk"),
        ("sampling", "weights_layout"),
        ("sampling", "reserve"),
        ("sampling", "kv_watermark"),
        ("env", "tool_answer_calls"),
    ):
        if field not in old.get(section, {}):
            new = _without(new, section, field)
    if "expert" not in old.get("mesh", {}) and new.get("mesh", {}).get("expert") == 1:
        new = _without(new, "mesh", "expert")  # saved before the expert axis: none (size 1)
    if isinstance(old.get("rules"), list) and isinstance(new.get("rules"), list):
        saved_names = {r[0] for r in old["rules"]}  # before the experts' rules: no experts
        new = {
            **new,
            "rules": [r for r in new["rules"] if r[0] in saved_names or r[0] not in MOE_RULES],
        }
    for field, default in {**TRUST_REGION_DEFAULTS, **REPLAY_DEFAULTS}.items():  # not there before
        if field not in old.get("rl", {}) and new.get("rl", {}).get(field) == default:
            new = _without(new, "rl", field)
    if _correction(old) is not None and _correction(old) == _correction(new):
        # "auto" (the default since issue 53) is what it resolves to: a run saved with "none"
        # (the default before) resumes under "auto" while its rollout is not quantised.
        new = {**new, "rl": {**new["rl"], "is_correction": old["rl"]["is_correction"]}}
    for field, default in PARTIAL_DEFAULTS.items():  # synchronous rollouts before
        if field not in old.get("rl", {}) and new.get("rl", {}).get(field) == default:
            new = _without(new, "rl", field)
    for field, default in REPO_ENV_DEFAULTS.items():  # read with these defaults before
        if field not in old.get("env", {}) and new.get("env", {}).get(field) == default:
            new = _without(new, "env", field)
    for section, field, default in HUB_DEFAULTS:
        if field not in old.get(section, {}) and new.get(section, {}).get(field) == default:
            new = _without(new, section, field)
    train, old_train = new.get("data", {}).get("train", {}), old.get("data", {}).get("train", {})
    for field, default in DATA_DEFAULTS.items():  # only "hf" sources read them
        if field not in old_train and (train.get(field) == default or train.get("type") != "hf"):
            train = _without({"t": train}, "t", field)["t"]
    if "hf_commit" not in old_train:  # a run from before data commits were pinned: unchecked
        train = _without({"t": train}, "t", "hf_commit")["t"]
    elif old_train["hf_commit"]:  # the commit is compared (_check_commit), not the revision
        train = {**train, "revision": old_train.get("revision")}
    if "data" in new:
        new = {**new, "data": {**new["data"], "train": train}}
    for where in PATH_FIELDS:
        new = _same_path(old, new, where)
    _check_commit(old, new)
    _check_commit(old, new, "data", "train", "path")
    # data.eval may change on resume (another held-out set), but the same Hub dataset at another
    # commit would change the held-out rows under the same name: checked as the train data's.
    old_eval, new_eval = (c.get("data", {}).get("eval", {}) for c in (old, new))
    if all(old_eval.get(k) == new_eval.get(k) for k in ("type", "path", "name", "split")):
        _check_commit(old, new, "data", "eval", "path")
    # f + ".": a section absent from an old run (`log`) matches its prefix ("log.") too
    diff = [f for f in changed_fields(old, new) if not (f + ".").startswith(RESUMABLE_CHANGES)]
    if diff:
        details = ", ".join(f"{f}: {_get(old, f)!r} -> {_get(new, f)!r}" for f in diff)
        flags = _restoring_flags(saved, asked, diff) if hint else ""
        raise UsageError(
            f"cannot resume with a changed config ({details}); use a new --workdir"
            + (f", or resume with the saved values: {flags}" if flags else "")
        )


# Local paths a resumed run may spell otherwise while they name the same file or directory.
PATH_FIELDS = ("model.hf_checkpoint", "data.train.path")


def _same_path(old: dict, new: dict, dotted: str) -> dict:
    """new with the path at `dotted` spelled as in old when both name the same existing file or
    directory (a relative one resolved from the working directory, as the run reads it): a run
    started as `--config configs/default.py` resumes as `--config /abs/.../configs/default.py`,
    whose config derives its checkpoint's path from its own (`ASSETS`). A path that no longer
    exists, or another copy of the same files, is still a change."""
    was, now = _get(old, dotted), _get(new, dotted)
    if not (isinstance(was, str) and isinstance(now, str) and was and now) or was == now:
        return new
    if glob.has_magic(was) or glob.has_magic(now):  # a data glob: compared as written
        return new
    try:
        if not os.path.samefile(was, now):
            return new
    except OSError:  # either is missing (a Hub id, a glob, a moved checkout)
        return new
    out = json.loads(json.dumps(new))
    _put(out, dotted, was)
    return out


def _restoring_flags(old: dict, new: dict, fields: list[str]) -> str:
    """The --config flags that set the changed `fields` that hold a plain value in the saved
    config back to it, if the run then resumes (a field absent from the old run, such as
    data.train.name, may then drop out); else ""."""
    import shlex

    flags, restored = [], json.loads(json.dumps(new))
    for f in fields:
        value = _get(old, f)
        if isinstance(value, (str, int, float, bool)):
            flags.append(f"--config.{f}={shlex.quote(str(value))}")
            _put(restored, f, value)
    try:
        check_resumable(old, restored, hint=False)
    except UsageError:
        return ""
    return " ".join(flags)


def _check_commit(old: dict, new: dict, *where: str) -> None:
    """The Hub commit that config.model.hf_checkpoint (launch.pin.pin_model), or with
    `where` ("data", "train", "path") config.data.train.path (pin_data; data.eval's alike),
    resolved to is the one
    the run started from: a snapshot that changed under the same id and revision (a moved
    branch, a re-filled cache) would change the weights under the checkpoints, or the rows
    under the data iterator's state."""
    *section, field = where or ("model", "hf_checkpoint")
    was, now = (
        _get(old, ".".join([*section, "hf_commit"])),
        _get(new, ".".join([*section, "hf_commit"])),
    )
    if was == now or not was:  # the same snapshot, or a local directory before (compared as such)
        return
    name = ".".join(["config", *section, field])
    revision = ".".join(["config", *section, "revision"])
    raise UsageError(
        f"{name}={_get(new, '.'.join([*section, field]))!r} resolves to commit "
        f"{now or '(a local directory)'}, but this run started from commit {was}; resume with "
        f"--{revision}={was} or use a new --workdir"
    )


# the logical axes of a mixture of experts' weights (models/moe.py), added to the rules with them
MOE_RULES = ("experts", "expert_mlp")


def _correction(config: dict) -> str | None:
    """The mismatch correction a config dict's rl.is_correction means ("auto" resolved)."""
    rl, sampling = config.get("rl", {}), config.get("sampling", {})
    if "is_correction" not in rl:
        return None
    dtypes = (sampling.get("cache_dtype", ""), sampling.get("weights_dtype", ""))
    return resolve_correction(rl["is_correction"], *dtypes, rl.get("old_logp", "recompute"))


def _without(config: dict, section: str, field: str) -> dict:
    """config (a nested dict) without config[section][field], if there is one."""
    if field not in config.get(section, {}):
        return config
    return {**config, section: {k: v for k, v in config[section].items() if k != field}}


def _put(d: dict, dotted: str, value) -> None:
    """d[a][b][c] = value for dotted "a.b.c", in place, the sections made where missing."""
    *sections, field = dotted.split(".")
    for part in sections:
        d = d.setdefault(part, {})
    d[field] = value


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d
