"""Prompt pipeline: sources, shuffling, per-process sharding, checkpointed iterator state."""

import itertools
import json

import numpy as np
import pytest

from configs import default
from models.tokenizer import CharTokenizer, load_tokenizer
from rl.data import format_prompt, load_records, make_prompt_iterator, reward_inputs
from rl.tasks import ARITHMETIC_ALPHABET, arithmetic_records, is_heldout

ARITH = {"type": "arithmetic", "num": 50, "digits": 2, "ops": "+-*", "seed": 1}


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _take(it, n):
    return [next(it) for _ in range(n)]


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
    with pytest.raises(ValueError, match="multiple of process_count"):
        make_prompt_iterator(ARITH, batch_size=3, seed=0, process_count=2)


def test_shuffle_determinism():
    first = _take(make_prompt_iterator(ARITH, batch_size=8, seed=7), 4)
    assert first == _take(make_prompt_iterator(ARITH, batch_size=8, seed=7), 4)
    assert first != _take(make_prompt_iterator(ARITH, batch_size=8, seed=8), 4)
    ordered = _take(make_prompt_iterator(ARITH, batch_size=8, seed=7, shuffle=False), 1)
    assert ordered[0] == load_records(ARITH)[:8]


def test_epochs_cover_every_record_and_end():
    # 50 records, 2 epochs, batches of 10: exactly 10 steps, each epoch a permutation.
    batches = list(make_prompt_iterator(ARITH, batch_size=10, seed=0, num_epochs=2))
    assert len(batches) == 10
    prompts = [r["prompt"] for b in batches for r in b]
    key = sorted(r["prompt"] for r in load_records(ARITH))
    assert sorted(prompts[:50]) == key and sorted(prompts[50:]) == key
    assert prompts[:50] != prompts[50:]  # reshuffled per epoch


def test_process_sharding_concatenates_to_global_batch():
    kw = dict(batch_size=8, seed=3, num_epochs=None)
    glob = _take(make_prompt_iterator(ARITH, **kw), 9)  # crosses the 50-record epoch boundary
    p0 = _take(make_prompt_iterator(ARITH, process_index=0, process_count=2, **kw), 9)
    p1 = _take(make_prompt_iterator(ARITH, process_index=1, process_count=2, **kw), 9)
    assert all(len(b) == 4 for b in p0 + p1)
    assert [a + b for a, b in zip(p0, p1)] == glob


def test_state_save_restore():
    kw = dict(batch_size=8, seed=5)
    it = make_prompt_iterator(ARITH, **kw)
    _take(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # must survive a JSON round trip
    expected = _take(it, 3)
    restored = make_prompt_iterator(ARITH, **kw)
    restored.set_state(state)
    assert _take(restored, 3) == expected
    # The state counts global steps, so a 2-process run resumes at the same place.
    shard = make_prompt_iterator(ARITH, process_index=1, process_count=2, **kw)
    shard.set_state(state)
    assert [b[4:] for b in expected] == _take(shard, 3)


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


def test_iterator_is_lazy_over_infinite_repeat():
    it = make_prompt_iterator(ARITH, batch_size=16, seed=0)
    assert len(list(itertools.islice(it, 20))) == 20


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
