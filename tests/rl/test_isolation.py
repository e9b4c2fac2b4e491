"""config.env.isolation fails closed (rl/sandbox/process.py, launch/validate.py `check_isolation`): without
working bubblewrap (hidden from the probe here, not uninstalled) a Sandbox refuses unless asked for
the weak mode, and every config that runs model-written code stops at start-up with one line,
before its workdir exists; configs that run none probe nothing, nor do --dry_run and export. The repo environment refuses a
sandbox that cannot import pytest (a venv under a private home, uid mode), and its shell has
`python` and `python3` in every mode."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from launch.cli import UsageError, load_config_file
from launch.train import main
from launch.validate import check_isolation
from rl.envs import code_rewards
from rl.envs.repo import RepoEnv
from rl.envs.repo import sandbox as rs
from rl.sandbox import Sandbox
from rl.sandbox import process as sandbox
from tests.conftest import FIXTURES, ROOT, sandbox_isolation
from tests.rl import repo_env_helpers
from tests.rl.repo_env_helpers import TOK, act, call, make_config

pytestmark = pytest.mark.filterwarnings("ignore:sandbox without bubblewrap")
tasks = repo_env_helpers.tasks  # the module fixture
# configs/*.py whose environment or reward runs model-written code; the others must not probe
CODE_CONFIGS = {
    "qwen2_5_0_5b_code",
    "qwen2_5_0_5b_code_32k",
    "qwen3_0_6b_code",
    "qwen3_0_6b_repo",
    "qwen3_coder_30b_a3b_repo",
}
CONFIGS = sorted(os.path.basename(p)[:-3] for p in glob.glob(f"{ROOT}/configs/*.py"))
CONFIGS.remove("__init__")


@pytest.fixture
def no_bwrap(monkeypatch):
    """bubblewrap hidden from the probe (its name on PATH changed); the python_tests reward's
    shared sandboxes and isolation set aside, so none made with bwrap is reused."""
    monkeypatch.setattr(sandbox, "BWRAP", "bwrap-hidden-by-test")
    monkeypatch.setattr(code_rewards, "_shared", {})
    monkeypatch.setattr(code_rewards, "_isolation", "auto")


def _roots():
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "sandbox-*")))


@pytest.mark.parametrize("isolation", ["auto", "bwrap"])
def test_sandbox_without_bwrap_refuses_in_one_line(no_bwrap, isolation):
    before = _roots()
    with pytest.raises(RuntimeError) as e:
        Sandbox(1, isolation=isolation)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("bubblewrap does not work here (bwrap-hidden-by-test")
    assert "is not installed" in msg and f"isolation={isolation!r} refuses" in msg
    assert "apt-get install bubblewrap" in msg and "--config.env.isolation=rlimits" in msg
    assert f"the weak {sandbox.weak_mode()!r} one" in msg
    assert _roots() <= before  # its root is removed again
    with pytest.raises(ValueError, match="isolation='off': expected one of"):
        Sandbox(1, isolation="off")


def test_bwrap_that_fails_to_start_is_refused_with_the_probes_reason(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "BWRAP", str(fake))
    monkeypatch.setattr(sandbox, "_probed", {})  # the probe is remembered per process
    with pytest.raises(RuntimeError) as e:
        Sandbox(1)
    assert "bwrap failed to start in this container: error: bwrap: No permissions" in str(e.value)


@pytest.mark.parametrize("name", CONFIGS)
def test_code_configs_stop_at_start_up_without_bwrap(no_bwrap, name, tmp_path, capsys):
    """launch.train's own start-up: a config that runs model-written code exits 2 with one line
    and no workdir; one that runs none passes the check without starting a sandbox."""
    path = f"{ROOT}/configs/{name}.py"
    if name not in CODE_CONFIGS:
        check_isolation(load_config_file(path))  # a probe would raise: bwrap is hidden
        assert code_rewards._shared == {}
        return
    workdir = tmp_path / "run"
    assert main([f"--config={path}", f"--workdir={workdir}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and not workdir.exists(), lines
    repo = name in ("qwen3_0_6b_repo", "qwen3_coder_30b_a3b_repo")  # isolation="bwrap" set
    iso = "bwrap" if repo else "auto"
    what = "env 'repo'" if repo else "env 'code_tests'"
    assert lines[0].startswith(f"error: config.env.isolation={iso!r}: {what} runs model-written "
                               "code; bubblewrap does not work here (bwrap-hidden-by-test")  # fmt: skip
    assert "apt-get install bubblewrap" in lines[0] and "--config.env.isolation=rlimits" in lines[0]
    print(lines[0])


def test_code_rewards_are_checked_and_wired_to_the_config(no_bwrap, monkeypatch):
    monkeypatch.setattr(sandbox, "_warned", set())
    config = load_config_file(f"{ROOT}/configs/default.py")
    config.rl.rewards = {"python_tests": 1.0}
    with pytest.raises(UsageError, match="reward 'python_tests' runs model-written code; bubbl"):
        check_isolation(config)
    config.env.isolation = "rlimits"
    with pytest.warns(RuntimeWarning, match="without bubblewrap"):
        check_isolation(config)
    assert code_rewards.shared_sandbox().isolation == "rlimits"  # what python_tests runs in
    assert code_rewards.python_tests(["p"], ["x = 1"], tests=["assert x == 1"]) == [1.0]
    config.env.isolation = "none"
    with pytest.raises(UsageError, match="config.env.isolation='none': expected one of"):
        check_isolation(config)


def _private_site(tmp_path):
    """A copy of the top-level packages `import pytest` loads, under a 0700 directory owned by
    us (root): a venv in a private home as the workspace uids see it."""
    site = rs.site_packages()
    out = subprocess.run([sys.executable, "-c", "import sys, pytest; print(*sys.modules.values(), "
                          "sep='\\n')"], capture_output=True, text=True, check=True).stdout  # fmt: skip
    tops = {line.split(f"from '{site}/")[1].split("/")[0].rstrip("'>")
            for line in out.splitlines() if f"from '{site}/" in line}  # fmt: skip
    home = tmp_path / "home"
    copy = home / "venv" / "site-packages"
    copy.mkdir(parents=True)
    for top in tops - {"__editable___jax_grpo_0_1_0_finder.py"}:
        src = os.path.join(site, top)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, copy / top)
    home.chmod(0o700)
    return str(home), str(copy)


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid mode needs root")
def test_repo_env_refuses_a_sandbox_that_cannot_import_pytest(tmp_path, monkeypatch):
    home, site = _private_site(tmp_path)
    monkeypatch.setattr(rs, "site_packages", lambda: site)
    config = make_config(isolation="rlimits")
    why = RepoEnv.check_sandbox(config)  # launch.validate's start-up check
    m = re.fullmatch(r"the repo environment's sandbox \(mode 'uid'\) cannot import pytest from "
                     r"(\S+): uid \d+ cannot read (\S+): permission denied; install bubblewrap .*",
                     why)  # fmt: skip
    assert m and m[1] == site, why
    assert home == m[2] or home.startswith(m[2] + "/"), why  # tmp_path's parents are 0700 too
    assert "where any user can read it" in why
    with pytest.raises(RuntimeError, match="cannot import pytest"):
        RepoEnv(TOK, config)
    try:
        Sandbox(1).close()
    except RuntimeError:
        return  # no bubblewrap here: its half of the test cannot run
    assert RepoEnv.check_sandbox(make_config(isolation="auto")) == ""  # bwrap binds the site


def _fix_with_python(env, task):
    """A scripted fix through the model's shell: `python` and `python3` run, then the edit."""
    ep = env.start(task)
    out = act(env, ep, call("bash", command="python -c 'print(6 * 7)'; python3 -c 'print(2**5)'"))
    root = env.tools.root(ep.workspace)
    fix = task["fix"]
    act(env, ep, call("str_replace_editor", command="str_replace", path=f"{root}/{fix['path']}",
                      old_str=fix["old"], new_str=fix["new"]))  # fmt: skip
    assert act(env, ep, call("submit")) is None
    try:
        return out, env.reward(ep), env.masked(ep)
    finally:
        env.close(ep)


@pytest.mark.parametrize("isolation", ["auto", "rlimits"])
def test_repo_shell_has_python_and_a_fix_scores_1(tasks, isolation):
    """In bubblewrap mode and in the weak mode (the uid mode as root, where the trainer's
    interpreter lies under /root here and the workspace uids run /usr/bin/python3)."""
    try:
        env = RepoEnv(TOK, make_config(isolation=isolation))
    except RuntimeError as e:
        pytest.skip(f"no sandbox in this mode here: {e}")
    try:
        out, reward, masked = _fix_with_python(env, tasks[3])
    finally:
        env.shutdown()
    assert out.startswith("42\n32\n[exit code 0]"), out
    assert reward == 1.0 and not masked


def test_dry_run_and_export_of_a_code_config_run_no_model_code_and_are_not_refused(
    no_bwrap, tmp_path, monkeypatch, capsys
):
    """launch.train --dry_run builds no environment and launch.export runs no episode: neither
    probes the sandbox, so neither refuses a code config without bubblewrap; launch.eval (which
    runs episodes) still does. The lowering and the restore are stubbed: only the start-up's
    choices are under test."""
    import launch.build
    import launch.train
    from launch.cli import config_json
    from launch.eval import main as evaluate
    from launch.export import main as export

    path = f"{ROOT}/configs/qwen3_0_6b_repo.py"
    lowered = []
    monkeypatch.setattr(launch.train, "dry_run", lambda config: lowered.append(config) or 0)
    (tmp_path / "tasks.jsonl").write_text("")
    args = [f"--config={path}", f"--config.model.hf_checkpoint={FIXTURES}/qwen3",
            f"--config.data.train.path={tmp_path}/tasks.jsonl",
            f"--config.data.eval.path={tmp_path}/tasks.jsonl"]  # fmt: skip
    assert main([*args, f"--workdir={tmp_path / 'dry'}", "--dry_run"]) == 0
    assert len(lowered) == 1 and "bubblewrap" not in capsys.readouterr().err
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps(config_json(load_config_file(path))))
    built = []

    class Built(Exception):  # stands in for the restore after build()
        pass

    def build(config, with_reference=True, with_env=True):
        built.append(with_env)
        raise Built

    fake = type("Ckpt", (), {"manager": type("M", (), {"all_steps": lambda self: [1]})()})
    monkeypatch.setattr(launch.build, "Checkpointer", lambda workdir: fake())
    monkeypatch.setattr(launch.build, "build", build)
    with pytest.raises(Built):
        export(["--workdir", str(workdir), "--out", str(tmp_path / "out")])
    assert built == [False] and "bubblewrap" not in capsys.readouterr().err
    assert evaluate(["--workdir", str(workdir)]) == 2 and built == [False]
    err = capsys.readouterr().err
    assert err.startswith("error: config.env.isolation='bwrap': env 'repo' runs model-written "), (
        err
    )


@pytest.mark.parametrize("isolation", ["bwrap", "rlimits"])
def test_the_pytest_refusal_suggests_the_fix_of_its_mode(isolation, tmp_path, monkeypatch):
    """A site without pytest: in bubblewrap mode installing bubblewrap is no fix (the sandbox sees
    the site, and pytest is not there), nor in the non-root weak mode; the uid mode's refusal
    (unreadable directories) is test_repo_env_refuses_a_sandbox_that_cannot_import_pytest's."""
    if isolation == "bwrap" and sandbox_isolation() != "bwrap":
        pytest.skip("bubblewrap does not work here")
    if isolation == "rlimits" and os.geteuid() == 0:
        pytest.skip("as root the weak mode is the uid mode")
    (tmp_path / "site").mkdir(mode=0o755)
    monkeypatch.setattr(rs, "site_packages", lambda: str(tmp_path / "site"))  # no pytest in it
    why = RepoEnv.check_sandbox(make_config(isolation=isolation))
    assert why.startswith(f"the repo environment's sandbox (mode {isolation!r}) cannot import ")
    assert "import pytest failed: ModuleNotFoundError" in why, why
    assert "install bubblewrap" not in why and "pip install pytest" in why, why
