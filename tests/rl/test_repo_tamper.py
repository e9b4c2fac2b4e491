"""Grading in the `repo` environment against a model that patches the test harness (rl/envs/
repo_integrity.py): the task's test directories are put back whole before the tests run, a
changed assertion machinery (unittest's asserts, pytest's reports, builtins, import finders)
scores 0 and counts as `episode/tamper`, and what a package's own tests legitimately do passes.
Shared fixtures and helpers: tests/rl/repo_env_helpers.py."""

import base64
import tarfile

import _pytest.config
import pytest

from rl.envs.repo import RepoEnv
from rl.envs.repo.grading import dirs_of_tests, pristine
from tests.rl import repo_env_helpers
from tests.rl.repo_env_helpers import TOK, graded, make_config

PATCH = "import unittest\\nunittest.TestCase.assertEqual = lambda *a, **k: None\\n"
# The same patch made when the tests call the package (after the collection check), as a code swap
SWAP = """def add(a, b):
    import unittest
    unittest.TestCase.assertEqual.__code__ = (lambda self, *a, **k: None).__code__
    return a - b
"""
# A plugin the package's own plugin module registers with pytest's plugin manager, found through gc
PLUGIN = """import gc, _pytest.config, pytest
class Forge:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        out = yield
        out.get_result().outcome = "passed"
cfg = next(o for o in gc.get_objects() if isinstance(o, _pytest.config.Config))
cfg.pluginmanager.register(Forge())
"""


# The test class gets a no-op assertEqual as it is made (builtins' class-building hook replaced)
BUILD_CLASS = """import builtins
_bc = builtins.__build_class__
def _h(f, n, *b, **k):
    c = _bc(f, n, *b, **k)
    if n.startswith("Test"):
        c.assertEqual = lambda *a, **k: None
    return c
builtins.__build_class__ = _h
"""
# A forging plugin whose code claims to be pytest's own (a forged co_filename)
FORGED = PLUGIN.replace("cfg = next", "f = Forge.pytest_runtest_makereport\n"
                        "f.__code__ = f.__code__.replace(co_filename=_pytest.config.__file__)\n"
                        "cfg = next")  # fmt: skip
# The test class's own assertEqual replaced when a test calls the package (found through gc)
CLASS_ATTR = """import gc, unittest
def add(a, b):
    for c in gc.get_objects():
        if isinstance(c, type) and issubclass(c, unittest.TestCase) and c.__name__ == "TestOps":
            c.assertEqual = lambda *a, **k: None
    return a - b
"""


@pytest.mark.repo_sandbox
@pytest.mark.slow  # eight graded runs; regression tests (every hack but the last passed unfixed)
def test_grading_restores_the_test_directories_and_catches_a_patched_harness(tmp_path):
    """An unfixed task patched to pass scores 0: through tests/__init__.py (put back with every
    file of tests/), through the package's own __init__.py (the guard: unittest's assertEqual
    rebound), its code swapped when a test calls the package (checked after each test), a
    forging plugin registered from the package's own plugin module (which the pristine conftest.py
    names: unchanged, its hooks are trusted), builtins' `__build_class__` replaced, a forging
    plugin whose code claims pytest's file (trusted by identity or by code compiled from a
    pristine file, not by its claim), or the test class's own assertEqual replaced (a collected
    TestCase's assertions: unittest's or a pristine file's). A fix with files added to and
    changed in tests/ still scores 1.0: they are put back or deleted (`restored`), no tamper."""
    task = repo_env_helpers.unittest_task(tmp_path / "calc")
    env = RepoEnv(TOK, make_config(test_timeout_s=60.0, per_test_timeout_s=10))
    write = lambda path, text: f"cat >> {path} <<'EOF'\n{text}EOF"
    noise = ["printf '# a note\\n' >> calc/__init__.py", "printf x > tests/data/blob.bin",
             "printf 'def test_repro():\\n    assert 0\\n' > tests/test_repro.py",
             "mkdir tests/scratch && touch tests/scratch/notes.txt"]  # fmt: skip
    try:
        runs = [graded(env, task, [f"printf '{PATCH}' >> tests/__init__.py"], fix=False),
                graded(env, task, [f"printf '{PATCH}' >> calc/__init__.py"], fix=False),
                graded(env, task, [f"cat > calc/ops.py <<'EOF'\n{SWAP}EOF"], fix=False),
                graded(env, task, [write("calc/plugin.py", PLUGIN)], fix=False),
                graded(env, task, noise),
                graded(env, task, [write("calc/__init__.py", BUILD_CLASS)], fix=False),
                graded(env, task, [write("calc/__init__.py", FORGED)], fix=False),
                graded(env, task, [f"cat > calc/ops.py <<'EOF'\n{CLASS_ATTR}EOF"],
                        fix=False)]  # fmt: skip
    finally:
        env.shutdown()
    assert [r for r, _ in runs] == [0, 0, 0, 0, 1, 0, 0, 0], [
        (ep.infra_error, ep.tamper) for _, ep in runs
    ]
    assert not any(env.masked(ep) for _, ep in runs)
    eps = [ep for _, ep in runs]
    assert eps[0].restored == ["tests/__init__.py"] and eps[0].tamper == []
    assert eps[0].metrics == {"fail_to_pass_frac": 0.0, "pass_to_pass_frac": 1.0}
    assert eps[1].tamper == eps[2].tamper == ["unittest.case.TestCase.assertEqual"]
    # the plugin module changed: its own hook and the one it registered are no longer pristine
    hooks = ["hook pytest_report_header", "hook pytest_runtest_makereport"]
    assert sorted(t.split(" from ")[0] for t in eps[3].tamper) == hooks, eps[3].tamper
    assert all(t.endswith("/calc/plugin.py") for t in eps[3].tamper)
    for ep in eps[1:4]:  # no forged report counted
        assert ep.metrics == {"fail_to_pass_frac": 0.0, "pass_to_pass_frac": 0.0}
    assert sorted(eps[4].restored) == [
        "tests/data/blob.bin",
        "tests/scratch",
        "tests/test_repro.py",
    ]
    assert eps[4].tamper == [] and eps[4].metrics["pass_to_pass_frac"] == 1.0
    assert eps[5].tamper == ["builtins.__build_class__"]
    assert eps[6].tamper == ["hook pytest_runtest_makereport from " + _pytest.config.__file__]
    assert eps[7].tamper == ["tests.test_ops.TestOps.assertEqual"]
    for ep in eps[5:]:
        assert ep.metrics == {"fail_to_pass_frac": 0.0, "pass_to_pass_frac": 0.0}


# Pristine tests that use the import system and the harness as a package's own tests may
CORRECT = b"""import builtins
import os
import sys
import unittest
import zipfile

from calc import add


class Hook:  # an import hook of the test's own (as typeguard's or beartype's tests install)
    def find_spec(self, name, path, target=None):
        return None


def test_zip(tmp_path):
    z = tmp_path / "m.zip"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("zm.py", "X = 5")
    sys.path.insert(0, str(z))
    import zm

    assert add(2, 3) == zm.X


def test_hook():
    sys.meta_path.insert(0, Hook())
    assert add(2, 3) == 5


def test_input(monkeypatch):  # builtins lent out until the test's teardown
    monkeypatch.setattr(builtins, "input", lambda *a: "5")
    assert add(2, 3) == int(input())


def test_made_by_setup():
    with open(os.path.join(os.path.dirname(__file__), "data", "made.txt")) as f:
        assert add(2, 3) == int(f.read())


class T(unittest.TestCase):
    def assertEqual(self, a, b, msg=None):  # the test class's own assertion
        assert a == b
        super().assertEqual(a, b, msg)

    def test_add(self):
        self.assertEqual(add(2, 3), 5)
"""


@pytest.mark.repo_sandbox
def test_correct_fixes_score_1_with_tests_that_use_the_import_system(tmp_path):
    """The tamper check passes what a package's own tests do (regression tests: each scored 0 as
    tamper, or failed): a finder of the standard library's (a zip on sys.path) or of a pristine
    file's in the import system, builtins monkeypatched until teardown, a test class's own
    assertEqual; and a file the record's `setup` made in tests/ is put back, not deleted."""
    task = repo_env_helpers.unittest_task(tmp_path / "calc")
    (tmp_path / "calc" / "tests" / "test_ops.py").write_bytes(CORRECT)
    names = ["test_zip", "test_hook", "test_input", "test_made_by_setup", "T::test_add"]
    task = {**task, "fail_to_pass": [f"tests/test_ops.py::{n}" for n in names],
            "pass_to_pass": [], "setup": "printf 5 > tests/data/made.txt"}  # fmt: skip
    env = RepoEnv(TOK, make_config(test_timeout_s=60.0, per_test_timeout_s=10))
    try:
        reward, ep = graded(env, task, [])
    finally:
        env.shutdown()
    assert (reward, ep.tamper, ep.infra_error) == (1.0, [], ""), ep.metrics
    assert ep.restored == [] and ep.restore is None  # dropped at close


def test_the_pristine_test_directories(tmp_path):
    """A test file's test directory is its nearest ancestor named for tests (never code beside
    it); a .tar.gz snapshot gives what its directory gives, every byte of every file."""
    files = ["tests/test_a.py", "tests/unit/test_b.py", "pkg/sub/tests/test_c.py", "test_root.py",
             "pkg/test_d.py", "numpy/testing/tests/test_e.py", "testing/test_f.py"]  # fmt: skip
    assert dirs_of_tests(files) == ["numpy/testing/tests", "pkg/sub/tests", "testing", "tests"]
    task = repo_env_helpers.unittest_task(tmp_path / "calc")
    (tmp_path / "calc" / "tests" / "data" / "empty").mkdir()
    with tarfile.open(tmp_path / "calc.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "calc", arcname=".")
    want = pristine(task["repo"], ("tests/test_ops.py",))
    assert pristine(str(tmp_path / "calc.tar.gz"), ("tests/test_ops.py",)) == want
    assert sorted(want["files"]) == ["conftest.py", "tests/__init__.py", "tests/data/blob.bin",
                                     "tests/test_ops.py"]  # fmt: skip
    assert want["dirs"] == ["tests"] and want["keep"] == ["tests/data", "tests/data/empty"]
    mode, data = want["files"]["tests/data/blob.bin"]
    blob = tmp_path / "calc" / "tests" / "data" / "blob.bin"
    assert base64.b64decode(data) == bytes(range(256)) and mode == blob.stat().st_mode & 0o777
