"""Reward registry, failure / timeout handling, and the built-in rewards on hand-written completions."""

import time
import warnings

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
        # The seven inputs the old extractor got wrong.
        ("#### 1,2345", "12345"),  # a ',' between digits is a separator, whatever the grouping
        ("#### \u22125", "-5"),  # U+2212 minus sign
        ("#### .5", "0.5"),
        ("#### 007", "7"),
        ("#### 1 234", "1234"),
        ("#### 1e3", "1000"),
        ("10-3", "3"),  # a '-' after a digit is an operator, not a sign
        # Signs.
        ("#### -3", "-3"),
        ("#### \u20135", "-5"),  # en dash directly before the digit
        ("#### +5", "5"),
        ("#### -.5", "-0.5"),
        ("#### -0", "0"),
        ("#### -0.00", "0"),
        ("x = -3", "-3"),
        ("(-3)", "-3"),
        ("x-3", "3"),  # after a letter: a hyphen
        ("f(2)-3", "3"),  # after a closing bracket: an operator
        ("it is \u22127 degrees", "-7"),
        ("10 - 3", "3"),  # a sign only counts directly before the digits
        # Separators, currency, units, markdown.
        ("so she has 1,234 left.\n#### 1,234", "1234"),
        ("#### $18", "18"),
        ("#### $1,000", "1000"),
        ("#### -$5", "-5"),
        ("#### 1,000.50", "1000.5"),
        ("#### 1\u2009234", "1234"),  # thin space
        ("#### 1\u202f234 567", "1234567"),  # narrow no-break space, then a plain one
        ("#### 18 dollars", "18"),
        ("#### 50%", "50"),
        ("#### 42.", "42"),
        ("#### **42**", "42"),
        ("The answer is **42**.", "42"),
        ("#### 2.5E-2", "0.025"),
        ("#### 12345678901234567890123456789012345", "12345678901234567890123456789012345"),
        # The first #### wins; without one, the last number in the text.
        ("#### 5 and later 7", "5"),
        ("#### 5\n#### 7", "5"),
        ("#### none here, but 9", "9"),
        ("The answer is 42.", "42"),
        ("I get 3 then 72.0", "72"),
        ("costs 2.50 dollars", "2.5"),
        ("counted 1,2,3", "3"),  # in free text a badly grouped ',' separates a list
        ("about 1\u2009234 of them", "1234"),
        ("the 3 400 items", "400"),  # in free text a plain space never joins digits
        ("version 1.2.3", "3"),
        ("no number here", None),
        ("", None),
        ("####", None),
    ],
)
def test_extract_gsm8k_number(text, number):
    assert extract_gsm8k_number(text) == number


GSM8K_GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,234"


@pytest.mark.parametrize(
    "completion, gold, reward",
    [
        ("#### 007", "7", 1.0),  # compared by value, not as strings
        ("The answer is 7.0", "7", 1.0),
        ("#### 2.50", "2.5", 1.0),
        ("#### .5", "0.5", 1.0),
        ("#### 1e3", "1000", 1.0),
        ("#### \u22125", "-5", 1.0),
        ("#### 5", "-5", 0.0),
        ("#### 1,234", GSM8K_GOLD, 1.0),
        ("The answer is 1234.", GSM8K_GOLD, 1.0),
        ("1234.0", GSM8K_GOLD, 1.0),
        ("#### 1235", GSM8K_GOLD, 0.0),
        ("-1234", GSM8K_GOLD, 0.0),
        ("no idea", GSM8K_GOLD, 0.0),
        ("0.1 + 0.2 = 0.3", "0.3", 1.0),  # exact decimals, no float rounding
        ("#### 0.30000000000000004", "0.3", 0.0),
    ],
)
def test_gsm8k_answer(completion, gold, reward):
    assert _score("gsm8k_answer", [completion], [gold]) == [reward]


def test_gsm8k_answer_gold_without_number():
    with pytest.raises(ValueError, match="no number in the answer field of item 1"):
        _score("gsm8k_answer", ["42", "42"], ["42", "unknown"])


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
    monkeypatch.setitem(rewards.REWARDS, "nan", lambda prompts, completions, **_: [1.0, np.nan])
    with pytest.warns(RuntimeWarning, match="reward 'nan' returned nan for completion 1"):
        total, _ = combined_rewards({"nan": 1.0}, prompts, completions, {})
    assert np.isnan(total[1]) and total[0] == 1.0  # passed on: the learner skips the step


def _raising(prompts, completions, **_):
    raise RuntimeError("grader crashed")


def test_raising_reward_scores_zero_and_is_counted(monkeypatch):
    monkeypatch.setitem(rewards.REWARDS, "raising_test", _raising)
    monkeypatch.setattr(rewards, "_WARNED", set())
    prompts, completions, fields = ["1+1=", "2+2="], ["2", "4"], {"answer": ["2", "5"]}
    with pytest.warns(
        RuntimeWarning, match="'raising_test' failed \\(RuntimeError: grader crashed"
    ):
        total, per = combined_rewards(
            {"arithmetic_exact": 1.0, "raising_test": 2.0}, prompts, completions, fields
        )
    np.testing.assert_array_equal(total, [1.0, 0.0])  # the other reward is unaffected
    np.testing.assert_array_equal(per["arithmetic_exact"], [1.0, 0.0])
    np.testing.assert_array_equal(per["arithmetic_exact_failed"], [0.0, 0.0])
    np.testing.assert_array_equal(per["raising_test"], [0.0, 0.0])
    np.testing.assert_array_equal(per["raising_test_failed"], [1.0, 1.0])
    assert all(v.dtype == np.float32 for v in per.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second failure is counted, not reported again
        _, per = combined_rewards({"raising_test": 1.0}, prompts, completions, fields)
    np.testing.assert_array_equal(per["raising_test_failed"], [1.0, 1.0])


def test_config_mistakes_still_raise(monkeypatch):
    monkeypatch.setitem(rewards.REWARDS, "raising_test", _raising)
    with pytest.raises(KeyError, match="unknown reward 'nope'"):  # before any reward is called
        combined_rewards({"raising_test": 1.0, "nope": 1.0}, ["p"], ["c"], {})
    with pytest.raises(ValueError, match="needs data fields"):
        combined_rewards({"raising_test": 1.0, "arithmetic_exact": 1.0}, ["p"], ["c"], {})
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        combined_rewards({"arithmetic_exact": 1.0}, ["p"], ["c"], {"answer": ["1"]}, timeout_s=0)
    monkeypatch.setitem(rewards.REWARDS, "none_test", lambda prompts, completions, **_: None)
    with pytest.raises(ValueError, match="reward 'none_test' returned shape"):
        combined_rewards({"none_test": 1.0}, ["p"], ["c"], {})


def test_reward_timeout(monkeypatch):
    def slow(prompts, completions, **_):
        time.sleep(5.0)
        return [1.0] * len(completions)

    monkeypatch.setitem(rewards.REWARDS, "slow_test", slow)
    monkeypatch.setattr(rewards, "_WARNED", set())
    fields = {"answer": ["2", "4"]}
    start = time.monotonic()
    with pytest.warns(
        RuntimeWarning, match="'slow_test' failed \\(RewardTimeout: no result within"
    ):
        total, per = combined_rewards(
            {"arithmetic_exact": 1.0, "slow_test": 1.0}, ["", ""], ["2", "4"], fields, timeout_s=1.0
        )
    assert time.monotonic() - start < 4.0  # the slow call was abandoned, not waited for
    np.testing.assert_array_equal(total, [1.0, 1.0])
    np.testing.assert_array_equal(per["slow_test"], [0.0, 0.0])
    np.testing.assert_array_equal(per["slow_test_failed"], [1.0, 1.0])
    np.testing.assert_array_equal(per["arithmetic_exact_failed"], [0.0, 0.0])
    # Within the budget a reward's result, and its errors, come back from the worker thread.
    total, per = combined_rewards(
        {"arithmetic_exact": 1.0}, [""], ["2"], {"answer": ["2"]}, timeout_s=5
    )
    np.testing.assert_array_equal(total, [1.0])
    monkeypatch.setitem(rewards.REWARDS, "nan", lambda prompts, completions, **_: [np.nan])
    with pytest.warns(RuntimeWarning, match="reward 'nan' returned nan for completion 0"):
        total, _ = combined_rewards({"nan": 1.0}, [""], ["2"], {}, timeout_s=5)
    assert np.isnan(total[0])
    monkeypatch.setitem(rewards.REWARDS, "raising_test", _raising)
    with pytest.warns(RuntimeWarning, match="RuntimeError: grader crashed"):
        _, per = combined_rewards({"raising_test": 1.0}, [""], ["2"], {}, timeout_s=5)
    np.testing.assert_array_equal(per["raising_test_failed"], [1.0])


@pytest.mark.parametrize(
    "completion, gold, reward",
    [
        (r"so the answer is \boxed{1/2}", "0.5", 1.0),
        (r"\boxed{\frac{1}{2}}", "1/2", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),  # gold as a LaTeX expression
        (r"\boxed{3}", r"so $x = 3$, hence \boxed{3}.", 1.0),  # gold's last \boxed{}
        (r"\boxed{3}", r"\boxed{3}", 1.0),
        (r"\boxed{1 + x^2}", "x^2+1", 1.0),
        (r"\boxed{\frac{1}{3}}", "1/2", 0.0),  # wrong
        (r"first \boxed{2}, no: \boxed{3}", "2", 0.0),  # the last box is the answer
        ("the answer is 1/2", "1/2", 0.0),  # no \boxed{}
        (r"so \boxed{\frac{1}{2", "1/2", 0.0),  # cut before the box closed
        (r"\boxed{}", "1/2", 0.0),
    ],
)
def test_math_verify(completion, gold, reward):
    assert _score("math_verify", [completion], [gold]) == [reward]


def test_math_verify_on_a_worker_thread():
    # math-verify's default timeouts use SIGALRM and fail off the main thread; ours are off.
    total, per = combined_rewards(
        {"math_verify": 1.0}, ["", ""], [r"\boxed{1/2}", r"\boxed{2}"], {"answer": ["0.5", "3"]},
        timeout_s=30,
    )  # fmt: skip
    np.testing.assert_array_equal(total, [1.0, 0.0])
    np.testing.assert_array_equal(per["math_verify_failed"], [0.0, 0.0])


def test_math_verify_empty_gold():
    with pytest.raises(ValueError, match="no answer in the answer field of item 1"):
        _score("math_verify", [r"\boxed{1}", r"\boxed{1}"], ["1", ""])


def test_last_boxed():
    assert rewards.last_boxed(r"a \boxed{\frac{1}{2}} b \fbox{x^{2}}") == "x^{2}"
    assert rewards.last_boxed(r"\boxed {3}") == "3"
    assert rewards.last_boxed("no box") is None
    assert rewards.last_boxed(r"\boxed{1} \boxed{2") is None
