"""Partial rollouts with a tool repeat themselves whatever the tool's latency (issue 35, must-show
5): the CPU tool demo (configs/calc_tool.py) with partial rollouts, its calculator behind random
0-60 ms delays (tests/launch/jittered_tools.py, unseeded) on 8 tool workers, ends with the
parameters of the instant tool, and so does one on 2 workers killed (kill -9) and resumed. The
straight runs and the resume run in this process (tests.conftest.train_here, one device: the run
of a one-device subprocess); the killed run is a subprocess.
Tool answers are taken on the loop's logical clock (env.tool_answer_calls, sampling.episodes:
"Logical time"), so which episodes a stop cuts, and where, follows decode calls, not the wall
clock. (The wall-clock rule, env.tool_answer_calls=0, ended these runs with different
fingerprints: docs/performance.md.)"""

import contextlib
import json
import random
import subprocess
import sys
import time

import pytest

from tests.conftest import METRIC_KEYS, ROOT, train_here
from tests.launch.jittered_tools import jittered

pytestmark = pytest.mark.slow  # four training runs, one killed (a subprocess) and resumed

# The command (8 steps) shortened to 5: steps 1, 2 and 4 stop with episodes in flight
# (cut mid-turn or waiting on the tool), 3 and 5 drain and save; the kill lands after step 3.
STEPS = 5
ARGS = [
    f"--config={ROOT}/configs/calc_tool.py", f"--config.num_steps={STEPS}",
    "--config.checkpoint_every=3", "--config.eval_every=0", "--config.rl.partial_rollouts=True",
    "--config.rl.is_correction=tis", "--config.data.eval.num=8",  # evaluation: 8 prompts, not 200
]  # fmt: skip
JITTER_MS = 60


def _cmd(workdir, *extra):
    """The jittered run as a subprocess (the one that is killed)."""
    return [sys.executable, "-m", "tests.launch.jittered_tools", str(JITTER_MS),
            f"--workdir={workdir}", *ARGS, *extra]  # fmt: skip


def _train(workdir, jitter: bool, *extra):
    """The run in this process (tests.conftest.train_here), the tool jittered or instant."""
    with jittered(JITTER_MS) if jitter else contextlib.nullcontext():
        assert train_here([f"--workdir={workdir}", *ARGS, *extra]) == 0


def _rows(workdir):
    return [json.loads(x) for x in open(workdir / "metrics.jsonl") if '"loss"' in x]


def train_metrics(workdir):
    """{step: the METRIC_KEYS a run without KL logs} (tests.conftest.train_metrics needs kl)."""
    return {r["step"]: {k: r[k] for k in METRIC_KEYS if k in r} for r in _rows(workdir)}


def _fingerprint(workdir):
    return json.load(open(workdir / "summary.json"))["params_fingerprint"]


CARRY = ("rollout/carried_episodes", "rollout/carried_groups", "rollout/staleness_max",
         "rollout/offpolicy_token_frac")  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Straight runs: the instant tool, and the jittered one on 8 tool workers (the 2-worker run
    is the killed and resumed one, below: one run fewer)."""
    out = {}
    for name, jitter in (("instant", False), ("jitter8", True)):
        out[name] = tmp_path_factory.mktemp(name)
        _train(out[name], jitter)
    return out


def _same_as_instant(runs, workdir, name):
    instant, rows = _rows(runs["instant"]), {r["step"]: r for r in _rows(workdir)}
    # the delays were there: ~30 ms per call on average, against microseconds
    tool_s = [r["episode/tool_seconds"] / max(r["episode/tool_calls"], 1e-9) for r in rows.values()]
    assert min(tool_s) > 0.005, (name, tool_s)
    assert max(r["episode/tool_seconds"] for r in instant) < 0.005
    assert _fingerprint(workdir) == _fingerprint(runs["instant"]), name
    assert train_metrics(workdir) == train_metrics(runs["instant"]), name
    for key in CARRY:
        assert [rows[r["step"]][key] for r in instant] == [r[key] for r in instant], (name, key)


def test_jittered_tools_train_exactly_as_the_instant_tool(runs):
    instant = _rows(runs["instant"])
    assert any(r["rollout/carried_episodes"] > 0 for r in instant)  # stops cut episodes ...
    assert any(r["rollout/offpolicy_token_frac"] > 0 for r in instant)  # ... trained later
    _same_as_instant(runs, runs["jitter8"], "jitter8")


def _latest(workdir) -> int:
    try:  # the run being watched creates the directory
        return max((int(p.name) for p in (workdir / "checkpoints").iterdir()
                    if p.name.isdigit()), default=0)  # fmt: skip
    except FileNotFoundError:
        return 0


def test_kill9_then_resume_of_the_jittered_run_is_exact(runs, tmp_path, capsys):
    """On 2 tool workers, killed in step 4 and resumed: the instant tool's run all the same."""
    killed, log, two = tmp_path / "killed", tmp_path / "kill.log", "--config.env.tool_workers=2"
    with open(log, "w") as err:
        proc = subprocess.Popen(_cmd(killed, two), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err)  # fmt: skip
        while proc.poll() is None and _latest(killed) == 0:
            time.sleep(0.01)  # polling files another process writes; nothing is timed
        time.sleep(random.Random(0).uniform(0.0, 0.3))  # a moment within step 4, seeded
        assert proc.poll() is None, f"the run ended before its kill: {open(log).read()[-3000:]}"
        proc.kill()
        proc.wait()
    assert _latest(killed) == 3
    capsys.readouterr()  # the resume's own output, below
    _train(killed, True, two)
    err = capsys.readouterr().err
    assert "resumed from step 3" in err, err[-3000:]
    _same_as_instant(runs, killed, "jitter2, killed and resumed")
