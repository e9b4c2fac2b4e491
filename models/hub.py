"""Checkpoints and datasets by Hugging Face Hub id, resolved to a local snapshot directory.

`resolve("Qwen/Qwen2.5-0.5B-Instruct", revision)` returns (directory, commit): a local directory
is returned as it is (commit ""), anything else is a Hub repo id fetched with
`huggingface_hub.snapshot_download` into the Hub cache that transformers and datasets use
(`HF_HOME`, `HF_HUB_CACHE`), for the files the loader reads only (`MODEL_FILES`; of the
weights, the shards the index names). The usual environment applies: `HF_TOKEN` for private and
gated repos, `HF_HUB_OFFLINE=1` to resolve from the cache alone. `revision` is a commit, branch
or tag ("" = the default branch); the commit it resolved to is returned so that a run can record
it and pin it later.

A missing repo, a gated one without a token, a revision that does not exist or a snapshot that is
not cached while offline raises `HubError`, one line naming `field`.
"""

from __future__ import annotations

import os
import re

# What models/hf.py and models/tokenizer.py read from a checkpoint directory. WEIGHTS stands for
# the weights the loader reads: the shards model.safetensors.index.json names, else
# model.safetensors (fetched second, at the commit the other files resolved to), not every
# *.safetensors of the repo: Mistral's repos also hold consolidated.safetensors (the same
# weights again, 14 GB for 7B), others variants in subfolders.
WEIGHTS, INDEX = "*.safetensors", "model.safetensors.index.json"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    WEIGHTS,
    INDEX,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "char_tokenizer.json",
)
CONFIG_FILES = ("config.json", "generation_config.json")  # what --dry_run and validation read
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_resolved: dict[tuple, tuple[str, str]] = {}  # (id, commit, type, cache, files) -> (dir, commit)


class HubError(ValueError):
    """A Hub id or revision that does not resolve; the message is one line naming the field."""


def is_local(path: str) -> bool:
    return os.path.isdir(os.path.expanduser(os.fspath(path)))


def shadowing(path) -> str:
    """For an error message: " (...)" saying that `path`, spelled like a Hub id ("org/name"),
    was read as the local directory of that name, which comes first (as transformers'
    from_pretrained and datasets' load_dataset take it); "" for any other path."""
    path = os.fspath(path)
    if "/" not in path or path.startswith((".", "/", "~")) or not _REPO_ID.match(path):
        return ""
    if not is_local(path):
        return ""
    return (
        f" ({path} is the local directory {os.path.abspath(path)}, read before the Hub id "
        f"of that spelling: move it, or run elsewhere, to use the Hub's)"
    )


def resolve(
    path: str,
    revision: str = "",
    *,
    field: str = "config.model.hf_checkpoint",
    revision_field: str = "config.model.revision",
    repo_type: str = "model",
    allow_patterns=MODEL_FILES,
    shown_revision: str | None = None,
) -> tuple[str, str]:
    """(local directory, commit) of a local directory (commit "") or a Hub repo id.
    `shown_revision`: the revision the errors name with the id where it is not `revision` (the
    user's, where `revision` is the commit it was pinned to)."""
    path = os.fspath(path)
    if is_local(path):
        if revision:  # (else it was dropped silently: the directory read whatever was asked)
            raise HubError(local_revision(path, revision, field, revision_field))
        return os.path.expanduser(path), ""
    if not path or not _REPO_ID.match(path) or path.startswith((".", "/", "~")):
        raise HubError(f"{field}={path!r}: not a local directory, nor a Hub repo id ('org/name')")
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ImportError:
        raise HubError(
            f"{field}={path!r}: not a local directory; a Hub id needs "
            "huggingface_hub: pip install -e '.[hub]'"
        ) from None
    patterns = tuple(allow_patterns) if allow_patterns else None
    key = (path, revision, repo_type, constants.HF_HUB_CACHE)
    for files in (patterns, MODEL_FILES, None):  # a commit resolved before (immutable), with
        if (*key, files) in _resolved:  # these files or with all the loader's
            return _resolved[(*key, files)]
    shown = revision if shown_revision is None else shown_revision
    what = f"{field}={path!r}" + (f" ({revision_field}={shown!r})" if shown else "")
    weights = repo_type == "model" and patterns is not None and WEIGHTS in patterns
    first = tuple(p for p in patterns if p != WEIGHTS) if weights else patterns
    directory = _download(
        huggingface_hub, errors, path, revision, repo_type, first, what, field, revision_field
    )
    commit = os.path.basename(os.path.normpath(directory))
    if not _COMMIT.match(commit):  # a snapshot directory is named by its commit
        raise HubError(f"{what}: resolved to {directory}, not a snapshot of the Hub cache")
    if weights:  # the shards the index names (or model.safetensors), at that commit
        shards = weight_files(directory)
        _download(
            huggingface_hub,
            errors,
            path,
            commit,
            repo_type,
            shards,
            what,
            field,
            revision_field,
            missing_ok=True,
        )
        missing = [f for f in shards if not os.path.isfile(os.path.join(directory, f))]
        offline = constants.is_offline_mode()
        fetch = (
            " in the Hub cache (it holds what a --dry_run fetched, or part of it): fetch "
            "it once without HF_HUB_OFFLINE"
            if offline
            else ""
        )
        if missing and len(missing) < len(shards):  # offline: an interrupted download
            raise HubError(
                f"{what}: the snapshot {commit} lacks {len(missing)} of the "
                f"{len(shards)} shards its {INDEX} names ({', '.join(missing[:3])})"
                + (fetch or " on the Hub")
            )
        if missing:  # offline, huggingface_hub returns a cached snapshot whatever it holds
            raise HubError(
                f"{what}: the snapshot {commit} has no *.safetensors weights"
                + (fetch or f" ({missing[0]}: only safetensors checkpoints are read)")
            )
    _resolved[(path, commit, *key[2:], patterns)] = (directory, commit)  # a branch may move
    return directory, commit


def weight_files(directory: str) -> tuple[str, ...]:
    """The safetensors files models/hf.py reads from a checkpoint directory: those its
    model.safetensors.index.json names, else model.safetensors."""
    index = os.path.join(directory, INDEX)
    if not os.path.isfile(index):
        return ("model.safetensors",)
    import json

    try:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        return tuple(sorted(set(weight_map.values())))
    except (OSError, ValueError, AttributeError, TypeError):
        return ("model.safetensors",)  # (models/hf.py names what is wrong with the index)


def _download(
    hub, errors, path, revision, repo_type, patterns, what, field, revision_field, missing_ok=False
):
    """snapshot_download's directory, its errors one-line HubErrors; with `missing_ok`, files
    that are not cached (offline) are left for the caller to name."""
    try:
        return hub.snapshot_download(
            path,
            repo_type=repo_type,
            revision=revision or None,
            allow_patterns=list(patterns) if patterns else None,
        )
    except errors.GatedRepoError:
        raise HubError(
            f"{what}: a gated repo; accept its terms on huggingface.co and set "
            "HF_TOKEN (or `hf auth login`)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise HubError(
            f"{what}: not a local directory, and no such {repo_type} repo on the Hub "
            "(or it is private: set HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubError(
            f"{revision_field}={revision!r}: no such revision of {path} on the Hub"
        ) from None
    except (errors.LocalEntryNotFoundError, _incomplete(errors)) as e:
        if missing_ok:
            return None
        raise HubError(_not_cached(path, revision, repo_type, field, revision_field, e)) from None
    except errors.HfHubHTTPError as e:
        raise HubError(f"{what}: {' '.join(str(e).split())[:200]}") from None
    except (OSError, _transport_error()) as e:  # the connection dropped, a full disk, ...
        said = " ".join(str(e).split())[:200] or type(e).__name__
        raise HubError(
            f"{what}: the download failed ({type(e).__name__}: {said}); run again "
            "to continue it (the files already fetched are kept)"
        ) from None


def _transport_error() -> type:
    """httpx's error for a failed connection or read (huggingface_hub's HTTP client)."""
    try:
        import httpx

        return httpx.TransportError
    except ImportError:
        return OSError


def local_revision(path, revision, field, revision_field) -> str:
    """The line for a revision given with a local path, which has none."""
    return (
        f"{revision_field}={revision!r}: {field}={os.fspath(path)!r} is local, which has "
        f"no revisions: drop it{shadowing(path)}"
    )


def _incomplete(errors) -> type:
    """huggingface_hub's error for a partial cached snapshot (newer releases only)."""
    return getattr(errors, "IncompleteSnapshotError", errors.LocalEntryNotFoundError)


def _not_cached(path, revision, repo_type, field, revision_field, e) -> str:
    """The line for a snapshot that is not in the cache (offline, or the Hub unreachable)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    offline = "HF_HUB_OFFLINE=1" if constants.is_offline_mode() else "the Hub is unreachable"
    folder = os.path.join(
        constants.HF_HUB_CACHE, repo_folder_name(repo_id=path, repo_type=repo_type)
    )
    if not os.path.isdir(folder):
        return (
            f"{field}={path!r}: not a local directory, and not in the Hub cache "
            f"{constants.HF_HUB_CACHE} ({offline})"
        )
    refs = os.path.join(folder, "refs")
    cached = sorted(
        os.path.relpath(os.path.join(root, name), refs)
        for root, _, names in os.walk(refs)
        for name in names
    )
    if "incomplete" in type(e).__name__.lower():  # "... N file(s) are missing (a, b, c). ..."
        what = re.search(r"(\d+ file\(s\) are missing \([^)]*(\([^)]*\))?\))", str(e))
        return (
            f"{field}={path!r}: the cached snapshot is incomplete"
            + (f", {what.group(1)}" if what else "")
            + f" ({offline}): fetch it once "
            + ("without HF_HUB_OFFLINE" if constants.is_offline_mode() else "online")
        )
    short = re.fullmatch(r"[0-9a-f]{4,39}", revision or "")  # offline: refs and full commits only
    return (
        f"{revision_field}={revision or 'main'!r}: no snapshot of {path} for it in "
        f"the Hub cache (cached refs: {cached}; {offline}"
        + ("; offline, a commit is its full 40 hex digits" if short else "")
        + ")"
    )
