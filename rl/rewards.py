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
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal

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
        if not np.isfinite(values).all():
            i = int(np.flatnonzero(~np.isfinite(values))[0])
            raise ValueError(f"reward {name!r} returned {values[i]} for completion {i}")
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


# GSM8K numbers. A sign is '+', '-' or a dash-like minus (U+2212 minus sign, U+2012 figure dash,
# U+2013 en dash, U+FE63 small / U+FF0D fullwidth hyphen-minus), and counts only directly before the
# digits or the leading '.' ("-5", "-.5"), or before a currency '$' ("-$5"; also "$-5").
# After '####' the answer is one number, so a ',' between digits is always a separator ("1,2345" is
# 12345) and spaces (plain, no-break U+00A0, thin U+2009, narrow no-break U+202F) separate groups of
# exactly three digits ("1 234"). In free text "1,2,3" is a list, so there a ',', U+00A0, U+2009 or
# U+202F only joins groups of exactly three digits ("1,234") and a plain space never joins.
_SIGN = "[-+\u2212\u2012\u2013\ufe63\uff0d]"
_FRACTION_EXPONENT = r"(?:\.\d+)?(?:[eE][-+\u2212]?\d{1,3}(?!\d))?"  # "1." stops before the '.'
_HASHES = re.compile(
    r"####[\s*_`]*"  # markdown around the answer: "#### **42**"
    rf"(?:(?P<currency_sign>{_SIGN})?\\?\$\s*)?(?P<sign>{_SIGN})?"  # "$5", "-$5", "$-5", "\$5"
    r"(?P<body>(?:\d{1,3}(?:[ \u00a0\u2009\u202f]\d{3})+(?!\d)|\d+(?:,\d+)*|(?=\.\d))"
    + _FRACTION_EXPONENT
    + ")"
)
_ANY_NUMBER = re.compile(
    rf"(?:(?<![\w)\]}}])(?P<sign>{_SIGN})(?:\\?\$)?)?"  # after a digit, letter or bracket: hyphen
    r"(?P<body>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d{1,3}(?:[\u00a0\u2009\u202f]\d{3})+(?!\d)|\d+"
    r"|(?<!\w)(?=\.\d))" + _FRACTION_EXPONENT + ")"
)
_TO_DECIMAL_SYNTAX = str.maketrans(
    {
        **{c: None for c in ", \u00a0\u2009\u202f+"},
        **{c: "-" for c in "\u2212\u2012\u2013\ufe63\uff0d"},
    }
)


def _normalize_number(sign: str, body: str) -> str:
    """The canonical string of the number `sign + body` as matched above, by exact decimal value.

    Separators go, every minus-like sign becomes '-', and the value is written in plain notation
    with no exponent, leading zeros or trailing fractional zeros: "007" -> "7", "2.50" -> "2.5",
    "1e3" -> "1000", ".5" -> "0.5", "-0.0" -> "0". Equal values give equal strings.
    """
    value = Decimal((sign + body).translate(_TO_DECIMAL_SYNTAX))
    if not value:
        return "0"  # also "-0"
    exact = Context(prec=len(value.as_tuple().digits), Emax=MAX_EMAX, Emin=MIN_EMIN)
    return format(value.normalize(exact), "f")


def extract_gsm8k_number(text: str) -> str | None:
    """The GSM8K answer in `text` as a canonical decimal string ("1000", "0.5", "-5"), or None.

    The answer is the number right after the first `####` that is followed by one, else the last
    number anywhere in `text`, else None. Between `####` and the number may come whitespace,
    markdown (`*`, `_`, backticks) and a currency `$` (or `\\$`). A number is an optional sign,
    digits with optional separators (the comment above `_SIGN` says which), an optional `.fraction`
    (or a bare `.5`) and an optional exponent of at most three digits (`1e3`, `2.5E-2`); whatever
    follows it (a unit, '%', a sentence's '.', more text) is ignored. In the last-number fallback a
    sign right after a digit, letter, '_' or closing bracket is a hyphen or an operator: "10-3"
    gives 3, while "x = -3" and "(-3)" give -3. Values are exact (`decimal.Decimal`, never floats)
    and canonical (see `_normalize_number`), so equal values give equal strings.
    """
    m = _HASHES.search(text)
    if m is not None:
        return _normalize_number(m["sign"] or m["currency_sign"] or "", m["body"])
    numbers = list(_ANY_NUMBER.finditer(text))
    return _normalize_number(numbers[-1]["sign"] or "", numbers[-1]["body"]) if numbers else None


@register_reward("gsm8k_answer")
def gsm8k_answer(prompts, completions, *, answer, **_):
    """1 if the completion's answer number equals the gold one in value, else 0.

    `answer` is GSM8K's full solution ending in `#### n` (a bare number works too); gold and
    completion are extracted the same way by `extract_gsm8k_number`, so "#### 007", "7.0" and "7"
    all match gold 7. A gold answer with no number raises ValueError naming the item.
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
