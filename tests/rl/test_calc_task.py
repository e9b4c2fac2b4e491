"""The calculator task: the tool (`rl.tasks.calculator`), its alphabet, and the warm start's
episode encoding (`launch.sft.calc_example` / `encode_calc`), token for token."""

import json
import os

import numpy as np
import pytest

from launch.sft import calc_example, encode_calc
from models.tokenizer import CharTokenizer, load_tokenizer
from rl.tasks import (
    ARITHMETIC_ALPHABET,
    CALC_ALPHABET,
    arithmetic_records,
    calc_observation,
    calculator,
)
from tests.conftest import ROOT

TOK = CharTokenizer(CALC_ALPHABET)
EOS = TOK.eos_ids[0]


@pytest.mark.parametrize(
    "expr, result",
    [
        ("123*456", "56088"),
        ("2+3", "5"),
        ("3-5", "-2"),
        ("0*0", "0"),
        ("007*2", "14"),  # leading zeros are digits like any other
        ("999999999999*999999999999", str(999999999999**2)),  # 12 digits: the limit
    ],
)
def test_calculator_valid(expr, result):
    assert calculator(expr) == result
    assert calc_observation(expr) == result + ";"


@pytest.mark.parametrize(
    "expr",
    [
        "",
        "123",
        "1+",
        "*2",
        "-1+2",  # no signs
        "1+-2",
        "1**2",
        "1+2+3",
        "1/2",
        "1 + 2",  # no spaces anywhere
        " 1+2",
        "1+2 ",
        "1+2\n",
        "1234567890123*2",  # 13 digits
        "2*1234567890123",
        "1e3*2",
        "١+2",  # a non-ASCII digit
        "<1+2>",  # the call's brackets are not part of the expression
        "1+2;",
        "?",
    ],
)
def test_calculator_malformed(expr):
    assert calculator(expr) is None
    assert calc_observation(expr) == "?;"


def test_calc_alphabet_extends_arithmetic():
    assert CALC_ALPHABET.startswith(ARITHMETIC_ALPHABET)  # earlier ids kept
    assert set(CALC_ALPHABET) - set(ARITHMETIC_ALPHABET) == set("<>;?")
    arith = CharTokenizer(ARITHMETIC_ALPHABET)
    assert TOK.encode(ARITHMETIC_ALPHABET) == arith.encode(ARITHMETIC_ALPHABET)
    assert TOK.vocab_size == 3 + 18


def test_calc_example_tool_path():
    tokens, mask = calc_example({"prompt": "123*456=", "answer": "56088"}, TOK, use_tool=True)
    assert tokens == TOK.encode("123*456=<123*456>56088;56088") + [EOS]
    # prompt (8) untrained, call "<123*456>" (9) trained, observation "56088;" (6) untrained,
    # answer "56088" + eos (6) trained
    assert mask == [0] * 8 + [1] * 9 + [0] * 6 + [1] * 6
    assert TOK.decode([t for t, m in zip(tokens, mask) if m]) == "<123*456>56088"


def test_calc_example_direct_path():
    tokens, mask = calc_example({"prompt": "7*45=", "answer": "315"}, TOK, use_tool=False)
    assert tokens == TOK.encode("7*45=315") + [EOS]
    assert mask == [0] * 5 + [1] * 4


def test_encode_calc_batch():
    records = arithmetic_records(seed=0, num=300, digits=3, ops="*")
    tokens, valid, mask = encode_calc(records, TOK, 32, tool_prob=0.3, seed=0)
    assert tokens.shape == (300, 32) and valid.shape == (300, 32) and mask.shape == (300, 31)
    assert np.array_equal(valid, tokens != 0)
    open_, semi = TOK.encode("<")[0], TOK.encode(";")[0]
    tool = np.any(tokens == open_, axis=1)
    assert 0.2 < tool.mean() < 0.4
    for r, row, m, t in zip(records, tokens, mask, tool):
        n = int((row != 0).sum())
        ids, per_token = calc_example(r, TOK, bool(t))
        assert row[:n].tolist() == ids and not row[n:].any()
        assert m.tolist() == per_token[1:] + [0] * (32 - n)  # mask[t] scores token t+1
        if t:  # observation digits and ";" are never targets; the call's ">" and the copy are
            s = int(np.flatnonzero(row == semi)[0])
            obs = len(calc_observation(r["prompt"][:-1]))
            assert not m[s - obs : s].any() and m[s - obs - 1] == 1 and m[s] == 1
    assert np.array_equal(encode_calc(records, TOK, 32, 0.3, 0)[0], tokens)  # deterministic
    assert not np.any(encode_calc(records, TOK, 32, 0.0, 0)[0] == open_)
    assert np.all(np.any(encode_calc(records, TOK, 32, 1.0, 0)[0] == open_, axis=1))
    with pytest.raises(ValueError, match="seq_len"):
        encode_calc(records, TOK, 20, 1.0, 0)


def test_calc_warm_start_tokenizer():
    """The shipped warm start carries a CharTokenizer over CALC_ALPHABET sized like its model."""
    checkpoint = os.path.join(ROOT, "configs", "assets", "calc_sft")
    tok = load_tokenizer(checkpoint)
    assert isinstance(tok, CharTokenizer) and tok.alphabet == CALC_ALPHABET
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    assert config["vocab_size"] == tok.vocab_size and config["max_position_embeddings"] >= 32
