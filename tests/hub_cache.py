"""A Hugging Face Hub cache made on disk, laid out as huggingface_hub lays it out, for offline tests.

    <cache>/models--org--name/blobs/<sha256>              file contents
    <cache>/models--org--name/snapshots/<commit>/<file>   relative links to the blobs
    <cache>/models--org--name/refs/<branch or tag>        the commit it points at

(`datasets--org--name` for datasets). The folder name comes from huggingface_hub's own
`repo_folder_name`, and `scan_cache_dir` (huggingface_hub's cache reader) must list what was made,
so a layout huggingface_hub would not read fails here first. `offline_hub(monkeypatch, cache)` points
this process (huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE when it is imported) and its
subprocesses (the environment) at the cache, offline.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os

from huggingface_hub import constants, scan_cache_dir
from huggingface_hub.file_download import repo_folder_name

# recent huggingface_hub releases (2.4 here) keep repo listings in the cache and check cached
# snapshots against them offline; older ones have neither
LISTINGS = importlib.util.find_spec("huggingface_hub._tree_cache") is not None


def add_snapshot(cache, repo_id: str, files: dict, commit: str, refs=("main",), repo_type="model",
                 listed=None):  # fmt: skip
    """Puts `files` ({path in the repo: bytes, or a local file to copy}) in `cache` as the
    snapshot of `repo_id` at `commit` (40 hex digits), with `refs` pointing at it. With `listed`
    (paths of the repo at that commit that are not cached), also the repo's file listing, as
    huggingface_hub's snapshot_download keeps it online (trees/<commit>.json, written by its
    own write_tree_cache, where it has one: LISTINGS): offline it then refuses a snapshot missing
    a file it is asked for."""
    repo = os.path.join(os.fspath(cache), repo_folder_name(repo_id=repo_id, repo_type=repo_type))
    if listed is not None and LISTINGS:
        from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

        sizes = {name: len(data) if isinstance(data, bytes) else os.path.getsize(data)
                 for name, data in files.items()}  # fmt: skip
        entries = {name: TreeCacheEntry(size=sizes.get(name, 1), blob_id=hashlib.sha1(
            name.encode()).hexdigest()) for name in (*files, *listed)}  # fmt: skip
        write_tree_cache(repo, commit, entries)
    for name, data in files.items():
        if not isinstance(data, bytes):
            with open(data, "rb") as f:
                data = f.read()
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(repo, "snapshots", commit, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    for ref in refs:  # a branch may hold slashes ("feature/x"): refs/feature/x
        os.makedirs(os.path.dirname(os.path.join(repo, "refs", ref)), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    found = {(r.repo_id, r.repo_type): r for r in scan_cache_dir(cache).repos}
    assert commit in {rev.commit_hash for rev in found[(repo_id, repo_type)].revisions}
    return os.path.join(repo, "snapshots", commit)


def add_directory(cache, repo_id: str, directory, commit: str, refs=("main",), repo_type="model"):
    """add_snapshot of every file under `directory`."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, directory)] = path
    return add_snapshot(cache, repo_id, files, commit, refs, repo_type)


def offline_hub(monkeypatch, cache, datasets_cache=None) -> None:
    """This process and its subprocesses read the Hub cache `cache`, offline; datasets writes
    its Arrow cache to `datasets_cache` (default: beside `cache`)."""
    cache = os.fspath(cache)
    datasets_cache = os.fspath(datasets_cache or os.path.join(os.path.dirname(cache), "datasets"))
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", datasets_cache)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    try:
        import datasets.config
    except ImportError:
        return
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", datasets_cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
