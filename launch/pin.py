"""Start-up resolution done on process 0 first, its answer then taken by every process
(`agreed`): the Hub commits a run pins (config.model.hf_checkpoint's, an "hf" data source's),
the model's weights at the pinned commit, and W&B credentials. launch.train calls these after
launch.validate's checks of the config; a resume then compares the pinned commits
(launch/resume_compat.py)."""

from __future__ import annotations

import os

import jax
import ml_collections
import numpy as np

from launch.cli import UsageError
from models.hub import CONFIG_FILES, MODEL_FILES, HubError, is_local, resolve
from rl.sources import names_files


def model_dir(c: ml_collections.ConfigDict, weights: bool = True) -> str:
    """The local directory of config.model.hf_checkpoint: the directory itself, or a Hub id's
    snapshot in the Hub cache at config.model.hf_commit (the commit `pin_model` recorded; a
    run's config.json has it) or else at config.model.revision (models/hub.py); without
    `weights` only its config files are fetched (validation, --dry_run)."""
    m = c.model
    rev = m.get("hf_commit", "") or m.get("revision", "")
    try:
        return resolve(
            m.hf_checkpoint,
            rev,
            allow_patterns=_files(weights),
            shown_revision=m.get("revision", ""),
        )[0]
    except HubError as e:
        raise UsageError(str(e)) from None


def _files(weights: bool) -> tuple[str, ...]:
    return MODEL_FILES if weights else CONFIG_FILES


def pin_model(c: ml_collections.ConfigDict, weights: bool = True) -> None:
    """Resolves a Hub id in config.model.hf_checkpoint at config.model.revision (downloading
    what the loader reads) and records the commit in config.model.hf_commit ("" for a local
    directory), so config.json holds it and a resume that resolves to another commit is
    refused (launch/resume_compat.py). In a multi-process run process 0 resolves first, then
    every other process resolves that same commit into its own host's Hub cache (HF_HOME):
    hosts of a TPU slice have their own disks, and a shared HF_HOME works too, as process 0 has
    filled it by then. An error on process 0 is raised on every process. Without `weights`
    only the config files are fetched: --dry_run, and launch.train, which fetches the weights
    (`fetch_weights`) once the resume has checked the commit."""
    m = c.model
    m.hf_commit = agreed(lambda rev: _resolve_commit(c, rev, weights), m.get("revision", ""))


def fetch_weights(c: ml_collections.ConfigDict) -> None:
    """The weights of a Hub model at the commit pin_model recorded, process 0 first (as
    pin_model): launch.train calls it after the resume check, so that a resume whose id now
    resolves to another commit is refused before that commit's weights are downloaded."""
    commit = c.model.get("hf_commit", "")
    if commit:
        agreed(lambda rev: _resolve_commit(c, rev, True), commit)


def pin_data(c: ml_collections.ConfigDict) -> None:
    """pin_model for the data: an "hf" source's Hub dataset id at data.<split>.revision has its
    commit recorded in data.<split>.hf_commit ("" for local files), and is read at it from then
    on. The training data's is checked on resume (launch/resume_compat.py): the iterator state
    indexes the rows, so a branch that moved under a run would change what it trains on. The
    eval data's is checked alike while data.eval names the same dataset (it may name another
    on resume, its commit then recorded anew), and lets launch.eval read the rows the run
    evaluated."""
    for split in ("train", "eval"):
        src = c.data[split]
        if src.type != "hf" or "hf_commit" not in src or not src.path:
            continue  # (validate names an empty path)
        try:  # imported only for an "hf" source: `import datasets` takes ~0.9 s of CPU
            import datasets  # noqa: F401
        except ImportError:  # validate names the missing library
            return
        src.hf_commit = agreed(
            lambda rev, s=src, n=split: _dataset_commit(s, rev, n), src.get("revision", "")
        )


def pinned_commits(c: ml_collections.ConfigDict) -> dict:
    """The Hub commits a run's summary records: `hf_commit` of its weights and `data_hf_commit`
    of its training prompts, each only when it came from the Hub."""
    commits = {
        "hf_commit": c.model.get("hf_commit"),
        "data_hf_commit": c.data.train.get("hf_commit"),
    }
    return {k: v for k, v in commits.items() if v}


def agreed(resolve_commit, revision: str) -> str:
    """resolve_commit(revision) on process 0, then resolve_commit(that commit) on the others
    (their own caches), "" everywhere for a local path; process 0's UsageError on all."""
    if jax.process_count() == 1:
        return resolve_commit(revision)
    from jax.experimental import multihost_utils

    message = b""
    if jax.process_index() == 0:
        try:
            message = b"ok:" + resolve_commit(revision).encode()
        except UsageError as e:
            message = b"error:" + clip_utf8(str(e), 1000)
    buf = np.zeros(1024, np.uint8)
    buf[: len(message)] = np.frombuffer(message, np.uint8)
    got = bytes(multihost_utils.broadcast_one_to_all(buf)).rstrip(b"\0").decode()
    if got.startswith("error:"):
        raise UsageError(got[len("error:") :])
    commit = got[len("ok:") :]
    return resolve_commit(commit) if commit else ""


def clip_utf8(text: str, limit: int) -> bytes:
    """text's UTF-8 bytes, at most `limit`, cut on a character boundary (a multi-byte character
    cut in two would not decode on the other processes)."""
    return text.encode()[:limit].decode("utf-8", "ignore").encode()


def _dataset_commit(src, revision: str, split: str = "train") -> str:
    if is_local(src.path) or names_files(src.path):
        return ""  # (validate names a missing file)
    try:  # the card only: the subset's files are fetched by validate / rl.sources at this commit
        return resolve(
            src.path,
            revision,
            field=f"config.data.{split}.path",
            revision_field=f"config.data.{split}.revision",
            repo_type="dataset",
            allow_patterns=("README.md",),
        )[1]
    except HubError as e:
        raise UsageError(str(e)) from None


def _resolve_commit(c: ml_collections.ConfigDict, revision: str, weights: bool) -> str:
    try:  # (a line about the pinned commit names the revision the user gave, if any)
        return resolve(
            c.model.hf_checkpoint,
            revision,
            allow_patterns=_files(weights),
            shown_revision=c.model.get("revision", ""),
        )[1]
    except HubError as e:
        raise UsageError(str(e)) from None


WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")  # WANDB_MODE values that need no login


def check_wandb_login(c: ml_collections.ConfigDict) -> None:
    """With log.wandb online (WANDB_MODE not offline / disabled) and no terminal to prompt on,
    process 0 (the one that logs) has W&B credentials (WANDB_API_KEY, or `wandb login`'s),
    checked with wandb.login(verify=False), which reads them without the network: before the
    model loads, on every process (process 0's answer), instead of wandb.init's traceback after
    it. With a terminal, wandb.init prompts for a key as usual."""
    if not c.get("log", {}).get("wandb"):
        return
    if os.environ.get("WANDB_MODE", "online") in WANDB_LOCAL_MODES or _interactive():
        return

    def probe(_):
        import contextlib
        import io

        import wandb

        try:  # (its "Loaded credentials" lines: wandb.init prints its own)
            with (
                contextlib.redirect_stderr(io.StringIO()),
                contextlib.redirect_stdout(io.StringIO()),
            ):
                wandb.login(verify=False)
        except Exception as e:  # noqa: BLE001 (wandb's UsageError, AuthenticationError, ...)
            raise UsageError(wandb_error(e)) from None
        return ""

    agreed(probe, "")


def wandb_error(e: Exception) -> str:
    """The one line of a W&B start-up failure (no key, an invalid one, a bad WANDB_MODE)."""
    said = " ".join(str(e).split())[:200]
    return (
        f"config.log.wandb=True: W&B: {said} (set WANDB_API_KEY or run `wandb login` "
        "first, or WANDB_MODE=offline to log locally and `wandb sync` later)"
    )


def _interactive() -> bool:
    try:
        return os.isatty(0)
    except (OSError, ValueError):
        return False
