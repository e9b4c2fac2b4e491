"""Grading in the `repo` environment (rl/envs/repo/env.py, the GRADE program of
rl/envs/repo/programs.py): infrastructure errors are masked, the model's failures (hangs at
import, broken or forging conftest.py and pytest configuration, files pytest would stumble on)
score 0, and nothing the model writes changes how its tests run. Shared fixtures and helpers:
tests/rl/repo_env_helpers.py."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from rl.envs.repo import RepoEnv
from tests.rl import repo_env_helpers
from tests.rl.repo_env_helpers import TOK, act, call, graded, make_config

tasks = repo_env_helpers.tasks  # the module fixture


@pytest.mark.repo_sandbox
@pytest.mark.slow  # waits out a harness timeout and a per-test alarm (~9 s)
def test_infrastructure_errors_are_flagged_not_scored(tmp_path, tasks):
    """A harness timeout, a failing setup and a missing repository mask the episode; the other
    episodes of the group are scored as usual. The two episodes that wait (the harness timeout,
    the per-test alarm) run in threads while the others are graded (episodes run concurrently in
    training too)."""
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
    # A test that hangs on its own is the model's fault: it fails on the per-test alarm.
    alarm = RepoEnv(TOK, make_config(test_timeout_s=30.0, per_test_timeout_s=2))

    def episode(e, rec):
        ep = e.start(rec)
        act(e, ep, call("bash", command="true"))
        try:
            return e.reward(ep), ep
        finally:
            e.close(ep)

    try:
        with ThreadPoolExecutor(2) as pool:
            waits = [pool.submit(episode, harsh, slow), pool.submit(episode, alarm, slow)]
            group = [{**tasks[0], "setup": "exit 1"}, {**tasks[0], "repo": str(tmp_path / "no")}]
            others = [episode(env, rec) for rec in group + [tasks[0]]]
            (timed_out, alarmed) = [w.result() for w in waits]
        rewards, eps = zip(*[timed_out, *others])
        assert [env.masked(ep) for ep in eps] == [True, True, True, False]
        assert eps[0].infra_error.startswith("harness timeout")
        assert eps[1].infra_error.startswith("setup failed")
        assert eps[2].infra_error.startswith("workspace: FileNotFoundError")
        assert rewards[3] == 0.0 and eps[3].metrics["pass_to_pass_frac"] == 1.0  # scored
        reward, ep = alarmed
        assert reward == 0.0 and not alarm.masked(ep)
        assert ep.metrics["fail_to_pass_frac"] == 0.0
    finally:
        harsh.shutdown()
        env.shutdown()
        alarm.shutdown()


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


@pytest.mark.repo_sandbox
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


@pytest.mark.repo_sandbox
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
        runs = [graded(env, tasks[0], [forge], fix=False), graded(env, tasks[0], broken),
                graded(env, own, [], fix=False),
                graded(env, own, ["printf 'raise ImportError(2)\\n' > mod.py"], fix=False),
                graded(env, own, ["printf 'import time\\ntime.sleep(60)\\n' > mod.py"],
                        fix=False),
                graded(env, tasks[0], [toml], fix=False), graded(env, tasks[0], [dist], fix=False),
                graded(env, tasks[0], [shadow], fix=False), graded(env, tasks[0], stumble),
                graded(env, tasks[0], exits)]  # fmt: skip
    finally:
        env.shutdown()
    assert [r for r, _ in runs] == [0, 1, 1, 0, 0, 0, 0, 0, 1, 0], [
        ep.infra_error for _, ep in runs
    ]
    assert not any(env.masked(ep) for _, ep in runs)
    for i in (0, 5, 6, 7):  # the forged reports never counted
        assert runs[i][1].metrics["fail_to_pass_frac"] == 0.0, i
    assert all(not ep.grade_timeout for _, ep in runs)  # the hang ended on its alarm


@pytest.mark.repo_sandbox
@pytest.mark.slow  # waits out env.test_timeout_s
def test_an_import_hang_that_ignores_the_alarm_scores_0_not_masked(tasks):
    """Code that ignores SIGALRM and hangs at import is killed with the whole graded run at
    env.test_timeout_s; it was in collection (the model's code) for longer than its alarm, so it
    scores 0 unmasked (a harness timeout elsewhere stays masked). The run gets 20 s (all of it
    waited): collection must start more than alarm + GRACE_S (7 s) before the kill, so within
    13 s of the start, and on CI's loaded machine pytest's own start-up took 5.5 s (a 10 s limit
    with a 2 s alarm masked the episode)."""
    env = RepoEnv(TOK, make_config(test_timeout_s=20.0, per_test_timeout_s=4))
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


@pytest.mark.repo_sandbox
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
