"""The bad-input catalogue: each input in CATALOGUE fails with one `error: ` line on stderr that
names the problem, a non-zero exit and no traceback, and changes no file.

Every case runs in its own temporary directory (the working directory) holding `run`, a link to
a finished one-step run (the existing workdir; made in-process on one of the 8 fake devices,
so a case resuming it runs on one too: `devices`), and the case's bad files. The directory, the run
included, is snapshotted (paths, bytes, mtimes) before the command and compared after, so a case
neither changes the run nor creates its `--workdir` / `--out`. docs/bad_inputs.md shows the same
table; `python -m tests.launch.test_bad_inputs --markdown` prints it, and
test_the_doc_is_the_catalogue checks that the doc is up to date.
"""

from __future__ import annotations

import json
import os
import sys
from typing import NamedTuple

import jax
import numpy as np
import pytest

from launch import bench, export, generate, images, make_repo_tasks, train
from launch import eval as eval_
from launch.workdir_lock import LOCK_FILE
from models.sharding import on_devices
from tests.conftest import ROOT, train_here  # (as a script too: the 8 fake devices)

ASSET = os.path.join(ROOT, "configs", "assets", "arithmetic_sft")
MOE_ASSET = os.path.join(ROOT, "configs", "assets", "arithmetic_moe_sft")  # a Qwen3-MoE
DOC = os.path.join(ROOT, "docs", "bad_inputs.md")
EIGHT = ["--config.mesh.data=8"]  # the in-process tests run on the 8 fake devices
RUN = ["--config.num_steps=1", "--config.data.prompts_per_step=2", "--config.data.eval.num=8",
       "--config.eval.pass_k=0"]  # fmt: skip


class Case(NamedTuple):
    id: str
    input: str  # markdown for the doc
    message: str  # the beginning of the error line, after "error: "
    argv: list[str]
    setup: object = None  # setup(monkeypatch) makes the bad files in the working directory
    entry: str = (
        "train"  # launch.<entry>: train, eval, export, bench, images, make_repo_tasks, generate
    )
    workdir: str = "run"  # launch.train's --workdir: the finished run, or a new one ("new")
    devices: int = 8  # the command runs on this many of the fake devices (`run` was made on one)


def write(name: str, data: str | bytes):
    def setup(_):
        os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
        with open(name, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)

    return setup


def ckpt(drop: str = "", files: dict | None = None, source: str = ASSET):
    """ckpt/: `source` (configs/assets/arithmetic_sft; linked) without `drop` and with `files`
    written."""
    files = files or {}

    def setup(_):
        os.mkdir("ckpt")
        for name in sorted(set(os.listdir(source)) - {drop, *files}):
            os.symlink(os.path.join(source, name), os.path.join("ckpt", name))
        for name, data in files.items():
            write(os.path.join("ckpt", name), data(name) if callable(data) else data)(None)

    return setup


def half(name):  # the first half of the asset's file
    with open(os.path.join(ASSET, name), "rb") as f:
        data = f.read()
    return data[: len(data) // 2]


def image(layers=None, drop_layer=False, layer_digest=None):
    """An OCI layout `img` (tests/rl/image_helpers.py) of `layers`, its layer blob deleted or
    stored under another digest."""

    def setup(_):
        from tests.rl.image_helpers import write_oci

        layers_ = layers or [BAD_LAYER]
        write_oci("img", layers_, layer_digests={0: layer_digest} if layer_digest else None)
        if drop_layer:
            os.unlink(os.path.join("img", "blobs", "sha256", _sha_hex(layers_[0])))

    return setup


def _sha_hex(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _layer(name):
    from tests.rl.image_helpers import layer

    return layer([(name, "file", b"x", 0o644)])


BAD_LAYER = _layer("ok")
EVIL_LAYER = _layer("../evil")


def not_an_image(_):
    import tarfile

    with tarfile.open("notimg.tar", "w") as t:
        t.addfile(tarfile.TarInfo("readme"))


def hf_config(source: str = ASSET, **changes):
    """The asset's (`source`'s) config.json with `changes`."""

    def make(name):
        with open(os.path.join(source, name)) as f:
            return json.dumps(dict(json.load(f), **changes))

    return make


def moe_tensors(**extra):
    """The MoE asset's model.safetensors with the `extra` tensors (name: shape) added."""

    def make(name):
        from safetensors.numpy import load_file, save

        tensors = load_file(os.path.join(MOE_ASSET, name))
        return save({**tensors, **{k: np.zeros(v, np.float32) for k, v in extra.items()}})

    return make


def hub_cache(monkeypatch):
    """hub/: an offline Hugging Face Hub cache holding org/tiny (the asset) at `main`."""
    from tests.hub_cache import add_directory, offline_hub

    add_directory(os.path.abspath("hub"), "org/tiny", ASSET, "0" * 40)
    offline_hub(monkeypatch, os.path.abspath("hub"), datasets_cache=os.path.abspath("datasets"))


def hub_partial(monkeypatch):
    """hub_cache, and org/partial at `main`: the asset's config files only (what a --dry_run
    fetches), no weights."""
    from tests.hub_cache import add_snapshot

    hub_cache(monkeypatch)
    files = {n: os.path.join(ASSET, n) for n in ("config.json", "generation_config.json")}
    add_snapshot(os.path.abspath("hub"), "org/partial", files, "1" * 40)


def hub_sharded(monkeypatch):
    """hub_cache, and org/sharded at `main`: the asset with an index naming two shards, the
    second not cached (an interrupted download)."""
    from tests.hub_cache import add_snapshot

    hub_cache(monkeypatch)
    files = {n: os.path.join(ASSET, n) for n in os.listdir(ASSET) if n != "model.safetensors"}
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    files["model-00001-of-00002.safetensors"] = os.path.join(ASSET, "model.safetensors")
    add_snapshot(os.path.abspath("hub"), "org/sharded", files, "2" * 40)


def wandb_no_key(monkeypatch):
    """W&B online (no WANDB_MODE), no WANDB_API_KEY, a HOME without `wandb login`'s netrc, no
    terminal to prompt on (a TPU VM's ssh --command, a notebook's !python)."""
    import tempfile

    import launch.pin

    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # a fresh process's W&B: an offline run earlier in this one left its mode

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_CONFIG_DIR", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", tempfile.mkdtemp(prefix="home-"))  # (outside the case's files)
    monkeypatch.setattr(launch.pin, "_interactive", lambda: False)


def hub_card(monkeypatch):
    """hub_cache, and the dataset org/gsm at `main`: its card only, whose configs are the
    subsets main and socratic (openai/gsm8k's)."""
    from tests.hub_cache import add_snapshot

    hub_cache(monkeypatch)
    card = "---\nconfigs:\n" + "".join(
        f"- config_name: {n}\n  data_files:\n  - split: train\n    path: {n}/train-*\n"
        for n in ("main", "socratic")
    )
    add_snapshot(os.path.abspath("hub"), "org/gsm", {"README.md": (card + "---\n").encode()},
                 "3" * 40, repo_type="dataset")  # fmt: skip


def shadowed(monkeypatch):
    """hub_cache, and an empty directory org/tiny here: a local directory spelled like the id."""
    hub_cache(monkeypatch)
    os.makedirs(os.path.join("org", "tiny"))


def parquet_rows(monkeypatch):
    """data/train.parquet: two arithmetic rows (prompt, answer); datasets' Arrow cache beside the
    working directory (not in it: the case must change nothing there). Skipped without the
    `hub` extra (datasets)."""
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.mkdir("data")
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    pq.write_table(pa.Table.from_pylist(rows), os.path.join("data", "train.parquet"))
    cache = os.path.join(os.path.dirname(os.getcwd()), os.path.basename(os.getcwd()) + "-ds")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)


def parquet_bytes(monkeypatch):
    """parquet_rows, and data/blob.parquet: the rows with a column of bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet_rows(monkeypatch)
    table = pq.read_table(os.path.join("data", "train.parquet"))
    blob = table.append_column("image", pa.array([b"\x89PNG", b"\x89PNG"], pa.binary()))
    pq.write_table(blob, os.path.join("data", "blob.parquet"))


def eval_hub_data(monkeypatch):
    """hub_cache, and evalhub/: the finished run (its checkpoints linked) whose config.json
    reads its held-out prompts from the Hub dataset org/nodata, which the cache lacks."""
    hub_cache(monkeypatch)
    os.mkdir("evalhub")
    os.symlink(os.path.realpath(os.path.join("run", "checkpoints")), "evalhub/checkpoints")
    with open(os.path.join("run", "config.json")) as f:
        config = json.load(f)
    config["data"]["eval"].update(type="hf", path="org/nodata", split="test")
    with open(os.path.join("evalhub", "config.json"), "w") as f:
        json.dump(config, f)


def repo_tasks(swap: str = "|`", problem: str = ""):
    """ckpt/: configs/assets/repo_fix_sft (linked), its character alphabet with swap[0] replaced
    by swap[1] (the repo environment's prompt has a `, never a |); tasks.jsonl: two tasks of
    launch.make_repo_tasks (repos/), the first one's issue `problem` when given."""

    def setup(_):
        from rl.envs.repo.templates import make_tasks

        asset = os.path.join(ROOT, "configs", "assets", "repo_fix_sft")
        os.mkdir("ckpt")
        for name in sorted(set(os.listdir(asset)) - {"char_tokenizer.json"}):
            os.symlink(os.path.join(asset, name), os.path.join("ckpt", name))
        with open(os.path.join(asset, "char_tokenizer.json")) as f:
            tok = json.load(f)
        tok["alphabet"] = tok["alphabet"].replace(*swap) if swap else tok["alphabet"]
        write(os.path.join("ckpt", "char_tokenizer.json"), json.dumps(tok))(None)
        rows = make_tasks(".", 2)
        if problem:
            rows[0]["problem"] = problem
            write("tasks.jsonl", "".join(json.dumps(r) + "\n" for r in rows))(None)

    return setup


def without(module: str):
    """`module` cannot be imported (as where it is not installed)."""

    def setup(monkeypatch):
        monkeypatch.setitem(sys.modules, module, None)

    return setup


def checkpoints_only(_):
    """other/: a workdir holding the finished run's checkpoints and no config.json (copied there)."""
    os.mkdir("other")
    os.symlink(
        os.path.realpath(os.path.join("run", "checkpoints")), os.path.join("other", "checkpoints")
    )


def bad_count_reward(monkeypatch):
    from rl import rewards

    monkeypatch.setitem(rewards.REWARDS, "bad_count", lambda prompts, completions, **_: [1.0])


JSONL = ["--config.data.train.type=jsonl", "--config.data.train.path"]
GOOD = '{"prompt": "1+1=", "answer": "2"}\n'
ENV = EIGHT + ["--config.env.name=calculator"]
ROW = '{"instance_id": "a__b-1", "problem_statement": "p", "FAIL_TO_PASS": "[]"}\n'  # SWE-Gym's
REPO = EIGHT + [
    "--config.model.hf_checkpoint=ckpt",
    "--config.env.name=repo",
    "--config.env.isolation=rlimits",
    *JSONL,
    "tasks.jsonl",
    "--config.data.train.prompt_field=problem",
    "--config.data.eval.type=jsonl",
    "--config.data.eval.path=tasks.jsonl",
    "--config.data.eval.prompt_field=problem",
    "--config.rl.num_generations=2",
    "--config.sampling.num_pages=4096",
]

CATALOGUE = [
    # The command line and the config: parse_args and launch.validate, before anything is built.
    Case("unknown-field", "`--config.rl.num_generation=4` (a typo)", "--config.rl.num_generation: no such config field; did you mean 'rl.num_generations'?", ["--config.rl.num_generation=4"]),
    Case("config-file-missing", "`--config=/nope.py`", "--config: /nope.py does not exist", ["--config=/nope.py"]),
    Case("config-file-syntax-error", "`--config=bad.py`, a config file with a syntax error on line 3", "--config: bad.py:3: invalid syntax", ["--config=bad.py"], write("bad.py", "def get_config():\n    c = {}\n    return c c\n")),
    Case("config-file-name-error", "`--config=bad.py`, whose get_config() uses an undefined name on line 5", "--config: bad.py:5: NameError: name 'foo' is not defined", ["--config=bad.py"], write("bad.py", "import ml_collections\n\n\ndef get_config():\n    return ml_collections.ConfigDict(dict(x=foo))\n")),
    Case("config-file-import-error", "`--config=bad.py`, which imports a module that does not exist", "--config: bad.py:1: ModuleNotFoundError: No module named 'nope'", ["--config=bad.py"], write("bad.py", "import nope\n")),
    Case("config-file-raises", "`--config=bad.py`, which divides by zero on line 2 when it is imported", "--config: bad.py:2: ZeroDivisionError: division by zero", ["--config=bad.py"], write("bad.py", "import ml_collections\nSTEPS = 1 / 0\n")),
    Case("config-not-a-configdict", "`--config=bad.py`, whose get_config() returns a dict", "--config: bad.py: get_config() returned a dict, not an ml_collections.ConfigDict", ["--config=bad.py"], write("bad.py", "def get_config():\n    return {'num_steps': 1}\n")),
    Case("config-is-a-directory", "`--config=cfgs`, a directory of config files", "--config: cfgs is a directory, not a config file (it holds cfgs/a.py)", ["--config=cfgs"], write("cfgs/a.py", "")),
    Case("wrong-type", "`--config.num_steps=abc`", "--config.num_steps=abc: expected int, got str 'abc'", ["--config.num_steps=abc"]),
    Case("float-for-int", "`--config.num_steps=1.5`", "--config.num_steps=1.5: expected int, got float 1.5", ["--config.num_steps=1.5"]),
    Case("negative-num-steps", "`--config.num_steps=-1`", "config.num_steps=-1: must be >= 0", EIGHT + ["--config.num_steps=-1"]),
    Case("zero-learning-rate", "`--config.optim.learning_rate=0`", "config.optim.learning_rate=0.0: must be > 0", EIGHT + ["--config.optim.learning_rate=0"]),
    Case("zero-top-p", "`--config.sampling.top_p=0.0`", "config.sampling.top_p=0.0: must be in (0, 1]", EIGHT + ["--config.sampling.top_p=0.0"]),
    Case("zero-page-size", "`--config.sampling.page_size=0`", "config.sampling.page_size=0: must be >= 1", EIGHT + ["--config.sampling.page_size=0"]),
    Case("zero-steps-per-call", "`--config.sampling.steps_per_call=0`", "config.sampling.steps_per_call=0: must be >= 1", EIGHT + ["--config.sampling.steps_per_call=0"]),
    Case("zero-keep-checkpoints", "`--config.keep_checkpoints=0`", "config.keep_checkpoints=0: must be >= 1", EIGHT + ["--config.keep_checkpoints=0"]),
    Case("negative-advantage-eps", "`--config.rl.advantage_eps=-1.0`", "config.rl.advantage_eps=-1.0: must be >= 0", EIGHT + ["--config.rl.advantage_eps=-1.0"]),
    Case("negative-seed", "`--config.seed=-1`", "config.seed=-1: must be in [0, 2**31)", EIGHT + ["--config.seed=-1"]),
    Case("one-generation", "`--config.rl.num_generations=1`", "config.rl.num_generations=1: GRPO needs G >= 2", EIGHT + ["--config.rl.num_generations=1"]),
    Case("minibatches-do-not-divide", "`--config.rl.minibatches=3`", "config.rl.minibatches=3: B*G = 128 is not divisible", EIGHT + ["--config.rl.minibatches=3"]),
    Case("tis-with-sampler-logp", "`--config.rl.is_correction=tis --config.rl.old_logp=sampler`", "config.rl.is_correction='tis': corrects pi_old against the sampler", EIGHT + ["--config.rl.is_correction=tis", "--config.rl.old_logp=sampler"]),
    Case("mis-band-reversed", "`--config.rl.is_correction=mis --config.rl.mis_low=3.0` (above mis_high = 2.0)", "config.rl.mis_low=3.0: must satisfy 0 <= mis_low < mis_high (2.0)", EIGHT + ["--config.rl.is_correction=mis", "--config.rl.mis_low=3.0"]),
    Case("negative-is-cap", "`--config.rl.is_correction=tis --config.rl.is_cap=-1.0`", "config.rl.is_cap=-1.0: must be > 0", EIGHT + ["--config.rl.is_correction=tis", "--config.rl.is_cap=-1.0"]),
    Case("negative-trust-region", "`--config.rl.trust_region=tv --config.rl.trust_region_low=-0.1`", "config.rl.trust_region_low=-0.1: must be >= 0 (the trust region's half-width)", EIGHT + ["--config.rl.trust_region=tv", "--config.rl.trust_region_low=-0.1"]),
    Case("unknown-is-correction", "`--config.rl.is_correction=tls` (a typo)", "config.rl.is_correction='tls': must be one of none, tis, mis, icepop, auto", EIGHT + ["--config.rl.is_correction=tls"]),
    Case("unknown-backend", "`--config.sampling.backend=nope`", "config.sampling.backend='nope': must be one of", EIGHT + ["--config.sampling.backend=nope"]),
    Case("pages-not-per-shard", "`--config.sampling.num_pages=509` on 8 batch shards", "config.sampling.num_pages=509: a total for the mesh, split evenly over the 8 batch shards (data x fsdp): must divide by 8", EIGHT + ["--config.sampling.num_pages=509"]),
    Case("slots-not-per-shard", "`--config.sampling.num_slots=60` on 8 batch shards", "config.sampling.num_slots=60: a total for the mesh, split evenly over the 8 batch shards (data x fsdp): must divide by 8", EIGHT + ["--config.sampling.num_slots=60"]),
    Case("pool-per-shard-too-small", "`--config.sampling.num_pages=16` on 8 batch shards", "config.sampling.num_pages=16: one group of G = 8 needs up to 16 pages (+ the null page) on one of the 8 batch shards, which holds num_pages / 8 = 2", EIGHT + ["--config.sampling.num_pages=16"]),
    Case("unknown-weights-layout", "`--config.sampling.weights_layout=nope`", "config.sampling.weights_layout='nope': must be one of tensor, training", EIGHT + ["--config.sampling.weights_layout=nope"]),
    Case("unknown-reserve", "`--config.sampling.reserve=nope`", "config.sampling.reserve='nope': must be one of demand, budget", EIGHT + ["--config.sampling.reserve=nope"]),
    Case("watermark-out-of-range", "`--config.sampling.kv_watermark=1.0`", "config.sampling.kv_watermark=1.0: must be in [0, 1) (a fraction of each shard's pages)", EIGHT + ["--config.sampling.kv_watermark=1.0"]),
    Case("pass-n-over-slots", "`--config.eval.pass_n=200`", "config.eval.pass_n=200: more samples per prompt than sampling.num_slots", EIGHT + ["--config.eval.pass_n=200"]),
    Case("stop-id-outside-vocab", "`--config.sampling.stop_ids=(99,)`", "config.sampling.stop_ids=(99,): must be token ids in [0, 17)", EIGHT + ["--config.sampling.stop_ids=(99,)"]),
    Case("lora-negative-rank", "`--config.model.lora.rank=-1`", "config.model.lora.rank=-1: must be an integer >= 0 (0 = off)", EIGHT + ["--config.model.lora.rank=-1"]),
    Case("lora-zero-alpha", "`--config.model.lora.rank=4 --config.model.lora.alpha=0`", "config.model.lora.alpha=0.0: must be > 0", EIGHT + ["--config.model.lora.rank=4", "--config.model.lora.alpha=0"]),
    Case("lora-dropout", "`--config.model.lora.rank=4 --config.model.lora.dropout=0.1`", "config.model.lora.dropout=0.1: only 0 is implemented", EIGHT + ["--config.model.lora.rank=4", "--config.model.lora.dropout=0.1"]),
    Case("lora-hf-target-names", "`--config.model.lora.rank=4 --config.model.lora.targets=\"('q_proj',)\"` (PEFT's module names)", "config.model.lora.targets=('q_proj',): expected a non-empty subset of ('q', 'k', 'v', 'o', 'gate', 'up', 'down')", EIGHT + ["--config.model.lora.rank=4", "--config.model.lora.targets=('q_proj',)"]),
    Case("lora-on-resume", "`--config.model.lora.rank=4` resuming `run` (a full fine-tune) with its other settings", "cannot resume with a changed config (model.lora.rank: 0 -> 4)", RUN + ["--config.model.lora.rank=4"], devices=1),
    Case("lora-targets-on-experts", "`--config.model.lora.rank=4` on configs/moe_tiny.py's checkpoint (a mixture of experts; the default targets name gate, up and down)", "config.model.lora.targets=('q', 'k', 'v', 'o', 'gate', 'up', 'down'): ('gate', 'up', 'down') are the experts' projections in this mixture of experts (frozen; no adapters on experts): use attention targets ('q', 'k', 'v', 'o')", EIGHT + [f"--config.model.hf_checkpoint={MOE_ASSET}", "--config.model.lora.rank=4"]),
    Case("moe-expert-axis-not-dividing", "`--config.mesh.expert=3` (on 6 devices) with configs/moe_tiny.py's checkpoint (8 experts)", "config.mesh.expert=3: does not divide the checkpoint's num_experts = 8", [f"--config.model.hf_checkpoint={MOE_ASSET}", "--config.mesh.data=2", "--config.mesh.expert=3"], devices=6),
    Case("moe-top-k-above-experts", "`--config.model.hf_checkpoint=ckpt`, a Qwen3-MoE config.json with `num_experts_per_tok` 9 of 8 experts", "config.model.hf_checkpoint='ckpt': ckpt/config.json: num_experts_per_tok=9: must be in [1, num_experts = 8]", EIGHT + ["--config.model.hf_checkpoint=ckpt"], ckpt(files={"config.json": hf_config(MOE_ASSET, num_experts_per_tok=9)}, source=MOE_ASSET)),
    Case("moe-shared-experts", "`--config.model.hf_checkpoint=ckpt`, a Qwen3-MoE config.json with shared experts (`shared_expert_intermediate_size` 64)", "config.model.hf_checkpoint='ckpt': ckpt/config.json: shared_expert_intermediate_size=64 is not supported", EIGHT + ["--config.model.hf_checkpoint=ckpt"], ckpt(files={"config.json": hf_config(MOE_ASSET, shared_expert_intermediate_size=64)}, source=MOE_ASSET)),
    Case("moe-unknown-field", "`--config.model.hf_checkpoint=ckpt`, a Qwen3-MoE config.json with a routing field the block does not have (`moe_router_bias`)", "config.model.hf_checkpoint='ckpt': ckpt/config.json: moe_router_bias=True is not a Qwen3-MoE field this reader knows", EIGHT + ["--config.model.hf_checkpoint=ckpt"], ckpt(files={"config.json": hf_config(MOE_ASSET, moe_router_bias=True)}, source=MOE_ASSET)),
    Case("moe-unread-tensor", "`--config.model.hf_checkpoint=ckpt`, a Qwen3-MoE checkpoint holding a shared expert's weight that its config.json does not announce", "ckpt/model.safetensors: tensor 'model.layers.0.mlp.shared_expert.up_proj.weight' is not a weight of the qwen3_moe model its config.json describes", EIGHT + ["--config.model.hf_checkpoint=ckpt"], ckpt(files={"model.safetensors": moe_tensors(**{"model.layers.0.mlp.shared_expert.up_proj.weight": (64, 128)})}, source=MOE_ASSET), workdir="new"),
    Case("mesh-does-not-fit", "`--config.mesh.data=3` on 8 devices", "config.mesh={'data': 3, 'fsdp': 1, 'expert': 1, 'tensor': 1}: uses 3 devices but 8 are available (on a CPU host, JAX_NUM_CPU_DEVICES=3 makes 3)", ["--config.mesh.data=3"]),
    Case("expert-axis-for-dense-model", "`--config.mesh.data=4 --config.mesh.expert=2` (the checkpoint has no experts)", "config.mesh.expert=2: splits a mixture of experts' experts; the checkpoint is a dense model (use 1)", ["--config.mesh.data=4", "--config.mesh.expert=2"]),
    Case("mesh-does-not-divide-batch", "`--config.data.prompts_per_step=3 --config.rl.num_generations=2` on mesh data=8", "config.data.prompts_per_step=3: the global batch B*G = 6 is not divisible by the batch shards data*fsdp = 8", EIGHT + ["--config.data.prompts_per_step=3", "--config.rl.num_generations=2"]),
    Case("unknown-reward", "`--config.rl.rewards={'nope': 1.0}`", "config.rl.rewards='nope': no such reward; registered:", EIGHT + ["--config.rl.rewards={'nope': 1.0}"]),
    Case("unknown-eval-reward", "`--config.eval.reward=nope`", "config.eval.reward='nope': no such reward; registered:", EIGHT + ["--config.eval.reward=nope"]),
    Case("reward-wrong-count", "`--config.rl.rewards={'bad_count': 1.0}`, a registered reward that returns one value for any number of completions", "config.rl.rewards='bad_count': returned shape (1,) for 8 completions of the first data.train record", EIGHT + ["--config.rl.rewards={'bad_count': 1.0}"], bad_count_reward),
    Case("refresh-without-partial", "`--config.rl.refresh_kv_on_update=True` (partial rollouts off)", "config.rl.refresh_kv_on_update=True: re-prefills carried episodes: set rl.partial_rollouts=True too", EIGHT + ["--config.rl.refresh_kv_on_update=True"]),
    Case("unknown-env", "`--config.env.name=nope`", "config.env.name='nope': no such environment", EIGHT + ["--config.env.name=nope"]),
    Case("env-zero-turns", "`--config.env.name=calculator --config.env.max_turns=0`", "config.env.max_turns=0: must be >= 1", ENV + ["--config.env.max_turns=0"]),
    Case("env-turn-over-budget", "`--config.env.name=calculator --config.env.max_turn_tokens=6`", "config.env.max_turn_tokens=6: must be in [0, sampling.max_new_tokens = 5]", ENV + ["--config.env.max_turn_tokens=6"]),
    Case("env-images-dir-missing", "`--config.env.name=calculator --config.env.images_dir=/nope`", "config.env.images_dir='/nope': no such directory (unpack images there: python -m launch.images unpack SRC --out DIR)", ENV + ["--config.env.images_dir=/nope"]),
    Case("env-answer-calls-negative", "`--config.env.name=calculator --config.env.tool_answer_calls=-1`", "config.env.tool_answer_calls=-1: must be >= 0 (0 = each answer as soon as it is done)", ENV + ["--config.env.tool_answer_calls=-1"]),
    Case("data-file-missing", "`data.train.path`: a jsonl file that does not exist", "config.data.train.path='missing.jsonl': no jsonl file there", EIGHT + JSONL + ["missing.jsonl"]),
    Case("checkpoint-missing", "`--config.model.hf_checkpoint=/nope`", "config.model.hf_checkpoint='/nope': not a local directory, nor a Hub repo id ('org/name')", EIGHT + ["--config.model.hf_checkpoint=/nope"]),
    Case("hub-id-missing", "`--config.model.hf_checkpoint=org/missing`, offline (`HF_HUB_OFFLINE=1`), not in the Hub cache", "config.model.hf_checkpoint='org/missing': not a local directory, and not in the Hub cache <cwd>/hub (HF_HUB_OFFLINE=1)", EIGHT + ["--config.model.hf_checkpoint=org/missing"], hub_cache),
    Case("hub-revision-missing", "`--config.model.hf_checkpoint=org/tiny --config.model.revision=v9`, offline, the cache holding `main` only", "config.model.revision='v9': no snapshot of org/tiny for it in the Hub cache (cached refs: ['main']; HF_HUB_OFFLINE=1)", EIGHT + ["--config.model.hf_checkpoint=org/tiny", "--config.model.revision=v9"], hub_cache),
    Case("hub-revision-local", "`--config.model.hf_checkpoint=ckpt --config.model.revision=v2`, ckpt/ a local checkpoint", "config.model.revision='v2': config.model.hf_checkpoint='ckpt' is local, which has no revisions: drop it", EIGHT + ["--config.model.hf_checkpoint=ckpt", "--config.model.revision=v2"], ckpt()),
    Case("hub-id-shadowed", "`--config.model.hf_checkpoint=org/tiny`, an empty directory org/tiny in the working directory (the Hub cache holding org/tiny)", "config.model.hf_checkpoint='org/tiny': has no config.json (org/tiny is the local directory <cwd>/org/tiny, read before the Hub id of that spelling: move it, or run elsewhere, to use the Hub's)", EIGHT + ["--config.model.hf_checkpoint=org/tiny"], shadowed),
    Case("hub-dataset-missing", "`--config.data.train.type=hf --config.data.train.path=org/nodata`, offline, not in the Hub cache", "config.data.train.path='org/nodata': not a local directory, and not in the Hub cache <cwd>/hub (HF_HUB_OFFLINE=1)", EIGHT + ["--config.data.train.type=hf", "--config.data.train.path=org/nodata"], hub_cache),
    Case("hub-dataset-subset-missing", "`--config.data.train.type=hf --config.data.train.path=org/gsm --config.data.train.name=mian`, offline, the card's subsets main and socratic (no data file fetched)", "config.data.train.name='mian': org/gsm: no such subset (it has ['main', 'socratic'])", EIGHT + ["--config.data.train.type=hf", "--config.data.train.path=org/gsm", "--config.data.train.name=mian"], hub_card, workdir="new"),
    Case("hub-snapshot-no-weights", "`--config.model.hf_checkpoint=org/partial`, offline, the cache holding its config files only (what a `--dry_run` fetched)", "config.model.hf_checkpoint='org/partial': the snapshot 1111111111111111111111111111111111111111 has no *.safetensors weights in the Hub cache (it holds what a --dry_run fetched, or part of it): fetch it once without HF_HUB_OFFLINE", EIGHT + ["--config.model.hf_checkpoint=org/partial"], hub_partial, workdir="new"),
    Case("hub-snapshot-shard-missing", "`--config.model.hf_checkpoint=org/sharded`, offline, the cache holding one of the two shards its index names", "config.model.hf_checkpoint='org/sharded': the snapshot 2222222222222222222222222222222222222222 lacks 1 of the 2 shards its model.safetensors.index.json names (model-00002-of-00002.safetensors) in the Hub cache", EIGHT + ["--config.model.hf_checkpoint=org/sharded"], hub_sharded, workdir="new"),
    Case("hf-data-file-missing", "`--config.data.train.type=hf --config.data.train.path=data/tain.parquet` (a typo)", "config.data.train.path='data/tain.parquet': no such data file", EIGHT + ["--config.data.train.type=hf", "--config.data.train.path=data/tain.parquet"], parquet_rows, workdir="new"),
    Case("hf-data-split-missing", "`--config.data.train.type=hf --config.data.train.path=data --config.data.train.split=validation`, data/ holding train.parquet", "config.data.train.split='validation': no such split of data (it has ['train'])", EIGHT + ["--config.data.train.type=hf", "--config.data.train.path=data", "--config.data.train.split=validation"], parquet_rows, workdir="new"),
    Case("hf-data-subset-missing", "`--config.data.train.type=hf --config.data.train.path=data --config.data.train.name=main`, data/ without subsets", "config.data.train.name='main': data: BuilderConfig 'main' not found. Available: ['default']", EIGHT + ["--config.data.train.type=hf", "--config.data.train.path=data", "--config.data.train.name=main"], parquet_rows, workdir="new"),
    Case("hf-data-no-prompt-field", "`--config.data.train.type=hf --config.data.train.path=data/train.parquet --config.data.train.prompt_field=question`, a file without that column", "config.data.train.prompt_field='question': no such column in data/train.parquet split 'train' (columns: ['answer', 'prompt'])", EIGHT + ["--config.data.train.type=hf", "--config.data.train.path=data/train.parquet", "--config.data.train.prompt_field=question"], parquet_rows, workdir="new"),
    Case("hf-data-bytes-column", "`--config.data.train.type=hf --config.data.train.path=data/blob.parquet`, a file with a column of bytes", "config.data.train.path='data/blob.parquet': columns ['image'] hold bytes (binary, or an Image / Audio feature), which a record cannot carry (records are JSON: logged with their completions, read by rewards as a jsonl line is); remove them (datasets' remove_columns, then save_to_disk) and read that", EIGHT + ["--config.data.train.type=hf", "--config.data.train.path=data/blob.parquet"], parquet_bytes, workdir="new"),
    Case("datasets-missing", "`--config.data.train.type=hf`, the `datasets` library not installed", "config.data.train.type='hf': needs the datasets library: pip install -e '.[hub]'", EIGHT + ["--config.data.train.type=hf", "--config.data.train.path=org/data"], without("datasets")),
    Case("wandb-missing", "`--config.log.wandb=True`, the `wandb` library not installed", "config.log.wandb=True: needs the wandb library: pip install -e '.[wandb]' (or pip install wandb)", EIGHT + ["--config.log.wandb=True"], without("wandb")),
    Case("wandb-no-key", "`--config.log.wandb=True`, W&B online, no API key (no `WANDB_API_KEY`, no `wandb login`), no terminal", "config.log.wandb=True: W&B: No API key configured", EIGHT + ["--config.log.wandb=True"], wandb_no_key, workdir="new"),
    Case("checkpoint-config-garbled", "`--config.model.hf_checkpoint=ckpt`, its config.json cut short", "config.model.hf_checkpoint='ckpt': ckpt/config.json: invalid JSON", EIGHT + ["--config.model.hf_checkpoint=ckpt"], ckpt(files={"config.json": '{"architectures": '})),
    Case("checkpoint-unsupported-architecture", "`--config.model.hf_checkpoint=ckpt`, its config.json of a GPT2LMHeadModel (`model_type` gpt2)", "config.model.hf_checkpoint='ckpt': ckpt/config.json: architectures=['GPT2LMHeadModel'] is not supported", EIGHT + ["--config.model.hf_checkpoint=ckpt"], ckpt(files={"config.json": hf_config(model_type="gpt2", architectures=["GPT2LMHeadModel"])})),
    Case("checkpoint-unsupported-model-type", "`--config.model.hf_checkpoint=ckpt`, its config.json with `model_type` gpt2 beside `architectures` LlamaForCausalLM", "config.model.hf_checkpoint='ckpt': ckpt/config.json: model_type='gpt2' with architectures=['LlamaForCausalLM'] is not supported (that architecture's model_type is 'llama'); supported: LlamaForCausalLM (llama), Qwen2ForCausalLM (qwen2), Qwen3ForCausalLM (qwen3)", EIGHT + ["--config.model.hf_checkpoint=ckpt"], ckpt(files={"config.json": hf_config(model_type="gpt2")})),
    Case("workdir-under-a-file", "`--workdir afile/run`, where afile is a file (see below for read-only paths)", "--workdir afile/run: afile is not a directory", EIGHT, write("afile", "x"), workdir="afile/run"),
    # Data and model files: launch.train.prepare, before the new workdir exists.
    Case("data-file-empty", "`data.train.path`: an empty jsonl file", "empty.jsonl: no records (empty jsonl data)", EIGHT + JSONL + ["empty.jsonl"], write("empty.jsonl", ""), workdir="new"),
    Case("data-not-utf8", "`data.train.path`: a jsonl file whose line 2 is Latin-1", "latin1.jsonl:2: not UTF-8 text (invalid continuation byte at byte 15)", EIGHT + JSONL + ["latin1.jsonl"], write("latin1.jsonl", GOOD.encode() + '{"prompt": "caf\xe9=", "answer": "1"}\n'.encode("latin-1")), workdir="new"),
    Case("data-malformed-line", "`data.train.path`: a jsonl file whose line 2 is not JSON", "bad.jsonl:2: not valid JSON (Expecting ',' delimiter: line 1 column 13 (char 12))", EIGHT + JSONL + ["bad.jsonl"], write("bad.jsonl", GOOD + '{"prompt": 1+1=}\n'), workdir="new"),
    Case("data-no-prompt-field", "`data.train.path`: a jsonl record without the prompt field", "noprompt.jsonl:1: no prompt field 'prompt' (the record has ['answer', 'question']); set the source's prompt_field", EIGHT + JSONL + ["noprompt.jsonl"], write("noprompt.jsonl", '{"question": "1+1=", "answer": "2"}\n'), workdir="new"),
    Case("data-prompt-too-long", "`data.train.path`: a jsonl prompt of 9 tokens, over `sampling.max_prompt_len=8`", "a prompt has 9 tokens > config.sampling.max_prompt_len=8 (data.train record 1: '11+11+11=')", EIGHT + JSONL + ["long.jsonl"], write("long.jsonl", GOOD + '{"prompt": "11+11+11=", "answer": "33"}\n'), workdir="new"),
    Case("arithmetic-prompt-too-long", "`--config.sampling.max_prompt_len=3` (the built-in task)", "a prompt has 6 tokens > config.sampling.max_prompt_len=3", EIGHT + ["--config.sampling.max_prompt_len=3"], workdir="new"),
    Case("arithmetic-bad-ops", "`--config.data.train.ops=/`", "ops='/' must be a non-empty string of '+-*'", EIGHT + ["--config.data.train.ops=/"], workdir="new"),
    Case("repo-prompt-too-long", "`--config.env.name=repo --config.sampling.max_prompt_len=1000`, a task whose issue is 68 tokens: with the environment's instructions and tool schemas (rl/envs/repo/tools.py) its prompt is not", "a prompt has 1934 tokens > config.sampling.max_prompt_len=1000 (data.train record 0, instance_id 'task0000_operator_pricing': its 'problem' 'line_total(3, 5) returns 8 instead of 15, so order total... in the 'repo' environment's prompt)", REPO + ["--config.sampling.max_prompt_len=1000"], repo_tasks(), workdir="new"),
    Case("repo-prompt-unencodable", "`--config.env.name=repo`, a task whose issue holds a character (é) the checkpoint's character tokenizer lacks", "data.train record 0, instance_id 'task0000_operator_pricing': its 'problem' cannot be encoded by the tokenizer of config.model.hf_checkpoint='ckpt': character 'é' is not in the CharTokenizer alphabet", REPO + ["--config.sampling.max_prompt_len=2048"], repo_tasks(problem="café prices are wrong"), workdir="new"),
    Case("repo-env-prompt-unencodable", "`--config.env.name=repo`, the checkpoint's character tokenizer without the backquote that the environment's instructions hold (configs/assets/repo_fix_sft's, as it is)", "data.train record 0, instance_id 'task0000_operator_pricing': the 'repo' environment's prompt around its 'problem' (instructions, tool schemas, the chat template) cannot be encoded by the tokenizer of config.model.hf_checkpoint='ckpt': character '`' is not in the CharTokenizer alphabet", REPO + ["--config.sampling.max_prompt_len=2048"], repo_tasks(swap=""), workdir="new"),
    Case("tokenizer-missing", "`--config.model.hf_checkpoint=ckpt`, without char_tokenizer.json (and no tokenizer.json)", "ckpt: no tokenizer (neither char_tokenizer.json nor tokenizer.json)", EIGHT + ["--config.model.hf_checkpoint=ckpt"], ckpt("char_tokenizer.json"), workdir="new"),
    Case("char-tokenizer-garbled", "`--config.model.hf_checkpoint=ckpt`, its char_tokenizer.json cut short", "ckpt/char_tokenizer.json: not valid JSON", EIGHT + ["--config.model.hf_checkpoint=ckpt"], ckpt(files={"char_tokenizer.json": '{"type": "char", "alpha'}), workdir="new"),
    Case("char-tokenizer-no-alphabet", "`--config.model.hf_checkpoint=ckpt`, its char_tokenizer.json `{\"type\": \"char\"}`", "ckpt/char_tokenizer.json: not a valid char tokenizer (KeyError('alphabet'))", EIGHT + ["--config.model.hf_checkpoint=ckpt"], ckpt(files={"char_tokenizer.json": '{"type": "char"}'}), workdir="new"),
    Case("hf-tokenizer-garbled", "`--config.model.hf_checkpoint=ckpt`, a broken tokenizer.json in place of char_tokenizer.json", "ckpt/tokenizer.json: not a valid tokenizer file", EIGHT + ["--config.model.hf_checkpoint=ckpt"], ckpt("char_tokenizer.json", {"tokenizer.json": '{"version": "1.0"}'}), workdir="new"),
    Case("safetensors-truncated", "`--config.model.hf_checkpoint=ckpt`, its model.safetensors cut to half its size", "ckpt/model.safetensors: unreadable safetensors file", EIGHT + ["--config.model.hf_checkpoint=ckpt"], ckpt(files={"model.safetensors": half}), workdir="new"),
    # Resuming: launch.build.restore_latest, once the run is built.
    Case("seed-differs-on-resume", "`--config.seed=1` resuming `other`, a workdir holding `run`'s checkpoints (seed 0) and no config.json", "config.seed=1: the checkpoint in <cwd>/other/checkpoints was written with seed 0; resume with --config.seed=0 or use a new --workdir", ["--config.mesh.data=2", "--config.mesh.tensor=4"] + RUN + ["--config.seed=1"], checkpoints_only, workdir="other"),
    # launch.eval and launch.export on the finished run.
    Case("eval-no-such-step", "`python -m launch.eval --workdir run --step 99`", "--workdir run: no checkpoint at step 99 (have [1])", ["--workdir", "run", "--step", "99"], entry="eval"),
    Case("eval-hub-data-missing", "`python -m launch.eval --workdir evalhub`, its config.json's data.eval the Hub dataset org/nodata, offline, not in the Hub cache", "config.data.eval.path='org/nodata': not a local directory, and not in the Hub cache <cwd>/hub (HF_HUB_OFFLINE=1)", ["--workdir", "evalhub"], eval_hub_data, entry="eval"),
    Case("eval-not-a-run", "`python -m launch.eval --workdir nope`", "--workdir nope: no config.json (not a training run)", ["--workdir", "nope"], entry="eval"),
    Case("export-no-such-step", "`python -m launch.export --workdir run --step 99 --out out`", "--workdir run: no checkpoint at step 99 (have [1])", ["--workdir", "run", "--step", "99", "--out", "out"], entry="export"),
    Case("export-bad-dtype", "`python -m launch.export --workdir run --out out --dtype float8`", "--dtype float8: expected one of ('float32', 'bfloat16', 'float16')", ["--workdir", "run", "--out", "out", "--dtype", "float8"], entry="export"),
    Case("export-into-the-workdir", "`python -m launch.export --workdir run --out run`", "--out run: is the run's workdir (its config.json would be overwritten)", ["--workdir", "run", "--out", "run"], entry="export"),
    Case("export-adapter-of-a-full-run", "`python -m launch.export --workdir run --out out --adapter`, a full fine-tune", "--adapter: the run in run has no LoRA adapters", ["--workdir", "run", "--out", "out", "--adapter"], entry="export"),
    Case("export-out-under-a-file", "`python -m launch.export --workdir run --out afile/hf`, where afile is a file", "--out afile/hf: afile is not a directory", ["--workdir", "run", "--out", "afile/hf"], write("afile", "x"), entry="export"),
    # launch.bench: a benchmark's name and flags, before anything is built or timed.
    Case("bench-unknown", "`python -m launch.bench nope`", "'nope': no such benchmark; expected python -m launch.bench <what> [--help], <what> one of sampler, learn, loop, memory, mesh, quant, replay, plots", ["nope"], entry="bench"),
    Case("bench-length-not-an-int", "`python -m launch.bench memory --tokens=abc`", "--tokens=abc: 'abc' is not an integer >= 1 (expected comma-separated integers >= 1, each once)", ["memory", "--tokens=abc"], entry="bench"),
    Case("bench-length-twice", "`python -m launch.bench memory --tokens=128,128`", "--tokens=128,128: 128 is given twice (comma-separated integers >= 1, each once)", ["memory", "--tokens=128,128"], entry="bench"),
    Case("bench-unknown-shape", "`python -m launch.bench memory --shape=nope`", "--shape=nope: expected one of tiny, small, tiny_moe, qwen2_5_0_5b, qwen2_5_7b, qwen2_5_32b, qwen3_0_6b, qwen3_30b_a3b, llama3_2_1b", ["memory", "--shape=nope"], entry="bench"),
    Case("bench-unknown-phase", "`python -m launch.bench memory --phases=learn,nope`", "--phases=learn,nope: 'nope' is not one of them (comma-separated, each once, of learn, logprobs, prefill)", ["memory", "--phases=learn,nope"], entry="bench"),
    Case("bench-flag-of-another-bench", "`python -m launch.bench memory --quick` (a flag of learn and loop)", "unrecognized arguments: --quick (python -m launch.bench memory --help lists the flags)", ["memory", "--quick"], entry="bench"),
    Case("bench-zero-reps", "`python -m launch.bench learn --reps=0`", "--reps=0: expected an integer >= 1", ["learn", "--reps=0"], entry="bench"),
    Case("bench-output-dir-missing", "`python -m launch.bench learn --output=nope/r.json`", "--output=nope/r.json: <cwd>/nope is not a directory", ["learn", "--output=nope/r.json"], entry="bench"),
    Case("bench-output-is-a-directory", "`python -m launch.bench learn --output=results`, results a directory", "--output=results: is a directory; name the JSON file (e.g. --output=results/bench_learn.json)", ["learn", "--output=results"], lambda _: os.mkdir("results"), entry="bench"),
    Case("bench-output-not-writable", "`python -m launch.bench learn --output=/proc/r.json` (no file can be made there, not even by root)", "--output=/proc/r.json: cannot be written (no such file or directory)", ["learn", "--output=/proc/r.json"], entry="bench"),
    Case("bench-sweep-not-an-int", "`python -m launch.bench sampler --batch_sweep=8,x`", "--batch_sweep=8,x: 'x' is not an integer >= 1 (expected comma-separated integers >= 1, each once)", ["sampler", "--batch_sweep=8,x"], entry="bench"),
    Case("bench-unknown-backend", "`python -m launch.bench sampler --compare_backends=nope`", "--compare_backends=nope: 'nope' is not one of them (comma-separated, each once, of auto, reference, blockwise, cpu_kernel, pallas_gpu, pallas_tpu)", ["sampler", "--compare_backends=nope"], entry="bench"),
    Case("bench-roofline-seqs-indivisible", "`python -m launch.bench sampler --num_seqs=5` (G = 8)", "--num_seqs=5: must be a multiple of --num_samples=8", ["sampler", "--num_seqs=5"], entry="bench"),
    Case("bench-unknown-lengths", "`python -m launch.bench loop --lengths=nope`", "--lengths=nope: expected one of fixed, skewed", ["loop", "--lengths=nope"], entry="bench"),
    Case("bench-partial-fixed-lengths", "`python -m launch.bench loop --partial_rollouts`", "--partial_rollouts: needs --lengths=skewed (got --lengths=fixed)", ["loop", "--partial_rollouts"], entry="bench"),
    Case("bench-capacity-fixed-lengths", "`python -m launch.bench loop --num_slots=32`", "--num_slots / --num_pages: the capacity comparison needs --lengths=skewed and no --partial_rollouts", ["loop", "--num_slots=32"], entry="bench"),
    Case("bench-capacity-pool-too-small", "`python -m launch.bench loop --lengths=skewed --num_pages=100`", "--num_pages=100: the pool must hold one group's worst case, 267 pages + the null page (budget reservation admits a group whole)", ["loop", "--lengths=skewed", "--num_pages=100"], entry="bench"),
    Case("bench-plots-file-missing", "`python -m launch.bench plots --sampler=nope.json`", "--sampler=nope.json: no such file or directory; write it with python -m launch.bench sampler --batch_sweep 8,16,32 --output nope.json", ["plots", "--sampler=nope.json"], entry="bench"),
    Case("bench-plots-out-a-file", "`python -m launch.bench plots --out=afile`, afile a file (--out is a directory)", "--out afile: afile is not a directory", ["plots", "--out=afile"], write("afile", "x"), entry="bench"),
    Case("bench-plots-wrong-json", "`python -m launch.bench plots --sampler=learn.json`, learn.json the JSON of another benchmark", "--sampler=learn.json: no 'batch_sweep' in it; write it with python -m launch.bench sampler --batch_sweep 8,16,32 --output learn.json", ["plots", "--sampler=learn.json"], write("learn.json", '{"device": "cpu", "tokens_per_s": 1.0}'), entry="bench"),
    Case("images-src-missing", "`python -m launch.images unpack nope --out imgs`", "nope: no such file or directory", ["unpack", "nope", "--out", "imgs"], entry="images"),
    Case("images-not-an-image", "`python -m launch.images unpack notimg.tar --out imgs`, a tar of other files", "notimg.tar: no index.json + oci-layout (OCI layout) or manifest.json (docker save)", ["unpack", "notimg.tar", "--out", "imgs"], not_an_image, entry="images"),
    Case("images-layer-missing", "`python -m launch.images unpack img --out imgs`, img an OCI layout without its layer blob", f"img: blobs/sha256/{_sha_hex(BAD_LAYER)}: No such file or directory", ["unpack", "img", "--out", "imgs"], image(drop_layer=True), entry="images"),
    Case("images-digest-mismatch", "`python -m launch.images unpack img --out imgs`, its layer's bytes not its digest", f"img: layer 0 (blobs/sha256/{'0' * 64}): layer digest mismatch (sha256:{_sha_hex(BAD_LAYER)[:16]}... != sha256:{'0' * 16}...)", ["unpack", "img", "--out", "imgs"], image(layer_digest="sha256:" + "0" * 64), entry="images"),
    Case("images-hostile-member", "`python -m launch.images unpack img --out imgs`, a layer member ../evil", f"img: layer 0 (blobs/sha256/{_sha_hex(EVIL_LAYER)}): member '../evil' escapes the root", ["unpack", "img", "--out", "imgs"], image([EVIL_LAYER]), entry="images"),
    # usage errors of the entry points on argparse (launch.cli.ArgumentParser) and launch.generate
    Case("eval-no-workdir", "`python -m launch.eval` (no --workdir)", "the following arguments are required: --workdir (python -m launch.eval --help lists the flags)", [], entry="eval"),
    Case("generate-flags-missing", "`python -m launch.generate --prompts p.jsonl`", "the following arguments are required: --hf_checkpoint, --output (python -m launch.generate --help lists the flags)", ["--prompts", "p.jsonl"], entry="generate"),
    Case("generate-prompts-missing", "`python -m launch.generate --hf_checkpoint ckpt --prompts missing.jsonl --output out.jsonl`, no such file", "--prompts: missing.jsonl does not exist", ["--hf_checkpoint", "ckpt", "--prompts", "missing.jsonl", "--output", "out.jsonl"], entry="generate"),
    Case("images-unknown-flag", "`python -m launch.images unpack img --out imgs --nope`", "unrecognized arguments: --nope (python -m launch.images --help lists the flags)", ["unpack", "img", "--out", "imgs", "--nope"], entry="images"),
    # launch.make_repo_tasks --from_rows: the rows, before anything is written under --out.
    Case("repo-tasks-none-convert", "`python -m launch.make_repo_tasks --out out --from_rows rows.jsonl`, no row with a FAIL_TO_PASS test", "--from_rows='rows.jsonl': none of its 1 rows converts (the first: a__b-1: FAIL_TO_PASS is empty)", ["--out", "out", "--from_rows", "rows.jsonl"], write("rows.jsonl", ROW), entry="make_repo_tasks"),
    Case("repo-tasks-rows-missing", "`python -m launch.make_repo_tasks --out out --from_rows missing.jsonl`, no such file", "--from_rows='missing.jsonl': no such file", ["--out", "out", "--from_rows", "missing.jsonl"], entry="make_repo_tasks"),
]  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished one-step run, made once per module in-process on one device."""
    workdir = str(tmp_path_factory.mktemp("finished") / "run")
    assert train_here(RUN + ["--workdir", workdir]) == 0
    return workdir


def snapshot(top: str) -> dict:
    """{path: (bytes, mtime)} of every file and directory under top, links followed; but a
    workdir's run.lock, which names the last run that held it (launch/workdir_lock.py)."""
    out = {}
    for root, dirs, files in os.walk(top, followlinks=True):
        for name in dirs + [f for f in files if f != LOCK_FILE]:
            path = os.path.join(root, name)
            data = None if os.path.isdir(path) else open(path, "rb").read()
            out[path] = (data, os.stat(path).st_mtime_ns)
    return out


# The `repo` environment's cases pass its start-up check of the sandbox first (launch.train), in
# REPO's isolation.
SANDBOXED = lambda c: (
    [pytest.mark.repo_sandbox(isolation="rlimits")] if "--config.env.name=repo" in c.argv else []
)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=SANDBOXED(c)) for c in CATALOGUE])
def test_bad_input(case, finished_run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    os.symlink(finished_run, "run")
    if case.setup:
        case.setup(monkeypatch)
    argv = case.argv + (["--workdir", case.workdir] if case.entry == "train" else [])
    before = snapshot(".")
    mains = {
        "train": train,
        "eval": eval_,
        "export": export,
        "bench": bench,
        "images": images,
        "make_repo_tasks": make_repo_tasks,
        "generate": generate,
    }
    with on_devices(jax.devices()[: case.devices]):
        try:
            rc = mains[case.entry].main(argv)
        except SystemExit as e:  # argparse's usage errors (launch.cli.ArgumentParser)
            rc = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    assert lines[-1].startswith(f"error: {case.message.replace('<cwd>', os.getcwd())}"), err
    assert len(lines) == 1, err
    assert snapshot(".") == before


def markdown() -> str:
    """The catalogue as the doc's table."""
    rows = ["| case | input | --workdir | message (its beginning) |", "| --- | --- | --- | --- |"]
    for c in CATALOGUE:
        workdir = c.workdir if c.entry == "train" else "(in the command)"
        cells = [c.id, c.input, workdir, f"`error: {c.message}`"]
        rows.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    return "\n".join(rows) + "\n"


def test_the_doc_is_the_catalogue():
    with open(DOC) as f:
        rows = [ln for ln in f.read().splitlines() if ln.startswith("| ")]
    assert rows == markdown().splitlines(), (
        "docs/bad_inputs.md is out of date: python -m tests.launch.test_bad_inputs --markdown"
    )
    assert len(CATALOGUE) >= 25 and len({c.id for c in CATALOGUE}) == len(CATALOGUE)


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m tests.launch.test_bad_inputs --markdown")
    print(markdown(), end="")
