"""Grading in the `repo` environment, host side: what the graded run (GRADE,
`rl/envs/repo/programs.py`) puts back from the pristine repository, and how its result becomes
the episode's reward, its metrics, or an infrastructure error (masked).

Put back: the task's test files; every file of their test directories; conftest.py and pytest
configuration files (HARNESS) anywhere. A test file's test directory is its nearest ancestor
whose name says tests (`tests`, `test`, `testing`, `test_*`, `*_test`, `*_tests`: `tests/`,
`tests/` for `tests/unit/test_a.py`, `pkg/sub/tests/`): the `__init__.py`, helpers and data
files there are the task's, never the fix. A test file with no such ancestor (at the root, or
beside the package's code) has only itself put back: its directory holds the code to fix. The
guard (`rl/envs/repo/integrity.py`) covers what is not put back, the package's own files. For a
record with a `setup`, what is put back is read from the workspace as setup left it
(`after_setup`), so a file setup makes in a test directory is the task's, not deleted.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import posixpath
import re
import tarfile

from rl.envs.repo.sandbox import last_phase

# conftest.py and the files pytest 9 reads its configuration from (its CONFIG_LOADERS_BY_NAME)
HARNESS = (
    "conftest.py",
    "pytest.toml",
    ".pytest.toml",
    "pytest.ini",
    ".pytest.ini",
    "pyproject.toml",
    "tox.ini",
    "setup.cfg",
)
GRACE_S = 3.0  # a graded run killed this long past an alarm, in the model's code: its fault
TEST_DIR = re.compile(r"(tests?|testing|test_.*|.*_tests?)")  # a directory name that says tests
ERRORS = (OSError, KeyError, UnicodeError, tarfile.TarError)  # a pristine repository unreadable


def tested_files(record: dict) -> list[str]:
    return sorted({n.split("::")[0] for n in record["fail_to_pass"] + record["pass_to_pass"]})


def dirs_of_tests(files: list[str]) -> list[str]:
    """The test directories of test files (see the module docstring), none inside another."""
    dirs = set()
    for f in files:
        parts = f.split("/")[:-1]
        named = [i for i, part in enumerate(parts) if TEST_DIR.fullmatch(part)]
        if named:
            dirs.add("/".join(parts[: named[-1] + 1]))
    return sorted(d for d in dirs if not any(d.startswith(o + "/") for o in dirs))


def _under(rel: str, dirs) -> bool:
    return any(rel == d or rel.startswith(d + "/") for d in dirs)


def _walk(repo: str, top: str) -> tuple[list[str], list[str]]:
    """(files, subdirectories) under repo/top, as paths relative to repo; symlinks followed (the
    workspace gets their contents), a directory seen twice (a link loop) and broken links left."""
    files, dirs, seen = [], [], set()
    for d, subdirs, names in os.walk(os.path.join(repo, top), followlinks=True):
        seen.add(os.path.realpath(d))
        subdirs[:] = [n for n in subdirs if os.path.realpath(os.path.join(d, n)) not in seen]
        dirs += [os.path.relpath(os.path.join(d, n), repo) for n in subdirs]
        files += [
            os.path.relpath(os.path.join(d, n), repo)
            for n in names
            if os.path.isfile(os.path.join(d, n))
        ]
    return files, dirs


def _read_dir(repo: str, tests, dirs) -> tuple[dict, list[str]]:
    """({path: [mode, bytes]}, subdirectories) of a directory: the test files, every file of
    their test directories, the HARNESS files anywhere."""
    rels = [
        os.path.relpath(os.path.join(d, n), repo)
        for d, _, names in os.walk(repo)
        for n in names
        if n in HARNESS
    ]
    keep, files = [], {}
    for top in dirs:
        more, subdirs = _walk(repo, top)
        rels, keep = rels + more, keep + subdirs
    for rel in sorted(set(rels) | set(tests)):
        with open(os.path.join(repo, rel), "rb") as f:
            data = f.read()
        files[rel] = [os.stat(os.path.join(repo, rel)).st_mode & 0o777, data]
    return files, keep


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _encoded(files: dict, dirs, keep, hashes: dict) -> dict:
    files = {rel: [mode, base64.b64encode(data).decode()] for rel, (mode, data) in files.items()}
    return {"files": files, "dirs": dirs, "keep": sorted(set(keep)), "hashes": hashes}


@functools.lru_cache(maxsize=16)
def pristine(repo: str, tests: tuple[str, ...]) -> dict:
    """GRADE's restore arguments for the repository (a directory or .tar.gz) and its test files:
    `files` {path: [mode, base64 bytes]} (the test files, every file of their test directories,
    the HARNESS files), `dirs` (the test directories), `keep` (their subdirectories) and
    `hashes` {path: sha256} of every .py file (the guard trusts hook implementations, import
    finders and assertions from those unchanged). Raises one of ERRORS when a test file is
    missing or the repository cannot be read."""
    dirs, files, keep, hashes = dirs_of_tests(list(tests)), {}, [], {}
    if os.path.isdir(repo):
        for d, subdirs, names in os.walk(repo):
            subdirs[:] = [n for n in subdirs if n != ".git"]
            for n in names:
                if n.endswith(".py") and os.path.isfile(p := os.path.join(d, n)):
                    with open(p, "rb") as f:
                        hashes[os.path.relpath(p, repo)] = _sha(f.read())
        files, keep = _read_dir(repo, tests, dirs)
    else:
        with tarfile.open(repo) as tar:
            for m in tar.getmembers():
                rel = m.name.removeprefix("./")
                if m.isfile() and rel.endswith(".py"):
                    hashes[rel] = _sha(tar.extractfile(m).read())
                if m.isdir() and _under(rel, dirs) and rel not in dirs:
                    keep.append(rel)
                elif (
                    rel in tests
                    or (m.isfile() and posixpath.basename(rel) in HARNESS)
                    or ((m.isfile() or m.issym() or m.islnk()) and _under(rel, dirs))
                ):
                    try:  # a link is read through, within the archive
                        f = tar.extractfile(m)
                    except KeyError:  # a broken link: left out, unless it is a test file
                        continue
                    if f is not None:
                        files[rel] = [m.mode & 0o777 if m.isfile() else 0o644, f.read()]
        missing = [t for t in tests if t not in files]
        if missing:
            raise FileNotFoundError(f"{missing[0]} is not in {repo}")
    return _encoded(files, dirs, keep, hashes)


def after_setup(workspace: str, repo: str, tests: tuple[str, ...]) -> dict:
    """pristine() as the record's `setup` left the workspace (trusted: the model has not acted
    yet), so that what setup made or changed in the test directories is put back, not deleted:
    their files and the HARNESS files read from the workspace, the .py hashes the repository's
    updated with those files'. Read once per episode, only for a record with a setup."""
    dirs = dirs_of_tests(list(tests))
    files, keep = _read_dir(workspace, tests, dirs)
    hashes = {**pristine(repo, tests)["hashes"]}
    hashes.update((rel, _sha(data)) for rel, (_, data) in files.items() if rel.endswith(".py"))
    return _encoded(files, dirs, keep, hashes)


def score(ep, r: dict, per_test: float, ended: float) -> float:
    """The episode's reward from GRADE's result `r` (RepoSandbox.program's dict), with its metrics
    and per-test `results`, `missing`, `tamper`, `restored`, `grade_timeout` or `infra_error`
    set; `ended`: time.monotonic() when the run returned (a killed run's phase is aged on the
    sandbox's own clock)."""
    run = r["_run"]
    zero = {"fail_to_pass_frac": 0.0, "pass_to_pass_frac": 0.0}
    if not r["_started"]:  # also: the harness (pytest) could not be imported before READY
        ep.infra_error = f"sandbox did not start ({run.reason}, {run.seconds:.1f} s): "
        ep.infra_error += run.stderr.strip()[-300:]
        return 0.0
    ep.restored = list(r.get("restored", []))
    if r.get("tamper"):  # the model's code changed the harness: no report of the run counts
        ep.tamper, ep.metrics = list(r["tamper"]), zero
        return 0.0
    if run.reason == "timeout":
        # Killed at env.test_timeout_s in a phase (restoring the files, pytest starting,
        # importing, configuring, a test, between tests) older than its alarm plus GRACE_S:
        # the model's code evaded or outlived an alarm (e.g. ignored SIGALRM) or kept pytest
        # busy, which pytest alone never takes that long for: it scores 0. A younger phase
        # (a slow machine) or none: masked. The phase's age is read on one clock, the
        # sandbox's start-up not in it.
        where = last_phase(run.stdout)
        age = ended - where[1] if where else 0.0
        if where and age > per_test + GRACE_S:
            ep.grade_timeout, ep.metrics = where[0], zero
            return 0.0
        name = where[0] if where else None
        ep.infra_error = (
            f"harness timeout ({run.reason}, {run.seconds:.1f} s, phase {name} for {age:.1f} s)"
        )
        return 0.0
    code, broken = r.get("exit"), r.get("broken")
    ep.missing = list(r.get("missing", []))  # node ids the pristine tests do not define
    alarm = code == 3 and "TimeoutError" in r.get("internal", [])  # inside pytest: slow
    undefined = r.get("missing") and code not in (2, 3)  # ids the pristine tests lack
    if not broken and (alarm or code == 4 or undefined):
        # pytest's internal error from an alarm, its usage error (the configuration is
        # pristine: the task's), or node ids the pristine tests do not define: masked. An
        # interrupt or another internal error (the model's code raised SystemExit while
        # collected, say) scores 0, as does any file the model broke.
        missing = r.get("missing", [])[:3]
        ep.infra_error = f"pytest exit status {code}, missing {missing}: {run.stdout[-300:]}"
        return 0.0
    f2p, p2p = list(ep.record["fail_to_pass"]), list(ep.record["pass_to_pass"])
    passed = r.get("passed", {})  # missing (the run died after READY): all fail
    frac = lambda nodes: sum(bool(passed.get(n)) for n in nodes) / max(1, len(nodes))
    ep.metrics = {"fail_to_pass_frac": frac(f2p), "pass_to_pass_frac": frac(p2p)}
    ep.results = {n: bool(passed.get(n)) for n in f2p + p2p}  # (launch.make_repo_tasks --validate)
    return float(all(passed.get(n) for n in f2p + p2p))
