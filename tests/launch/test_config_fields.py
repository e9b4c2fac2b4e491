"""Every field of LossConfig, LearnerConfig, EngineConfig and SamplingParams can be set from the
command line (`--config.<section>.<field>=...`), arrives in the object the run builds, and is
documented with a comment in configs/default.py."""

import dataclasses
import os

import pytest

from launch.cli import DEFAULT_CONFIG, UsageError, config_json, parse_args
from launch.validate import engine_config, learner_config, validate
from rl.learner import LearnerConfig
from rl.losses import LossConfig
from sampling.distribution import SamplingParams
from sampling.engine import EngineConfig

EOS = (2,)
# A value each field accepts, different from its default. Numbers are derived from the default.
CHOICES = {
    "policy_loss": "cispo", "kl_estimator": "k2", "kl_in": "reward",
    "aggregation": "seq_mean_token_sum", "is_correction": "tis", "is_level": "sequence",
    "old_logp": "sampler", "backend": "blockwise", "cache_dtype": "bfloat16", "stop_ids": (61, 62),
    "weights_dtype": "float32", "weights_layout": "training", "reserve": "budget",
    "grad_reduce_dtype": "bfloat16", "trust_region": "tv", "routing_replay": "rollout",
}  # fmt: skip


def _fields(cls):
    """Leaf field names of cls, nested dataclasses expanded."""
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or f.name in ("sampling", "loss"):
            continue  # LearnerConfig.sampling / .loss: walked as SamplingParams / LossConfig
        out.append((cls, f.name))
    return out


# EngineConfig.interpret runs the Pallas kernels op by op on a CPU: a test switch, not a run's;
# EngineConfig.record_routes follows rl.routing_replay and the model (launch.validate.records_routes).
FIELDS = sorted(
    {name for cls in (LossConfig, LearnerConfig, EngineConfig, SamplingParams)
     for _, name in _fields(cls)} - {"interpret", "record_routes"}
)  # fmt: skip


def _new_value(name, old):
    if name in CHOICES:
        return CHOICES[name]
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return old + 3
    if isinstance(old, float):
        return old * 0.5 if old else 0.25
    raise AssertionError(f"no test value for {name}={old!r}")


def _built(config):
    """The four objects a run builds from a config, by class."""
    learner = learner_config(config, EOS)
    return {
        LearnerConfig: learner, LossConfig: learner.loss, SamplingParams: learner.sampling,
        EngineConfig: engine_config(config, EOS),
    }  # fmt: skip


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_is_settable_from_the_command_line(name):
    default = parse_args([], {})[0]
    sections = [s for s in ("rl", "optim", "sampling") if name in default[s]]
    assert len(sections) == 1, f"{name} is in config sections {sections}: expected exactly one"
    dotted = f"{sections[0]}.{name}"
    value = _new_value(name, default[sections[0]][name])
    text = repr(value) if not isinstance(value, str) else value
    config = parse_args([f"--config.{dotted}={text}"], {})[0]
    built = _built(config)
    holders = [cls for cls in built if name in {f.name for f in dataclasses.fields(cls)}]
    assert holders
    for cls in holders:
        got = getattr(built[cls], name)
        if name == "stop_ids":
            assert set(value) <= set(got) and set(EOS) <= set(got), got
        else:
            assert got == value, (cls.__name__, name, got, value)


def test_every_field_is_documented_in_the_default_config():
    with open(DEFAULT_CONFIG) as f:
        lines = f.read().splitlines()
    for name in FIELDS:
        rows = [ln for ln in lines if f".{name} = " in ln]
        assert rows, f"{name} is not set in {os.path.basename(DEFAULT_CONFIG)}"
        assert all("#" in ln for ln in rows), rows


@pytest.mark.parametrize(
    "override, message",
    [
        ("sampling.temperature=0.0", "config.sampling.temperature=0.0: a rollout needs temperature > 0"),
        ("sampling.top_p=1.5", "config.sampling.top_p=1.5: must be in (0, 1]"),
        ("rl.eps_low=1.5", "config.rl.eps_low=1.5: must be in [0, 1)"),
        ("rl.kl_estimator=k1", "config.rl.kl_estimator='k1': k1 in the loss has zero expected gradient"),
        ("rl.kl_in=reward", "config.rl.kl_estimator='k3': kl_in='reward' folds k1"),
        ("optim.b1=-1.0", "config.optim.b1=-1.0"),
        ("sampling.min_new_tokens=9", "config.sampling.min_new_tokens=9: must be in [0, sampling.max_new_tokens = 5]"),
        ("sampling.weights_dtype=bfloat16", "config.sampling.weights_dtype='bfloat16': a decode copy must be in model.dtype = 'float32'"),
        ("sampling.weights_dtype=int4", "config.sampling.weights_dtype='int4': must be '', float32, bfloat16, float16, int8 or float8_e4m3fn"),
        ("optim.grad_reduce_dtype=bfloat16", "config.optim.grad_reduce_dtype='bfloat16': must be 'float32' or model.dtype = 'float32'"),
        ("optim.grad_reduce_dtype=f32", "config.optim.grad_reduce_dtype='f32': must be 'float32' or model.dtype = 'float32'"),
    ],
)  # fmt: skip
def test_bad_values_name_the_config_field(override, message):
    config = parse_args([f"--config.{override}", "--config.rl.kl_coef=0.04"], {})[0]
    with pytest.raises(UsageError) as e:
        validate(config, 1)
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([], "config.rl.is_correction='auto': means none on an unquantised rollout, and partial rollouts"),
        (["rl.is_correction=none"], "config.rl.is_correction='none': partial rollouts train on tokens of older policies"),
        (["sampling.cache_dtype=int8", "rl.extra_groups=0"], "config.rl.extra_groups=0"),  # auto: tis
        (["rl.is_correction=tis", "rl.extra_groups=0"], "config.rl.extra_groups=0: must be in [1, data.prompts_per_step=16]"),
        (["rl.is_correction=mis", "rl.max_staleness=0"], "config.rl.max_staleness=0: must be >= 1"),
        (["rl.is_correction=tis", "sampling.min_new_tokens=1"], "config.sampling.min_new_tokens=1: must be 0"),
    ],
)  # fmt: skip
def test_partial_rollout_settings_are_checked(overrides, message):
    args = ["--config.rl.partial_rollouts=True", *(f"--config.{o}" for o in overrides)]
    with pytest.raises(UsageError) as e:
        validate(parse_args(args, {})[0], 1)
    assert str(e.value).startswith(message), str(e.value)


def test_a_run_saved_before_partial_rollouts_resumes():
    from launch.resume_compat import PARTIAL_DEFAULTS, check_resumable

    new = config_json(parse_args([], {})[0])
    old = {**new, "rl": {k: v for k, v in new["rl"].items() if k not in PARTIAL_DEFAULTS}}
    check_resumable(old, new)
    on = config_json(parse_args(["--config.rl.partial_rollouts=True"], {})[0])
    with pytest.raises(UsageError, match="rl.partial_rollouts"):
        check_resumable(old, on)


def test_a_run_saved_before_grad_reduce_dtype_resumes_summing_in_its_compute_dtype():
    """Before optim.grad_reduce_dtype, gradients were summed in model.dtype: a float32 run
    resumes with the default, a bfloat16 one with bfloat16, and is refused with the default,
    the flag that resumes it named."""
    from launch.resume_compat import check_resumable

    for dtype, ok, refused in (("float32", "float32", None), ("bfloat16", "bfloat16", "float32")):
        flags = [f"--config.model.dtype={dtype}"]
        new = config_json(parse_args(flags, {})[0])
        old = {**new, "optim": {k: v for k, v in new["optim"].items() if k != "grad_reduce_dtype"}}
        asked = [*flags, f"--config.optim.grad_reduce_dtype={ok}"]
        check_resumable(old, config_json(parse_args(asked, {})[0]))
        if refused:
            asked = [*flags, f"--config.optim.grad_reduce_dtype={refused}"]
            with pytest.raises(UsageError) as e:
                check_resumable(old, config_json(parse_args(asked, {})[0]))
            assert "optim.grad_reduce_dtype: 'bfloat16' -> 'float32'" in str(e.value)
            assert "--config.optim.grad_reduce_dtype=bfloat16" in str(e.value)


def test_repo_env_fields_are_documented_read_validated_and_resumable():
    """The repo environment's fields: set with a comment in configs/default.py to the defaults
    rl/envs/repo/env.py reads them with, checked at start-up, and a run saved before they existed
    resumes while they keep those values."""
    from launch.resume_compat import REPO_ENV_DEFAULTS, check_resumable

    with open(DEFAULT_CONFIG) as f:
        lines = f.read().splitlines()
    with open(
        os.path.join(os.path.dirname(DEFAULT_CONFIG), "..", "rl", "envs", "repo", "env.py")
    ) as f:
        env_source = f.read()
    default = parse_args([], {})[0]
    for name, value in REPO_ENV_DEFAULTS.items():
        rows = [ln for ln in lines if f"c.env.{name} = " in ln]
        assert len(rows) == 1 and "#" in rows[0], (name, rows)
        assert default.env[name] == value, name
        assert f'e.get("{name}", ' in env_source, name
    for override, message in [
        ("env.sandbox_processes=0", "config.env.sandbox_processes=0: must be >= 1"),
        ("env.isolation=yes", "config.env.isolation='yes': expected one of ('auto', 'bwrap', "),
    ]:
        config = parse_args([f"--config.{override}", "--config.env.name=calculator"], {})[0]
        with pytest.raises(UsageError) as e:
            validate(config, 1)
        assert str(e.value).startswith(message), str(e.value)
    new = default.to_dict()
    old = {**new, "env": {k: v for k, v in new["env"].items() if k not in REPO_ENV_DEFAULTS}}
    check_resumable(old, new)
    new["env"]["test_timeout_s"] = 5.0
    with pytest.raises(UsageError, match="env.test_timeout_s"):
        check_resumable(old, new)


@pytest.mark.parametrize("bwrap, isolation", [(None, "auto"), (True, "bwrap"), (False, "rlimits"),
                                              ("absent", "auto")])  # fmt: skip
def test_a_run_saved_with_sandbox_bwrap_resumes_with_the_isolation_it_meant(bwrap, isolation):
    """env.sandbox_bwrap became env.isolation: a saved config.json with the old field (or, older,
    with neither) resumes under the isolation it meant; and, host policy rather than part of the
    trajectory, under another one too (a run saved with the old default resumes with
    --config.env.isolation=rlimits on a host without bubblewrap)."""
    from launch.resume_compat import check_resumable

    new = config_json(parse_args([f"--config.env.isolation={isolation}"], {})[0])
    env = {k: v for k, v in new["env"].items() if k != "isolation"}
    old = {**new, "env": env if bwrap == "absent" else {**env, "sandbox_bwrap": bwrap}}
    check_resumable(old, new)
    other = "rlimits" if isolation != "rlimits" else "auto"
    changed = config_json(parse_args([f"--config.env.isolation={other}"], {})[0])
    check_resumable(old, changed)
    changed["env"]["max_tool_calls"] = 1  # a trajectory field is still refused, and alone named
    with pytest.raises(UsageError, match=r"config \(env.max_tool_calls: \d+ -> 1\); use"):
        check_resumable(old, changed)


def test_a_run_saved_before_tool_answer_calls_resumes_with_the_value_asked_for():
    """Saved before env.tool_answer_calls existed (answers as soon as done, a carry that did not
    repeat itself): it resumes under any value; a run saved with the field keeps its value."""
    from launch.resume_compat import check_resumable

    new = config_json(parse_args(["--config.env.tool_answer_calls=2"], {})[0])
    old = {**new, "env": {k: v for k, v in new["env"].items() if k != "tool_answer_calls"}}
    check_resumable(old, new)
    check_resumable(old, {**new, "env": {**new["env"], "tool_answer_calls": 0}})
    with pytest.raises(UsageError, match=r"env.tool_answer_calls: 2 -> 4"):
        check_resumable(new, config_json(parse_args([], {})[0]))


def test_unpacked_rows_of_a_batch_shard_must_divide_by_the_minibatches():
    """rl.pack=False: each batch shard's B/S*G sequences are its learner rows, split over the
    minibatches (`rl.rollout`), so the minibatches must divide them, not only B*G (B=4, G=2 on 4
    batch shards: 2 rows a shard; 4 minibatches failed in the first step's packing)."""
    mesh = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
    run = [*mesh, "--config.data.prompts_per_step=4", "--config.rl.num_generations=2",
           "--config.rl.pack=False"]  # fmt: skip
    config = parse_args([*run, "--config.rl.minibatches=4"], {})[0]
    with pytest.raises(UsageError) as e:
        validate(config, 8)
    assert str(e.value).startswith(
        "config.rl.minibatches=4: with rl.pack=False each of the 4 batch shards fills one "
        "learner row per sequence, B/4*G = 2 rows"
    ), str(e.value)
    validate(parse_args([*run, "--config.rl.minibatches=2"], {})[0], 8)
    validate(parse_args([*run, "--config.rl.minibatches=4", "--config.data.prompts_per_step=8"],
                        {})[0], 8)  # fmt: skip


def test_a_path_spelled_otherwise_resumes_when_it_names_the_same_files(tmp_path, monkeypatch):
    """model.hf_checkpoint and data.train.path may be spelled otherwise on resume (relative and
    absolute, through a symlink) while they name the same existing directory or file; another
    directory, a copy of the same files, or a path that is gone is still refused, named."""
    from launch.resume_compat import check_resumable

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "copy").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ckpt")
    (tmp_path / "train.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)

    def config(ckpt, data="train.jsonl"):
        flags = [f"--config.model.hf_checkpoint={ckpt}", f"--config.data.train.path={data}"]
        return config_json(parse_args(flags, {})[0])

    old = config("ckpt")
    for same in (str(tmp_path / "ckpt"), "link", "./ckpt/", str(tmp_path / "link")):
        check_resumable(old, config(same, str(tmp_path / "train.jsonl")))
    for other in ("copy", str(tmp_path / "gone")):
        with pytest.raises(UsageError, match="model.hf_checkpoint: 'ckpt' -> "):
            check_resumable(old, config(other))
    with pytest.raises(UsageError, match="data.train.path"):
        check_resumable(old, config("ckpt", "other.jsonl"))
    (tmp_path / "train*.jsonl").write_text("{}\n")  # a glob is compared as written
    with pytest.raises(UsageError, match="data.train.path"):
        check_resumable(
            config("ckpt", "train*.jsonl"), config("ckpt", str(tmp_path / "train*.jsonl"))
        )
    gone = config(str(tmp_path / "moved_away"))  # saved under a path that no longer exists
    with pytest.raises(UsageError, match="model.hf_checkpoint"):
        check_resumable(gone, config("ckpt"))
