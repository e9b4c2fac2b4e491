"""launch.make_repo_tasks (its generator: rl/envs/repo/templates.py): every generated task's
FAIL_TO_PASS tests fail with the planted bug and pass after the reference fix, and its PASS_TO_PASS
tests pass before and after (pytest in a process of its own per repository state, forked from one
subprocess)."""

import json
import os
import random
import shutil
import subprocess
import sys
import tarfile

import pytest

from launch.make_repo_tasks import main
from rl.envs.repo.templates import KINDS, TEMPLATES, make_task
from tests.conftest import sandbox_isolation

# Runs `python -m pytest -q -rA -p no:cacheprovider <nodes>` in each root of the JSON list
# [[root, nodes, log], ...] on stdin, in a child forked from one interpreter that imported pytest
# (a fresh process per repository state, as `python -m pytest` in the root, without an
# interpreter start and pytest's import for each), the venv's pytest plugins (xdist, anyio: none
# the generated tests use) not loaded; each child's output goes to its log.
_FORKED_PYTEST = """
import json, os, sys
import pytest
for root, nodes, log in json.loads(sys.stdin.read()):
    pid = os.fork()
    if pid == 0:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(root)
        sys.path[0] = root  # what python -m puts first: the working directory
        rc = 70  # pytest.main raised: this child ends here, never runs the loop's other jobs
        try:
            rc = pytest.main(["-q", "-rA", "-p", "no:cacheprovider", *nodes])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    os.waitpid(pid, 0)
"""


def outcomes_of(runs: list[tuple[str, list[str]]], logs: str) -> list[dict[str, str]]:
    """For each (root, nodes): node id -> PASSED | FAILED | ERROR | MISSING, from pytest -rA run
    in `root` in a process of its own (_FORKED_PYTEST; one subprocess for all of them)."""
    jobs = [[root, nodes, os.path.join(logs, f"{i}.log")] for i, (root, nodes) in enumerate(runs)]
    r = subprocess.run(
        [sys.executable, "-c", _FORKED_PYTEST], input=json.dumps(jobs), capture_output=True,
        text=True, timeout=300,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = []
    for _, nodes, log in jobs:
        seen = {}
        for line in open(log).read().splitlines():
            word, _, rest = line.partition(" ")
            if word in ("PASSED", "FAILED", "ERROR"):
                seen[rest.split(" - ")[0]] = word
        out.append({n: seen.get(n, "MISSING") for n in nodes})
    return out


def apply_fix(root: str, fix: dict) -> None:
    path = os.path.join(root, fix["path"])
    src = open(path).read()
    assert src.count(fix["old"]) == 1
    open(path, "w").write(src.replace(fix["old"], fix["new"]))


TEMPLATE_KINDS = [(k, t) for k in KINDS for t in TEMPLATES[k]]


@pytest.fixture(scope="module")
def graded_templates(tmp_path_factory):
    """{template name: (row, outcomes before the fix, after it)}: each template's task made, its
    repository copied and the copy fixed, every state's tests run (one subprocess for all)."""
    rows, runs = {}, []
    for kind, template in TEMPLATE_KINDS:
        d = tmp_path_factory.mktemp(template.__name__)
        row = make_task(str(d), 0, random.Random(0), kind, template)
        fixed = str(d / "fixed")
        shutil.copytree(row["repo"], fixed)
        apply_fix(fixed, row["fix"])
        rows[template.__name__] = row
        nodes = row["fail_to_pass"] + row["pass_to_pass"]
        runs += [(row["repo"], nodes), (fixed, nodes)]
    results = outcomes_of(runs, str(tmp_path_factory.mktemp("logs")))
    return {name: (row, results[2 * i], results[2 * i + 1]) for i, (name, row) in
            enumerate(rows.items())}  # fmt: skip


@pytest.mark.parametrize(
    "kind,template", TEMPLATE_KINDS, ids=[t.__name__ for _, t in TEMPLATE_KINDS]
)
def test_tasks_fail_before_and_pass_after_the_reference_fix(graded_templates, kind, template):
    row, before, after = graded_templates[template.__name__]
    f2p, p2p = row["fail_to_pass"], row["pass_to_pass"]
    assert f2p and p2p and row["problem"] and row["bug"] == kind
    assert all(before[n] == "FAILED" for n in f2p), (row["instance_id"], before)
    assert all(before[n] == "PASSED" for n in p2p), (row["instance_id"], before)
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


@pytest.mark.repo_sandbox
def test_swe_style_rows_convert_to_records_the_env_grades(tmp_path, capsys):
    """SWE-Gym rows (JSON-string test lists, checkout at <repos>/<instance_id>), SWE-smith /
    R2E-Gym rows (lists, an explicit repo_path) become records; rows without a checkout, with
    non-pytest test ids or whose test files are missing are skipped with the reason. A converted
    record grades in the repo env: unfixed 0 with its PASS_TO_PASS passing, fixed 1."""
    import shutil
    import string

    import ml_collections

    from models.tokenizer import CharTokenizer
    from rl.envs.repo import RepoEnv, check_record
    from rl.envs.repo.tasks import from_swe_row

    gen = tmp_path / "gen"
    main(["--out", str(gen), "--num", "2", "--seed", "3"])
    tasks = [json.loads(x) for x in open(gen / "tasks.jsonl")]
    checkouts = tmp_path / "checkouts"
    checkouts.mkdir()
    shutil.copytree(tasks[0]["repo"], checkouts / "org__pkg-1")
    swe_gym = {"instance_id": "org__pkg-1", "repo": "org/pkg", "base_commit": "abc",
               "problem_statement": tasks[0]["problem"],
               "FAIL_TO_PASS": json.dumps(tasks[0]["fail_to_pass"]),
               "PASS_TO_PASS": json.dumps(tasks[0]["pass_to_pass"])}  # fmt: skip
    smith = {"instance_id": "org__pkg.x1", "repo": "org/pkg", "repo_path": tasks[1]["repo"],
             "problem_statement": tasks[1]["problem"], "FAIL_TO_PASS": tasks[1]["fail_to_pass"],
             "PASS_TO_PASS": tasks[1]["pass_to_pass"], "setup": "true"}  # fmt: skip
    bad = [
        {**swe_gym, "instance_id": "org__pkg-2"},  # no checkout
        {**smith, "FAIL_TO_PASS": '["test_x (tests.T)"]'},  # not a pytest node id
        {**smith, "FAIL_TO_PASS": ["tests/test_new.py::test_x"]},  # test patch not applied
    ]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in [swe_gym, smith, *bad]))
    out = tmp_path / "out"
    main(["--out", str(out), "--from_rows", str(rows), "--repos", str(checkouts)])
    printed = capsys.readouterr().out
    assert "wrote 2 of 5 rows" in printed
    for why in ("no local checkout", "not a pytest node id", "test patch applied?"):
        assert why in printed, (why, printed)
    records = [json.loads(x) for x in open(out / "tasks.jsonl")]
    assert records[0] == {
        "instance_id": "org__pkg-1", "repo": str(checkouts / "org__pkg-1"),
        "problem": tasks[0]["problem"], "fail_to_pass": tasks[0]["fail_to_pass"],
        "pass_to_pass": tasks[0]["pass_to_pass"], "setup": "",
    }  # fmt: skip
    assert records[1]["repo"] == tasks[1]["repo"] and records[1]["setup"] == "true"
    assert (
        from_swe_row({**smith, "repo_path": None, "repo": tasks[1]["repo"]})["repo"]
        == (tasks[1]["repo"])
    )

    assert "test_cmd" not in from_swe_row({**smith, "test_cmd": "pytest -x"})  # not carried
    with pytest.raises(ValueError, match="test_cmd='pytest' is not supported"):
        check_record({**records[0], "test_cmd": "pytest"})

    env_cfg = {"command_timeout_s": 4.0, "tool_workers": 2, "workspace_bytes": 32 << 20,
               "isolation": sandbox_isolation()}  # fmt: skip
    data = {"use_chat_template": False, "system_prompt": "", "chat_template_kwargs": {}}
    config = ml_collections.ConfigDict({"data": data, "env": env_cfg})
    env = RepoEnv(CharTokenizer(string.printable), config)
    try:
        for fixed in (False, True):
            record = records[0]
            if fixed:
                fixed_dir = tmp_path / "fixed"
                shutil.copytree(record["repo"], fixed_dir)
                apply_fix(str(fixed_dir), tasks[0]["fix"])
                record = {**record, "repo": str(fixed_dir)}
            ep = env.start(record)
            reward = env.reward(ep)
            env.close(ep)
            assert not env.masked(ep), ep.infra_error
            assert reward == float(fixed) and ep.metrics["pass_to_pass_frac"] == 1.0
    finally:
        env.shutdown()


SWE_GYM_CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
---
"""


def test_rows_from_a_hub_dataset_convert_as_the_jsonl_rows(tmp_path, monkeypatch, capsys):
    """--from_rows takes a Hub dataset id (offline, from a Hub cache in huggingface_hub's layout),
    a save_to_disk directory or a parquet file as well as jsonl: SWE-Gym-format rows (JSON-string
    test lists, repo + base_commit, a checkout under --repos) give the same records and the same
    skip reasons as the jsonl rows; --revision picks a snapshot; a bad id, revision, split, subset
    or a dataset without instance_id / FAIL_TO_PASS is one line naming the flag."""
    import hashlib
    import shutil

    datasets = pytest.importorskip("datasets")
    from tests.hub_cache import add_directory, offline_hub

    gen = tmp_path / "gen"
    main(["--out", str(gen), "--num", "2", "--seed", "5"])
    capsys.readouterr()
    tasks = [json.loads(x) for x in open(gen / "tasks.jsonl")]
    checkouts = tmp_path / "checkouts"
    for i, task in enumerate(tasks):
        shutil.copytree(task["repo"], checkouts / f"org__pkg-{i}")
    rows = [{"instance_id": f"org__pkg-{i}", "repo": "org/pkg", "base_commit": f"{i:040x}",
             "problem_statement": t["problem"], "FAIL_TO_PASS": json.dumps(t["fail_to_pass"]),
             "PASS_TO_PASS": json.dumps(t["pass_to_pass"]), "version": "1.0"}
            for i, t in enumerate(tasks)]  # fmt: skip
    rows += [
        {**rows[0], "instance_id": "org__pkg-9"},  # no checkout
        {**rows[1], "instance_id": "org__pkg-1b", "FAIL_TO_PASS": None},  # (null in Arrow)
        {**rows[1], "instance_id": None},
        {**rows[1], "instance_id": "org__pkg-1c", "PASS_TO_PASS": "[not json"},
    ]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n"
                             for r in rows))  # fmt: skip
    repo = tmp_path / "swe_gym"  # SWE-Gym/SWE-Gym's layout: a card, data/train-*.parquet
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text(SWE_GYM_CARD)
    datasets.Dataset.from_list(rows).to_parquet(str(repo / "data/train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    cache, (c1, c0) = tmp_path / "hub", (hashlib.sha1(x).hexdigest() for x in (b"1", b"0"))
    add_directory(cache, "SWE-Gym/SWE-Gym", repo, c1, refs=("main",), repo_type="dataset")
    datasets.Dataset.from_list(rows[:1]).to_parquet(str(repo / "data/train-00000-of-00001.parquet"))
    add_directory(cache, "SWE-Gym/SWE-Gym", repo, c0, refs=("v0",), repo_type="dataset")
    offline_hub(monkeypatch, cache)

    def convert(*flags):
        out = tmp_path / f"out{len(os.listdir(tmp_path))}"
        assert main(["--out", str(out), "--repos", str(checkouts), "--from_rows", *flags]) == 0
        printed = capsys.readouterr().out.replace(str(out), "OUT").splitlines()
        return [json.loads(x) for x in open(out / "tasks.jsonl")], printed

    want, printed = convert(str(jsonl))
    assert [r["instance_id"] for r in want] == ["org__pkg-0", "org__pkg-1"]
    assert want[0] == {
        "instance_id": "org__pkg-0", "repo": str(checkouts / "org__pkg-0"),
        "problem": tasks[0]["problem"], "fail_to_pass": tasks[0]["fail_to_pass"],
        "pass_to_pass": tasks[0]["pass_to_pass"], "setup": "",
    }  # fmt: skip
    assert printed[:-1] == [
        f"skipped org__pkg-9: no local checkout (looked for repo_path, {checkouts}/org__pkg-9"
        "[.tar.gz] and repo='org/pkg')",
        "skipped org__pkg-1b: no FAIL_TO_PASS",
        "skipped row 5: no instance_id (got None)",
        "skipped org__pkg-1c: PASS_TO_PASS is not a JSON list (Expecting value: line 1 column 2 "
        "(char 1))",
    ]
    assert printed[-1] == "wrote 2 of 6 rows to OUT/tasks.jsonl"
    parquet = str(repo / "../hub_file.parquet")
    shutil.copy(os.path.join(cache, "datasets--SWE-Gym--SWE-Gym", "snapshots", c1,
                             "data/train-00000-of-00001.parquet"), parquet)  # fmt: skip
    for flags in (["SWE-Gym/SWE-Gym"], ["SWE-Gym/SWE-Gym", "--split", "train", "--revision",
                  "main"], [str(tmp_path / "saved")], [parquet]):  # fmt: skip
        got, said = convert(*flags)
        assert got == want and said[:-1] == printed[:-1], flags
        at = f" (SWE-Gym/SWE-Gym at commit {c1})" if "SWE-Gym/SWE-Gym" in flags else ""
        assert said[-1] == printed[-1] + at, said[-1]
    assert convert("SWE-Gym/SWE-Gym", "--revision", "v0")[0] == want[:1]
    assert convert("SWE-Gym/SWE-Gym", "--revision", c0)[1][-1].endswith(f"at commit {c0})")

    datasets.Dataset.from_list([{"question": "q"}]).save_to_disk(str(tmp_path / "gsm"))
    datasets.Dataset.from_list([{"instance_id": "x"}]).save_to_disk(str(tmp_path / "no_f2p"))
    refused = [
        (["SWE-Gym/nope"], f"--from_rows='SWE-Gym/nope': not a local directory, and not in the "
         f"Hub cache {cache} (HF_HUB_OFFLINE=1)"),
        (["SWE-Gym/SWE-Gym", "--revision", "v9"], "--revision='v9': no snapshot of "
         "SWE-Gym/SWE-Gym for it in the Hub cache (cached refs: ['main', 'v0']; HF_HUB_OFFLINE=1)"),
        (["SWE-Gym/SWE-Gym", "--split", "test"], "--split='test': no such split of "
         "SWE-Gym/SWE-Gym (it has ['train'])"),
        (["SWE-Gym/SWE-Gym", "--name", "lite"], "--name='lite': SWE-Gym/SWE-Gym: no such subset "
         "(it has ['default'])"),  # (from the card, before any data file is fetched)
        ([str(tmp_path / "gsm")], f"--from_rows='{tmp_path}/gsm': no 'instance_id' column in "
         f"{tmp_path}/gsm split 'train' (columns: ['question'])"),
        ([str(tmp_path / "no_f2p")], f"--from_rows='{tmp_path}/no_f2p': no FAIL_TO_PASS column "
         "(columns: ['instance_id'])"),
        ([str(tmp_path / "rows.parquet")], f"--from_rows='{tmp_path}/rows.parquet': no such "
         "data file"),
        ([str(jsonl), "--split", "test"], f"--from_rows='{jsonl}': a jsonl file has no subset, "
         "split or revision (--name, --split, --revision)"),
    ]  # fmt: skip
    capsys.readouterr()
    for flags, message in refused:
        assert main(["--out", str(tmp_path / "bad"), "--from_rows", *flags]) == 2, flags
        assert capsys.readouterr().err == f"error: {message}\n"
    assert not (tmp_path / "bad").exists()
    (tmp_path / "cwd" / "SWE-Gym" / "SWE-Gym").mkdir(parents=True)  # spelled like the id
    (tmp_path / "cwd" / "SWE-Gym" / "SWE-Gym" / "notes.txt").write_text("not rows\n")
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["--out", str(tmp_path / "bad"), "--from_rows", "SWE-Gym/SWE-Gym"]) == 2
    assert capsys.readouterr().err == (
        "error: --from_rows='SWE-Gym/SWE-Gym': no 'instance_id' column in SWE-Gym/SWE-Gym split "
        "'train' (columns: ['text']) (SWE-Gym/SWE-Gym is the local directory "
        f"{tmp_path}/cwd/SWE-Gym/SWE-Gym, read before the Hub id of that spelling: move it, or "
        "run elsewhere, to use the Hub's)\n"
    )
