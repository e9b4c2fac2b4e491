"""Prompt data: records from jsonl / parquet files, a `datasets` dataset or a built-in task,
shuffled and repeated with grain.

A record is a dict with a prompt column (`prompt_field`, default "prompt") and any other columns the
rewards need (e.g. "answer"). The prompt is text, or a list of {"role", "content"} messages for
chat datasets. `PromptStream` draws them in the run's global order, each process those of its own
batch shards; `format_prompt` turns a record into token ids and `reward_inputs` lays the
columns out for `rl.rewards.combined_rewards`.

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
        rl.envs.repo_fix_tasks.repo_fix_records)

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
- Records are drawn by their position in one global order (`PromptStream`), grain's shuffled,
  repeated MapDataset read by index, rather than by a per-process iterator: a step's records
  are split over the batch shards in contiguous slices (shard i the i-th B/S), each process
  reads those of its own shards and no other, and DAPO's refills draw the records after the
  step's. The position is the whole state: JSON-able, the same on every process, so a run
  resumes on a different number of processes; it does depend on the data, seed and shuffle
  staying the same.
"""

from __future__ import annotations

import datetime
import decimal
import glob
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import grain

from models.special_text import Trusted
from models.tokenizer import Tokenizer
from rl.tasks import arithmetic_records

SOURCE_TYPES = ("jsonl", "parquet", "hf", "arithmetic", "repo_fix")


def _cfg_get(cfg: Any, key: str, default: Any) -> Any:
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
        why = (f"columns {bad} hold bytes (binary, or an Image / Audio feature), which a record "
               "cannot carry (records are JSON: logged with their completions, read by rewards as a jsonl line is); "
               "remove them (datasets' remove_columns, then save_to_disk) and read that")  # fmt: skip
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
    path: str, revision: str = "", name: str | None = None, *,
    field: str = "data source path", revision_field: str = "revision",
) -> str:  # fmt: skip
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
            raise SourceError("name", "", f"{path or directory} has several subsets and no "
                              f"default: name one of {sorted(configs)}")  # fmt: skip
    if configs and name not in configs:
        raise SourceError("name", name, f"{path or directory}: no such subset (it has "
                          f"{sorted(configs)})")  # fmt: skip
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
DATA_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv",
                      ".arrow": "arrow"}  # fmt: skip


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


def _check_prompt_field(datasets, args, split: str, prompt_field: str, where: str,
                        path: str) -> None:  # fmt: skip
    """The first row's columns hold prompt_field, read by streaming it, and no column holds bytes
    (where the files' schema says): before load_dataset generates the Arrow cache (minutes for
    a large dataset, and progress bars on stderr)."""
    stream = datasets.load_dataset(*args[0], split=_split_names(split)[0], streaming=True,
                                   **args[1])  # fmt: skip
    if stream.features is not None:  # (known from the files' schema: parquet, arrow)
        _check_jsonable(stream.features.arrow_schema, path)
    first = next(iter(stream), None)
    if first is not None and prompt_field not in first:
        raise SourceError("prompt_field", prompt_field, f"no such column in {where} split "
                          f"{split!r} (columns: {sorted(first)})")  # fmt: skip


def _load_hf(source_cfg: Any, prompt_field: str) -> HFRecords:
    try:
        import datasets
    except ImportError:
        raise ImportError("a data source of type 'hf' needs the datasets library: "
                          "pip install -e '.[hub]'") from None  # fmt: skip
    path = os.fspath(_cfg_get(source_cfg, "path", ""))
    name = _cfg_get(source_cfg, "name", "") or None
    split = str(_cfg_get(source_cfg, "split", "train"))
    where = f"{path}" + (f" (subset {name})" if name else "")
    local = os.path.expanduser(path)
    files = data_files(path)
    if os.path.isfile(os.path.join(local, "dataset_dict.json")) or os.path.isfile(
        os.path.join(local, "state.json")
    ):  # a save_to_disk directory (a DatasetDict or a Dataset)
        ds = datasets.load_from_disk(local)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise SourceError("split", split, f"no such split of {path} (it has "
                                  f"{sorted(ds)})")  # fmt: skip
            ds = ds[split]
    elif files:  # data files: datasets' builder for their format, all of them the split
        ext = os.path.splitext(files[0])[1].lower()
        if ext not in DATA_FILE_BUILDERS or any(not f.lower().endswith(ext) for f in files):
            raise SourceError("path", path, "data files must all be one of "
                              f"{sorted(DATA_FILE_BUILDERS)}")  # fmt: skip
        args = (DATA_FILE_BUILDERS[ext],), dict(data_files={split: files})
        _check_prompt_field(datasets, args, split, prompt_field, where, path)
        ds = datasets.load_dataset(*args[0], split=split, **args[1])
    else:  # a directory of data files, or a Hub dataset id (fetched into the Hub cache)
        revision = _cfg_get(source_cfg, "hf_commit", "") or _cfg_get(source_cfg, "revision", "")
        directory = hub_dataset_dir(path, str(revision), name)
        try:  # the subset and split are checked before any split is generated
            builder = datasets.load_dataset_builder(directory, name)
        except ValueError as e:  # an unknown or missing subset
            raise SourceError("name", name or "", f"{path}: "
                              f"{' '.join(str(e).split())[:300]}") from None  # fmt: skip
        known = [str(s) for s in builder.config.data_files or builder.info.splits or []]
        missing = [s for s in _split_names(split) if s not in known]
        if known and missing:
            raise SourceError("split", split, f"no such split of {where} (it has {known})")
        _check_prompt_field(datasets, ((directory, name), {}), split, prompt_field, where, path)
        try:
            ds = datasets.load_dataset(directory, name, split=split)
        except ValueError as e:  # a split spec datasets refuses
            raise SourceError("split", split, f"{where}: "
                              f"{' '.join(str(e).split())[:300]}") from None  # fmt: skip
    if prompt_field not in ds.column_names:
        raise SourceError("prompt_field", prompt_field, f"no such column in {where} split "
                          f"{split!r} (columns: {sorted(ds.column_names)})")  # fmt: skip
    _check_jsonable(ds.data.schema, path)
    return HFRecords(ds, f"{where} split {split!r}")


def load_records(source_cfg: Any) -> Sequence[dict]:
    """All records of a source config (see the module docstring), in file order: a list, or
    for an "hf" source its rows as a random-access `HFRecords`."""
    kind = _cfg_get(source_cfg, "type", None)
    prompt_field = _cfg_get(source_cfg, "prompt_field", "prompt")
    if kind == "arithmetic":
        records = arithmetic_records(
            seed=int(_cfg_get(source_cfg, "seed", 0)),
            num=int(_cfg_get(source_cfg, "num", 10_000)),
            digits=int(_cfg_get(source_cfg, "digits", 2)),
            ops=str(_cfg_get(source_cfg, "ops", "+")),
            split=str(_cfg_get(source_cfg, "split", "train")),
            eval_fraction=float(_cfg_get(source_cfg, "eval_fraction", 0.1)),
        )
        if prompt_field != "prompt":
            raise ValueError(
                f"the arithmetic task's prompt field is 'prompt', not {prompt_field!r}"
            )
    elif kind == "repo_fix":  # the CPU repository demo's tiny repositories
        from rl.envs.repo_fix_tasks import repo_fix_records

        records = repo_fix_records(
            seed=int(_cfg_get(source_cfg, "seed", 0)),
            num=int(_cfg_get(source_cfg, "num", 10_000)),
            split=str(_cfg_get(source_cfg, "split", "train")),
            eval_fraction=float(_cfg_get(source_cfg, "eval_fraction", 0.1)),
        )
    elif kind in ("jsonl", "parquet"):
        read = _read_jsonl if kind == "jsonl" else _read_parquet
        records, paths = [], _expand_paths(_cfg_get(source_cfg, "path", None))
        for path in paths:
            records.extend(read(path, prompt_field))
        if not records:
            raise ValueError(f"{', '.join(paths)}: no records (empty {kind} data)")
    elif kind == "hf":
        records = _load_hf(source_cfg, prompt_field)
        if not len(records):
            raise ValueError(f"{records.where}: no records (an empty dataset)")
    else:
        raise ValueError(f"data source type must be one of {SOURCE_TYPES}, got {kind!r}")
    if not len(records):
        raise ValueError(f"data source {dict(source_cfg)} has no records")
    return records


def prompt_dataset(
    records: Sequence[dict], *, seed: int, shuffle: bool = True, num_epochs: int | None = None
) -> grain.MapDataset:
    """A grain MapDataset whose element q is the q-th record of the global data order: every
    epoch a permutation of the records (grain folds the epoch into the seed), `num_epochs=None`
    forever. Random access: a process reads only the records it draws (`PromptStream`)."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must be in [0, 2**32) for grain's shuffle")
    ds = grain.MapDataset.source(records if isinstance(records, HFRecords) else list(records))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat(num_epochs)


def make_prompt_stream(source_cfg: Any, *, batch_size: int, seed: int, shuffle: bool = True,
                       num_epochs: int | None = None) -> PromptStream:  # fmt: skip
    """The `PromptStream` of the records of `source_cfg`, `batch_size` prompts a step."""
    records = load_records(source_cfg)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if num_epochs is not None and len(records) * num_epochs < batch_size:
        raise ValueError(
            f"{len(records)} records x {num_epochs} epochs do not fill one batch of {batch_size}"
        )
    ds = prompt_dataset(records, seed=seed, shuffle=shuffle, num_epochs=num_epochs)
    end = None if num_epochs is None else len(records) * num_epochs // batch_size * batch_size
    return PromptStream(ds, batch_size, end)


class PromptStream:
    """The training records in their global order, drawn by position: `take(n)` the next n, or
    `take_shards(counts, mine)` the next counts[i] for each batch shard i, shard 0 first.

    The order is the one the steps' batches of `batch_size` records make one after the other
    (a record of a finite last incomplete batch is never drawn), whatever the number of
    processes or shards: a step's B prompts are records [q, q+B) wherever they are sampled, and
    DAPO's refills and partial rollouts' new groups take the records after them, so every
    record of an epoch is drawn exactly once. With shards, each process reads only the records
    of its own shards (`mine`): records are read by index from the random-access dataset, so
    nothing is read twice, and none travels between processes. The state is the position (an
    int, the same on every process): a run resumes on another number of processes, and from
    the checkpoints of earlier versions (a grain iterator's step and the records carried).
    """

    def __init__(self, dataset, batch_size: int, end: int | None = None):
        self.dataset, self.batch_size, self.end = dataset, batch_size, end
        self.position = 0

    def take(self, n: int) -> list[dict]:
        """The next n records."""
        return self.take_shards([n], [True])[0]

    def take_shards(self, counts, mine) -> list[list[dict] | None]:
        """Per shard i the next counts[i] records after those of shards < i (its own when
        mine[i], else None: another process reads them); the position moves past all."""
        total = int(sum(counts))
        if self.end is not None and self.position + total > self.end:
            raise StopIteration(f"the data's epochs end after {self.end} records")
        out, at = [], self.position
        for n, own in zip(counts, mine, strict=True):
            out.append([dict(self.dataset[q]) for q in range(at, at + n)] if own else None)
            at += n
        self.position = at
        return out

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        if "position" in state:
            self.position = int(state["position"])
            return
        # Earlier checkpoints: a grain iterator's state (its next step) and the records of the
        # step it had read but not drawn yet, or, older still, the iterator's state alone.
        if "iterator" not in state:
            state = {"iterator": state, "carry": []}
        steps = int(state["iterator"]["next_index"])
        self.position = steps * self.batch_size - len(state["carry"])


def format_prompt(
    record: Mapping,
    tokenizer: Tokenizer,
    use_chat_template: bool,
    system_prompt: str | None = None,
    prompt_field: str = "prompt",
    template_kwargs: Mapping | None = None,
) -> list[int]:
    """Prompt token ids of one record.

    With the chat template: [system_prompt?, user: prompt] rendered by the tokenizer with the
    generation prompt appended (`template_kwargs` such as Qwen3's enable_thinking=False go to the
    template), encoded without extra BOS (the template text has it). Without:
    `system_prompt + prompt` verbatim (bring your own separator), with BOS only when the tokenizer
    asks for it on raw text. A prompt that is already a message list needs the chat template.

    The record's prompt is data: special-token strings in it ("<|im_end|>") are encoded as text
    (`models/special_text.py`). The system prompt is the config's own text, like the template:
    its special-token strings (a `<tool_call>` in a described call format) keep their ids.
    """
    prompt = record[prompt_field]
    if use_chat_template:
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        )
        if system_prompt:
            messages = [{"role": "system", "content": Trusted(system_prompt)}, *messages]
        return tokenizer.encode_chat(
            messages, add_generation_prompt=True, **dict(template_kwargs or {})
        )
    if not isinstance(prompt, str):
        raise ValueError(
            f"prompt field {prompt_field!r} holds {type(prompt).__name__}, not text; "
            "message lists need use_chat_template=True"
        )
    text = (system_prompt or "") + tokenizer.escape(prompt)
    return tokenizer.encode_rendered(text, add_bos=tokenizer.add_bos_token)


def tokenize_prompts(
    records: Sequence[Mapping], tokenizer: Tokenizer, config, prompt_field: str, keep: bool = True
):
    """Prompt ids of records under a training config's data settings (chat template, system
    prompt, template kwargs); a prompt longer than config.sampling.max_prompt_len is an error.
    Without `keep` the ids are only checked, one record at a time, and None is returned: a
    large "hf" source is not copied into a list of token lists (launch.train.prepare)."""
    d = config.data
    prompts, longest, where = [], -1, None
    for i, r in enumerate(records):
        ids = format_prompt(r, tokenizer, d.use_chat_template, d.system_prompt or None,
                            prompt_field, d.chat_template_kwargs.to_dict())  # fmt: skip
        if len(ids) > longest:  # the first of the longest
            longest, where = len(ids), i
        if keep:
            prompts.append(ids)
    if where is not None and longest > config.sampling.max_prompt_len:
        text = repr(records[where][prompt_field])
        text = text if len(text) <= 60 else text[:57] + "..."
        raise ValueError(
            f"a prompt has {longest} tokens > config.sampling.max_prompt_len="
            f"{config.sampling.max_prompt_len} (record {where}: {text})"
        )
    return prompts if keep else None


def reward_inputs(
    records: Sequence[Mapping], num_generations: int, prompt_field: str = "prompt"
) -> tuple[list, dict[str, list]]:
    """(prompts, fields) for `combined_rewards`, each record repeated G times in a row.

    That is the sampler's group-contiguous order (completion g of prompt i at row i*G + g). The
    prompt is the record's raw prompt (text or messages), not the templated text.
    """
    rows = [r for r in records for _ in range(num_generations)]
    prompts = [r[prompt_field] for r in rows]
    keys = list(dict.fromkeys(k for r in records for k in r if k != prompt_field))
    return prompts, {k: [r.get(k) for r in rows] for k in keys}
