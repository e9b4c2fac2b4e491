"""Reward functions: plain host Python over decoded text, looked up by name from the config.

A reward is `fn(prompts: list[str], completions: list[str], **fields) -> list[float]`, one value per
completion. `fields` are the data record's other columns as lists aligned with `completions`
(e.g. `answer=[...]`), so a reward names the columns it needs as keyword-only arguments and takes
`**_` for the rest. Adding one:

    @register_reward("ends_with_period")
    def ends_with_period(prompts, completions, **_):
        return [float(c.rstrip().endswith(".")) for c in completions]

then give it a weight next to the others in the config's name -> weight dict; `combined_rewards`
sums them.

Rewards see text, not token ids: the tokenizer's decode is the one place ids become text, and a
reward written against text works for every tokenizer. Completions are expected cut at their
length (EOS and padding removed) before they get here.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np

RewardFn = Callable[..., Sequence[float]]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to the registry under `name`."""

    def wrap(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered (by {REWARDS[name]!r})")
        REWARDS[name] = fn
        return fn

    return wrap


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; known rewards: {sorted(REWARDS)}")
    return REWARDS[name]


def _required_fields(fn: RewardFn) -> list[str]:
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty
    ]


def combined_rewards(
    names_and_weights: Mapping[str, float],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Mapping[str, Sequence] | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(total f32[N], {name: unweighted f32[N]}): the weighted sum of the named rewards.

    The per-reward values are returned unweighted so they can be logged on their own scale.
    """
    if not names_and_weights:
        raise ValueError(f"no rewards configured; known rewards: {sorted(REWARDS)}")
    fields = dict(fields or {})
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions")
    for k, v in fields.items():
        if len(v) != n:
            raise ValueError(f"field {k!r} has {len(v)} values for {n} completions")
    total = np.zeros(n, np.float32)
    per_reward = {}
    for name, weight in names_and_weights.items():
        fn = get_reward(name)
        missing = [f for f in _required_fields(fn) if f not in fields]
        if missing:
            raise ValueError(
                f"reward {name!r} needs data fields {missing}; the records have {sorted(fields)}"
            )
        values = np.asarray(fn(list(prompts), list(completions), **fields), np.float32)
        if values.shape != (n,):
            raise ValueError(f"reward {name!r} returned shape {values.shape}, expected ({n},)")
        per_reward[name] = values
        total += np.float32(weight) * values
    return total, per_reward


# --- built-in rewards -------------------------------------------------------------------------

_LEADING_INT = re.compile(r"\s*(-?\d+)")


@register_reward("arithmetic_exact")
def arithmetic_exact(prompts, completions, *, answer, **_):
    """1 if the completion starts with exactly the answer's integer, else 0.

    The integer is the leading `-?digits` run after whitespace; whatever follows it (EOS text,
    another '=') is ignored. Comparison is on strings, so "081" for 81 is wrong: the canonical form
    is part of the task.
    """
    out = []
    for completion, gold in zip(completions, answer):
        m = _LEADING_INT.match(completion)
        out.append(float(m is not None and m.group(1) == str(gold).strip()))
    return out


# Comma-grouped numbers first, so "1,234" is one number and "1,2,3" three; a trailing '.' (end of
# sentence) is not part of the number.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def _normalize_number(s: str) -> str:
    s = s.replace(",", "")
    if "." in s:
        s = s.rstrip("0").rstrip(".")  # "72.0" -> "72", "2.50" -> "2.5"
    return "0" if s == "-0" else s


def extract_gsm8k_number(text: str) -> str | None:
    """The number after the first `####`, else the last number in `text`, normalised; or None."""
    m = _HASHES.search(text)
    if m is not None:
        return _normalize_number(m.group(1))
    numbers = _ANY_NUMBER.findall(text)
    return _normalize_number(numbers[-1]) if numbers else None


@register_reward("gsm8k_answer")
def gsm8k_answer(prompts, completions, *, answer, **_):
    """1 if the completion's final number equals the gold one, else 0.

    `answer` is GSM8K's full solution ending in `#### n` (a bare number works too); gold and
    completion are extracted the same way by `extract_gsm8k_number`.
    """
    out = []
    for i, (completion, gold_text) in enumerate(zip(completions, answer)):
        gold = extract_gsm8k_number(str(gold_text))
        if gold is None:
            raise ValueError(
                f"gsm8k_answer: no number in the answer field of item {i}: {gold_text!r}"
            )
        out.append(float(extract_gsm8k_number(completion) == gold))
    return out
