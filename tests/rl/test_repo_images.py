"""Image tasks of the `repo` environment (rl/envs/repo/images.py): a test image (the host's
interpreter and standard library, its own pytest and a marker module, a small repository at
/testbed; tests/rl/image_helpers.py) is unpacked once for the module; episodes run their tools and
their graded run inside it with its python; 32 concurrent episodes on it are isolated and leave
it unchanged; a venv in /testbed (R2E-Gym's layout) is graded with and stays the image's,
read-only; the cost per episode (disk, start-up) is measured against today's workspace copy of
a checkout of the same size; a SWE-Gym row converts and runs through --from_rows."""

import json
import os
import shutil
import socket
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from launch.make_repo_tasks import main as make_repo_tasks
from rl.envs.repo import RepoEnv
from rl.envs.repo import images as repo_images
from rl.sandbox.oci import unpack
from rl.sandbox.workspace import _live
from tests.rl import image_helpers
from tests.rl.image_helpers import python_image
from tests.rl.repo_env_helpers import TOK, act, call, make_config

BLOB = os.urandom(4 << 20)  # a repository of some size: what a copy per episode costs
TESTBED = {
    "calc/__init__.py": b"from calc.ops import add\n",
    "calc/ops.py": b"def add(a, b):\n    return a - b\n",
    "data/blob.bin": BLOB,
    "tests/test_ops.py": b"""import sys

import imagemark  # only the image has it: grading used the image's python and site-packages
import pthmark  # only a .pth file of the image's site-packages names its directory
import pytest

from calc import add


def test_add():
    assert add(2, 3) == 5


def test_image():
    assert imagemark.WHERE == "image" and sys.executable.startswith("/opt/miniconda3/envs/")
    assert pytest.__file__.startswith("/opt/miniconda3/envs/testbed/lib/") and pthmark.WHERE
""",
    "tests/test_venv.py": b"""import sys

import imagemark
import pthmark


def test_venv():  # the venv's site-packages first, then the base's (and its .pth file)
    assert imagemark.WHERE == "venv" and pthmark.WHERE == "pth"
    assert sys.executable == "/testbed/.venv/bin/python"
""",
}
F2P, P2P = ["tests/test_ops.py::test_add"], ["tests/test_ops.py::test_image"]
NAME = "sweb.eval.x86_64.calc__calc-1"
HACK = """cat > conftest.py <<'X'
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    r = yield
    r.get_result().outcome = "passed"
X
"""


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """The test image, unpacked under images_dir as NAME (built once for the module)."""
    d = tmp_path_factory.mktemp("image")
    t0 = time.monotonic()
    python_image(str(d / "oci"), TESTBED, b'WHERE = "image"\n')
    info = unpack(str(d / "oci"), str(d / "images"), (NAME,))
    print(f"\nimage built and unpacked in {time.monotonic() - t0:.1f} s")
    # What every test compares the image with when it ends (hashed once: 0.4 s a hash)
    before = repo_images.tree_hash(info["rootfs"])
    return {"dir": str(d / "images"), "rootfs": info["rootfs"], "path": info["path"],
            "hash": before}  # fmt: skip


@pytest.fixture(scope="module")
def env(image):
    e = RepoEnv(TOK, make_config(images_dir=image["dir"], command_timeout_s=60.0))
    if e.tools.mode != "bwrap":
        e.shutdown()
        pytest.skip(f"image tasks need bubblewrap (mode {e.tools.mode!r})")
    yield e
    e.shutdown()


def task(**kw):
    return {"instance_id": "calc__calc-1", "image": NAME, "problem": "add(2, 3) is not 5",
            "fail_to_pass": F2P, "pass_to_pass": P2P, **kw}  # fmt: skip


def bash(env, ep, command):
    return act(env, ep, call("bash", command=command))


def fix(env, ep):
    return act(env, ep, call("str_replace_editor", command="str_replace", path="calc/ops.py",
                             old_str="a - b", new_str="a + b"))  # fmt: skip


@pytest.mark.repo_sandbox
def test_an_image_task_runs_in_the_image_and_is_graded_with_its_python(env, image):
    before = image["hash"]  # the image as unpacked
    ep = env.start(task())
    out = bash(
        env,
        ep,
        "pwd; echo $IMAGE_ENV; python -c 'import sys, imagemark; "
        "print(sys.prefix)'; python -c 'import jax' 2>&1 | tail -1; ls /testbed",
    )
    assert not env.masked(ep), ep.infra_error
    assert env.image_view == ep.view.mode and ep.view.mode in repo_images.MODES
    print(f"\nview mode: {ep.view.mode}")
    assert "/testbed\nfrom-the-image\n/opt/miniconda3/envs/testbed\n" in out, out
    assert "No module named 'jax'" in out  # the trainer's site-packages are not bound
    assert "calc" in out and "data" in out
    assert "has been edited" in fix(env, ep)
    assert env.reward(ep) == 1.0, (ep.infra_error, ep.tamper, ep.metrics)
    env.close(ep)
    for commands, why in (([], "no-op"), ([HACK], "conftest hack")):
        ep = env.start(task())
        for c in commands:
            bash(env, ep, c)
        assert env.reward(ep) == 0.0 and not env.masked(ep), (why, ep.infra_error)
        assert ep.metrics["fail_to_pass_frac"] == 0.0, why
        if commands:
            assert "conftest.py" in ep.restored
        env.close(ep)
    # A record whose python is /testbed/.venv's (R2E-Gym's layout), the no-op again: graded with
    # the venv's site-packages before the base's, .pth files read (test_venv passes); the venv
    # is the image's, read-only in every run (a .pth file or a pytest of the model's there would
    # run before the tamper check; a python of its own would report what it likes).
    venv = "/testbed/.venv/lib/" + os.path.basename(os.path.dirname(os.__file__))
    rec = task(python="/testbed/.venv/bin/python", pass_to_pass=["tests/test_venv.py::test_venv"])
    ep = env.start(rec)
    out = bash(env, ep, f"echo 'import os' > {venv}/site-packages/evil.pth; "
               "mv /testbed/.venv /testbed/v2; rm -rf /testbed/.venv; ls /testbed/.venv")  # fmt: skip
    assert f"{venv}/site-packages/evil.pth: Read-only file system" in out, out
    assert "mv: cannot move '/testbed/.venv'" in out and "bin\nlib\npyvenv.cfg" in out, out
    assert env.reward(ep) == 0.0 and not env.masked(ep), ep.infra_error
    assert ep.metrics["pass_to_pass_frac"] == 1.0 and ep.metrics["fail_to_pass_frac"] == 0.0
    env.close(ep)
    assert repo_images.tree_hash(image["rootfs"]) == before


@pytest.mark.repo_sandbox
def test_image_records_probe_the_python_and_refuse_what_cannot_run(env, image, tmp_path):
    root = image["rootfs"]
    assert repo_images.find_python(root, "/usr/bin", "/testbed") == repo_images.TESTBED_PYTHON
    assert (
        repo_images.find_python(root, "/usr/bin", "/testbed", "/usr/bin/python3")
        == "/usr/bin/python3"
    )
    venv = tmp_path / "venv_root"  # no testbed env: /testbed/.venv, then python3 on PATH
    (venv / "testbed/.venv/bin").mkdir(parents=True)
    (venv / "usr/bin").mkdir(parents=True)
    for p in ("testbed/.venv/bin/python", "usr/bin/python3"):
        (venv / p).write_text("")
        (venv / p).chmod(0o755)
    assert repo_images.find_python(str(venv), "/usr/bin", "/testbed") == "/testbed/.venv/bin/python"
    (venv / "testbed/.venv/bin/python").unlink()
    assert repo_images.find_python(str(venv), "/bin:/usr/bin", "/testbed") == "/usr/bin/python3"
    with pytest.raises(ValueError, match="not found"):
        env.start(task(image="no/such:image"))
    with pytest.raises(ValueError, match="need bubblewrap"):
        repo_images.check(task(), "rlimits", image["dir"])
    # at load time (launch.train.prepare), not at the run's first episode
    from rl.envs.repo import check_record

    with pytest.raises(ValueError, match="env.isolation=rlimits"):
        check_record(task(), {"isolation": "rlimits", "images_dir": image["dir"]})
    with pytest.raises(ValueError, match="not found"):
        check_record(task(image="no/such:image"), {"isolation": "auto", "images_dir": image["dir"]})
    assert check_record(task(), {"isolation": "auto", "images_dir": image["dir"]}) == task()
    for img in (image["path"], image["rootfs"]):  # a directory names its image too
        assert repo_images.load(task(image=img), None).rootfs == image["rootfs"]


def test_a_python_the_model_could_replace_is_refused(tmp_path):
    (tmp_path / "testbed/tools").mkdir(parents=True)  # /testbed/tools/python: no venv around it
    (tmp_path / "testbed/tools/python").write_text("")
    (tmp_path / "testbed/tools/python").chmod(0o755)
    with pytest.raises(ValueError, match="outside an environment"):
        repo_images.load(task(image=str(tmp_path), python="/testbed/tools/python"), None)


@pytest.mark.repo_sandbox
@pytest.mark.slow  # 32 sandboxed episodes at once (~10 s)
def test_32_concurrent_episodes_on_one_image_are_isolated_and_cheap(env, image, tmp_path):
    """32 episodes at once: each edits its own /testbed, tries to read and write the others'
    (their host paths, /proc), the host and the network; none sees another's edits, the image
    is unchanged (hashed before and after). Start-up (the first call, `true`) and disk per
    episode are compared with today's workspace copy of a checkout of the same repository."""
    before = image["hash"]  # the image as unpacked
    canary = tmp_path / "canary"
    canary.write_text("host")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    eps = [env.start(task()) for _ in range(32)]

    def first(ep):
        t0 = time.perf_counter()
        out = bash(env, ep, "true")
        return time.perf_counter() - t0, out

    with ThreadPoolExecutor(8) as pool:
        starts = list(pool.map(first, eps))
    assert all(not env.masked(ep) for ep in eps), [ep.infra_error for ep in eps][:2]
    hosts = [ep.view.upper if ep.view.mode != "copy" else ep.view.testbed for ep in eps]
    probe = "; ".join(
        [f"cat {h}/testbed/secret {h}/secret 2>/dev/null; echo pwned > {h}/secret" for h in hosts]
        + [f"cat {canary}; echo pwned > {canary}", "cat /proc/*/root/testbed/secret",
           "echo x > /usr/bin/cat; echo x > /etc/img 2>&1",
           f"python -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 1)\"",
           "python -c \"import socket; socket.create_connection(('1.1.1.1', 53), 1)\""]
    )  # fmt: skip

    def attack(i):
        ep = eps[i]
        bash(env, ep, f"echo 'SECRET<{i}>' > /testbed/secret; "
             f"sed -i 's/a - b/a + b + {i}/' calc/ops.py")  # fmt: skip
        out = bash(env, ep, probe)
        return out + bash(env, ep, "cat /testbed/secret calc/ops.py")

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(attack, range(32)))
    for i, out in enumerate(outs):
        assert not any(f"SECRET<{j}>" in out for j in range(32) if j != i), (i, out[:300])
        assert f"SECRET<{i}>" in out and f"a + b + {i}\n" in out, out[-300:]
        assert "host" not in out.split("\n") and "pwned" not in out
    disk = [ep.view.disk() for ep in eps]
    mode = eps[0].view.mode
    uids = [ep.workspace.uid for ep in eps]
    for ep in eps:
        env.close(ep)
    assert canary.read_text() == "host"
    with pytest.raises(TimeoutError):
        server.accept()  # nobody connected
    server.close()
    assert not any(_live(uid, "") for uid in uids if uid >= 0)
    assert repo_images.tree_hash(image["rootfs"]) == before  # the image was never written

    # Today's workspace copy of a checkout of the same repository, 32 episodes the same way.
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.join(image["rootfs"], "testbed"), checkout, symlinks=True)
    base = [env.start({**task(), "image": "", "repo": str(checkout)}) for _ in range(32)]
    with ThreadPoolExecutor(8) as pool:
        base_starts = list(pool.map(first, base))
    from rl.envs.repo.sandbox import disk_usage

    base_disk = [disk_usage(ep.workspace.path) for ep in base]
    for ep in base:
        env.close(ep)
    med = lambda xs: statistics.median(xs)
    line = (f"\ncost over 32 concurrent episodes ({mode} view): start-up median "
            f"{med([s for s, _ in starts]) * 1e3:.0f} ms (image) vs "
            f"{med([s for s, _ in base_starts]) * 1e3:.0f} ms (workspace copy); disk per episode "
            f"median {med(disk) / 1024:.0f} KiB (image, after its edits) vs "
            f"{med(base_disk) / 1024:.0f} KiB (copy, at start)")  # fmt: skip
    print(line)
    if mode != "copy":
        assert med(disk) < len(BLOB) / 8 < med(base_disk)  # no copy of the repository


@pytest.mark.repo_sandbox
def test_hostile_commands_in_an_image_are_contained(env, image, tmp_path):
    before = image["hash"]  # the image as unpacked
    sentinel = subprocess.Popen(["sleep", "60"])
    ep = env.start(task())
    out = bash(env, ep, "rm -rf --no-preserve-root / 2>/dev/null; echo done")
    assert "done" in out and not env.masked(ep), (out, ep.infra_error)
    assert bash(env, ep, "kill -9 -1; echo done") is not None and not env.masked(ep)
    assert sentinel.poll() is None  # the host's process survived
    site = f"{image_helpers.PREFIX}/lib/{os.path.basename(os.path.dirname(os.__file__))}"
    out = bash(env, ep, f"echo 'import os' > {site}/site-packages/evil.pth")  # a 0777 dir
    assert "evil.pth: Read-only file system" in out, out  # its code would run before the guard
    out = bash(
        env,
        ep,
        "ls /testbed | wc -l; ls /usr/bin/bash; "
        "for i in $(seq 100); do head -c 1M /dev/zero > /tmp/f$i || break; done; echo done",
    )
    assert "No space left" in out or "File too large" in out, out[-300:]
    assert "/usr/bin/bash" in out  # the image's own files were not the model's to delete
    out = bash(env, ep, "(sleep 1234 &); echo alive")
    assert "alive" in out and not _live(-1, "1234")
    assert env.reward(ep) == 0.0 and not env.masked(ep)  # its repository was deleted
    uid = ep.workspace.uid
    env.close(ep)
    sentinel.kill()
    assert not _live(uid, "") if uid >= 0 else True
    assert repo_images.tree_hash(image["rootfs"]) == before
    ep = env.start(task())  # the next episode sees the image whole
    assert "has been edited" in fix(env, ep) and env.reward(ep) == 1.0
    env.close(ep)


@pytest.mark.repo_sandbox
def test_a_swe_gym_row_converts_and_runs_against_a_local_image(env, image, tmp_path, capsys):
    row = {"instance_id": "calc__calc-1", "repo": "calc/calc", "base_commit": "0" * 40,
           "problem_statement": "add(2, 3) returns -1", "version": "1.0",
           "FAIL_TO_PASS": json.dumps(F2P), "PASS_TO_PASS": json.dumps(P2P)}  # fmt: skip
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n" + json.dumps({**row, "instance_id": "x__y-2"}) + "\n")
    make_repo_tasks(["--out", str(tmp_path / "out"), "--from_rows", str(rows), "--images_dir",
                     image["dir"], "--image_template", "sweb.eval.x86_64.{instance_id}"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "wrote 1 of 2 rows" in printed and "x__y-2" in printed, printed
    (record,) = [
        json.loads(x) for x in (tmp_path / "out" / "tasks.jsonl").read_text().split("\n") if x
    ]
    assert record["image"] == NAME and record["fail_to_pass"] == F2P and "repo" not in record
    ep = env.start(record)
    fix(env, ep)
    assert env.reward(ep) == 1.0, ep.infra_error
    env.close(ep)


@pytest.mark.repo_sandbox
def test_the_copy_view_when_no_overlay_works(env, image, monkeypatch):
    """The last mode (no overlay: a copy of /testbed alone over the read-only image) grades the
    same, and its disk is the copy; the mode is forced here (this host mounts overlayfs)."""
    key = (env.tools._bwrap, env.tools.as_root)
    monkeypatch.setitem(repo_images._modes, key, "copy")
    before = image["hash"]  # the image as unpacked
    ep = env.start(task())
    out = bash(env, ep, "echo x > /usr/bin/cat; echo t > /tmp/t && cat /tmp/t; ls /testbed")
    assert ep.view.mode == "copy" and "Read-only file system" in out and "t\ncalc" in out, out
    assert ep.view.disk() >= len(BLOB)
    fix(env, ep)
    assert env.reward(ep) == 1.0, ep.infra_error
    env.close(ep)
    assert repo_images.tree_hash(image["rootfs"]) == before
