"""Prompt pipeline: sources, shuffling, per-shard draws, checkpointed stream position."""

import json
import sys

import grain
import numpy as np
import pytest

from configs import default
from models.tokenizer import CharTokenizer, load_tokenizer
from rl.data import format_prompt, make_prompt_stream, reward_inputs
from rl.sources import load_records
from rl.tasks import ARITHMETIC_ALPHABET, arithmetic_records, is_heldout

ARITH = {"type": "arithmetic", "num": 50, "digits": 2, "ops": "+-*", "seed": 1}


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _takes(stream, n, batch_size):
    """n steps' batches of batch_size records."""
    return [stream.take(batch_size) for _ in range(n)]


class _Spy:
    """Stands for a stream's dataset, recording the indices read."""

    def __init__(self, dataset):
        self.dataset, self.read = dataset, []

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, q):
        self.read.append(q)
        return self.dataset[q]


def test_arithmetic_records():
    records = arithmetic_records(seed=3, num=200, digits=2, ops="+-*")
    assert records == arithmetic_records(seed=3, num=200, digits=2, ops="+-*")
    for r in records:
        assert r["answer"] == str(eval(r["prompt"][:-1]))
        assert set(r["prompt"] + r["answer"]) <= set(ARITHMETIC_ALPHABET)
    assert any(r["answer"].startswith("-") for r in records)


@pytest.mark.parametrize(
    "digits,ops,split", [(1, "+", "train"), (2, "*", "eval"), (12, "-", "train")]
)
def test_one_operator_records_are_the_record_by_record_stream(digits, ops, split):
    """One operator takes the batched draw (rl/tasks.py `_draws`): the same records as drawing two
    operands and an operator index per record, rejecting the other split's prompts."""
    rng, want = np.random.default_rng(5), []
    while len(want) < 300:
        a, b = (int(x) for x in rng.integers(0, 10**digits, size=2))
        op = ops[int(rng.integers(len(ops)))]
        if is_heldout(f"{a}{op}{b}=", 0.3) == (split == "eval"):
            want.append({"prompt": f"{a}{op}{b}=", "answer": str(eval(f"{a}{op}{b}"))})
    assert arithmetic_records(5, 300, digits, ops, split, eval_fraction=0.3) == want


def test_warm_start_tokenizer_encodes_every_op():
    """The demo's warm start (configs/assets/arithmetic_sft) carries a CharTokenizer over
    ARITHMETIC_ALPHABET, sized like the model's vocabulary, that encodes records of every op."""
    checkpoint = default.get_config().model.hf_checkpoint
    tok = load_tokenizer(checkpoint)
    assert isinstance(tok, CharTokenizer) and tok.alphabet == ARITHMETIC_ALPHABET
    with open(f"{checkpoint}/config.json") as f:
        assert json.load(f)["vocab_size"] == tok.vocab_size
    seen = set()
    for ops in ("+", "-", "*", "+-*"):
        for split in ("train", "eval"):
            for r in arithmetic_records(seed=0, num=100, digits=2, ops=ops, split=split):
                text = r["prompt"] + r["answer"]
                assert tok.decode(tok.encode(text)) == text
                seen |= set(text)
    assert seen == set(ARITHMETIC_ALPHABET)  # every character occurs (negative answers too)


def test_arithmetic_eval_split_disjoint():
    train = arithmetic_records(seed=0, num=2000, digits=1, ops="+", eval_fraction=0.2)
    held = arithmetic_records(seed=0, num=50, digits=1, ops="+", split="eval", eval_fraction=0.2)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(is_heldout(r["prompt"], 0.2) for r in held)


def test_jsonl_source(tmp_path):
    recs = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    a = _write_jsonl(tmp_path / "a.jsonl", recs[:3])
    _write_jsonl(tmp_path / "b.jsonl", recs[3:])
    assert load_records({"type": "jsonl", "path": a}) == recs[:3]
    assert load_records({"type": "jsonl", "path": str(tmp_path / "*.jsonl")}) == recs


def test_clear_errors(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_records({"type": "jsonl", "path": missing})
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"question": "b"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no prompt field 'prompt'"):
        load_records({"type": "jsonl", "path": bad})
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no prompt field 'question'"):
        load_records({"type": "jsonl", "path": bad, "prompt_field": "question"})
    with pytest.raises(ValueError, match="source type must be one of"):
        load_records({"type": "csv", "path": bad})
    with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
        make_prompt_stream(ARITH, batch_size=0, seed=0)
    five = _write_jsonl(tmp_path / "five.jsonl", [{"prompt": str(i)} for i in range(5)])
    with pytest.raises(ValueError, match="do not fill one batch of 8"):
        make_prompt_stream({"type": "jsonl", "path": five}, batch_size=8, seed=0, num_epochs=1)


def test_shuffle_determinism():
    first = _takes(make_prompt_stream(ARITH, batch_size=8, seed=7), 4, 8)
    assert first == _takes(make_prompt_stream(ARITH, batch_size=8, seed=7), 4, 8)
    assert first != _takes(make_prompt_stream(ARITH, batch_size=8, seed=8), 4, 8)
    ordered = make_prompt_stream(ARITH, batch_size=8, seed=7, shuffle=False)
    records = load_records(ARITH)
    assert ordered.take(8) == records[:8]
    assert ordered.take(45) == records[8:] + records[:3]  # then the next epoch, in order again


def test_epochs_cover_every_record_and_end():
    # 50 records, 2 epochs, batches of 10: exactly 100 records, each epoch a permutation.
    stream = make_prompt_stream(ARITH, batch_size=10, seed=0, num_epochs=2)
    batches = _takes(stream, 10, 10)
    with pytest.raises(StopIteration):
        stream.take(10)
    with pytest.raises(StopIteration):  # not even one record more
        stream.take(1)
    prompts = [r["prompt"] for b in batches for r in b]
    key = sorted(r["prompt"] for r in load_records(ARITH))
    assert sorted(prompts[:50]) == key and sorted(prompts[50:]) == key
    assert prompts[:50] != prompts[50:]  # reshuffled per epoch


def test_epochs_end_at_the_last_whole_batch():
    # 50 records x 1 epoch in batches of 8: 6 batches; the 2 records of a 7th are never drawn,
    # also not by draws smaller than a batch.
    stream = make_prompt_stream(ARITH, batch_size=8, seed=0, num_epochs=1)
    assert len(stream.take(45)) == 45 and len(stream.take(3)) == 3
    with pytest.raises(StopIteration):
        stream.take(1)
    assert stream.get_state() == {"position": 48}


def test_shard_draws_concatenate_to_the_global_draws():
    kw = dict(batch_size=8, seed=3, num_epochs=None)
    glob = _takes(make_prompt_stream(ARITH, **kw), 9, 8)  # crosses the 50-record epoch boundary
    both = make_prompt_stream(ARITH, **kw)
    shards = [both.take_shards([4, 4], [True, True]) for _ in range(9)]
    assert all(len(b) == 4 for s in shards for b in s)
    assert [a + b for a, b in shards] == glob
    # A process holding shard 1 alone gets None for shard 0 and never reads its records.
    other = make_prompt_stream(ARITH, **kw)
    other.dataset = spy = _Spy(other.dataset)
    mine = [other.take_shards([4, 4], [False, True]) for _ in range(9)]
    assert all(a is None for a, _ in mine)
    assert [b for _, b in mine] == [b for _, b in shards]
    assert spy.read == [q for step in range(9) for q in range(8 * step + 4, 8 * step + 8)]
    assert other.get_state() == both.get_state() == {"position": 72}
    # Uneven shards (a DAPO refill asks each shard for what it misses) take the records in turn.
    uneven = make_prompt_stream(ARITH, **kw)
    a, none, c = uneven.take_shards([3, 0, 2], [True, True, True])
    assert a + none + c == glob[0][:5] and none == []
    assert uneven.take(3) == glob[0][5:]


def test_state_save_restore():
    kw = dict(batch_size=8, seed=5)
    stream = make_prompt_stream(ARITH, **kw)
    _takes(stream, 3, 8)
    stream.take(3)  # a refill: part of a batch
    state = json.loads(json.dumps(stream.get_state()))  # must survive a JSON round trip
    assert state == {"position": 27}
    expected = _takes(stream, 5, 8)  # crosses the epoch boundary
    restored = make_prompt_stream(ARITH, **kw)
    restored.set_state(state)
    assert _takes(restored, 5, 8) == expected
    # The state is the global position, so a process holding shard 1 of 2 resumes at the same place.
    shard = make_prompt_stream(ARITH, **kw)
    shard.set_state(state)
    assert [b[4:] for b in expected] == [
        shard.take_shards([4, 4], [False, True])[1] for _ in range(5)
    ]


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_from_old_checkpoint_formats(shuffle):
    """Checkpoints of earlier versions: a grain iterator over batches of batch_size records of the
    global order ({"next_index": k}, the next batch it yields) with the records of the batches
    it had read but not drawn yet ("carry"), or, older, the iterator's state alone."""
    kw = dict(batch_size=8, seed=5, shuffle=shuffle)
    records = load_records(ARITH)
    if shuffle:  # the old iterator's batches, built with grain as it built them
        ds = grain.MapDataset.source(records).shuffle(seed=5).repeat(None)
        old = ds.batch(8, drop_remainder=True, batch_fn=list)
        batch = lambda k: old[k]
    else:
        batch = lambda k: [records[q % len(records)] for q in range(8 * k, 8 * k + 8)]
    # A run drew 6 batches and a refill of 5 records: batch 6 read (records 48..55, across the
    # epoch boundary), 3 of its records carried.
    carried = batch(6)[5:]
    state = {"iterator": {"next_index": 7}, "carry": carried}
    resumed = make_prompt_stream(ARITH, **kw)
    resumed.set_state(json.loads(json.dumps(state)))
    want = carried + batch(7) + batch(8)[:5]
    assert resumed.take(8) + resumed.take(8) == want
    assert resumed.get_state() == {"position": 69}
    uninterrupted = make_prompt_stream(ARITH, **kw)
    assert _takes(uninterrupted, 6, 8) == [batch(k) for k in range(6)]
    uninterrupted.take(5)
    assert uninterrupted.take(8) + uninterrupted.take(8) == want
    # Older still: the iterator's state alone, at a batch boundary.
    bare = make_prompt_stream(ARITH, **kw)
    bare.set_state({"next_index": 3})
    assert _takes(bare, 5, 8) == [batch(k) for k in range(3, 8)]


def test_format_prompt_and_reward_inputs():
    tok = CharTokenizer(ARITHMETIC_ALPHABET)
    rec = {"prompt": "23+58=", "answer": "81"}
    ids = format_prompt(rec, tok, use_chat_template=False, system_prompt=None)
    assert tok.decode(ids) == "23+58="
    assert format_prompt(rec, tok, use_chat_template=True, system_prompt="1=") == tok.encode(
        "1=23+58="
    )
    with pytest.raises(ValueError, match="use_chat_template=True"):
        format_prompt({"prompt": [{"role": "user", "content": "1"}]}, tok, False)
    prompts, fields = reward_inputs([rec, {"prompt": "1+1=", "answer": "2"}], num_generations=2)
    assert prompts == ["23+58=", "23+58=", "1+1=", "1+1="]
    assert fields == {"answer": ["81", "81", "2", "2"]}


def test_stream_is_lazy_over_infinite_repeat():
    stream = make_prompt_stream(ARITH, batch_size=16, seed=0)
    assert len(stream.dataset) == sys.maxsize  # repeated forever: never materialised
    stream.dataset = spy = _Spy(stream.dataset)
    assert all(len(b) == 16 for b in _takes(stream, 20, 16))
    assert spy.read == list(range(320))  # only the records drawn were read


class _RecordingTokenizer(CharTokenizer):
    """Renders messages as role:content| so the test sees what format_prompt sent."""

    add_bos_token = True

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
        return "".join(f"{m['role']}:{m['content']}|" for m in messages) + "A:"


def test_format_prompt_messages_and_bos():
    tok = _RecordingTokenizer("ASemorstuy:|0123456789+=")
    text = lambda ids: tok.decode(ids, skip_special=False)
    rec = {"prompt": "1+1="}
    assert text(format_prompt(rec, tok, True, "S")) == "system:S|user:1+1=|A:"
    chat = {"prompt": [{"role": "user", "content": "2"}]}
    assert text(format_prompt(chat, tok, True, None)) == "user:2|A:"
    assert text(format_prompt(rec, tok, False)) == "<bos>1+1="  # the tokenizer asks for BOS


def test_config_dict_source_and_parquet(tmp_path):
    ml_collections = pytest.importorskip("ml_collections")
    cfg = ml_collections.ConfigDict(dict(ARITH, path=""))
    assert load_records(cfg) == load_records(ARITH)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        empty = tmp_path / "x.parquet"
        empty.write_bytes(b"")
        with pytest.raises(ImportError, match="pip install pyarrow"):
            load_records({"type": "parquet", "path": str(empty)})
