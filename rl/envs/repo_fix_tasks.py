"""The tiny repositories of the CPU repository demo (env `repo_fix`, configs/repo_fix.py).

A record is a one-file repository with a planted wrong constant, an issue that lists candidate
fixes, and the repository's tests, as data:

    {"prompt": "m.py:k=3\\nfix:5|7|9|2\\n",        the file, then the issue's candidate values
     "files": {"m.py": "k=3"},                     the repository
     "fail_to_pass": ["assert m.k==9"],            fails before the fix, passes after it
     "pass_to_pass": ["import m"],                 passes before and after (the module loads)
     "answer": "9"}                                the right candidate (for reports only)

The tests are not in the prompt, as SWE-bench's FAIL_TO_PASS tests are not shown to the agent:
the model learns which candidate is right only by running them. `run_tests` is the repository's
test runner, in process and without exec: a module is a list of `name=integer` lines, parsed by
`parse_module` (anything else is a syntax error), and a test is `import m` or `assert m.NAME==INT`.
Its failure output names the expected value the way pytest's assertion rewriting does
(`assert 7==9;`: the value the edited file has, then the one the test wants), so a policy that
reads it knows the right candidate after one failed attempt.

`scripted_episode` writes the warm start's episodes (launch.sft --task repo_fix): an edit to a
uniformly drawn candidate, the test output, and after a failure a second edit to a uniformly drawn
other candidate, whatever the output said; then submit (the end token). Reading the failure is
what GRPO has to learn.
"""

from __future__ import annotations

import re
import zlib

import numpy as np

from rl.sources import cfg_get, register_source

# The code alphabet (the character-level tokenizer's): identifiers, integers, the few operators a
# tiny Python file and its test output use, and the tool-call characters.
REPO_FIX_ALPHABET = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_=+-*/<>()[]{}|:;,.'\"#!? \n"
)
CALL_OPEN, CALL_CLOSE, SEP, OBS_END = "<", ">", "/", ";"  # "<old/new>": str_replace in m.py
MODULE = "m.py"
NAMES = "abcdefghijkmnpqrstuvwxyz"  # one-letter constants (no l, o: they read as 1, 0)
NUM_CANDIDATES = 4
PASSED = "passed"
_LINE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(-?[0-9]+)")
_ASSERT = re.compile(r"assert m\.([A-Za-z_][A-Za-z0-9_]*)==(-?[0-9]+)")


def is_heldout(prompt: str, eval_fraction: float) -> bool:
    """Stable train / held-out split by prompt hash (as `rl.tasks.is_heldout`)."""
    return zlib.crc32(prompt.encode("utf-8")) < eval_fraction * 2**32


@register_source("repo_fix")
def repo_fix_source(source_cfg) -> list[dict]:
    """The records of a data source of type "repo_fix" (rl/sources.py): num, split,
    eval_fraction, seed."""
    return repo_fix_records(
        seed=int(cfg_get(source_cfg, "seed", 0)),
        num=int(cfg_get(source_cfg, "num", 10_000)),
        split=str(cfg_get(source_cfg, "split", "train")),
        eval_fraction=float(cfg_get(source_cfg, "eval_fraction", 0.1)),
    )


def repo_fix_records(
    seed: int,
    num: int,
    split: str = "train",
    eval_fraction: float = 0.1,
    candidates: int = NUM_CANDIDATES,
) -> list[dict]:
    """`num` tiny repositories (module docstring): a constant `name=bug`, `candidates` distinct
    candidate values (none equal to the bug) in random order, one of them, uniformly, right.
    Deterministic in the arguments; a prompt is held out iff its hash says so."""
    if not 2 <= candidates <= 9:
        raise ValueError(f"candidates={candidates} must be in [2, 9]")
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be train or eval")
    rng = np.random.default_rng(seed)
    records = []
    while len(records) < num:
        name = NAMES[int(rng.integers(len(NAMES)))]
        values = [str(v) for v in rng.permutation(10)[: candidates + 1]]
        bug, cands = values[0], values[1:]
        prompt = f"{MODULE}:{name}={bug}\nfix:{'|'.join(cands)}\n"
        if is_heldout(prompt, eval_fraction) != (split == "eval"):
            continue
        right = cands[int(rng.integers(candidates))]
        records.append(
            {
                "prompt": prompt,
                "files": {MODULE: f"{name}={bug}"},
                "fail_to_pass": [f"assert m.{name}=={right}"],
                "pass_to_pass": ["import m"],
                "answer": right,
            }
        )
    return records


def parse_module(source: str) -> dict[str, int] | None:
    """The constants of a module made of `name=integer` lines; None when it does not parse."""
    out = {}
    for line in source.split("\n"):
        if not line.strip():
            continue
        m = _LINE.fullmatch(line.strip())
        if m is None:
            return None
        out[m.group(1)] = int(m.group(2))
    return out


def run_test(test: str, source: str) -> str | None:
    """None when `test` passes on the module `source`, else its failure output (no OBS_END)."""
    module = parse_module(source)
    if module is None:
        return "E SyntaxError"
    if test == "import m":
        return None
    m = _ASSERT.fullmatch(test)
    if m is None:
        raise ValueError(f"unknown test {test!r}")  # a bad record: the harness's fault
    name, want = m.group(1), int(m.group(2))
    if name not in module:
        return f"E no m.{name}"
    return None if module[name] == want else f"assert {module[name]}=={want}"


def run_tests(record: dict, source: str) -> tuple[float, float, str]:
    """(FAIL_TO_PASS pass fraction, PASS_TO_PASS pass fraction, output): the output is "passed"
    when all pass, else the first failure's output."""
    fails = {k: [run_test(t, source) for t in record[k]] for k in ("fail_to_pass", "pass_to_pass")}
    frac = {k: float(np.mean([f is None for f in v])) for k, v in fails.items()}
    first = next((f for f in fails["pass_to_pass"] + fails["fail_to_pass"] if f), None)
    return frac["fail_to_pass"], frac["pass_to_pass"], first or PASSED


def str_replace(source: str, call: str) -> tuple[str | None, str]:
    """Applies the call body "old/new" (the text between "<" and ">") to `source`, with the
    editor's semantics: `old` must occur exactly once. (new source, "") or (None, error)."""
    old, sep, new = call.partition(SEP)
    if not sep or not old:
        return None, "E bad call"
    count = source.count(old)
    if count != 1:
        return None, "E no match" if count == 0 else "E not unique"
    return source.replace(old, new), ""


def candidates(record: dict) -> list[str]:
    """The candidate values the record's issue lists."""
    return record["prompt"].split("fix:")[1].strip().split("|")


def observation(output: str) -> str:
    return output + OBS_END


def scripted_episode(record: dict, rng: np.random.Generator) -> list[tuple[str, bool]]:
    """The warm start's episode as (text, is the model's) pieces: prompt, an edit to a random
    candidate, its test output, after a failure an edit to a random other candidate and its
    output, then the end token (submit, written by the caller)."""
    source = record["files"][MODULE]
    name, value = source.split("=")
    cands = candidates(record)
    parts = [(record["prompt"], False)]
    tried = []
    for _ in range(2):
        pick = str(rng.choice([c for c in cands if c not in tried]))
        tried.append(pick)
        parts.append((f"{CALL_OPEN}{name}={value}{SEP}{name}={pick}{CALL_CLOSE}", True))
        source, value = f"{name}={pick}", pick
        output = run_tests(record, source)[2]
        parts.append((observation(output), False))
        if output == PASSED:
            break
    return parts
