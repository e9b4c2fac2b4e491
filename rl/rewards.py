"""Reward functions: plain host Python over decoded text, looked up by name from the config.

A reward is `fn(prompts: list[str], completions: list[str], **fields) -> list[float]`, one value per
completion. `fields` are the data record's other columns as lists aligned with `completions`
(e.g. `answer=[...]`), so a reward names the columns it needs as keyword-only arguments and takes
`**_` for the rest. Adding one:

    @register_reward("ends_with_period")
    def ends_with_period(prompts, completions, **_):
        return [float(c.rstrip().endswith(".")) for c in completions]

then give it a weight next to the others in the config's name -> weight dict; `combined_rewards`
sums them. The registry (`REWARDS`, `register_reward`, `get_reward`, and `CODE_REWARDS`: the
rewards that run model-written code) is this module's. An environment's rewards register from
above: `python_tests` (rl/envs/code_rewards.py) when `rl.envs` is imported, as every launch
entry point does; this module imports no environment.

Rewards see text, not token ids: the tokenizer's decode is the one place ids become text, and a
reward written against text works for every tokenizer. Completions are expected cut at their
length (EOS and padding removed) before they get here.

A reward that raises, or (with `timeout_s`) runs past its time budget, scores 0 for the completions
of that call and is counted in `{name}_failed`; training goes on. Mistakes in the config or the
reward's own output (unknown name, missing data field, wrong shape) still raise. A NaN or inf
value is passed on with a warning: the step's loss is then not finite, and the learner skips the
update (`rl.learner.Learner.step`; the run stops after `max_nonfinite_steps` such steps).
"""

from __future__ import annotations

import inspect
import re
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal

import numpy as np

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


def _required_fields(fn: RewardFn) -> list[str]:
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty
    ]


class RewardTimeout(Exception):
    """A reward call that had not returned within `combined_rewards`' `timeout_s`."""


_WARNED: set[str] = set()  # reward names whose failure has been reported already
_WARNED_LOCK = threading.Lock()  # rewards are scored on several rollout worker threads at once


def _warn_failure_once(name: str, error: Exception) -> None:
    with _WARNED_LOCK:
        if name in _WARNED:
            return
        _WARNED.add(name)
    warnings.warn(
        f"reward {name!r} failed ({type(error).__name__}: {error}); its completions score 0 and "
        f"are counted in reward/{name}_failed. Further failures of {name!r} are not reported.",
        RuntimeWarning,
        stacklevel=3,
    )


def _call_with_timeout(fn: RewardFn, name: str, timeout_s: float, args, kwargs):
    """fn(*args, **kwargs) on a daemon thread; RewardTimeout if it has not returned in timeout_s.

    Python cannot kill a thread: a call that times out is abandoned and runs on in the background
    until it returns by itself (its result is dropped), holding whatever it holds; being a daemon
    thread it does not keep the process alive at exit. Rewards that may hang for good or eat memory
    must bound themselves: the sandboxed `python_tests` reward runs the code in a child process
    with its own time and memory limits.
    """
    out: dict = {}
    done = threading.Event()

    def target():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller, which decides
            out["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name=f"reward-{name}", daemon=True).start()
    if not done.wait(timeout_s):
        raise RewardTimeout(f"no result within timeout_s={timeout_s:g} s (the call is abandoned)")
    if "error" in out:
        raise out["error"]
    return out["value"]


def combined_rewards(
    names_and_weights: Mapping[str, float],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Mapping[str, Sequence] | None = None,
    *,
    timeout_s: float | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(total f32[N], {name: unweighted f32[N]}): the weighted sum of the named rewards.

    The per-reward values are returned unweighted so they can be logged on their own scale. Next
    to each reward `name` the dict holds `f"{name}_failed"`, f32[N] with 1.0 for the completions of
    a call that raised (or timed out): those score 0 in `name` and in the total, a warning names the
    reward and the error once per process, and training goes on. The `_failed` entries are always
    present (0.0 when all went well), so every group has the same keys and the logged mean
    `reward/{name}_failed` is the failure rate.

    `timeout_s`: None calls each reward directly in this thread. A number runs each reward call on
    a daemon worker thread and treats a call that has not returned after `timeout_s` seconds as
    failed; the thread cannot be killed and is abandoned (see `_call_with_timeout`).

    Config and programming errors still raise: no rewards, an unknown name (KeyError), a data
    field the reward needs but the records lack, a result of the wrong shape (ValueError naming
    the reward). Non-finite values are returned, with a warning.
    """
    if not names_and_weights:
        raise ValueError(f"no rewards configured; known rewards: {sorted(REWARDS)}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"reward timeout_s must be > 0 seconds or None, got {timeout_s!r}")
    fields = dict(fields or {})
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions")
    for k, v in fields.items():
        if len(v) != n:
            raise ValueError(f"field {k!r} has {len(v)} values for {n} completions")
    fns = {name: get_reward(name) for name in names_and_weights}  # every name checked first
    for name, fn in fns.items():
        missing = [f for f in _required_fields(fn) if f not in fields]
        if missing:
            raise ValueError(
                f"reward {name!r} needs data fields {missing}; the records have {sorted(fields)}"
            )
        if f"{name}_failed" in fns:
            raise ValueError(f"reward names {name!r} and '{name}_failed' collide in the metrics")
    total = np.zeros(n, np.float32)
    per_reward = {}
    for name, weight in names_and_weights.items():
        args, kwargs = (list(prompts), list(completions)), fields
        try:
            if timeout_s is None:
                raw = fns[name](*args, **kwargs)
            else:
                raw = _call_with_timeout(fns[name], name, timeout_s, args, kwargs)
        except Exception as e:  # a failing reward must not stop training
            _warn_failure_once(name, e)
            values, failed = np.zeros(n, np.float32), np.ones(n, np.float32)
        else:
            try:
                values = np.asarray(raw, np.float32)
            except (TypeError, ValueError) as e:
                raise ValueError(f"reward {name!r} returned {type(raw).__name__}: {e}") from e
            if values.shape != (n,):
                raise ValueError(f"reward {name!r} returned shape {values.shape}, expected ({n},)")
            if not np.isfinite(values).all():  # passed on: the learner skips the step
                i = int(np.flatnonzero(~np.isfinite(values))[0])
                warnings.warn(
                    f"reward {name!r} returned {values[i]} for completion {i}: the "
                    "step's loss is not finite and its update is skipped",
                    RuntimeWarning,
                    stacklevel=2,
                )
            failed = np.zeros(n, np.float32)
        per_reward[name] = values
        per_reward[f"{name}_failed"] = failed
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


# MATH-style answers: the library `math-verify` parses LaTeX / plain expressions into sympy and
# compares them by value ("\\frac{1}{2}" = "0.5" = "1/2", "x^2+1" = "1+x^2", "10\\%" = "0.1").
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced, or None.

    None when there is none, or when the last one is never closed (a completion cut at its length):
    an earlier box is not the final answer.
    """
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth = 1
    for i in range(starts[-1], len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[starts[-1] : i]
    return None


@register_reward("math_verify")
def math_verify_reward(prompts, completions, *, answer, **_):
    """1 if the completion's last `\\boxed{}` answer equals the gold answer by math-verify, else 0.

    Gold may be a bare number ("0.5"), a LaTeX expression ("\\frac{1}{2}") or a solution text with
    a `\\boxed{}` answer (its last one is used). A completion whose last `\\boxed{}` is missing,
    unclosed or empty scores 0. math-verify's own timeouts use SIGALRM, which only works in the main thread, and rewards run
    on worker threads, so they are off (`parsing_timeout=None`, `timeout_seconds=None`); bound a
    reward's time with `combined_rewards(timeout_s=...)` (config `rl.reward_timeout_s`). An empty
    gold answer raises ValueError naming the item (counted as a failure by `combined_rewards`).
    """
    from math_verify import parse, verify  # lazy: sympy and the LaTeX parser are slow to import

    def parsed(content: str):
        return parse(f"\\boxed{{{content}}}", parsing_timeout=None)

    out = []
    for i, (completion, gold_text) in enumerate(zip(completions, answer)):
        gold_text = str(gold_text)
        gold_content = last_boxed(gold_text)
        gold = parsed(gold_text.strip() if gold_content is None else gold_content)
        if not gold:
            raise ValueError(
                f"math_verify: no answer in the answer field of item {i}: {gold_text!r}"
            )
        content = last_boxed(completion)
        if content is None or not content.strip():
            out.append(0.0)
            continue
        pred = parsed(content)
        out.append(float(bool(pred) and verify(gold, pred, timeout_seconds=None)))
    return out
