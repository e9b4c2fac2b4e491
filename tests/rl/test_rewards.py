"""Reward registry and the built-in arithmetic / GSM8K rewards on hand-written completions."""

import numpy as np
import pytest

from rl import rewards
from rl.rewards import combined_rewards, extract_gsm8k_number, get_reward


def _score(name, completions, answers):
    return get_reward(name)([""] * len(completions), completions, answer=answers)


def test_arithmetic_exact():
    cases = [
        ("81", "81", 1.0),
        (" 81", "81", 1.0),
        ("81<eos>", "81", 1.0),
        ("81=12", "81", 1.0),
        ("-3", "-3", 1.0),
        ("3", "-3", 0.0),
        ("-", "-3", 0.0),
        ("081", "81", 0.0),
        ("8 1", "81", 0.0),
        ("812", "81", 0.0),
        ("", "81", 0.0),
        ("x81", "81", 0.0),
    ]
    got = _score("arithmetic_exact", [c for c, _, _ in cases], [a for _, a, _ in cases])
    assert got == [want for _, _, want in cases]


@pytest.mark.parametrize(
    "text, number",
    [
        ("so she has 1,234 left.\n#### 1,234", "1234"),
        ("The answer is 42.", "42"),
        ("#### -3", "-3"),
        ("#### $18", "18"),
        ("I get 3 then 72.0", "72"),
        ("costs 2.50 dollars", "2.5"),
        ("#### 5 and later 7", "5"),
        ("counted 1,2,3", "3"),
        ("no number here", None),
    ],
)
def test_extract_gsm8k_number(text, number):
    assert extract_gsm8k_number(text) == number


def test_gsm8k_answer():
    gold = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,234"
    completions = ["#### 1,234", "The answer is 1234.", "1234.0", "#### 1235", "no idea", "-1234"]
    assert _score("gsm8k_answer", completions, [gold] * 6) == [1, 1, 1, 0, 0, 0]
    assert _score("gsm8k_answer", ["The answer is 42."], ["42"]) == [1.0]
    with pytest.raises(ValueError, match="no number in the answer"):
        _score("gsm8k_answer", ["42"], ["unknown"])


def test_registry_errors():
    with pytest.raises(KeyError, match="arithmetic_exact"):  # the message lists known names
        get_reward("nope")
    with pytest.raises(ValueError, match="already registered"):
        rewards.register_reward("gsm8k_answer")(lambda p, c, **_: [])
    with pytest.raises(ValueError, match="needs data fields \\['answer'\\]"):
        combined_rewards({"arithmetic_exact": 1.0}, ["1+1="], ["2"], {"other": [0]})
    with pytest.raises(ValueError, match="no rewards configured"):
        combined_rewards({}, ["1+1="], ["2"], {"answer": ["2"]})


def test_combined_weights(monkeypatch):
    monkeypatch.setitem(
        rewards.REWARDS, "length", lambda prompts, completions, **_: [len(c) for c in completions]
    )
    prompts, completions = ["1+1=", "2+2="], ["2", "5xx"]
    total, per = combined_rewards(
        {"arithmetic_exact": 1.0, "length": -0.5}, prompts, completions, {"answer": ["2", "4"]}
    )
    assert total.dtype == np.float32
    np.testing.assert_array_equal(total, [1.0 - 0.5, 0.0 - 1.5])
    np.testing.assert_array_equal(per["arithmetic_exact"], [1.0, 0.0])
    np.testing.assert_array_equal(per["length"], [1.0, 3.0])
    with pytest.raises(ValueError, match="returned shape"):
        monkeypatch.setitem(rewards.REWARDS, "bad", lambda prompts, completions, **_: [1.0])
        combined_rewards({"bad": 1.0}, prompts, completions, {})
