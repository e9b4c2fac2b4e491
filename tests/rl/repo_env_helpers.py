"""What the `repo` environment's tests share: a tokenizer, the env config, generated tasks and an
env (module fixtures: import them into a test module to use them there), and a scripted turn."""

import json
import string

import ml_collections
import pytest

from launch.make_repo_tasks import make_tasks
from models.tokenizer import CharTokenizer
from rl.envs.base import Turn
from rl.envs.repo import RepoEnv

TOK = CharTokenizer(string.printable)


def make_config(**env):
    env = {"max_observation_chars": 2000, "command_timeout_s": 4.0, "tool_workers": 8,
           "workspace_bytes": 32 << 20, "max_tool_seconds": 120.0, **env}  # fmt: skip
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


def call(name, **args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def act(env, ep, text):
    """One scripted turn: the observation text, or None when the episode ended."""
    turn = Turn(TOK.encode(text), text, "stop")
    ep.turns.append(turn)
    obs = env.step(ep, turn)
    return None if obs is None else TOK.decode(obs)
