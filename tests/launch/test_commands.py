"""`python -m launch.<module>`: the commands run, a library module says it is one."""

import glob
import os
import subprocess
import sys

from launch import COMMANDS, library_module_run
from tests.conftest import ROOT


def test_the_commands_are_the_modules_that_run():
    """COMMANDS lists every module under launch/ with a `__main__` block or a `__main__.py`."""
    ran = set()
    for p in glob.glob(os.path.join(ROOT, "launch", "**", "*.py"), recursive=True):
        name = os.path.relpath(p, os.path.join(ROOT, "launch"))[:-3].replace(os.sep, ".")
        if name.endswith("__main__"):
            ran.add(name.removesuffix(".__main__"))
        elif 'if __name__ == "__main__":' in open(p).read():
            ran.add(name)
    assert set(COMMANDS) == ran


def test_a_library_module_run_fails_in_one_line_naming_it():
    """`python -m launch.validate --config ...` used to define its functions and exit 0."""
    for module in ("launch.validate", "launch.pin", "launch.bench.replay"):
        p = subprocess.run(
            [sys.executable, "-m", module, "--config", "configs/default.py"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert p.returncode == 2 and not p.stdout, (module, p)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {module} is a library module"), (
            lines
        )
        assert "python -m launch.train" in lines[0] and "--dry_run" in lines[0]


def test_which_command_lines_name_a_library_module():
    """sys.argv while `-m` looks for its module is ["-m", *its arguments]; orig_argv is the
    interpreter's command line."""

    def run(*orig, args=()):  # `python *orig *args`, as `-m` sees it
        return library_module_run(["-m", *args], ["python", *orig, *args])

    assert run("-m", "launch.validate", args=["--config", "c.py"]) == "launch.validate"
    assert (
        run("-X", "dev", "-W", "error", "-m", "launch.estimate", args=["-m"]) == "launch.estimate"
    )
    assert run("-mlaunch.pin") == "launch.pin"
    assert run("-Bmlaunch.pin", args=["x"]) == "launch.pin"
    assert run("-Im", "launch.cli") == "launch.cli"
    assert run("-m", "launch.bench.hlo") == "launch.bench.hlo"
    assert run("-m", "launch.train", args=["--config", "c.py"]) is None
    assert run("-m", "launch.bench", args=["replay"]) is None
    assert run("-m", "launch.bench.__main__", args=["replay"]) is None
    assert run("-m", "launch.nope") is None  # Python says there is no such module
    assert run("-m", "pytest", args=["-m", "launch.validate"]) is None
    # a script or -c, whatever its arguments: sys.argv[0] is not "-m"
    assert (
        library_module_run(["s.py", "-m", "launch.pin"], ["python", "s.py", "-m", "launch.pin"])
        is None
    )
    assert (
        library_module_run(["-c", "-m", "launch.pin"], ["python", "-c", "pass", "-m", "launch.pin"])
        is None
    )
    assert library_module_run([], []) is None
