"""The README's install lines against pyproject.toml. The Python it asks for is the oldest that the
dependencies support. The "Install on a TPU VM, a GPU host or Colab" paragraph: every
extra its commands install exists, the accelerator extras are jax's own extras in the project's
jax range, and its device check is the command that prints jax's devices (run here: the CPU's).
Whether pip resolves the extras needs the network: `pip install --dry-run -e '.[tpu]'` (and
'.[cuda12]', '.[cuda13]') by hand."""

import os
import re
import shlex
import subprocess
import sys
import tomllib
from importlib import metadata

from tests.conftest import ROOT

MARK = "<!-- accelerator install -->"
CHECK = 'python -c "import jax; print(jax.devices())"'


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _commands() -> list[list[str]]:
    """The commands of the fenced block after MARK (comments dropped), and the `!`-commands the
    Colab sentence after it names, each as an argv."""
    text = open(os.path.join(ROOT, "README.md")).read()
    assert text.count(MARK) == 1
    after = text.split(MARK, 1)[1]
    block, rest = after.split("```bash\n", 1)[1].split("```", 1)
    colab = rest.split("\n\n", 2)[1]  # the paragraph after the block
    lines = [x for x in block.splitlines() if x.strip()]
    lines += re.findall(r"`!([^`]+)`", colab)
    return [shlex.split(x, comments=True) for x in lines]


def _extras(argv: list[str]) -> list[str]:
    """The extras of `pip install -e '.[a,b]'`."""
    assert argv[:3] == ["pip", "install", "-e"], argv
    spec = argv[3]
    assert spec.startswith(".[") and spec.endswith("]"), spec
    return spec[2:-1].split(",")


def test_the_readme_installs_extras_that_exist_in_the_jax_range():
    project = _pyproject()
    extras = project["optional-dependencies"]
    jax_range = next(d for d in project["dependencies"] if re.match(r"jax\b", d))[len("jax") :]
    commands = _commands()
    installs = [c for c in commands if c[:2] == ["pip", "install"]]
    named = {e for c in installs for e in _extras(c)}
    # the block installs for a TPU VM and a GPU host, Colab names the same commands
    assert {"tpu", "cuda12", "hub"} <= named, named
    assert named <= set(extras), (
        f"extras the README names but pyproject lacks: {named - set(extras)}"
    )
    for name in ("tpu", "cuda12", "cuda13"):  # jax's own extra of that name, the project's range
        assert extras[name] == [f"jax[{name}]{jax_range}"], (name, extras[name])
    # every platform's command is in the block, the Colab sentence repeats them with `!`
    assert sum(c == ["pip", "install", "-e", ".[tpu,hub]"] for c in installs) == 2
    assert sum(c == ["pip", "install", "-e", ".[cuda12,hub]"] for c in installs) == 2
    # the comment names cuda13's install, an extra that exists (checked above for the others)
    assert "'.[cuda13,hub]'" in open(os.path.join(ROOT, "README.md")).read().split(MARK, 1)[1]


def test_the_readme_check_prints_jax_devices():
    checks = [c for c in _commands() if c[:2] == ["python", "-c"]]
    assert checks == [shlex.split(CHECK)] * 2, checks
    out = subprocess.run(
        [sys.executable, "-c", checks[0][2]],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.fullmatch(r"\[CpuDevice\(id=0\)(, CpuDevice\(id=\d+\))*\]\n", out.stdout), out.stdout


def _floor(spec: str | None) -> tuple[int, int]:
    """The oldest Python 3.N a Requires-Python specifier admits (">=3.11", ">=3.11.0", "~=3.11",
    ">3.10": (3, 11)); (3, 0) for none."""
    from packaging.specifiers import SpecifierSet

    allowed = SpecifierSet(spec or "")
    return next((3, n) for n in range(40) if allowed.contains(f"3.{n}.99"))


def test_the_python_asked_for_is_the_oldest_the_dependencies_support():
    """pyproject's requires-python and the README's quick start ("Python 3.11+") name the highest
    Requires-Python floor of the core dependencies whose versions pyproject caps (jax, flax: the
    floor of a capped range does not move with new releases, as an uncapped dependency's
    newest one may): with a lower one, pip on an older Python fails on the first such
    dependency ("no matching distribution found for jax") instead of refusing the project's
    Python in one line."""
    from packaging.requirements import Requirement

    project = _pyproject()
    capped = [r for r in map(Requirement, project["dependencies"]) if "<" in str(r.specifier)]
    assert {r.name for r in capped} >= {"jax", "flax"}, capped
    floors = {r.name: _floor(metadata.metadata(r.name).get("Requires-Python")) for r in capped}
    want = max(floors.values())
    assert _floor(project["requires-python"]) == want, (project["requires-python"], floors)
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert f"Python {want[0]}.{want[1]}+ on a fresh machine" in readme
