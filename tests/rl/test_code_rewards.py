"""The `python_tests` reward: code extraction, and scoring through the shared sandbox."""

import pytest

from rl.envs import code_rewards
from rl.envs.code_rewards import extract_code, failure_message, python_tests, run_tests
from rl.rewards import get_reward
from tests.conftest import sandbox_isolation

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


@pytest.fixture(autouse=True)
def _sandbox_in_the_tests_isolation(monkeypatch):
    """The shared sandbox in the tests' isolation (tests.conftest.sandbox_isolation), as
    launch.validate's use_isolation sets it from config.env.isolation in a run."""
    monkeypatch.setattr(code_rewards, "_isolation", sandbox_isolation())


@pytest.mark.parametrize(
    "text, code",
    [
        ("def f():\n    return 1\n", "def f():\n    return 1\n"),  # no block: the whole text
        ("Here:\n```python\nx = 1\n```\nDone.", "x = 1\n"),
        ("```py\nx = 1\n```", "x = 1\n"),
        ("```\nx = 1\n```", "x = 1\n"),  # untagged
        ("```python\na = 1\n```\ntext\n```python\nb = 2\n```\n", "b = 2\n"),  # the last one
        ("```python\na = 1\n```\nUsage:\n```\n>>> a\n1\n```", "a = 1\n"),  # python beats untagged
        ("```bash\nls\n```\n```\nx = 1\n```", "x = 1\n"),  # other languages are ignored
        ("````python\ns = '```'\n````", "s = '```'\n"),  # a longer fence holds a shorter one
        ("~~~python\nx = 1\n~~~", "x = 1\n"),
        ("I think:\n```python\ndef f():\n    return 2", "def f():\n    return 2"),  # cut off
        ("```python\n```", ""),
    ],
)
def test_extract_code(text, code):
    assert extract_code(text) == code


def test_python_tests_scores_completions_in_parallel():
    completions = [
        "```python\ndef add(a, b):\n    return a + b\n```",  # correct
        "```python\ndef add(a, b):\n    return a - b\n```",  # wrong
        "```python\ndef add(a, b)\n    return a + b\n```",  # syntax error
        "def add(a, b):\n    return a + b\n",  # no code block: the whole text is the code
        "Plain prose, no code at all.",  # no code block, not code
        "```python\ndef add(a, b):\n    return 0\n```\nFixed:\n```python\ndef add(a, b):\n"
        "    return a + b\n```",  # several blocks: the last counts
        "```python\ndef add(a, b):\n    return a + b\n```\n```python\ndef add(a, b):\n"
        "    return 0\n```",  # ... also when it is wrong
        "```python\nimport sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n```",  # exits early
    ]
    rewards = python_tests(["p"] * len(completions), completions, tests=[TESTS] * len(completions))
    assert rewards == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_python_tests_is_registered_and_reads_the_tests_field():
    fn = get_reward("python_tests")
    assert fn is python_tests
    out = fn(["p", "p"], ["```python\nx = 1\n```"] * 2, tests=["assert x == 1", "assert x == 2"])
    assert out == [1.0, 0.0]


def test_run_tests_result_and_failure_message():
    ok = run_tests("def add(a, b):\n    print('adding')\n    return a + b\n", TESTS)
    assert ok.ok and ok.stdout == "adding\nadding\n" and failure_message(ok) == ""
    bad = run_tests("def add(a, b):\n    return a - b\n", TESTS)
    assert not bad.ok and bad.reason == "error"
    msg = failure_message(bad, max_chars=200)
    assert msg.startswith("exit status 1") and "AssertionError" in msg
    assert 'File "tests.py", line 1' in msg and "assert add(2, 3) == 5" in msg  # source shown
    early = run_tests("import os\nos._exit(0)\n", TESTS)
    assert early.reason == "exited_early" and "exited before" in failure_message(early)


def test_the_shared_sandbox_is_made_once():
    assert code_rewards.shared_sandbox() is code_rewards.shared_sandbox()
