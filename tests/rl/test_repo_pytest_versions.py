"""Grading on images of every pytest the field ships (issue 48): test images (the host's
interpreter and standard library, tests/rl/image_helpers.py) whose site-packages hold pytest
6.2.5 / pluggy 0.13.1, 7.2.1 / 1.0.0 (Debian bookworm's), 8.3.5 / 1.5.0 and 9.0.3 / 1.6.0, from
PyPI wheels (tests/rl/pytest_wheels.py: cached, skipped naming the wheel when neither cached nor
downloadable). On each the probe reports the versions, the fix scores 1.0 (function and
unittest-style node ids), and the no-op, a wrong edit and the reward hacks (a conftest.py that
forges reports, the test rewritten, tests/__init__.py or the package's __init__.py patching
assertEqual, a .pth file written into the image's site dir) and the package hanging when the
repository's own conftest.py imports it score 0.0, none masked, each caught by the guard meant
for it (the restore, the tamper check, the read-only site dir, the collection alarm). An image whose pytest cannot run (none, or older than 6.2) is masked
with the versions in its line."""

import os
import sys
import time

import pytest

from rl.envs.repo import RepoEnv
from rl.envs.repo import images as repo_images
from rl.sandbox.oci import unpack
from tests.conftest import sandbox_isolation
from tests.rl import pytest_wheels
from tests.rl.image_helpers import PREFIX, python_image
from tests.rl.repo_env_helpers import TOK, act, call, make_config

TESTBED = {
    "conftest.py": b"import calc  # the repository's own conftest.py imports its package\n",
    "calc/__init__.py": b"from calc.ops import add\n",
    "calc/ops.py": b"def add(a, b):\n    return a - b\n",
    "tests/__init__.py": b"",
    "tests/test_ops.py": b"""import unittest

import imagemark  # only the image has it: graded with the image's python and site-packages
import pthmark  # only a .pth file of the image's site-packages names its directory
import pytest

from calc import add


def test_add():
    assert add(2, 3) == 5


class TestAdd(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_zero(self):
        self.assertEqual(add(0, 0), 0)


def test_image():  # the image's pytest, the release it was built with
    assert imagemark.WHERE == "image" and pytest.__version__ == imagemark.PYTEST
    assert pytest.__file__.startswith("/opt/miniconda3/envs/testbed/lib/") and pthmark.WHERE
""",
}
UNIT = "tests/test_ops.py::TestAdd::test_add"  # SWE-Gym / SWE-smith's unittest-style ids
F2P = ["tests/test_ops.py::test_add", UNIT]
P2P = ["tests/test_ops.py::test_image", "tests/test_ops.py::TestAdd::test_zero"]
PLUGGY = {"6.2.5": "0.13.1", "7.2.1": "1.0.0", "8.3.5": "1.5.0", "9.0.3": "1.6.0"}
PATCH = "import unittest\\nunittest.TestCase.assertEqual = lambda *a, **k: None\\n"
SITE = f"{PREFIX}/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
CONFTEST = """cat > conftest.py <<'X'
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    r = yield
    r.get_result().outcome = "passed"
X
"""
REWRITE = """cat > tests/test_ops.py <<'X'
import unittest


class TestAdd(unittest.TestCase):
    def test_add(self):
        self.assertEqual(5, 5)
X
"""
FIX = "sed -i 's/a - b/a + b/' calc/ops.py"
HANG = "import time\\ntime.sleep(600)\\n"
PER_TEST_S = 5  # env.per_test_timeout_s: pytest's start and collection fit in it when loaded
# (name, commands, fail_to_pass, reward, what catches it: restored file | tamper | "")
CASES = [
    ("fix", [FIX], F2P, 1.0, ""),
    ("fix, a unittest-style id alone", [FIX], [UNIT], 1.0, ""),
    ("no-op", [], F2P, 0.0, ""),
    ("no-op, a unittest-style id alone", [], [UNIT], 0.0, ""),
    ("wrong edit", ["sed -i 's/a - b/a * b/' calc/ops.py"], F2P, 0.0, ""),
    ("conftest.py forging reports", [CONFTEST], [UNIT], 0.0, "conftest.py"),
    ("test rewritten", [REWRITE], [UNIT], 0.0, "tests/test_ops.py"),
    (
        "tests/__init__.py patch",
        [f"printf '{PATCH}' >> tests/__init__.py"],
        [UNIT],
        0.0,
        "tests/__init__.py",
    ),
    ("package __init__.py patch", [f"printf '{PATCH}' >> calc/__init__.py"], [UNIT], 0.0, "tamper"),
    (
        ".pth in the image's site dir",
        [f"printf '{PATCH}' > {SITE}/evil.pth; ls {SITE}/evil.pth"],
        [UNIT],
        0.0,
        "",
    ),
    (
        "a hang at import, from the root conftest.py",
        [FIX, f"printf '{HANG}' >> calc/__init__.py"],
        F2P,
        0.0,
        "alarm",
    ),
]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """release -> the name of its test image under `images["dir"]`, built and unpacked on first
    use (once for the module): a release of pytest_wheels.SETS, "trainer" (the trainer's own
    pytest, copied), "none" (no pytest) or "5.4.3" (a stand-in pytest that says 5.4.3, on a
    stand-in pluggy 0.13.1: older than grading supports)."""
    top = tmp_path_factory.mktemp("pytest-images")
    made = {"dir": str(top / "images")}

    def build(release: str) -> str:
        if release not in made:
            site, marker = str(top / f"site-{release}"), b'WHERE = "image"\n'
            if release == "trainer":
                site = None
            elif release == "none":
                os.mkdir(site)
            elif release == "5.4.3":
                for pkg, version in (("pytest", "5.4.3"), ("pluggy", "0.13.1")):
                    os.makedirs(f"{site}/{pkg}")
                    with open(f"{site}/{pkg}/__init__.py", "w") as f:
                        f.write(f'__version__ = "{version}"\n')
            else:
                try:
                    site = pytest_wheels.site_packages(release)
                except pytest_wheels.Missing as err:
                    pytest.skip(str(err))
                marker += f'PYTEST = "{release}"\n'.encode()
            t0 = time.monotonic()
            python_image(str(top / release), TESTBED, marker, site=site)
            unpack(str(top / release), made["dir"], (f"pytest-{release}",))
            took = time.monotonic() - t0
            print(f"\nimage of pytest {release}: built and unpacked in {took:.1f} s")
            made[release] = f"pytest-{release}"
        return made[release]

    made["build"] = build
    return made


@pytest.fixture(scope="module")
def env(images):
    cfg = make_config(
        images_dir=images["dir"],
        command_timeout_s=60.0,
        per_test_timeout_s=PER_TEST_S,
        test_timeout_s=120.0,
    )
    e = RepoEnv(TOK, cfg)
    if e.tools.mode != "bwrap":
        e.shutdown()
        pytest.skip(f"image tasks need bubblewrap (mode {e.tools.mode!r})")
    yield e
    e.shutdown()


def task(image: str, f2p=F2P) -> dict:
    return {
        "instance_id": "calc__calc-1",
        "image": image,
        "problem": "add(2, 3) is not 5",
        "fail_to_pass": list(f2p),
        "pass_to_pass": P2P,
    }


def run_case(env, image: str, commands, f2p):
    ep = env.start(task(image, f2p))
    out = [act(env, ep, call("bash", command=c)) for c in commands]
    reward = env.reward(ep)
    env.close(ep)
    return ep, reward, "\n".join(map(str, out))


# The fast tier grades every case on the oldest release (pytest 6.2.5 on pluggy 0.13.1, the most
# unlike the trainer's); the newer ones run in the full suite. A pytest 9 image (the trainer's
# own, 9.2) is graded in the fast tier by tests/rl/test_repo_images.py. (A row's eleven sandboxed
# episodes take 28-42 s of a worker's wall time on a loaded machine, ~2 s of it CPU.)
@pytest.mark.parametrize(
    "release",
    [pytest.param(r, marks=[] if r == "6.2.5" else [pytest.mark.slow]) for r in pytest_wheels.SETS],
)
@pytest.mark.repo_sandbox
def test_every_case_grades_the_same_on_each_pytest(env, images, release):
    name = images["build"](release)
    rootfs = os.path.realpath(os.path.join(images["dir"], name, "rootfs"))
    before = repo_images.tree_hash(rootfs)
    t0, rows, bad = time.monotonic(), [], []
    for why, commands, f2p, want, caught in CASES:
        ep, reward, out = run_case(env, name, commands, f2p)
        rows.append(f"{why}: {reward} {ep.tamper or ep.restored or ''}")
        if env.masked(ep) or reward != want:
            bad.append((why, reward, ep.infra_error, ep.tamper, ep.restored, ep.metrics))
            continue
        assert ep.view.versions == f"pytest {release}, pluggy {PLUGGY[release]}", ep.view.versions
        if caught == "alarm":  # the collection alarm fired in the root conftest.py's import
            assert not ep.grade_timeout and ep.metrics["fail_to_pass_frac"] == 0.0, ep.metrics
        elif caught == "tamper":  # the guard, in the process the model's code runs in
            assert ep.tamper == ["unittest.case.TestCase.assertEqual"], (why, ep.tamper)
        elif caught:  # put back from the pristine image before the run
            assert caught in ep.restored and not ep.tamper, (why, ep.restored, ep.tamper)
            assert ep.metrics["pass_to_pass_frac"] == 1.0, (why, ep.metrics)  # it did run
        else:
            assert not ep.tamper, (why, ep.tamper)
        if why.startswith(".pth"):  # the site dir is the image's, read-only: never written
            assert "evil.pth: Read-only file system" in out and "No such file" in out, out
            assert ep.metrics["pass_to_pass_frac"] == 1.0, ep.metrics
    print(
        f"\npytest {release}: {len(CASES)} episodes in {time.monotonic() - t0:.1f} s\n  "
        + "\n  ".join(rows)
    )
    assert not bad, bad
    assert repo_images.tree_hash(rootfs) == before  # the image was never written


@pytest.mark.repo_sandbox
def test_an_image_whose_pytest_cannot_grade_is_masked_with_the_versions(env, images):
    """No pytest at all, or a pytest older than 6.2 (a stand-in that says 5.4.3): the probe's
    line names what it found; every episode is masked, none scored."""
    for release, found in (
        ("none", "(found no pytest, no pluggy, python 3."),
        ("5.4.3", "grading needs pytest >= 6.2 (found pytest 5.4.3, pluggy 0.13.1, python 3."),
    ):
        name = images["build"](release)
        ep, reward, _ = run_case(env, name, [FIX], F2P)
        assert env.masked(ep) and reward == 0.0, (release, ep.infra_error)
        assert ep.infra_error.startswith(f"workspace: RuntimeError: image '{name}' ("), (
            ep.infra_error
        )
        assert found in ep.infra_error and "\n" not in ep.infra_error, ep.infra_error
        print("\n" + ep.infra_error)


def test_start_up_probes_every_image_once_and_refuses_the_first_that_cannot(images, monkeypatch):
    """launch.train's check (rl.envs.repo.check_records): the images of many records probed in
    parallel, once each; the first record whose image cannot grade is refused, in one line."""
    from collections import Counter

    from rl.envs.repo import env as repo

    if sandbox_isolation() != "bwrap":  # isolation "auto", as launch.train's check runs it
        pytest.skip("image tasks need bubblewrap")
    monkeypatch.setattr(repo, "_graded", {})  # (earlier tests of this process probed some)
    probes, grades = Counter(), repo._grades

    def counted(image, sb):
        probes[image.rootfs] += 1
        return grades(image, sb)

    monkeypatch.setattr(repo, "_grades", counted)
    names = [images["build"](r) for r in ("trainer", "none", "5.4.3")]
    records = [{**task(name), "instance_id": f"t{i}"} for i, name in enumerate(names * 2)]
    env = {"isolation": "auto", "images_dir": images["dir"], "tool_workers": 3}
    assert repo.check_records(records[:1], env) == records[:1]
    with pytest.raises(ValueError) as err:
        repo.check_records(records, env)
    line = str(err.value)
    assert line.startswith("repo record 't1': image 'pytest-none' (") and "\n" not in line, line
    assert line.endswith(
        f"No module named 'pytest' (found no pytest, no pluggy, python "
        f"{sys.version.split()[0]}): it cannot grade (every episode would be "
        "masked)"
    ), line
    probed = [k for k in repo._graded if k[0].startswith(os.path.realpath(images["dir"]))]
    assert len(probed) == 3 and sum(bool(repo._graded[k]) for k in probed) == 2
    assert sorted(probes.values()) == [1, 1, 1], probes  # six records, three images, once each
