"""Small Python repositories with a planted bug, generated for the `repo` environment: one record
each (the command line is `python -m launch.make_repo_tasks --out DIR [--num 64 --seed 0 --tar]`).

Each task is a directory DIR/repos/<id> (or a DIR/repos/<id>.tar.gz snapshot with --tar) holding a
package of two modules and their tests (`tests/test_<module>.py`, plain pytest functions), and one
row of DIR/tasks.jsonl:

    {"instance_id", "repo": path, "problem": issue text, "fail_to_pass": [node ids],
     "pass_to_pass": [node ids], "fix": {"path", "old", "new"}, "bug": kind}

The bug is one of four kinds, planted in the module a template defines (constants and names drawn
from the seed, so tasks differ): `operator` (an operator swapped), `off_by_one` (a range or slice
bound), `constant` (a wrong constant) and `edge_case` (a missing guard for an empty input). The
FAIL_TO_PASS tests fail with the bug and pass after the reference fix (`fix`: replace `old` by
`new`, once, in `path`); the PASS_TO_PASS tests pass before and after (the other module's tests and
those of the buggy module that do not reach the bug). `tests/launch/test_make_repo_tasks.py` checks
both against the reference fix. The problem text reports the symptom as a user would, not the fix.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tarfile
import textwrap

PACKAGES = (
    "shoplib",
    "geomkit",
    "timeutil",
    "gradebook",
    "invtrack",
    "statpak",
    "unitconv",
    "textops",
)


def _dedent(s: str) -> str:
    return textwrap.dedent(s).lstrip("\n")


def _pricing(rng: random.Random) -> dict:
    """operator: `price * qty` written `price + qty`."""
    tax = rng.choice([5, 8, 10, 20])
    src = _dedent(f'''
        """Order totals."""

        TAX_PERCENT = {tax}


        def line_total(price, qty):
            """Cost of `qty` items at `price` each."""
            return price * qty


        def order_total(lines):
            """Sum of line totals of (price, qty) pairs, before tax."""
            return sum(line_total(p, q) for p, q in lines)


        def with_tax(amount):
            return amount * (100 + TAX_PERCENT) / 100
    ''')
    p, q = rng.randint(3, 9), rng.randint(3, 6)
    tests = _dedent(f"""
        from {{pkg}}.pricing import line_total, order_total, with_tax


        def test_line_total():
            assert line_total({p}, {q}) == {p * q}


        def test_order_total():
            assert order_total([({p}, {q}), (2, 5)]) == {p * q + 10}


        def test_with_tax():
            assert with_tax(100) == {100 + tax}
    """)
    return dict(
        module="pricing",
        src=src,
        tests=tests,
        old="return price * qty",
        new_bug="return price + qty",
        f2p=["test_line_total", "test_order_total"],
        p2p=["test_with_tax"],
        problem=f"line_total({p}, {q}) returns {p + q} instead of {p * q}, so order "
        "totals are wrong.",
    )


def _ranges(rng: random.Random) -> dict:
    """off_by_one: `range(1, n + 1)` written `range(1, n)`."""
    n = rng.randint(4, 9)
    src = _dedent('''
        """Sums over integer ranges."""


        def sum_to(n):
            """1 + 2 + ... + n."""
            total = 0
            for i in range(1, n + 1):
                total += i
            return total


        def evens(xs):
            return [x for x in xs if x % 2 == 0]
    ''')
    tests = _dedent(f"""
        from {{pkg}}.ranges import evens, sum_to


        def test_sum_to():
            assert sum_to({n}) == {n * (n + 1) // 2}


        def test_sum_to_one():
            assert sum_to(1) == 1


        def test_sum_to_zero():
            assert sum_to(0) == 0


        def test_evens():
            assert evens([1, 2, 3, 4]) == [2, 4]
    """)
    return dict(
        module="ranges",
        src=src,
        tests=tests,
        old="range(1, n + 1)",
        new_bug="range(1, n)",
        f2p=["test_sum_to", "test_sum_to_one"],
        p2p=["test_sum_to_zero", "test_evens"],
        problem=f"sum_to({n}) should be 1 + 2 + ... + {n} = {n * (n + 1) // 2} but "
        f"returns {n * (n - 1) // 2}.",
    )


def _window(rng: random.Random) -> dict:
    """off_by_one: `xs[-k:]` written `xs[-k + 1:]`."""
    k = rng.randint(2, 4)
    xs = list(range(1, k + 4))
    src = _dedent('''
        """Last-k windows."""


        def last(xs, k):
            """The last k items of xs (all of them if there are fewer)."""
            if k <= 0:
                return []
            return xs[-k:]
    ''')
    tests = _dedent(f"""
        from {{pkg}}.window import last


        def test_last_k():
            assert last({xs}, {k}) == {xs[-k:]}


        def test_last_zero():
            assert last([1, 2], 0) == []
    """)
    return dict(
        module="window",
        src=src,
        tests=tests,
        old="return xs[-k:]",
        new_bug="return xs[-k + 1:]",
        f2p=["test_last_k"],
        p2p=["test_last_zero"],
        problem=f"last({xs}, {k}) returns {xs[-k + 1 :]}: one item too few.",
    )


def _clock(rng: random.Random) -> dict:
    """constant: SECONDS_PER_HOUR = 3600 written 360 (or 60)."""
    bad = rng.choice([360, 60, 3000])
    h = rng.randint(2, 5)
    src = _dedent('''
        """Durations."""

        SECONDS_PER_MINUTE = 60
        SECONDS_PER_HOUR = 3600


        def to_seconds(hours=0, minutes=0, seconds=0):
            return hours * SECONDS_PER_HOUR + minutes * SECONDS_PER_MINUTE + seconds
    ''')
    tests = _dedent(f"""
        from {{pkg}}.clock import to_seconds


        def test_hours():
            assert to_seconds(hours={h}) == {h * 3600}


        def test_minutes():
            assert to_seconds(minutes=2, seconds=5) == 125
    """)
    return dict(
        module="clock",
        src=src,
        tests=tests,
        old="SECONDS_PER_HOUR = 3600",
        new_bug=f"SECONDS_PER_HOUR = {bad}",
        f2p=["test_hours"],
        p2p=["test_minutes"],
        problem=f"to_seconds(hours={h}) gives {h * bad}; {h} hours are {h * 3600} seconds.",
    )


def _grades(rng: random.Random) -> dict:
    """constant: a pass mark of 50 written 60."""
    mark, bad = 50, rng.choice([55, 60, 65])
    score = rng.randint(mark, bad - 1)
    src = _dedent(f'''
        """Pass/fail by score."""

        PASS_MARK = {mark}


        def passed(score):
            """Scores of PASS_MARK ({mark}) and above pass."""
            return score >= PASS_MARK
    ''')
    tests = _dedent(f"""
        from {{pkg}}.grades import passed


        def test_pass_at_mark():
            assert passed({score})


        def test_fail_low():
            assert not passed(10)
    """)
    return dict(
        module="grades",
        src=src,
        tests=tests,
        old=f"PASS_MARK = {mark}",
        new_bug=f"PASS_MARK = {bad}",
        f2p=["test_pass_at_mark"],
        p2p=["test_fail_low"],
        problem=f"A score of {score} should pass (the pass mark is {mark}), but "
        f"passed({score}) is False.",
    )


def _stats(rng: random.Random) -> dict:
    """edge_case: mean([]) should be 0.0, the guard is missing (ZeroDivisionError)."""
    xs = [rng.randint(1, 9) * 2 for _ in range(4)]
    src = _dedent('''
        """Summary statistics."""


        def mean(xs):
            """The arithmetic mean; 0.0 for an empty list."""
            if not xs:
                return 0.0
            return sum(xs) / len(xs)
    ''')
    tests = _dedent(f"""
        from {{pkg}}.stats import mean


        def test_mean():
            assert mean({xs}) == {sum(xs) / len(xs)}


        def test_mean_empty():
            assert mean([]) == 0.0
    """)
    return dict(
        module="stats",
        src=src,
        tests=tests,
        old="    if not xs:\n        return 0.0\n    return sum(xs) / len(xs)",
        new_bug="    return sum(xs) / len(xs)",
        f2p=["test_mean_empty"],
        p2p=["test_mean"],
        problem="mean([]) raises ZeroDivisionError; it should return 0.0 as documented.",
    )


def _words(rng: random.Random) -> dict:
    """edge_case: first_word('') should be '' (IndexError without the guard)."""
    w = rng.choice(["alpha", "delta", "kappa", "sigma"])
    src = _dedent('''
        """Words of a text."""


        def first_word(text):
            """The first whitespace-separated word, or '' when there is none."""
            words = text.split()
            if not words:
                return ""
            return words[0]
    ''')
    tests = _dedent(f"""
        from {{pkg}}.words import first_word


        def test_first_word():
            assert first_word("{w} beta") == "{w}"


        def test_first_word_blank():
            assert first_word("   ") == ""
    """)
    return dict(
        module="words",
        src=src,
        tests=tests,
        old='    if not words:\n        return ""\n    return words[0]',
        new_bug="    return words[0]",
        f2p=["test_first_word_blank"],
        p2p=["test_first_word"],
        problem="first_word on a blank string raises IndexError instead of returning ''.",
    )


TEMPLATES = {
    "operator": [_pricing],
    "off_by_one": [_ranges, _window],
    "constant": [_clock, _grades],
    "edge_case": [_stats, _words],
}
KINDS = tuple(TEMPLATES)

UTIL_SRC = _dedent('''
    """Helpers the tests of every task share."""


    def clamp(x, lo, hi):
        return max(lo, min(hi, x))
''')
UTIL_TESTS = _dedent("""
    from {pkg}.util import clamp


    def test_clamp():
        assert clamp(5, 0, 3) == 3 and clamp(-1, 0, 3) == 0 and clamp(2, 0, 3) == 2
""")


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def make_task(
    out: str, index: int, rng: random.Random, kind: str | None = None, template=None
) -> dict:
    """Writes one repository under out/repos and returns its row (the repo a directory); the bug
    kind is the index's in turn and the template drawn among the kind's, unless given."""
    kind = kind or KINDS[index % len(KINDS)]
    t = (template or rng.choice(TEMPLATES[kind]))(rng)
    pkg = rng.choice(PACKAGES)
    iid = f"task{index:04d}_{kind}_{t['module']}"
    root = os.path.join(out, "repos", iid)
    if os.path.exists(root):
        shutil.rmtree(root)
    mod_path = f"{pkg}/{t['module']}.py"
    assert t["src"].count(t["old"]) == 1, (kind, t["module"])
    buggy = t["src"].replace(t["old"], t["new_bug"])
    _write(os.path.join(root, pkg, "__init__.py"), f'"""The {pkg} package."""\n')
    _write(os.path.join(root, mod_path), buggy)
    _write(os.path.join(root, pkg, "util.py"), UTIL_SRC)
    test_file = f"tests/test_{t['module']}.py"
    _write(os.path.join(root, test_file), t["tests"].format(pkg=pkg))
    _write(os.path.join(root, "tests", "test_util.py"), UTIL_TESTS.format(pkg=pkg))
    _write(os.path.join(root, "README.md"), f"# {pkg}\n\nRun the tests with `python -m pytest`.\n")
    return {
        "instance_id": iid,
        "repo": os.path.abspath(root),
        "problem": t["problem"],
        "fail_to_pass": [f"{test_file}::{n}" for n in t["f2p"]],
        "pass_to_pass": [f"{test_file}::{n}" for n in t["p2p"]]
        + ["tests/test_util.py::test_clamp"],
        "fix": {"path": mod_path, "old": t["new_bug"], "new": t["old"]},
        "bug": kind,
    }


def to_tar(row: dict) -> dict:
    """Replaces the row's repository directory by a .tar.gz snapshot beside it (files at its root)."""
    tar_path = row["repo"] + ".tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        tar.add(row["repo"], arcname=".")
    shutil.rmtree(row["repo"])
    return {**row, "repo": tar_path}


def make_tasks(out: str, num: int, seed: int = 0, tar: bool = False) -> list[dict]:
    """Writes `num` tasks (the bug kinds in turn) under `out` and out/tasks.jsonl; the rows."""
    rng = random.Random(seed)
    rows = [make_task(out, i, rng) for i in range(num)]
    rows = [to_tar(r) for r in rows] if tar else rows
    with open(os.path.join(out, "tasks.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows
