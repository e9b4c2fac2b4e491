"""Data sources of type "hf" (rl/sources.py): a `save_to_disk` directory (load_from_disk) and a
directory of parquet files (datasets.load_dataset) give the records of the same rows as jsonl, in
the same order, per batch shard, through grain's random access, and resume as jsonl does."""

import json

import pytest

from rl.data import make_prompt_stream
from rl.sources import HFRecords, load_records

datasets = pytest.importorskip("datasets")

ROWS = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}", "n": i} for i in range(11)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same rows as jsonl, as a save_to_disk directory and as a parquet file (its name gives
    the split, as on the Hub), as source configs."""
    top = tmp_path_factory.mktemp("hf_data")
    jsonl = top / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    datasets.Dataset.from_list(ROWS).save_to_disk(str(top / "saved"))
    (top / "parquet").mkdir()
    datasets.Dataset.from_list(ROWS).to_parquet(
        str(top / "parquet" / "train-00000-of-00001.parquet")
    )
    old, datasets.config.HF_DATASETS_CACHE = datasets.config.HF_DATASETS_CACHE, str(top / "cache")
    field = {"prompt_field": "question"}
    yield {
        "jsonl": {"type": "jsonl", "path": str(jsonl), **field},
        "saved": {"type": "hf", "path": str(top / "saved"), **field},
        "parquet": {"type": "hf", "path": str(top / "parquet"), "split": "train", **field},
        # one file: load_dataset("parquet", data_files=...)
        "file": {"type": "hf", "path": str(top / "parquet" / "train-*.parquet"), **field},
    }
    datasets.config.HF_DATASETS_CACHE = old  # (the Arrow cache load_dataset writes, above)


def test_records_are_the_rows_in_order(sources):
    """Same records as the jsonl lines; an "hf" source stays a random-access view of the Arrow
    table (HFRecords), not a list."""
    want = load_records(sources["jsonl"])
    for name in ("saved", "parquet", "file"):
        got = load_records(sources[name])
        assert isinstance(got, HFRecords) and len(got) == len(ROWS)
        assert list(got) == want == ROWS, name
        assert got[3] == ROWS[3] and got[-1] == ROWS[-1] and got[2:4] == ROWS[2:4]


def test_batches_per_process_and_resume_equal_jsonl(sources):
    """Each shard's draws (2 shards of 2 prompts a step, 11 rows: steps straddle epochs) are
    those of the jsonl rows, and a stream set to a saved state goes on exactly."""
    kwargs = dict(batch_size=4, seed=3)
    runs = {}
    for name, src in sources.items():
        stream = make_prompt_stream(src, **kwargs)
        runs[name] = [stream.take_shards([2, 2], [True, True]) for _ in range(3)]
        state = stream.get_state()
        resumed = make_prompt_stream(src, **kwargs)
        resumed.set_state(json.loads(json.dumps(state)))  # as the checkpoint stores it
        runs[name] += [resumed.take_shards([2, 2], [True, True]) for _ in range(3)]
        assert runs[name][3:] == [stream.take_shards([2, 2], [True, True]) for _ in range(3)], name
    assert runs["saved"] == runs["jsonl"] == runs["parquet"] == runs["file"]
    assert all(len(shard) == 2 for step in runs["jsonl"] for shard in step)
    first = runs["saved"][0]
    assert first[0] != first[1]  # the shards hold different records


def test_a_hub_dataset_is_fetched_for_its_subset_only(tmp_path):
    """subset_files: the files of the asked subset from the card's `configs` (openai/gsm8k has
    `main` and `socratic`), the default or only subset without a name, all files (None) where the
    card does not say; a subset it does not hold, or none of several, is refused naming them."""
    from rl.sources import SourceError, subset_files

    card = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files: socratic/*.parquet
  data_dir: extra
---
"""
    (tmp_path / "README.md").write_text(card)
    assert subset_files(str(tmp_path), "main") == ("README.md", "main/train-*", "main/test-*")
    assert subset_files(str(tmp_path), "socratic") == ("README.md", "extra/socratic/*.parquet")
    with pytest.raises(SourceError, match=r"^name='': org/d has several subsets and no "
                       r"default: name one of \['main', 'socratic'\]$"):  # fmt: skip
        subset_files(str(tmp_path), None, "org/d")  # (before any data file is fetched)
    with pytest.raises(SourceError, match=r"^name='mian': org/d: no such subset \(it has "
                       r"\['main', 'socratic'\]\)$"):  # fmt: skip
        subset_files(str(tmp_path), "mian", "org/d")
    (tmp_path / "README.md").write_text(card.split("- config_name: socratic")[0] + "---\n")
    assert subset_files(str(tmp_path), None) == ("README.md", "main/train-*", "main/test-*")
    (tmp_path / "README.md").write_text("# no card metadata\n")
    assert subset_files(str(tmp_path), "main") is None
    assert subset_files(str(tmp_path / "none"), "main") is None


@pytest.mark.parametrize(
    "source, changes, message",
    [
        ("parquet", {"split": "test"}, "split='test': no such split of {parquet} (it has ['train'])"),
        ("parquet", {"split": "train+test[:2]"}, "split='train+test[:2]': no such split of {parquet} (it has ['train'])"),
        ("saved", {"prompt_field": "q"}, "prompt_field='q': no such column in {saved} split 'train' (columns: ['answer', 'n', 'question'])"),
        ("parquet", {"prompt_field": "q"}, "prompt_field='q': no such column in {parquet} split 'train' (columns: ['answer', 'n', 'question'])"),
        ("file", {"prompt_field": "q"}, "prompt_field='q': no such column in {file} split 'train' (columns: ['answer', 'n', 'question'])"),
        ("parquet", {"name": "nope"}, "name='nope': {parquet}: BuilderConfig 'nope' not found. Available: ['default']"),
    ],
)  # fmt: skip
def test_bad_fields_name_the_field(sources, source, changes, message):
    """A wrong split, subset or prompt field of an "hf" source raises SourceError, its message
    starting with the field (launch.validate prefixes config.data.<split>.); the split and the
    prompt field are checked before load_dataset generates the Arrow cache."""
    from rl.sources import SourceError

    paths = {k: v["path"] for k, v in sources.items()}
    with pytest.raises(SourceError) as e:
        load_records({**sources[source], **changes})
    assert str(e.value) == message.format(**paths)
    assert e.value.field == next(iter(changes))


def test_prompts_are_checked_without_a_list():
    """launch.train.prepare's length check (keep=False) reads an "hf" source row by row and keeps
    no token lists; it names the same first longest record as the kept ids do."""
    from launch.cli import parse_args
    from models.tokenizer import load_tokenizer
    from rl.data import tokenize_prompts
    from rl.tasks import arithmetic_records

    config = parse_args(["--config.sampling.max_prompt_len=64"], {})[0]
    tokenizer = load_tokenizer(config.model.hf_checkpoint)  # the demo's character tokenizer
    rows = arithmetic_records(seed=0, num=20, digits=3, ops="+-*")
    records = HFRecords(datasets.Dataset.from_list(rows), "rows")
    kept = tokenize_prompts(records, tokenizer, config, "prompt")
    assert tokenize_prompts(records, tokenizer, config, "prompt", keep=False) is None
    longest = max(len(p) for p in kept)
    config.sampling.max_prompt_len = longest - 1
    first = next(i for i, p in enumerate(kept) if len(p) == longest)
    for keep in (True, False):
        with pytest.raises(
            ValueError, match=rf"a prompt has {longest} tokens > .*\(record {first}:"
        ):
            tokenize_prompts(records, tokenizer, config, "prompt", keep=keep)


def test_values_json_cannot_carry(tmp_path, monkeypatch):
    """Arrow's dates, times, durations and decimals (nested ones too) arrive as the text / seconds
    a jsonl file of the rows would hold, for an "hf" source and a parquet one, so the records
    survive the JSON they travel and are logged as (a datetime made json.dumps raise there);
    a column of bytes is refused in one line naming it."""
    import datetime
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rl.sources import SourceError

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    when = datetime.datetime(2024, 1, 2, 3, 4, 5)
    table = pa.table({
        "prompt": ["a", "b", "c"],
        "ts": pa.array([when] * 3, pa.timestamp("s")),
        "day": pa.array([when.date()] * 3, pa.date32()),
        "took": pa.array([datetime.timedelta(seconds=3)] * 3, pa.duration("s")),
        "price": pa.array([decimal.Decimal("1.25")] * 3, pa.decimal128(5, 2)),
        "nested": [[[1, 2], [3]], [[4]], []],
        "meta": [{"at": when, "tags": ["x"]}] * 3,
    })  # fmt: skip
    pq.write_table(table, tmp_path / "train.parquet")
    text = {"ts": "2024-01-02T03:04:05", "day": "2024-01-02", "took": 3.0, "price": "1.25",
            "meta": {"at": "2024-01-02T03:04:05", "tags": ["x"]}}  # fmt: skip
    want = [{"prompt": p, **text, "nested": n} for p, n in zip("abc", [[[1, 2], [3]], [[4]], []])]
    for kind in ("hf", "parquet"):
        src = {"type": kind, "path": str(tmp_path / "train.parquet")}
        got = load_records(src)
        assert [dict(r) for r in got] == want == json.loads(json.dumps(list(got))), kind
        assert got[1] == want[1]
        stream = make_prompt_stream(src, batch_size=2, seed=0)
        (record,) = stream.take(1)
        assert record["ts"] == "2024-01-02T03:04:05" and json.loads(json.dumps(record)) == record
        assert json.loads(json.dumps(stream.get_state())) == {"position": 1}
    pq.write_table(table.append_column("blob", pa.array([b"\x00"] * 3, pa.binary())),
                   tmp_path / "blob.parquet")  # fmt: skip
    path = str(tmp_path / "blob.parquet")
    why = ("columns ['blob'] hold bytes (binary, or an Image / Audio feature), which a record "
           "cannot carry (records are JSON: logged with their completions, read by rewards as a "
           "jsonl line is); remove them (datasets' remove_columns, then save_to_disk) and read "
           "that")  # fmt: skip
    with pytest.raises(SourceError) as e:
        load_records({"type": "hf", "path": path})
    assert str(e.value) == f"path={path!r}: {why}" and e.value.field == "path"
    with pytest.raises(ValueError) as e:
        load_records({"type": "parquet", "path": path})
    assert str(e.value) == f"{path}: {why}"
