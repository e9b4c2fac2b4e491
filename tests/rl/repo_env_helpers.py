"""What the `repo` environment's tests share: a tokenizer, the env config, generated tasks and an
env (module fixtures: import them into a test module to use them there), a scripted turn, and a
tiny unittest-style repository of our own (`unittest_task`)."""

import string

import ml_collections
import pytest

from models.tokenizer import CharTokenizer
from rl.environment import Turn
from rl.envs.repo import RepoEnv
from rl.envs.repo.templates import make_tasks
from tests.conftest import sandbox_isolation
from tests.rl.repo_scripted import call  # noqa: F401 (shared with the tests)

TOK = CharTokenizer(string.printable)


def make_config(**env):
    env = {"max_observation_chars": 2000, "command_timeout_s": 4.0, "tool_workers": 8,
           "workspace_bytes": 32 << 20, "max_tool_seconds": 120.0,
           "isolation": sandbox_isolation(), **env}  # fmt: skip
    data = {"use_chat_template": False, "system_prompt": "", "chat_template_kwargs": {}}
    return ml_collections.ConfigDict({"data": data, "env": env})


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return make_tasks(str(tmp_path_factory.mktemp("repo_tasks")), 10, seed=1)


@pytest.fixture(scope="module")
def env():
    e = RepoEnv(TOK, make_config())
    yield e
    e.shutdown()


def act(env, ep, text):
    """One scripted turn: the observation text, or None when the episode ended."""
    turn = Turn(TOK.encode(text), text, "stop")
    ep.turns.append(turn)
    obs = env.step(ep, turn)
    return None if obs is None else TOK.decode(obs)


UNITTEST_REPO = {  # a package with a planted bug, its unittest tests in a tests package, data,
    # and a pytest plugin of the package's own that the root conftest.py names (as Sphinx's does)
    "conftest.py": b'pytest_plugins = ["calc.plugin"]\n',
    "calc/__init__.py": b"from calc.ops import add\n",
    "calc/ops.py": b"def add(a, b):\n    return a - b\n",
    "calc/plugin.py": b'def pytest_report_header(config):\n    return "calc"\n',
    "tests/__init__.py": b"",
    "tests/data/blob.bin": bytes(range(256)),  # not text: restored as bytes
    "tests/test_ops.py": b"""import os
import unittest

from calc import add


class TestOps(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_blob(self):
        with open(os.path.join(os.path.dirname(__file__), "data", "blob.bin"), "rb") as f:
            self.assertEqual(f.read(), bytes(range(256)))
""",
}


def unittest_task(root) -> dict:
    """A record of UNITTEST_REPO written under `root`: test_add fails until `fix` is applied."""
    for rel, data in UNITTEST_REPO.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return {"repo": str(root), "problem": "add(2, 3) is not 5",
            "fail_to_pass": ["tests/test_ops.py::TestOps::test_add"],
            "pass_to_pass": ["tests/test_ops.py::TestOps::test_blob"],
            "fix": {"path": "calc/ops.py", "old": "a - b", "new": "a + b"}}  # fmt: skip


def graded(env, task, commands, fix=True):
    """The reward and episode of `task` after its fix (with `fix`) and bash `commands`."""
    ep = env.start(task)
    if fix:
        f = task["fix"]
        act(env, ep, call("str_replace_editor", command="str_replace", path=f["path"],
                          old_str=f["old"], new_str=f["new"]))  # fmt: skip
    for command in commands:
        act(env, ep, call("bash", command=command))
    try:
        return env.reward(ep), ep
    finally:
        env.close(ep)
