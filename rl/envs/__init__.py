"""The built-in environments (`rl.environment` has the interface and the registries). Importing
this package registers, from above, what the learning modules look up by name and never import:
the environments (config `env.name`), their rewards (`python_tests`, rl/envs/code_rewards.py),
their data sources (`repo_fix`, rl/sources.py) and the sandbox's run counter (`sandbox_runs`,
reported per process by rl/multiturn.py). launch's entry points import it.

    calculator.py      the CPU tool task (a calculator)
    code_tests.py      code with test feedback, run in the sandbox; code_rewards.py its reward
    repo/              repository-level coding episodes (SWE-Gym style), a package
    repo_fix.py        the CPU repository demo; repo_fix_tasks.py its tiny repositories (source)
"""

from rl import sandbox
from rl.environment import (
    ENVIRONMENTS,
    Environment,
    Episode,
    Turn,
    make_env,
    register_counter,
    register_env,
)
from rl.envs import calculator, code_rewards, code_tests, repo, repo_fix  # noqa: F401  (register)

register_counter("sandbox_runs", lambda: sandbox.RUNS[0])  # programs started in a sandbox

__all__ = ["ENVIRONMENTS", "Environment", "Episode", "Turn", "make_env", "register_env"]
