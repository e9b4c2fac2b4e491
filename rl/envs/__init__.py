"""Multi-turn environments (`rl.envs.base` has the interface); importing this package registers
the built-in ones by name for the config's `env.name`."""

from rl.envs import calculator, code_tests, repo, repo_fix  # noqa: F401  (register themselves)
from rl.envs.base import ENVIRONMENTS, Environment, Episode, Turn, make_env, register_env

__all__ = ["ENVIRONMENTS", "Environment", "Episode", "Turn", "make_env", "register_env"]
