"""launch.make_repo_tasks: every generated task's FAIL_TO_PASS tests fail with the planted bug and
pass after the reference fix, and its PASS_TO_PASS tests pass before and after (pytest in a
subprocess, one run per repository state)."""

import json
import os
import random
import subprocess
import sys
import tarfile

import pytest

from launch.make_repo_tasks import KINDS, TEMPLATES, main, make_task


def outcomes(root: str, nodes: list[str]) -> dict[str, str]:
    """node id -> PASSED | FAILED | ERROR, from pytest -rA run in `root`."""
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *nodes],
        cwd=root, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    seen = {}
    for line in r.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR"):
            seen[rest.split(" - ")[0]] = word
    return {n: seen.get(n, "MISSING") for n in nodes}


def apply_fix(root: str, fix: dict) -> None:
    path = os.path.join(root, fix["path"])
    src = open(path).read()
    assert src.count(fix["old"]) == 1
    open(path, "w").write(src.replace(fix["old"], fix["new"]))


TEMPLATE_KINDS = [(k, t) for k in KINDS for t in TEMPLATES[k]]


@pytest.mark.parametrize(
    "kind,template", TEMPLATE_KINDS, ids=[t.__name__ for _, t in TEMPLATE_KINDS]
)
def test_tasks_fail_before_and_pass_after_the_reference_fix(tmp_path, kind, template):
    row = make_task(str(tmp_path), 0, random.Random(0), kind, template)
    f2p, p2p = row["fail_to_pass"], row["pass_to_pass"]
    assert f2p and p2p and row["problem"] and row["bug"] == kind
    before = outcomes(row["repo"], f2p + p2p)
    assert all(before[n] == "FAILED" for n in f2p), (row["instance_id"], before)
    assert all(before[n] == "PASSED" for n in p2p), (row["instance_id"], before)
    apply_fix(row["repo"], row["fix"])
    after = outcomes(row["repo"], f2p + p2p)
    assert all(v == "PASSED" for v in after.values()), (row["instance_id"], after)


def test_cli_writes_rows_and_tar_snapshots(tmp_path, capsys):
    main(["--out", str(tmp_path), "--num", "5", "--seed", "3", "--tar"])
    rows = [json.loads(line) for line in open(tmp_path / "tasks.jsonl")]
    assert len(rows) == 5 and {r["bug"] for r in rows} == set(KINDS)
    assert len({r["instance_id"] for r in rows}) == 5
    for r in rows:
        assert r["repo"].endswith(".tar.gz") and os.path.isfile(r["repo"])
        with tarfile.open(r["repo"]) as tar:
            names = tar.getnames()
        assert f"./{r['fix']['path']}" in names and "./tests/test_util.py" in names
    assert "wrote 5 tasks" in capsys.readouterr().out
