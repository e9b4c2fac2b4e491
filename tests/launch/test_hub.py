"""Models and data by Hub id, offline, and W&B logging (issue 36).

A Hub cache laid out as huggingface_hub lays it out (tests/hub_cache.py) holds, under the real ids,
tiny stand-ins: `Qwen/Qwen2.5-0.5B-Instruct` is the Qwen2 fixture with a small BPE tokenizer
(tests/launch/test_real_configs.py) at commit A on `main`, and at commit B (weights doubled) on
the tag `v2`; `openai/gsm8k` is four GSM8K-style rows as parquet, laid out as on the Hub (README
configs, subset `main`, splits train / test). With HF_HUB_OFFLINE=1 the README's real-model
commands run as written, with the sizes test_real_configs uses, in one shared run: it trains by
the ids, logs to W&B offline, resumes under the same W&B run, is refused once the snapshot under
`main` changed, and launch.eval / export / generate read the same ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import ROOT, process_cache
from tests.hub_cache import LISTINGS, add_directory, add_snapshot, offline_hub

datasets = pytest.importorskip("datasets")

MODEL, DATASET = "Qwen/Qwen2.5-0.5B-Instruct", "openai/gsm8k"
A, B, D = (hashlib.sha1(x).hexdigest() for x in (b"A", b"B", b"D"))
# test_real_configs' fixture sizes (the 8 fake devices as data=2, fsdp=2, tensor=2)
TINY = [
    "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
    "--config.data.prompts_per_step=4", "--config.rl.num_generations=2",
    "--config.rl.micro_batches=1", "--config.sampling.max_prompt_len=64",
    "--config.sampling.max_new_tokens=8", "--config.sampling.num_slots=8",
    "--config.sampling.page_size=8", "--config.sampling.num_pages=64",
    "--config.sampling.steps_per_call=4", "--config.rl.overlong_buffer=4",
    "--config.eval.pass_k=1", "--config.eval.pass_n=1",
]  # fmt: skip
GSM8K_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
"""


def gsm8k_repo(directory, rows) -> None:
    """openai/gsm8k's layout: README configs, main/{train,test}-00000-of-00001.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.join(directory, "main"))
    for split in ("train", "test"):
        path = os.path.join(directory, "main", f"{split}-00000-of-00001.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
    with open(os.path.join(directory, "README.md"), "w") as f:
        f.write(GSM8K_CARD)


def doubled(src, dst) -> None:
    """A copy of checkpoint directory src whose weights are doubled (another snapshot)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    save_file({k: v * 2 for k, v in load_file(path).items()}, path)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The offline Hub cache (this process and its subprocesses), the working directory a
    scratch directory; yields it."""
    from tests.launch.test_real_configs import DATA, _stand_in

    top = tmp_path_factory.mktemp("hub")
    ckpt, _ = _stand_in("qwen2", top)
    doubled(ckpt, top / "doubled")
    gsm8k_repo(top / "gsm8k", DATA)
    cache = top / "cache"
    add_directory(cache, MODEL, ckpt, A, refs=("main",))
    add_directory(cache, MODEL, top / "doubled", B, refs=("v2",))
    add_directory(cache, DATASET, top / "gsm8k", D, refs=("main",), repo_type="dataset")
    with pytest.MonkeyPatch.context() as mp:
        offline_hub(mp, cache)
        work = top / "work"  # the README's commands run from the repository root: its configs/
        work.mkdir()
        os.symlink(os.path.join(ROOT, "configs"), work / "configs")
        mp.chdir(work)
        yield top


def test_revision_picks_the_snapshot(hub):
    """model.revision: "" (main) is commit A, the tag v2 and commit B itself are B; the weights
    read are those of the snapshot (B's are A's doubled)."""
    import jax

    from models.hf import load_hf
    from models.hub import resolve
    from models.sharding import flatten, make_mesh

    a, b = resolve(MODEL), resolve(MODEL, "v2")
    assert a[1] == A and b[1] == B and resolve(MODEL, B) == b
    assert a[0].endswith(f"snapshots/{A}") and b[0].endswith(f"snapshots/{B}")
    mesh = make_mesh({}, devices=jax.devices()[:1])
    pa, pb = (flatten(load_hf(d, mesh)[2]) for d, _ in (a, b))
    for k in pa:
        np.testing.assert_array_equal(np.asarray(pb[k]), 2 * np.asarray(pa[k]), err_msg=k)


def test_a_sharded_checkpoint_is_fetched_for_the_shards_its_index_names(tmp_path, monkeypatch):
    """A sharded repo laid out as Mistral's (the index's shards, and consolidated.safetensors and
    a subfolder's safetensors besides, in the repo's listing): the loader's files are its
    config, index, tokenizer and the shards the index names, so a cache holding those (what
    transformers fetches) resolves offline, where a '*.safetensors' pattern asked for the rest
    (huggingface_hub's listing check refused it as incomplete; online it fetched them: 14 GB
    more for Mistral-7B). A missing shard is one line naming it."""
    from models.hub import HubError, resolve

    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    files = {"config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode(),
             "model-00001-of-00002.safetensors": b"1", "model-00002-of-00002.safetensors": b"2",
             "tokenizer.json": b"{}"}  # fmt: skip
    listed = ["consolidated.safetensors", "fp8/model.safetensors", "tokenizer.model", "README.md"]
    snapshot = add_snapshot(tmp_path, "org/sharded", files, A, listed=listed)
    offline_hub(monkeypatch, tmp_path)
    assert resolve("org/sharded") == (snapshot, A)
    os.remove(os.path.join(snapshot, "model-00002-of-00002.safetensors"))
    with pytest.raises(HubError) as e:
        resolve("org/sharded")
    assert str(e.value) == (
        f"config.model.hf_checkpoint='org/sharded': the snapshot {A} lacks 1 of the 2 shards its "
        "model.safetensors.index.json names (model-00002-of-00002.safetensors) in the Hub cache "
        "(it holds what a --dry_run fetched, or part of it): fetch it once without HF_HUB_OFFLINE"
    )
    # what a --dry_run fetched, with the listing: huggingface_hub names the missing files
    add_snapshot(
        tmp_path,
        "org/dry",
        {"config.json": b"{}"},
        B,
        listed=["tokenizer.json", "model.safetensors"],
    )
    with pytest.raises(HubError) as e:
        resolve("org/dry")
    assert str(e.value) == (
        "config.model.hf_checkpoint='org/dry': the cached snapshot is incomplete, 1 file(s) are "
        "missing (tokenizer.json) (HF_HUB_OFFLINE=1): fetch it once without HF_HUB_OFFLINE"
        if LISTINGS  # (an older huggingface_hub keeps no listing: the weights are found missing)
        else f"config.model.hf_checkpoint='org/dry': the snapshot {B} has no *.safetensors "
        "weights in the Hub cache (it holds what a --dry_run fetched, or part of it): fetch it "
        "once without HF_HUB_OFFLINE"
    )


@pytest.mark.parametrize(
    "error, message",
    [
        ("RepositoryNotFoundError", "config.model.hf_checkpoint='org/x' (config.model.revision='v1'): not a local directory, and no such model repo on the Hub (or it is private: set HF_TOKEN)"),
        ("GatedRepoError", "config.model.hf_checkpoint='org/x' (config.model.revision='v1'): a gated repo; accept its terms on huggingface.co and set HF_TOKEN (or `hf auth login`)"),
        ("RevisionNotFoundError", "config.model.revision='v1': no such revision of org/x on the Hub"),
    ],
)  # fmt: skip
def test_hub_errors_online_are_one_line(error, message, monkeypatch):
    """The Hub's answers for a missing repo, a gated one without a token and a missing revision
    (raised here by a stand-in for snapshot_download: there is no network) become one line."""
    import httpx
    import huggingface_hub
    from huggingface_hub import errors

    from models.hub import HubError, resolve

    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/x"))

    def refuse(*_, **__):
        raise getattr(errors, error)("the Hub's message", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(HubError) as e:
        resolve("org/x", "v1")
    assert str(e.value) == message


def test_a_revision_of_a_local_path_is_refused(tmp_path):
    """A revision given with a local directory or data file is one line naming both fields (it
    was dropped silently: a local directory spelled like the id was read whatever revision the
    user asked for)."""
    from models.hub import HubError, resolve
    from rl.sources import hub_dataset_dir

    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "rows.parquet").write_bytes(b"")
    with pytest.raises(HubError, match=r"^--revision='v2': --hf_checkpoint='.*/org/name' is "
                       r"local, which has no revisions: drop it$"):  # fmt: skip
        resolve(str(tmp_path / "org" / "name"), "v2", field="--hf_checkpoint",
                revision_field="--revision")  # fmt: skip
    with pytest.raises(HubError, match=r"^revision='v2': data source path='.*rows.parquet' is "
                       r"local, which has no revisions: drop it$"):  # fmt: skip
        hub_dataset_dir(str(tmp_path / "rows.parquet"), "v2")


def test_a_failed_download_is_one_line(monkeypatch):
    """A connection that drops mid-download (httpx's ReadTimeout, raised here by a stand-in for
    snapshot_download) or a full disk is one line naming the field, not a traceback."""
    import errno

    import httpx
    import huggingface_hub

    from models.hub import HubError, resolve

    for error in (httpx.ReadTimeout("The read operation timed out"),
                  OSError(errno.ENOSPC, "No space left on device")):  # fmt: skip

        def drop(*_, error=error, **__):
            raise error

        monkeypatch.setattr(huggingface_hub, "snapshot_download", drop)
        with pytest.raises(HubError) as e:
            resolve("org/x")
        assert str(e.value) == (
            f"config.model.hf_checkpoint='org/x': the download failed ({type(error).__name__}: "
            f"{error}); run again to continue it (the files already fetched are kept)"
        )


def test_resume_checks_the_commit_and_old_runs_resume():
    """launch.resume_compat: a run saved before the Hub fields (no model.revision / hf_commit,
    no log section, no data.train.name / revision) resumes; log.* and model.revision may change;
    another commit under the same id is refused in one line naming both."""
    from launch.cli import UsageError, config_json, parse_args
    from launch.resume_compat import check_resumable

    new = config_json(parse_args([], {})[0])
    old = json.loads(json.dumps(new))
    del old["model"]["revision"], old["model"]["hf_commit"], old["log"]
    del old["data"]["train"]["name"], old["data"]["train"]["revision"]
    check_resumable(old, new)
    pinned = json.loads(json.dumps(new))
    pinned["model"].update(hf_checkpoint=MODEL, hf_commit=A)
    moved = json.loads(json.dumps(pinned))
    moved["model"].update(hf_commit=B, revision="v2")
    moved["log"].update(wandb=True, wandb_tags=["x"])
    check_resumable(pinned, {**moved, "model": {**moved["model"], "hf_commit": A}})
    with pytest.raises(UsageError, match=f"resolves to commit {B}, but this run started from "
                       f"commit {A}; resume with --config.model.revision={A}"):  # fmt: skip
        check_resumable(pinned, moved)


def test_only_process_0_logs_to_wandb(tmp_path, monkeypatch):
    """RunLogger on a process other than 0 (enabled=False) starts no W&B run and writes nothing,
    even with log.wandb; wandb.init is never called there."""
    import wandb

    from launch.cli import parse_args
    from launch.logger import RunLogger

    monkeypatch.setattr(wandb, "init", lambda **_: pytest.fail("wandb.init on process 1"))
    config = parse_args(["--config.log.wandb=True"], {})[0]
    log = RunLogger(str(tmp_path), enabled=False, config=config)
    log.scalars(1, {"loss": 1.0})
    log.close()
    assert log.wandb is None and os.listdir(tmp_path) == []


def test_a_moved_id_is_refused_before_its_weights_are_fetched(tmp_path, monkeypatch, capsys):
    """A resume whose Hub id now resolves to another commit is refused, naming both commits,
    with only that commit's config files fetched: launch.train pins the commit from the config
    files, checks the resume, then fetches the weights (here the new commit has none cached: a
    weights fetch first said 'has no *.safetensors weights' instead, and online downloaded the
    new commit's weights before the refusal)."""
    from launch import train
    from launch.cli import config_json, parse_args

    asset = os.path.join(ROOT, "configs", "assets", "arithmetic_sft")
    files = {n: os.path.join(asset, n) for n in ("config.json", "generation_config.json")}
    add_snapshot(tmp_path / "hub", "org/m", files, B)  # main moved to B, config files only
    offline_hub(monkeypatch, tmp_path / "hub")
    argv = ["--config.mesh.data=8", "--config.model.hf_checkpoint=org/m"]
    saved = config_json(parse_args(argv, {})[0])
    saved["model"]["hf_commit"] = A  # the run started from commit A
    os.makedirs(tmp_path / "run" / "checkpoints" / "1")
    (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
    assert train.main([*argv, "--workdir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: config.model.hf_checkpoint='org/m' resolves to commit {B}, but this run started "
        f"from commit {A}; resume with --config.model.revision={A} or use a new --workdir"
    ]


def test_a_moved_dataset_is_refused_before_its_files_are_fetched(tmp_path, monkeypatch, capsys):
    """A resume whose Hub dataset now resolves to another commit is refused, naming both
    commits, before any of that commit's data files is fetched: here the new commit's card is
    cached but not its parquet files (validation fetched the subset's files first, and offline
    said they were missing instead of refusing the resume)."""
    from launch import train
    from launch.cli import config_json, parse_args

    card = GSM8K_CARD.encode()
    add_snapshot(
        tmp_path / "hub", "org/data", {"README.md": card}, B, refs=("main",), repo_type="dataset"
    )
    offline_hub(monkeypatch, tmp_path / "hub")
    argv = [
        "--config.mesh.data=8",
        "--config.data.train.type=hf",
        "--config.data.train.path=org/data",
        "--config.data.train.name=main",
    ]
    saved = config_json(parse_args(argv, {})[0])
    saved["data"]["train"]["hf_commit"] = A  # the run started from commit A
    os.makedirs(tmp_path / "run" / "checkpoints" / "1")
    (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
    assert train.main([*argv, "--workdir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: config.data.train.path='org/data' resolves to commit {B}, but this run started "
        f"from commit {A}; resume with --config.data.train.revision={A} or use a new --workdir"
    ]


def test_process_0s_error_reaches_the_others_whole_characters(monkeypatch):
    """launch.pin.agreed broadcasts process 0's error in 1,024 bytes: a message cut at 1,000
    bytes in the middle of a two-byte character failed to decode on the other processes
    (UnicodeDecodeError); it is cut on a character boundary. Two processes are faked: the
    broadcast returns process 0's buffer."""
    from jax.experimental import multihost_utils

    from launch import pin
    from launch.cli import UsageError

    monkeypatch.setattr(pin.jax, "process_count", lambda: 2)
    monkeypatch.setattr(pin.jax, "process_index", lambda: 0)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: x)
    text = "x" + "é" * 700  # 1,401 bytes: the 1,000th byte is the first of an "é"

    def refuse(_):
        raise UsageError(text)

    with pytest.raises(UsageError) as e:
        pin.agreed(refuse, "")
    assert text.startswith(str(e.value)) and len(str(e.value).encode()) == 999


def test_a_failing_wandb_init_is_one_line(tmp_path, monkeypatch):
    """wandb.init failing after the start-up check (the server unreachable, the key refused)
    is a UsageError of one line naming log.wandb (launch.train prints it and stops), not
    wandb's traceback."""
    import wandb

    from launch.cli import UsageError, parse_args
    from launch.logger import RunLogger

    def refuse(**_):
        raise wandb.errors.CommError("Run initialization has timed out after 90.0 sec.\nPlease...")

    monkeypatch.setattr(wandb, "init", refuse)
    config = parse_args(["--config.log.wandb=True"], {})[0]
    with pytest.raises(UsageError) as e:
        RunLogger(str(tmp_path), config=config)
    assert str(e.value) == (
        "config.log.wandb=True: W&B: Run initialization has timed out after 90.0 sec. Please... "
        "(set WANDB_API_KEY or run `wandb login` first, or WANDB_MODE=offline to log locally "
        "and `wandb sync` later)"
    )


def test_a_run_id_held_by_an_inherited_wandb_service_stops_at_once(tmp_path, monkeypatch):
    """Resuming a run whose W&B run id is held by the W&B service this process inherited
    (WANDB_SERVICE: the parent uses W&B and started the killed run too) stops at once with a
    line that names WANDB_SERVICE; no wait for a process that will not go away."""
    import wandb

    from launch.cli import UsageError, parse_args
    from launch.logger import RunLogger

    calls = []

    def held(**_):
        calls.append(1)
        raise wandb.errors.CommError("run ID s53jl06i is in use")

    (tmp_path / "wandb_run_id").write_text("s53jl06i")
    monkeypatch.setattr(wandb, "init", held)
    monkeypatch.setenv("WANDB_SERVICE", "3-1-unix-/tmp/wandb-1-2-3/socket")
    config = parse_args(["--config.log.wandb=True"], {})[0]
    with pytest.raises(UsageError) as e:
        RunLogger(str(tmp_path), config=config)
    assert len(calls) == 1
    assert str(e.value).startswith(
        "config.log.wandb=True: W&B run s53jl06i is still in use by the W&B service this "
        "process inherited (WANDB_SERVICE is set"
    )


def readme_commands() -> list[list[str]]:
    """The README's real-model quick start (the block after `<!-- hub quick start -->`), one
    argv per command, `python -m` and line continuations removed, comments dropped."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split("<!-- hub quick start -->", 1)[1].split("```bash\n", 1)[1].split("```")[0]
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            assert words[:2] == ["python", "-m"], line
            out.append(words[2:])
    return out


def tb_scalars(workdir) -> dict[int, dict[str, np.float32]]:
    """{step: {tag: value}} of the run's TensorBoard event files (float32, as written)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out: dict = {}
    events = os.path.join(workdir, "tensorboard")
    for name in sorted(os.listdir(events)):
        for event in EventFileLoader(os.path.join(events, name)).Load():
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "scalars":
                    value = tensor_util.make_ndarray(v.tensor)
                    out.setdefault(event.step, {})[v.tag] = np.float32(value)
    return out


def wandb_history(run_dir) -> dict[int, dict]:
    """{step: {key: value}} of an offline W&B run's history, read back from its .wandb log with
    W&B's own reader (`wandb leet inspect --json`)."""
    exe = os.path.join(os.path.dirname(sys.executable), "wandb")
    out = subprocess.run([exe, "leet", "inspect", "--json", str(run_dir)], capture_output=True,
                         text=True, timeout=120, check=True).stdout  # fmt: skip
    rows: dict = {}
    for line in out.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            item = record["history"]["item"]
            rows.setdefault(item["_step"], {}).update(
                {k: v for k, v in item.items() if not k.startswith("_")}
            )
    return rows


@pytest.mark.slow
def test_readme_commands_by_hub_id(hub, capsys, monkeypatch):
    """The README's real-model commands as written (plus test_real_configs' sizes), offline."""
    from launch import eval as eval_
    from launch import export, generate, train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    entry = {"launch.train": train, "launch.eval": eval_, "launch.export": export,
             "launch.generate": generate}  # fmt: skip
    commands = readme_commands()
    assert [c[0] for c in commands] == [
        "launch.train", "launch.train", "launch.eval", "launch.export", "launch.generate"
    ]  # fmt: skip
    assert "--dry_run" in commands[0] and MODEL in commands[4]
    workdir = commands[1][commands[1].index("--workdir") + 1]
    with open("prompts.jsonl", "w") as f:  # launch.generate's input
        f.write(json.dumps({"prompt": "Tom has 3 apples"}) + "\n")
    steps = ["--config.num_steps=2", "--config.log.wandb=True"]
    for argv in commands:
        extra = TINY + steps if argv[0] == "launch.train" else []
        assert entry[argv[0]].main(argv[1:] + extra) == 0, argv
    out = capsys.readouterr().out
    assert "estimated peak per device" in out  # the --dry_run

    # trained by the ids; the commit is recorded in config.json and summary.json
    config = json.load(open(os.path.join(workdir, "config.json")))
    summary = json.load(open(os.path.join(workdir, "summary.json")))
    assert config["model"]["hf_checkpoint"] == MODEL and config["model"]["hf_commit"] == A
    assert config["data"]["train"]["path"] == DATASET and summary["hf_commit"] == A
    assert config["data"]["train"]["hf_commit"] == D and summary["data_hf_commit"] == D
    assert config["data"]["eval"]["hf_commit"] == D  # what launch.eval reads the rows at
    assert summary["steps"] == 2
    # launch.eval printed its JSON, launch.export wrote the checkpoint, generate its samples
    assert json.loads(out.strip().splitlines()[-2])["step"] == 2
    assert os.path.exists("exported/model.safetensors") and os.path.exists(
        "exported/tokenizer.json"
    )
    assert len(open("out.jsonl").read().splitlines()) == 4  # --num_samples 4 of one prompt

    # W&B: steps 0-2 hold the TensorBoard scalars, at float32
    run_id = open(os.path.join(workdir, "wandb_run_id")).read()
    runs = sorted(os.listdir(os.path.join(workdir, "wandb")))
    runs = [r for r in runs if r.startswith("offline-run-")]
    assert len(runs) == 1 and runs[0].endswith(run_id)
    history, tb = wandb_history(os.path.join(workdir, "wandb", runs[0])), tb_scalars(workdir)
    assert sorted(tb) == [0, 1, 2] and sorted(history) == [0, 1, 2]
    for step in (0, 1, 2):
        assert set(history[step]) == set(tb[step]), step
        for tag, value in tb[step].items():
            assert np.float32(history[step][tag]) == value, (step, tag)
    assert "loss" in tb[1] and "eval/accuracy" in tb[0]

    # a resumed run continues the same W&B run
    train_argv = commands[1][1:] + TINY + ["--config.num_steps=3", "--config.log.wandb=True"]
    assert train.main(train_argv) == 0
    assert "resumed from step 2" in capsys.readouterr().err
    runs = sorted(r for r in os.listdir(os.path.join(workdir, "wandb")) if r.startswith("off"))
    assert len(runs) == 2 and all(r.endswith(f"-{run_id}") for r in runs)
    resumed = wandb_history(os.path.join(workdir, "wandb", runs[1]))
    assert 3 in resumed and resumed[3]["loss"] == np.float32(tb_scalars(workdir)[3]["loss"])

    # the snapshot under `main` changed: the resume is refused, in one line, the run untouched
    ref = os.path.join(os.environ["HF_HUB_CACHE"], "models--Qwen--Qwen2.5-0.5B-Instruct", "refs")
    shutil.copy(os.path.join(ref, "v2"), os.path.join(ref, "main"))
    try:
        assert train.main(commands[1][1:] + TINY + ["--config.num_steps=4"]) == 2
    finally:
        add_snapshot(os.environ["HF_HUB_CACHE"], MODEL, {}, A, refs=("main",))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: config.model.hf_checkpoint='{MODEL}' resolves to commit {B}, but "
                   f"this run started from commit {A}; resume with --config.model.revision={A} "
                   "or use a new --workdir"]  # fmt: skip
    assert json.load(open(os.path.join(workdir, "config.json")))["model"]["hf_commit"] == A


# The CPU demo (configs/default.py) reading its training prompts from a save_to_disk directory.
KILL_STEPS = 4
DEMO = [
    f"--config.num_steps={KILL_STEPS}", "--config.checkpoint_every=1",
    "--config.data.prompts_per_step=4", "--config.rl.num_generations=4",
    "--config.data.eval.num=8", "--config.eval.pass_k=0", "--config.eval_every=0",
    "--config.sampling.num_slots=32", "--config.sampling.num_pages=128",
    "--config.rl.kl_coef=0.04", "--config.data.train.type=hf",
]  # fmt: skip


@pytest.mark.slow
def test_kill9_resume_on_a_saved_dataset_is_exact(tmp_path, capsys):
    """A run on a `save_to_disk` dataset (the demo's arithmetic records), killed with SIGKILL in
    the step after a checkpoint committed and run again, ends bitwise equal to a straight run:
    the grain iterator over the Arrow rows resumes where the checkpoint left it. The killed run
    is a one-device subprocess; the straight run and the resume run in this process on one of
    its 8 fake devices (tests.conftest.train_here: the same programs, so bitwise the same run),
    the resume reading the killed run's checkpoint from disk."""
    from rl.tasks import arithmetic_records
    from tests.conftest import train_here, train_metrics
    from tests.launch.test_train import _latest

    saved = tmp_path / "saved"
    datasets.Dataset.from_list(arithmetic_records(seed=0, num=64)).save_to_disk(str(saved))

    def args(workdir):
        return [f"--workdir={workdir}", *DEMO, f"--config.data.train.path={saved}"]

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert train_here(args(straight)) == 0
    with open(tmp_path / "kill.log", "w") as log:
        cmd = [sys.executable, "-m", "launch.train", *args(killed)]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
        while proc.poll() is None and _latest(killed) < 1:
            time.sleep(0.01)  # polling files another process writes; nothing is timed
        time.sleep(0.05)  # into the next step's rollout
        assert proc.poll() is None, open(tmp_path / "kill.log").read()[-3000:]
        proc.kill()
        proc.wait()
    assert 1 <= _latest(killed) < KILL_STEPS
    capsys.readouterr()
    assert train_here(args(killed)) == 0
    assert "resumed from step" in capsys.readouterr().err
    a, b = (json.load(open(w / "summary.json")) for w in (straight, killed))
    assert a["params_fingerprint"] == b["params_fingerprint"]
    assert train_metrics(straight) == train_metrics(killed)
    assert sorted(train_metrics(killed)) == list(range(1, KILL_STEPS + 1))


def test_adapter_of_a_hub_run_names_the_base_commit():
    """launch.export --adapter of a run started from a Hub id writes the id with the commit the
    run started from (peft's `revision`, which AutoPeftModel loads the base at), not the default
    branch; a local directory stays an absolute path without a revision."""
    from launch.cli import parse_args
    from launch.export import adapter_base
    from models import lora
    from models.hf_config import config_from_hf

    hub_run = parse_args([f"--config.model.hf_checkpoint={MODEL}", f"--config.model.hf_commit={B}",
                          "--config.model.revision=v2"], {})[0]  # fmt: skip
    assert adapter_base(hub_run) == (MODEL, B)
    local = parse_args([], {})[0]
    assert adapter_base(local) == (os.path.abspath(local.model.hf_checkpoint), None)
    cfg = config_from_hf(local.model.hf_checkpoint, lora_rank=2)
    written = lora.peft_config(cfg, MODEL, B)  # peft.PeftConfig's fields of these names
    assert (written["base_model_name_or_path"], written["revision"]) == (MODEL, B)


def test_an_old_gsm8k_run_is_told_the_flags_that_resume_it():
    """A GSM8K run from before its config read the Hub ids (a local checkpoint directory and
    jsonl files; no model.revision / hf_commit, data.train.name / revision, log section) is not
    resumed on the ids (a jsonl file need not hold the Hub's rows in its order): the refusal names
    the flags that restore the saved values, and with them it resumes."""
    from launch.cli import UsageError, config_json, parse_args
    from launch.resume_compat import check_resumable

    gsm8k = ["--config", os.path.join(ROOT, "configs", "qwen2_5_0_5b_gsm8k.py")]
    new = config_json(parse_args(gsm8k, {})[0])
    old = json.loads(json.dumps(new))
    del old["model"]["revision"], old["model"]["hf_commit"], old["log"]
    old["model"]["hf_checkpoint"] = "/home/me/models/Qwen2.5-0.5B-Instruct"
    train = {k: v for k, v in old["data"]["train"].items() if k not in ("name", "revision")}
    old["data"]["train"] = {**train, "type": "jsonl", "path": "/home/me/gsm8k/train set.jsonl"}
    flags = ["--config.data.train.path=/home/me/gsm8k/train set.jsonl",
             "--config.data.train.type=jsonl",
             "--config.model.hf_checkpoint=/home/me/models/Qwen2.5-0.5B-Instruct"]  # fmt: skip
    with pytest.raises(UsageError) as e:
        check_resumable(old, new)
    assert str(e.value).startswith("cannot resume with a changed config (data.train.name: None")
    assert str(e.value).endswith(
        "; use a new --workdir, or resume with the saved values: --config.data.train.path="
        "'/home/me/gsm8k/train set.jsonl' --config.data.train.type=jsonl "
        "--config.model.hf_checkpoint=/home/me/models/Qwen2.5-0.5B-Instruct"
    )
    check_resumable(old, config_json(parse_args(gsm8k + flags, {})[0]))
    with pytest.raises(UsageError, match=r"data.train.type: 'jsonl' -> 'hf'\); use a new "
                       r"--workdir, or resume with the saved values: --config.data.train.type="
                       r"jsonl$"):  # fmt: skip
        check_resumable(old, config_json(parse_args(gsm8k + flags[:1] + flags[2:], {})[0]))


def test_a_hub_dataset_commit_is_pinned_and_checked_on_resume(hub):
    """launch.pin.pin_data records the commit openai/gsm8k resolved to in
    data.train.hf_commit and data.eval.hf_commit and the sources are read at them; once `main`
    points at another commit (its rows reversed) a resume is refused in one line naming
    data.train.path and both commits, and resumes with --config.data.train.revision=<the old
    commit> on the old rows; the eval source (it may change on resume) is still read at the
    recorded commit, what launch.eval reads. The eval source's commit is checked alike while it
    names the same dataset (it may name another on resume). A local source pins nothing."""
    from launch.cli import UsageError, config_json, parse_args
    from launch.pin import pin_data
    from launch.resume_compat import check_resumable
    from rl.sources import load_records
    from tests.launch.test_real_configs import DATA

    argv = ["--config", os.path.join(ROOT, "configs", "qwen2_5_0_5b_gsm8k.py")]
    config = parse_args(argv, {})[0]
    pin_data(config)
    assert config.data.train.hf_commit == config.data.eval.hf_commit == D
    saved, rows = config_json(config), list(load_records(config.data.train))
    eval_rows = list(load_records(config.data.eval))
    assert rows == eval_rows == DATA and len(DATA) > 1
    other = hashlib.sha1(b"D2").hexdigest()
    moved_dir = os.path.join(str(hub), "gsm8k_moved")
    gsm8k_repo(moved_dir, DATA[::-1])
    add_directory(os.environ["HF_HUB_CACHE"], DATASET, moved_dir, other, repo_type="dataset")
    try:
        moved = parse_args(argv, {})[0]
        pin_data(moved)
        assert moved.data.train.hf_commit == moved.data.eval.hf_commit == other
        assert list(load_records(moved.data.train)) == DATA[::-1]
        with pytest.raises(UsageError) as e:
            check_resumable(saved, config_json(moved))
        assert str(e.value) == (
            f"config.data.train.path='{DATASET}' resolves to commit {other}, but this run "
            f"started from commit {D}; resume with --config.data.train.revision={D} or use a "
            "new --workdir"
        )
        pinned = parse_args(argv + [f"--config.data.train.revision={D}"], {})[0]
        pin_data(pinned)
        with pytest.raises(UsageError) as e:  # the same eval dataset at another commit
            check_resumable(saved, config_json(pinned))
        assert str(e.value) == (
            f"config.data.eval.path='{DATASET}' resolves to commit {other}, but this run "
            f"started from commit {D}; resume with --config.data.eval.revision={D} or use a "
            "new --workdir"
        )
        pinned = parse_args(
            argv + [f"--config.data.train.revision={D}", f"--config.data.eval.revision={D}"], {}
        )[0]
        pin_data(pinned)
        check_resumable(saved, config_json(pinned))
        assert list(load_records(pinned.data.train)) == rows
        assert list(load_records(pinned.data.eval)) == eval_rows
        # another held-out set (data.eval may change on resume): its commit is not compared
        local_eval = os.path.join(str(hub), "gsm8k")
        other_eval = parse_args(
            argv + [f"--config.data.train.revision={D}", f"--config.data.eval.path={local_eval}"],
            {},
        )[0]
        pin_data(other_eval)
        check_resumable(saved, config_json(other_eval))
        assert list(load_records(config.data.eval)) == eval_rows  # at the recorded commit
    finally:
        add_snapshot(
            os.environ["HF_HUB_CACHE"], DATASET, {}, D, refs=("main",), repo_type="dataset"
        )
    local = parse_args(argv + ["--config.data.train.path=" + os.path.join(str(hub), "gsm8k")],
                       {})[0]  # fmt: skip
    pin_data(local)
    assert local.data.train.hf_commit == ""


PIN_WORKER = """
import json, sys
from launch.cli import UsageError, parse_args
from launch.distributed import init_distributed
from launch.pin import pin_data, pin_model
out, runs = {}, json.loads(sys.argv[1])
init_distributed(parse_args([], {})[0])
for name, argv in runs.items():
    config = parse_args(argv, {})[0]
    try:
        pin_model(config, weights=False)
        pin_data(config)
        out[name] = [config.model.hf_commit, config.data.train.hf_commit,
                     config.data.eval.hf_commit]
    except UsageError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


@pytest.mark.slow  # two interpreters importing jax (about 13 s of CPU)
def test_two_processes_pin_process_0s_commits_each_in_its_own_cache(tmp_path):
    """pin_model / pin_data in 2 jax.distributed processes (CPU, gloo; no training), each with
    its own offline Hub cache as a TPU slice's hosts have: on process 1's host `main` has moved
    (to B and D2) but the commits process 0 resolved (A, D) are cached there too: both record
    A and D. A Hub id process 0 cannot resolve fails on both processes with process 0's line,
    though process 1's cache holds it. A local directory pins "" on both."""
    from tests.launch.test_multiprocess import _free_port

    model = {"config.json": b"{}", "generation_config.json": b"{}"}
    card = {"README.md": GSM8K_CARD.encode()}
    d2 = hashlib.sha1(b"D2").hexdigest()
    caches = [tmp_path / "host0", tmp_path / "host1"]
    add_snapshot(caches[0], MODEL, model, A, refs=("main",))
    add_snapshot(caches[0], DATASET, card, D, refs=("main",), repo_type="dataset")
    add_snapshot(caches[1], MODEL, model, A, refs=())
    add_snapshot(caches[1], MODEL, {**model, "config.json": b'{"x": 1}'}, B, refs=("main",))
    add_snapshot(caches[1], DATASET, card, D, refs=(), repo_type="dataset")
    add_snapshot(caches[1], DATASET, {"README.md": b"---\n---\n"}, d2, refs=("main",),
                 repo_type="dataset")  # fmt: skip
    add_snapshot(caches[1], "org/only-on-1", model, B, refs=("main",))
    gsm8k = ["--config", os.path.join(ROOT, "configs", "qwen2_5_0_5b_gsm8k.py")]
    local = os.path.join(ROOT, "configs", "assets", "arithmetic_sft")
    runs = {"hub": gsm8k, "missing": [*gsm8k, "--config.model.hf_checkpoint=org/only-on-1"],
            "local": [f"--config.model.hf_checkpoint={local}"]}  # fmt: skip
    port, procs = _free_port(), []
    for i, cache in enumerate(caches):
        env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu",
                   JAX_NUM_CPU_DEVICES="1", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
                   JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", JAX_COMPILATION_CACHE_DIR=process_cache(i),
                   HF_DATASETS_CACHE=str(tmp_path / f"datasets{i}"))  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, "-c", PIN_WORKER, json.dumps(runs)], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    got = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        got.append(json.loads(out.strip().splitlines()[-1]))
    missing = (f"config.model.hf_checkpoint='org/only-on-1': not a local directory, and not in "
               f"the Hub cache {caches[0]} (HF_HUB_OFFLINE=1)")  # fmt: skip
    assert got[0] == got[1] == {"hub": [A, D, D], "missing": missing, "local": ["", "", ""]}
