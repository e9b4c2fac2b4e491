"""launch.make_repo_tasks --validate and --reference_episode (rl/envs/repo/reference.py): each
record's tests before and after its reference fix, run as the repo environment runs a training
episode (its sandbox, its setup, the graded run). Generated tasks (their `fix`) and a SWE-Gym row
converted with --from_rows (its gold `patch`, applied with git apply / patch through the tools)
validate; a record for each way a row can be broken is refused with its reason."""

import difflib
import json
import os
import shutil

import pytest

from launch.make_repo_tasks import main
from rl.envs.repo.templates import make_tasks
from tests.conftest import sandbox_isolation


def diff(root: str, path: str, new: str) -> str:
    """A git-style unified diff of root/path to the text `new` (SWE-bench's `patch`)."""
    with open(os.path.join(root, path)) as f:
        old = f.read()
    lines = difflib.unified_diff(
        old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}"
    )
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


def fixed(task: dict, path: str | None = None, old: str = "", new: str = "") -> str:
    """The text of the task's file `path` (its fix's file by default) with its fix applied, and
    then `old` replaced by `new` there."""
    f = task["fix"]
    with open(os.path.join(task["repo"], path or f["path"])) as fh:
        text = fh.read()
    return (text.replace(f["old"], f["new"]) if path is None else text).replace(old, new)


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    """DIR/tasks.jsonl: two good records (a generated task; a SWE-Gym row with a gold patch,
    converted with --from_rows) and one broken record of each kind; {instance id: what its
    refusal says}."""
    d = tmp_path_factory.mktemp("validate")
    gen = make_tasks(str(d / "gen"), 3, seed=1)
    t0, t1, t2 = gen
    checkouts = d / "checkouts"
    shutil.copytree(t1["repo"], checkouts / "org__pkg-1")
    row = {
        "instance_id": "org__pkg-1",
        "repo": "org/pkg",
        "base_commit": "0" * 40,
        "problem_statement": t1["problem"],
        "FAIL_TO_PASS": json.dumps(t1["fail_to_pass"]),
        "PASS_TO_PASS": json.dumps(t1["pass_to_pass"]),
        "patch": diff(t1["repo"], t1["fix"]["path"], fixed(t1)),
    }
    (d / "rows.jsonl").write_text(json.dumps(row) + "\n")
    assert (
        main(
            [
                "--out",
                str(d / "swe"),
                "--from_rows",
                str(d / "rows.jsonl"),
                "--repos",
                str(checkouts),
            ]
        )
        == 0
    )
    swe = json.loads((d / "swe" / "tasks.jsonl").read_text())
    assert swe["patch"] == row["patch"]  # the gold patch is carried over

    util = [n for n in t0["pass_to_pass"] if "test_util" in n]
    pkg = t2["fix"]["path"].split("/")[0]
    no_fix = {k: v for k, v in t2.items() if k != "fix"}
    broken = {  # instance id: (record, the beginning of its reason)
        "already": (
            {
                **t0,
                "fail_to_pass": t0["fail_to_pass"] + util,
                "pass_to_pass": [n for n in t0["pass_to_pass"] if n not in util],
            },
            f"FAIL_TO_PASS already passing before the fix: {util}",
        ),
        "still": (
            {**no_fix, "patch": diff(t2["repo"], "README.md", "# fixed?\n")},
            f"FAIL_TO_PASS still failing after the fix: {t2['fail_to_pass']}",
        ),
        "before": (
            {**t0, "pass_to_pass": t0["pass_to_pass"] + t0["fail_to_pass"][:1]},
            f"PASS_TO_PASS failing before the fix: {t0['fail_to_pass'][:1]}",
        ),
        "breaks": (
            {
                **no_fix,
                "patch": diff(t2["repo"], t2["fix"]["path"], fixed(t2))
                + diff(
                    t2["repo"], f"{pkg}/util.py", fixed(t2, f"{pkg}/util.py", "max(lo", "min(lo")
                ),
            },
            "PASS_TO_PASS broken by the fix: ['tests/test_util.py::test_clamp']",
        ),
        "no_apply": (
            {**no_fix, "patch": diff(t1["repo"], t1["fix"]["path"], fixed(t1))},
            "the reference fix does not apply: ",
        ),
        "setup": (
            {**t0, "setup": "echo no network >&2; exit 3"},
            "infrastructure error before the fix: setup failed: no network",
        ),
        "renamed": (
            {**t0, "fail_to_pass": [t0["fail_to_pass"][0] + "_renamed"]},
            "infrastructure error before the fix: ",
        ),
        "none": (no_fix, "no reference fix (neither a `patch` nor a `fix` field)"),
    }
    records = [t0, swe] + [{**r, "instance_id": iid} for iid, (r, _) in broken.items()]
    (d / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d, records, {iid: why for iid, (_, why) in broken.items()}


@pytest.mark.repo_sandbox
def test_validate_keeps_the_good_records_and_says_why_of_the_others(tasks_dir, capsys):
    d, records, why = tasks_dir
    capsys.readouterr()
    rc = main(["--validate", str(d), "--isolation", sandbox_isolation(), "--workers", "4"])
    out = capsys.readouterr().out.splitlines()
    print("\n".join(out))
    assert rc == 0, out
    kept = [json.loads(x) for x in (d / "valid.jsonl").read_text().splitlines()]
    assert kept == records[:2]  # the generated task and the converted row, as they were
    assert out[:2] == [f"valid {r['instance_id']}" for r in records[:2]]
    refused = dict(line.removeprefix("refused ").split(": ", 1) for line in out[2:-1])
    assert list(refused) == list(why), out
    for iid, reason in why.items():
        assert refused[iid].startswith(reason), (iid, refused[iid])
    assert refused["renamed"] == (
        "infrastructure error before the fix: test ids the repository does not define (renamed? "
        f"the test patch not applied?): {[records[0]['fail_to_pass'][0] + '_renamed']}"
    )
    assert refused["no_apply"].endswith("[exit code 1]"), refused["no_apply"]
    assert out[-1] == f"kept 2 of {len(records)} records in {d}/valid.jsonl"


@pytest.mark.repo_sandbox
def test_reference_episode_scores_a_good_record_1_and_a_broken_one_0(tasks_dir, capsys):
    d, records, _ = tasks_dir
    iso = ["--isolation", sandbox_isolation()]
    for index, reward, rc in ((1, 1.0, 0), (0, 1.0, 0), (3, 0.0, 1)):
        r = records[index]
        capsys.readouterr()
        assert main(["--reference_episode", str(d), "--index", str(index), *iso]) == rc, index
        line = capsys.readouterr().out.splitlines()[0]
        f2p, p2p = len(r["fail_to_pass"]), len(r["pass_to_pass"])
        assert line.startswith(
            f"{r['instance_id']}: reward {reward} (FAIL_TO_PASS {f2p if reward else 0}/{f2p} "
            f"passing, PASS_TO_PASS {p2p}/{p2p}; "
        ), line
    capsys.readouterr()
    assert main(["--reference_episode", str(d), "--index", "99", *iso]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --index=99: {d}/tasks.jsonl has records 0 to {len(records) - 1}\n"


IMAGE_TESTBED = {
    "calc/__init__.py": b"",
    "calc/ops.py": b"def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return -a\n",
    "tests/test_ops.py": b"from calc.ops import add, neg\n\n\ndef test_add():\n"
    b"    assert add(2, 3) == 5\n\n\ndef test_neg():\n    assert neg(2) == -2\n",
}


def test_image_records_validate_in_their_image(tmp_path, capsys):
    """Image records (tests/rl/image_helpers.py's test image; needs bubblewrap, as image tasks
    do) are validated in the image, with its python: a good one kept, one whose FAIL_TO_PASS
    already passes refused; the reference episode runs in the image's view."""
    if sandbox_isolation() != "bwrap":
        pytest.skip("image tasks need bubblewrap")
    from rl.sandbox.oci import unpack
    from tests.rl.image_helpers import python_image

    name = "sweb.eval.x86_64.calc__calc-2"
    python_image(str(tmp_path / "oci"), IMAGE_TESTBED, b'WHERE = "image"\n')
    unpack(str(tmp_path / "oci"), str(tmp_path / "images"), (name,))
    good = {
        "instance_id": "calc__calc-2",
        "image": name,
        "problem": "add(2, 3) is -1",
        "fail_to_pass": ["tests/test_ops.py::test_add"],
        "pass_to_pass": ["tests/test_ops.py::test_neg"],
        "fix": {"path": "calc/ops.py", "old": "a - b", "new": "a + b"},
    }
    bad = {
        **good,
        "instance_id": "calc__calc-3",
        "pass_to_pass": [],
        "fail_to_pass": good["fail_to_pass"] + good["pass_to_pass"],
    }
    (tmp_path / "tasks.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    images = ["--images_dir", str(tmp_path / "images"), "--isolation", "bwrap"]
    assert main(["--validate", str(tmp_path), *images]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "valid calc__calc-2",
        "refused calc__calc-3: FAIL_TO_PASS already passing before the fix: "
        "['tests/test_ops.py::test_neg']",
        f"kept 1 of 2 records in {tmp_path}/valid.jsonl",
    ]
    assert main(["--reference_episode", str(tmp_path), *images]) == 0
    line = capsys.readouterr().out
    assert line.startswith("calc__calc-2: reward 1.0 (FAIL_TO_PASS 1/1 passing, PASS_TO_PASS 1/1;")
    assert "sandbox bwrap, image view " in line, line
