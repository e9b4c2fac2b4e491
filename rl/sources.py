"""Data sources: the records of a source config, from jsonl / parquet files, a `datasets`
dataset (a Hub id, a directory of data files, a `save_to_disk` directory) or a built-in task.
`rl.data` draws them in the run's order and turns them into prompts.

A record is a dict with a prompt column (`prompt_field`, default "prompt") and any other columns the
rewards need (e.g. "answer"). The prompt is text, or a list of {"role", "content"} messages for
chat datasets.

Source config (a dict or ml_collections.ConfigDict; missing keys take the defaults shown):
    type: "jsonl" | "parquet" | "hf" | "arithmetic" | "repo_fix"
    path: file path, list of paths, or glob pattern   (jsonl / parquet)
    path, name, split, revision   (hf: a Hub dataset id, a directory of data files, a data file
        or glob (.parquet / .jsonl / .json / .csv / .arrow, all of them the split) or a
        `save_to_disk` directory; `name` the subset, `revision` a Hub commit, branch or tag; a
        bad name, split or prompt_field raises SourceError naming it)
    prompt_field: "prompt"
    num: 10_000, digits: 2, ops: "+", split: "train", eval_fraction: 0.1, seed: 0   (arithmetic,
        see rl.tasks.arithmetic_records; the held-out set is the same config with split="eval")
    num, split, eval_fraction, seed   (repo_fix: the CPU repository demo's tiny repositories,
        rl.envs.repo_fix_tasks.repo_fix_source)

A built-in type an environment brings ("repo_fix") is registered from above (`register_source`,
by rl/envs/, which launch's entry points import): this module imports no environment.

Choices a reader may question:
- jsonl / parquet records are read into host memory up front. Prompt sets are small (GSM8K: 7.5k
  rows), and a list gives grain random access, so shuffling is a global permutation with no buffer.
- An "hf" source is a `datasets.Dataset` (Arrow, memory-mapped) that grain reads row by row as a
  random-access source (`HFRecords`): nothing is copied into a list. A Hub id is fetched with
  `huggingface_hub.snapshot_download(repo_type="dataset")` into the Hub cache datasets itself
  downloads to (HF_HOME; HF_HUB_OFFLINE=1 reads the cache alone; HF_TOKEN), then read with
  `datasets.load_dataset(snapshot, name, split=split)`, as is a directory of data files;
  `load_from_disk` reads a `save_to_disk` directory. Its rows are the records, in its order.
- A record is JSON (it is logged with its completions, and rewards read its fields as a jsonl
  line would give them): Arrow dates and times of a parquet file or a dataset become ISO 8601
  text, durations seconds, decimals text (`jsonable`); a column of bytes (binary, Image, Audio)
  is refused, naming it.
"""

from __future__ import annotations

import datetime
import decimal
import glob
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from rl.tasks import arithmetic_records

FILE_TYPES = ("jsonl", "parquet", "hf")
# Source types an environment brings (type -> fn(source config) -> records), filled from above by
# `register_source` (rl/envs registers "repo_fix").
GENERATED: dict[str, Callable[[Any], list[dict]]] = {}


def register_source(kind: str):
    """Decorator adding a built-in source type `kind`: fn(source config) -> its records."""

    def wrap(fn):
        if kind in GENERATED or kind in (*FILE_TYPES, "arithmetic"):
            raise ValueError(f"data source type {kind!r} is already registered")
        GENERATED[kind] = fn
        return fn

    return wrap


def builtin_types() -> tuple[str, ...]:
    """The built-in (generated, not read) source types: "arithmetic" and the registered ones."""
    return ("arithmetic", *GENERATED)


def source_types() -> tuple[str, ...]:
    """Every source type `load_records` knows now."""
    return FILE_TYPES + builtin_types()


def cfg_get(cfg: Any, key: str, default: Any) -> Any:
    """`cfg[key]` of a dict or ConfigDict; `default` when it is missing or None."""
    value = cfg.get(key, default) if hasattr(cfg, "get") else default
    return default if value is None else value


def _expand_paths(path: Any) -> list[str]:
    patterns = [path] if isinstance(path, (str, os.PathLike)) else list(path or [])
    if not patterns:
        raise ValueError("data source has no `path`: set it to a file, list of files or glob")
    paths = []
    for pattern in map(os.fspath, patterns):
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise FileNotFoundError(f"no data files match {pattern!r}")
            paths.extend(matches)
        elif not os.path.isfile(pattern):
            raise FileNotFoundError(f"data file not found: {pattern}")
        else:
            paths.append(pattern)
    return paths


def _check_record(record: Any, prompt_field: str, where: str) -> dict:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if prompt_field not in record:
        raise ValueError(
            f"{where}: no prompt field {prompt_field!r} (the record has {sorted(record)}); "
            "set the source's prompt_field"
        )
    return record


def read_jsonl(path: str) -> list[tuple[str, Any]]:
    """(where, record) for every non-empty line; `where` ("path:line") is for error messages."""
    out = []
    with open(path, "rb") as f:  # bytes, so that a non-UTF-8 line is reported with its number
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start})"
                ) from None
            if not line.strip():
                continue
            try:
                out.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
    return out


def _read_jsonl(path: str, prompt_field: str) -> list[dict]:
    return [_check_record(record, prompt_field, where) for where, record in read_jsonl(path)]


def _read_parquet(path: str, prompt_field: str) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    table = pq.read_table(path)
    if prompt_field not in table.column_names:
        raise ValueError(
            f"{path}: no prompt field {prompt_field!r} (columns: {table.column_names}); "
            "set the source's prompt_field"
        )
    _check_jsonable(table.schema, path, hf=False)
    return [jsonable(row) for row in table.to_pylist()]


def jsonable(value: Any) -> Any:
    """A row's value as a record carries it: records are JSON (logged with their completions,
    read by rewards as a jsonl line is), so Arrow's dates and times become ISO 8601 text,
    durations seconds and decimals text, in lists and dicts too; JSON values pass. (A jsonl
    file of the same rows would hold that text.)"""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    return value


def _holds_bytes(t) -> bool:
    """Whether pyarrow type t is, or holds, binary data."""
    import pyarrow as pa

    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return True
    if getattr(pa.types, "is_binary_view", lambda _: False)(t):
        return True
    if pa.types.is_struct(t):
        return any(_holds_bytes(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _holds_bytes(t.key_type) or _holds_bytes(t.item_type)
    if hasattr(t, "value_type"):  # list, large list, fixed-size list, dictionary
        return _holds_bytes(t.value_type)
    return False


def _check_jsonable(schema, where: str, hf: bool = True) -> None:
    """Refuses columns of bytes (binary, or datasets' Image / Audio features, stored as bytes):
    a record cannot carry them (`jsonable`), and a prompt dataset has no use for them. An "hf"
    source's error names its path (SourceError), a parquet file's the file."""
    bad = [f.name for f in schema if _holds_bytes(f.type)]
    if bad:
        why = (
            f"columns {bad} hold bytes (binary, or an Image / Audio feature), which a record "
            "cannot carry (records are JSON: logged with their completions, read by rewards as a jsonl line is); "
            "remove them (datasets' remove_columns, then save_to_disk) and read that"
        )
        raise SourceError("path", where, why) if hf else ValueError(f"{where}: {why}")


class HFRecords(Sequence):
    """The rows of a `datasets.Dataset` as a random-access sequence of record dicts (what grain's
    MapDataset.source reads); slices are lists. Nothing is read before it is asked for."""

    def __init__(self, dataset, where: str):
        self.dataset, self.where = dataset, where

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return jsonable(self.dataset[int(i) % len(self)])

    def __iter__(self):
        for batch in self.dataset.iter(batch_size=1024):
            yield from (jsonable(dict(zip(batch, row))) for row in zip(*batch.values()))


def hub_dataset_dir(
    path: str,
    revision: str = "",
    name: str | None = None,
    *,
    field: str = "data source path",
    revision_field: str = "revision",
) -> str:
    """The local directory of an "hf" source's `path`: the directory itself, or a Hub dataset's
    snapshot in the Hub cache at `revision`, fetched with the files of subset `name` only where
    the dataset card's `configs` name them (`subset_files`), else all its files."""
    from models.hub import HubError, is_local, local_revision, resolve

    if is_local(path) or data_files(path):
        if revision:
            raise HubError(local_revision(path, revision, field, revision_field))
        return os.path.expanduser(path)
    if names_files(path):
        raise HubError(f"{field}={path!r}: no such data file")  # not a Hub id: a typo'd file
    kw = dict(field=field, revision_field=revision_field, repo_type="dataset")
    card, commit = resolve(path, revision, allow_patterns=("README.md",), **kw)
    return resolve(path, commit, allow_patterns=subset_files(card, name, path), **kw)[0]


def subset_files(directory: str, name: str | None, path: str = "") -> tuple[str, ...] | None:
    """The file patterns of subset `name` (None: the card's default, or its only one) in the
    `configs` of the dataset card directory/README.md (read with datasets' own MetadataConfigs),
    with the card; None (every file) where the card does not say. A subset the card's configs
    do not hold, or none asked of several without a default, raises SourceError("name"), before
    any data file is fetched (else every file of every subset came down first)."""
    card = os.path.join(directory, "README.md")
    if not os.path.isfile(card):
        return None
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(card).data)
    if configs and name is None:
        name = configs.get_default_config_name() or (
            next(iter(configs)) if len(configs) == 1 else None
        )
        if name is None:
            raise SourceError(
                "name",
                "",
                f"{path or directory} has several subsets and no "
                f"default: name one of {sorted(configs)}",
            )
    if configs and name not in configs:
        raise SourceError(
            "name", name, f"{path or directory}: no such subset (it has {sorted(configs)})"
        )
    files = (configs.get(name) or {}).get("data_files")
    if isinstance(files, (str, dict)):
        files = [files]
    paths = []
    for f in files or []:
        got = f.get("path") if isinstance(f, dict) else f
        paths += [got] if isinstance(got, str) else list(got or [])
    if not paths or not all(isinstance(p, str) for p in paths):
        return None
    data_dir = configs[name].get("data_dir")
    return ("README.md", *(os.path.join(data_dir, p) if data_dir else p for p in paths))


class SourceError(ValueError):
    """A bad field of an "hf" source, `field` ("name", "split", "prompt_field"): the message
    starts with `field=value: `, so that launch.validate names it as config.data.<split>.<field>."""

    def __init__(self, field: str, value: Any, message: str):
        self.field = field
        super().__init__(f"{field}={value!r}: {message}")


# "hf" sources whose path is a data file (or a glob of them): the datasets builder per extension
DATA_FILE_BUILDERS = {
    ".parquet": "parquet",
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".arrow": "arrow",
}


def names_files(path: str) -> bool:
    """Whether an "hf" source's path is meant as data files (a glob, or a data file's
    extension), whether or not they exist: such a path is never taken for a Hub id."""
    return glob.has_magic(path) or os.path.splitext(path)[1].lower() in DATA_FILE_BUILDERS


def data_files(path: str) -> list[str] | None:
    """The files of an "hf" source's path that names data files (a file or a glob), else None."""
    path = os.path.expanduser(path)
    if glob.has_magic(path):
        found = sorted(f for f in glob.glob(path) if os.path.isfile(f))
        return found or None
    return [path] if os.path.isfile(path) else None


def _split_names(split: str) -> list[str]:
    """The split names of a datasets split spec ("train", "train[:100]", "train+test")."""
    return [part.split("[")[0].strip() for part in split.split("+")]


def _check_prompt_field(
    datasets, args, split: str, prompt_field: str, where: str, path: str
) -> None:
    """The first row's columns hold prompt_field, read by streaming it, and no column holds bytes
    (where the files' schema says): before load_dataset generates the Arrow cache (minutes for
    a large dataset, and progress bars on stderr)."""
    stream = datasets.load_dataset(
        *args[0], split=_split_names(split)[0], streaming=True, **args[1]
    )
    if stream.features is not None:  # (known from the files' schema: parquet, arrow)
        _check_jsonable(stream.features.arrow_schema, path)
    first = next(iter(stream), None)
    if first is not None and prompt_field not in first:
        raise SourceError(
            "prompt_field",
            prompt_field,
            f"no such column in {where} split {split!r} (columns: {sorted(first)})",
        )


def _load_hf(source_cfg: Any, prompt_field: str) -> HFRecords:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "a data source of type 'hf' needs the datasets library: pip install -e '.[hub]'"
        ) from None
    path = os.fspath(cfg_get(source_cfg, "path", ""))
    name = cfg_get(source_cfg, "name", "") or None
    split = str(cfg_get(source_cfg, "split", "train"))
    where = f"{path}" + (f" (subset {name})" if name else "")
    local = os.path.expanduser(path)
    files = data_files(path)
    if os.path.isfile(os.path.join(local, "dataset_dict.json")) or os.path.isfile(
        os.path.join(local, "state.json")
    ):  # a save_to_disk directory (a DatasetDict or a Dataset)
        ds = datasets.load_from_disk(local)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise SourceError("split", split, f"no such split of {path} (it has {sorted(ds)})")
            ds = ds[split]
    elif files:  # data files: datasets' builder for their format, all of them the split
        ext = os.path.splitext(files[0])[1].lower()
        if ext not in DATA_FILE_BUILDERS or any(not f.lower().endswith(ext) for f in files):
            raise SourceError(
                "path", path, f"data files must all be one of {sorted(DATA_FILE_BUILDERS)}"
            )
        args = (DATA_FILE_BUILDERS[ext],), dict(data_files={split: files})
        _check_prompt_field(datasets, args, split, prompt_field, where, path)
        ds = datasets.load_dataset(*args[0], split=split, **args[1])
    else:  # a directory of data files, or a Hub dataset id (fetched into the Hub cache)
        revision = cfg_get(source_cfg, "hf_commit", "") or cfg_get(source_cfg, "revision", "")
        directory = hub_dataset_dir(path, str(revision), name)
        try:  # the subset and split are checked before any split is generated
            builder = datasets.load_dataset_builder(directory, name)
        except ValueError as e:  # an unknown or missing subset
            raise SourceError(
                "name", name or "", f"{path}: {' '.join(str(e).split())[:300]}"
            ) from None
        known = [str(s) for s in builder.config.data_files or builder.info.splits or []]
        missing = [s for s in _split_names(split) if s not in known]
        if known and missing:
            raise SourceError("split", split, f"no such split of {where} (it has {known})")
        _check_prompt_field(datasets, ((directory, name), {}), split, prompt_field, where, path)
        try:
            ds = datasets.load_dataset(directory, name, split=split)
        except ValueError as e:  # a split spec datasets refuses
            raise SourceError(
                "split", split, f"{where}: {' '.join(str(e).split())[:300]}"
            ) from None
    if prompt_field not in ds.column_names:
        raise SourceError(
            "prompt_field",
            prompt_field,
            f"no such column in {where} split {split!r} (columns: {sorted(ds.column_names)})",
        )
    _check_jsonable(ds.data.schema, path)
    return HFRecords(ds, f"{where} split {split!r}")


def load_records(source_cfg: Any) -> Sequence[dict]:
    """All records of a source config (see the module docstring), in file order: a list, or
    for an "hf" source its rows as a random-access `HFRecords`."""
    kind = cfg_get(source_cfg, "type", None)
    prompt_field = cfg_get(source_cfg, "prompt_field", "prompt")
    if kind == "arithmetic":
        records = arithmetic_records(
            seed=int(cfg_get(source_cfg, "seed", 0)),
            num=int(cfg_get(source_cfg, "num", 10_000)),
            digits=int(cfg_get(source_cfg, "digits", 2)),
            ops=str(cfg_get(source_cfg, "ops", "+")),
            split=str(cfg_get(source_cfg, "split", "train")),
            eval_fraction=float(cfg_get(source_cfg, "eval_fraction", 0.1)),
        )
        if prompt_field != "prompt":
            raise ValueError(
                f"the arithmetic task's prompt field is 'prompt', not {prompt_field!r}"
            )
    elif kind in GENERATED:  # an environment's tasks (e.g. repo_fix's tiny repositories)
        records = GENERATED[kind](source_cfg)
    elif kind in ("jsonl", "parquet"):
        read = _read_jsonl if kind == "jsonl" else _read_parquet
        records, paths = [], _expand_paths(cfg_get(source_cfg, "path", None))
        for path in paths:
            records.extend(read(path, prompt_field))
        if not records:
            raise ValueError(f"{', '.join(paths)}: no records (empty {kind} data)")
    elif kind == "hf":
        records = _load_hf(source_cfg, prompt_field)
        if not len(records):
            raise ValueError(f"{records.where}: no records (an empty dataset)")
    else:
        raise ValueError(f"data source type must be one of {source_types()}, got {kind!r}")
    if not len(records):
        raise ValueError(f"data source {dict(source_cfg)} has no records")
    return records
