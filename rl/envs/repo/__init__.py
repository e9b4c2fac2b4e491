"""The `repo` environment: repository-level coding episodes (SWE-Gym / R2E-Gym style) run in the
sandbox, on a local repository copy or a container image, graded by the repository's own tests.

    env.py        the episodes: records, tools, submit, reward (`RepoEnv`, registered as "repo")
    tools.py      the tool-call format: schemas, instructions, parsing, cutting observations
    sandbox.py    per-episode workspaces and running the three programs in them
    programs.py   the three programs' source (shell, editor, graded test run)
    integrity.py  what keeps the graded run honest (test files put back, the tamper guard)
    grading.py    what grading puts back, and how its result becomes the reward
    images.py     image tasks: a record's container image as the sandbox's root
    tasks.py      SWE-Gym / SWE-smith / R2E-Gym rows -> records
    templates.py  small generated repositories with a planted bug (python -m launch.make_repo_tasks)
    reference.py  reference episodes: a record's own fix through the tools (validation, smoke test)

docs/repo_env.md describes the environment; this package's names below are what launch/ and the
tests use.
"""

from rl.envs.repo.env import RepoEnv, RepoEpisode, check_record, check_records

__all__ = ["RepoEnv", "RepoEpisode", "check_record", "check_records"]
