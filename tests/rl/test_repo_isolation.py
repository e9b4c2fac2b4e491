"""Isolation of the `repo` environment's bubblewrap-mode episodes (rl/envs/repo/env.py): concurrent
episodes cannot read or write each other's workspaces or the host, and hostile commands are
contained, each with a host-side check. Skipped where bubblewrap does not work."""

import os
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rl.envs.repo import RepoEnv
from rl.sandbox.workspace import _live
from tests.rl import repo_env_helpers
from tests.rl.repo_env_helpers import TOK, act, call, make_config

env, tasks = repo_env_helpers.env, repo_env_helpers.tasks  # the module fixtures


def needs_bwrap(env):
    if env.tools.mode != "bwrap":
        pytest.skip(f"isolation checks need bubblewrap (mode {env.tools.mode!r})")


def bash(env, ep, command):
    return act(env, ep, call("bash", command=command))


def no_process_left(uids):
    return not any(_live(uid, "") for uid in uids if uid >= 0)


@pytest.mark.repo_sandbox
def test_32_concurrent_episodes_are_isolated(env, tasks, tmp_path):
    """Each of 32 concurrent episodes writes a secret, then tries to read and overwrite every
    other workspace (by its host path and through /proc), reach a host socket and the host's
    files; host side: every secret intact, no connection, canary intact, no process left."""
    needs_bwrap(env)
    env = RepoEnv(TOK, make_config(command_timeout_s=300.0))  # 8 probes at once on a slow host
    try:
        _attack_each_other(env, tasks, tmp_path)
    finally:
        env.shutdown()


def _attack_each_other(env, tasks, tmp_path):
    canary = tmp_path / "canary"
    canary.write_text("host")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    eps = [env.start(tasks[i % len(tasks)]) for i in range(32)]
    for i, ep in enumerate(eps):
        assert env._ready(ep)
        with open(os.path.join(ep.workspace.path, "secret"), "w") as f:
            f.write(f"SECRET<{i}>")
    paths = [ep.workspace.path for ep in eps]
    probe = "; ".join(
        [f"cat {p}/secret; echo pwned > {p}/secret" for p in paths]
        + [f"cat {canary}; echo pwned > {canary}", "cat /proc/*/root/testbed/secret",
           "ls /tmp /root /work 2>&1 | head -3",
           f"python -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 1)\"",
           "python -c \"import socket; socket.create_connection(('1.1.1.1', 53), 1)\""]
    )  # fmt: skip

    def attack(i):
        return bash(env, eps[i], probe + "; cat /testbed/secret")

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(attack, range(32)))
    for i, out in enumerate(outs):
        others = [f"SECRET<{j}>" for j in range(32) if j != i]
        assert not any(s in out for s in others), (i, out[:300])
        assert f"SECRET<{i}>" in out  # its own, through /testbed
        assert "host" not in out.split("\n")
    for i, ep in enumerate(eps):
        assert open(os.path.join(ep.workspace.path, "secret")).read() == f"SECRET<{i}>"
    assert canary.read_text() == "host"
    with pytest.raises(TimeoutError):
        server.accept()  # nobody connected
    server.close()
    uids = [ep.workspace.uid for ep in eps]
    for ep in eps:
        env.close(ep)
    assert no_process_left(uids) and not any(os.path.exists(p) for p in paths)


HOSTILE = {
    "rm_rf_root": "rm -rf --no-preserve-root / 2>/dev/null; echo done",
    "fork_bomb": "bomb() { bomb | bomb & }; bomb; sleep 2; echo done",
    "kill_all": "kill -9 -1; echo done",
    "fill_disk": "for i in $(seq 100); do head -c 1M /dev/zero > f$i || break; done; echo done",
    "alloc_10gb": "python -c 'b = bytearray(10 * 2**30)'; echo done",
    "background": "(sleep 1234 &) ; nohup sleep 1235 > /dev/null 2>&1 & echo done",
}


@pytest.mark.repo_sandbox
@pytest.mark.slow  # moved out of the fast tier (pytest -m 'not slow' < 5 min cold)
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_commands_are_contained(env, tasks, tmp_path, name):
    needs_bwrap(env)
    canary = tmp_path / "canary"
    canary.write_text("host")
    sentinel = subprocess.Popen(["sleep", "60"])  # a host process of ours, as kill's target
    ep = env.start(tasks[4])
    assert env._ready(ep)
    uid, ws = ep.workspace.uid, ep.workspace.path
    free = os.statvfs("/").f_bavail * os.statvfs("/").f_frsize
    t0 = time.monotonic()
    out = bash(env, ep, HOSTILE[name])
    seconds = time.monotonic() - t0
    assert out is not None and seconds < 15, (name, seconds)
    assert not env.masked(ep), ep.infra_error
    # The workspace still works afterwards (the next call is a fresh process).
    assert "alive" in bash(env, ep, "echo alive")
    if name == "rm_rf_root":
        assert canary.read_text() == "host" and os.path.exists("/usr/bin/env")
        assert os.path.exists(os.path.join(tasks[5]["repo"], tasks[5]["fix"]["path"]))
    if name == "fork_bomb":
        assert "Resource temporarily unavailable" in out or "timed out" in out
    if name == "kill_all":
        assert sentinel.poll() is None  # the host's process survived
    if name == "fill_disk":
        st = os.statvfs(ws)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        assert used <= 32 << 20 and "No space left" in out, out[-300:]
        after = os.statvfs("/").f_bavail * os.statvfs("/").f_frsize
        assert free - after < 16 << 20  # the host's disk did not take it
    if name == "alloc_10gb":
        assert "MemoryError" in out
    if name == "background":
        # The call returned without waiting for its background processes (not on the 4 s
        # command limit, which says so), and they were killed with it.
        assert "done" in out and "timed out" not in out, out[-300:]
        assert not _live(-1, "1234") and not _live(-1, "1235") and not _live(uid, "")
    env.close(ep)
    sentinel.kill()
    assert no_process_left([uid]) and not os.path.exists(ws)
