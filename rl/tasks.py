"""Built-in synthetic tasks for the CPU demos: integer arithmetic with an exact answer, alone or
with a calculator tool.

Records look like {"prompt": "23+58=", "answer": "81"}: the prompt is the whole question, so a tiny
model with a `CharTokenizer(ARITHMETIC_ALPHABET)` can learn it from the `arithmetic_exact` reward
alone, without a chat template or downloaded files.

The calculator task (`CharTokenizer(CALC_ALPHABET)`) uses the same records (3-digit "*") in
multi-turn episodes. A model turn either answers directly ("56088" + eos) or calls the tool,
"<123*456>", ending on the stop id of ">"; the environment then appends the observation
`calc_observation("123*456")` = "56088;" (the result and ";", or "?;" for a malformed call) and the
model answers in its next turn. The whole tool-path episode reads "123*456=<123*456>56088;56088"
+ eos; the observation characters are not trained on.

Choices a reader may question:
- Train and held-out eval prompts are split by a stable hash of the prompt text (crc32), not by
  seed: a prompt is held out iff its hash falls in the first `eval_fraction` of the hash range.
  Each split's generator rejects the other split's prompts, so no eval prompt ever appears in
  training, whatever seeds and record counts the two sides use.
- Operands are drawn i.i.d. with replacement, so a split can repeat a prompt (small `digits` have
  few distinct problems: 100 for one-digit addition). Training on a stream does not care; eval
  averages over draws.
"""

from __future__ import annotations

import re
import zlib

import numpy as np

# Every character a prompt or an answer can contain; the one definition (launch.sft writes it into
# the warm start's char_tokenizer.json). Appending keeps the ids of the earlier characters.
ARITHMETIC_ALPHABET = "0123456789+=-*"
ARITHMETIC_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
# The calculator task's characters: a tool call is "<" expression ">", an observation ends on ";",
# and "?" is the calculator's answer to a malformed call.
CALL_OPEN, CALL_CLOSE, RESULT_END, CALC_ERROR = "<", ">", ";", "?"
CALC_ALPHABET = ARITHMETIC_ALPHABET + CALL_OPEN + CALL_CLOSE + RESULT_END + CALC_ERROR
CALC_MAX_DIGITS = 12  # longest operand the calculator accepts
_CALC_EXPR = re.compile(rf"([0-9]{{1,{CALC_MAX_DIGITS}}})([+*-])([0-9]{{1,{CALC_MAX_DIGITS}}})")
SPLITS = ("train", "eval")


def is_heldout(prompt: str, eval_fraction: float) -> bool:
    """Whether `prompt` belongs to the held-out eval split (stable across runs and machines)."""
    return zlib.crc32(prompt.encode("utf-8")) < eval_fraction * 2**32


def arithmetic_records(
    seed: int,
    num: int,
    digits: int = 2,
    ops: str = "+",
    split: str = "train",
    eval_fraction: float = 0.1,
) -> list[dict]:
    """`num` records {"prompt": "a<op>b=", "answer": str(result)} with operands in [0, 10**digits).

    Deterministic in all arguments. `ops` is a string of operators drawn uniformly per record, a
    subset of "+-*"; "-" can give negative answers ("-35").
    """
    if num < 0:
        raise ValueError(f"num={num} must be >= 0")
    if digits < 1:
        raise ValueError(f"digits={digits} must be >= 1")
    if not ops or any(op not in ARITHMETIC_OPS for op in ops):
        raise ValueError(f"ops={ops!r} must be a non-empty string of {''.join(ARITHMETIC_OPS)!r}")
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction} must be in (0, 1)")

    rng = np.random.default_rng(seed)
    want_heldout = split == "eval"
    records, rejected = [], 0
    while len(records) < num:
        for a, op, b in _draws(rng, digits, ops, num - len(records)):
            prompt = f"{a}{op}{b}="
            if is_heldout(prompt, eval_fraction) != want_heldout:
                rejected += 1
                # A split can be empty for tiny problem spaces (e.g. digits=1 and a small fraction).
                if rejected > 1000 * (num + 1):
                    raise ValueError(
                        f"found no {split} prompts for digits={digits}, ops={ops!r}, "
                        f"eval_fraction={eval_fraction}; use more digits or another eval_fraction"
                    )
                continue
            records.append({"prompt": prompt, "answer": str(ARITHMETIC_OPS[op](a, b))})
            if len(records) == num:
                break
    return records


def _draws(rng: np.random.Generator, digits: int, ops: str, n: int):
    """The next (a, op, b) draws of `rng`: per record two operands, then an operator index.

    With one operator the index draw takes no random bits (its range is one value), and numpy's
    bounded integers draw value by value from the bit generator, so one array of 2 * n operands
    is the same stream as n draws of 2: a batch, which makes 10k records ~10x faster (this runs at
    every start-up). With several operators the draws interleave, one record at a time.
    """
    if len(ops) == 1:
        for a, b in rng.integers(0, 10**digits, size=(max(n, 16), 2)).tolist():
            yield a, ops, b
        return
    while True:
        a, b = (int(x) for x in rng.integers(0, 10**digits, size=2))
        yield a, ops[int(rng.integers(len(ops)))], b


def calculator(expr: str) -> str | None:
    """The result of a strict "a<op>b" (non-negative integers of at most CALC_MAX_DIGITS ASCII
    digits, op in "+-*", nothing else: no spaces, signs or brackets) as a string, e.g.
    "123*456" -> "56088", "3-5" -> "-2"; None for anything else."""
    m = _CALC_EXPR.fullmatch(expr)
    if m is None:
        return None
    a, op, b = m.groups()
    return str(ARITHMETIC_OPS[op](int(a), int(b)))


def calc_observation(expr: str) -> str:
    """What the environment appends after the tool call "<expr>": "56088;" or "?;"."""
    result = calculator(expr)
    return (CALC_ERROR if result is None else result) + RESULT_END
