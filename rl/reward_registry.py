"""The reward registry: name -> reward function, filled by `@register_reward(name)`.

It is a module of its own so that reward modules can register into it without importing
`rl.rewards`, which imports them (`rl.code_rewards`): the arrows run one way,
rl.rewards -> rl.code_rewards -> rl.reward_registry. Look rewards up through `rl.rewards`
(`REWARDS`, `get_reward`), which registers every built-in one when imported.
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
