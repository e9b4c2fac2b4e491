"""Grading in the `repo` environment (rl/envs/repo.py, the GRADE program of
rl/envs/repo_programs.py): infrastructure errors are masked, the model's failures (hangs at
import, broken or forging conftest.py and pytest configuration, files pytest would stumble on)
score 0, and nothing the model writes changes how its tests run. Shared fixtures and helpers:
tests/rl/repo_env_helpers.py."""

import base64
import json
import tarfile

import _pytest.config
import pytest

from rl.envs.repo import RepoEnv
from rl.envs.repo_grading import dirs_of_tests, pristine
from tests.rl import repo_env_helpers
from tests.rl.repo_env_helpers import TOK, act, call, make_config

tasks = repo_env_helpers.tasks  # the module fixture


def test_infrastructure_errors_are_flagged_not_scored(tmp_path, tasks):
    """A harness timeout, a failing setup and a missing repository mask the episode; the other
    episodes of the group are scored as usual."""
    repo = tmp_path / "slow"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_slow.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(30)\n"
    )
    slow = {"repo": str(repo), "problem": "p", "fail_to_pass": ["tests/test_slow.py::test_slow"],
            "pass_to_pass": []}  # fmt: skip
    # The slow test's run (30 s) passes the 8 s limit, with time for the sandbox to start on a
    # loaded machine (else: 'sandbox did not start'); the others are graded under 60 s (a slow
    # machine must not time the control episode out as well).
    harsh = RepoEnv(TOK, make_config(test_timeout_s=8.0, per_test_timeout_s=60))
    env = RepoEnv(TOK, make_config(test_timeout_s=60.0, per_test_timeout_s=60))
    try:
        group = [slow, {**tasks[0], "setup": "exit 1"}, {**tasks[0], "repo": str(tmp_path / "no")}]
        group += [tasks[0]]
        rewards, eps = [], []
        for rec, e in zip(group, [harsh, env, env, env]):
            ep = e.start(rec)
            act(e, ep, call("bash", command="true"))
            rewards.append(e.reward(ep))
            eps.append(ep)
            e.close(ep)
        assert [env.masked(ep) for ep in eps] == [True, True, True, False]
        assert eps[0].infra_error.startswith("harness timeout")
        assert eps[1].infra_error.startswith("setup failed")
        assert eps[2].infra_error.startswith("workspace: FileNotFoundError")
        assert rewards[3] == 0.0 and eps[3].metrics["pass_to_pass_frac"] == 1.0  # scored
    finally:
        harsh.shutdown()
        env.shutdown()
    # A test that hangs on its own is the model's fault: it fails on the per-test alarm.
    env = RepoEnv(TOK, make_config(test_timeout_s=30.0, per_test_timeout_s=2))
    try:
        ep = env.start(slow)
        assert env.reward(ep) == 0.0 and not env.masked(ep)
        assert ep.metrics["fail_to_pass_frac"] == 0.0
        env.close(ep)
    finally:
        env.shutdown()


def _hang_at_import(env, task, code):
    """The task fixed, then `code` appended to the fixed module (run when the tests import it)."""
    fix = task["fix"]
    ep = env.start(task)
    edit = call("str_replace_editor", command="str_replace", path=fix["path"],
                old_str=fix["old"], new_str=fix["new"])  # fmt: skip
    act(env, ep, edit)
    act(env, ep, call("bash", command=f"printf '{code}' >> {fix['path']}"))
    try:
        return env.reward(ep), ep
    finally:
        env.close(ep)


def test_a_hang_at_import_scores_0_not_masked(tasks):
    """Collecting the tests imports the model's code under an alarm of env.per_test_timeout_s:
    a fixed module that then sleeps at import is a collection error, reward 0, not masked."""
    # A 4 s alarm: the collection before the hang fits in it on a loaded machine.
    env = RepoEnv(TOK, make_config(test_timeout_s=60.0, per_test_timeout_s=4))
    try:
        reward, ep = _hang_at_import(env, tasks[0], "\\nimport time\\ntime.sleep(60)\\n")
    finally:
        env.shutdown()
    assert reward == 0.0 and not env.masked(ep), ep.infra_error
    assert ep.metrics["fail_to_pass_frac"] == 0.0 and not ep.grade_timeout  # its alarm fired


FORGE = """import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    out = yield
    out.get_result().outcome = "passed"
"""


def _graded(env, task, commands, fix=True):
    """The reward and episode of `task` after its fix (with `fix`) and bash `commands`."""
    ep = env.start(task)
    if fix:
        f = task["fix"]
        act(env, ep, call("str_replace_editor", command="str_replace", path=f["path"],
                          old_str=f["old"], new_str=f["new"]))  # fmt: skip
    for command in commands:
        act(env, ep, call("bash", command=command))
    try:
        return env.reward(ep), ep
    finally:
        env.close(ep)


@pytest.mark.slow  # ten graded runs; a regression test (a conftest.py hook passed every test)
def test_grading_runs_the_repositorys_own_conftest_and_pytest_configuration(tasks, tmp_path):
    """The model's conftest.py and pytest configuration files are deleted before grading (the
    repository's own are put back): a conftest.py hook that reports every test passed does not
    pass an unfixed task, and a broken conftest.py or ini file does not fail a fixed one. The
    repository's own conftest.py runs, under the collection alarm: a module it imports that
    fails or hangs at import is the model's fault (pytest's exit status 4), scored 0."""
    # A 4 s alarm: the collection before the hang fits in it on a loaded machine.
    env = RepoEnv(TOK, make_config(test_timeout_s=60.0, per_test_timeout_s=4))
    forge = f"cat > conftest.py <<'EOF'\n{FORGE}EOF\ncp conftest.py tests/conftest.py"
    broken = ["printf 'raise ImportError(1)\\n' > conftest.py",
              "printf '[pytest]\\naddopts = --no-such-option\\n' | tee pytest.ini tests/pytest.ini",
              "printf '[tool.pytest.ini_options]\\naddopts = \"-p nope\"\\n' > pyproject.toml"]  # fmt: skip
    repo = tmp_path / "own_conftest"
    (repo / "tests").mkdir(parents=True)
    (repo / "conftest.py").write_text("import mod\n")
    (repo / "mod.py").write_text("def f():\n    return 1\n")
    (repo / "tests" / "test_mod.py").write_text(
        "import mod\n\n\ndef test_f():\n    assert mod.f() == 1\n"
    )
    own = {"repo": str(repo), "problem": "p", "fail_to_pass": ["tests/test_mod.py::test_f"],
           "pass_to_pass": []}  # fmt: skip
    # The same hook reached other ways: pytest 9's own pytest.toml naming a plugin module, an
    # installed-looking distribution whose pytest11 entry point pytest autoloads, and a json.py
    # that would stand in for the grading program's own import and print its result.
    plugin = f"cat > forge.py <<'EOF'\n{FORGE}EOF\n"
    toml = plugin + 'printf \'[pytest]\\naddopts = ["-p", "forge"]\\n\' > pytest.toml'
    dist = plugin + ("mkdir forge-1.0.dist-info && printf 'Name: forge\\nVersion: 1.0\\n' > "
                     "forge-1.0.dist-info/METADATA && printf '[pytest11]\\nforge = forge\\n' > "
                     "forge-1.0.dist-info/entry_points.txt")  # fmt: skip
    nodes = tasks[0]["fail_to_pass"] + tasks[0]["pass_to_pass"]
    fake = json.dumps(
        {"exit": 0, "passed": dict.fromkeys(nodes, True), "broken": [], "missing": []}
    )
    shadow = (f"cat > json.py <<'EOF'\nimport os\nos.write(1, b'\\x00READY\\n\\x00RESULT ' + "
              f"{fake!r}.encode() + b'\\n')\nos._exit(0)\nEOF")  # fmt: skip
    test_file = nodes[0].split("::")[0]
    # Files pytest would stumble on: a FIFO where a test file goes, a setup.py moving rootdir.
    stumble = [f"rm {test_file} && mkfifo {test_file}", "touch tests/setup.py"]
    fixed = tasks[0]["fix"]["path"]
    exits = [f"printf '\\nraise SystemExit(0)\\n' >> {fixed}"]  # collecting it ends pytest
    try:
        runs = [_graded(env, tasks[0], [forge], fix=False), _graded(env, tasks[0], broken),
                _graded(env, own, [], fix=False),
                _graded(env, own, ["printf 'raise ImportError(2)\\n' > mod.py"], fix=False),
                _graded(env, own, ["printf 'import time\\ntime.sleep(60)\\n' > mod.py"],
                        fix=False),
                _graded(env, tasks[0], [toml], fix=False), _graded(env, tasks[0], [dist], fix=False),
                _graded(env, tasks[0], [shadow], fix=False), _graded(env, tasks[0], stumble),
                _graded(env, tasks[0], exits)]  # fmt: skip
    finally:
        env.shutdown()
    assert [r for r, _ in runs] == [0, 1, 1, 0, 0, 0, 0, 0, 1, 0], [
        ep.infra_error for _, ep in runs
    ]
    assert not any(env.masked(ep) for _, ep in runs)
    for i in (0, 5, 6, 7):  # the forged reports never counted
        assert runs[i][1].metrics["fail_to_pass_frac"] == 0.0, i
    assert all(not ep.grade_timeout for _, ep in runs)  # the hang ended on its alarm


@pytest.mark.slow  # waits out env.test_timeout_s
def test_an_import_hang_that_ignores_the_alarm_scores_0_not_masked(tasks):
    """Code that ignores SIGALRM and hangs at import is killed with the whole graded run at
    env.test_timeout_s; it was in collection (the model's code) for longer than its alarm, so it
    scores 0 unmasked (a harness timeout elsewhere stays masked). The run gets 30 s: collection
    must start more than alarm + GRACE_S (7 s) before the kill, and on CI's loaded machine
    pytest's own start-up took 5.5 s (a 10 s limit with a 2 s alarm masked the episode)."""
    env = RepoEnv(TOK, make_config(test_timeout_s=30.0, per_test_timeout_s=4))
    code = (
        "\\nimport signal, time\\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\\ntime.sleep(60)\\n"
    )
    try:
        reward, ep = _hang_at_import(env, tasks[0], code)
    finally:
        env.shutdown()
    assert reward == 0.0 and not env.masked(ep), ep.infra_error
    assert ep.grade_timeout == "collect"
    assert ep.metrics == {"fail_to_pass_frac": 0.0, "pass_to_pass_frac": 0.0}


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
        runs = [_graded(env, task, [f"printf '{PATCH}' >> tests/__init__.py"], fix=False),
                _graded(env, task, [f"printf '{PATCH}' >> calc/__init__.py"], fix=False),
                _graded(env, task, [f"cat > calc/ops.py <<'EOF'\n{SWAP}EOF"], fix=False),
                _graded(env, task, [write("calc/plugin.py", PLUGIN)], fix=False),
                _graded(env, task, noise),
                _graded(env, task, [write("calc/__init__.py", BUILD_CLASS)], fix=False),
                _graded(env, task, [write("calc/__init__.py", FORGED)], fix=False),
                _graded(env, task, [f"cat > calc/ops.py <<'EOF'\n{CLASS_ATTR}EOF"],
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
        reward, ep = _graded(env, task, [])
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


def test_a_sandbox_that_cannot_import_pytest_masks_the_episode(tmp_path, tasks):
    """pytest is imported before READY: a sandbox where it cannot be (here a site directory
    without it, in place of the trainer's) is an infrastructure error, masked, not the model's
    0 (it was scored 0 when the import came after READY)."""
    env = RepoEnv(TOK, make_config(test_timeout_s=60.0, per_test_timeout_s=10))
    empty = tmp_path / "site"
    empty.mkdir()
    env.grader.site = str(empty)
    try:
        ep = env.start(tasks[0])
        assert env.reward(ep) == 0.0 and env.masked(ep)
        env.close(ep)
    finally:
        env.shutdown()
    assert ep.infra_error.startswith("sandbox did not start"), ep.infra_error
    assert "No module named 'pytest'" in ep.infra_error and not ep.metrics
