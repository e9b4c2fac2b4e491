"""`python -m launch.<module>`: the commands run, a library module says it is one."""

import glob
import os
import subprocess
import sys

from launch import COMMANDS, library_module_run
from tests.conftest import ROOT


def test_the_commands_are_the_modules_that_run():
    """COMMANDS lists every module of launch/ with a `__main__` block or a `__main__.py`."""
    ran = {
        os.path.basename(os.path.dirname(p))
        for p in glob.glob(os.path.join(ROOT, "launch/*/__main__.py"))
    } | {
        os.path.basename(p)[:-3]
        for p in glob.glob(os.path.join(ROOT, "launch/*.py"))
        if 'if __name__ == "__main__":' in open(p).read()
    }
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
    py = "python"
    assert library_module_run([py, "-m", "launch.validate"]) == "launch.validate"
    assert (
        library_module_run([py, "-X", "dev", "-m", "launch.estimate", "-m", "x"])
        == "launch.estimate"
    )
    assert library_module_run([py, "-m", "launch.bench.hlo"]) == "launch.bench.hlo"
    assert library_module_run([py, "-m", "launch.train", "--config", "c.py"]) is None
    assert library_module_run([py, "-m", "launch.bench", "replay"]) is None
    assert library_module_run([py, "-m", "launch.bench.__main__", "replay"]) is None
    assert library_module_run([py, "-m", "launch.nope"]) is None  # Python says there is none
    assert library_module_run([py, "-m", "pytest", "-m", "launch.validate"]) is None
    assert library_module_run([py, "-c", "import launch.validate"]) is None
    assert library_module_run([py, "-m"]) is None
    assert library_module_run([py, "-mlaunch.pin"]) == "launch.pin"
    assert library_module_run([py, "-W", "error", "-u", "-m", "launch.cli"]) == "launch.cli"
    assert library_module_run([py, "script.py", "-m", "launch.validate"]) is None  # its argument
    assert library_module_run([py, "-c", "pass", "-m", "launch.validate"]) is None
    assert library_module_run([]) is None
