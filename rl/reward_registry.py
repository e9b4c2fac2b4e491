"""The reward registry: name -> reward function, filled by `@register_reward(name)`.

It is a module of its own so that an environment's rewards register into it from above without
importing `rl.rewards`: rl.envs.code_rewards -> rl.reward_registry, and no learning module imports
an environment. `rl.rewards` defines the plain-text rewards and re-exports the registry
(`REWARDS`, `get_reward`); importing `rl.envs` (launch's entry points do) adds the environments'
rewards (`python_tests`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

RewardFn = Callable[..., Sequence[float]]
REWARDS: dict[str, RewardFn] = {}
CODE_REWARDS: set[str] = set()  # rewards that run model-written code (start-up isolation check)


def register_reward(name: str, runs_code: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to the registry under `name`; `runs_code`: it runs
    the completions' code (in rl.sandbox), so launch.validate checks config.env.isolation."""

    def wrap(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered (by {REWARDS[name]!r})")
        REWARDS[name] = fn
        if runs_code:
            CODE_REWARDS.add(name)
        return fn

    return wrap


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; known rewards: {sorted(REWARDS)}")
    return REWARDS[name]
