"""The pytest releases that test images carry (tests/rl/test_repo_pytest_versions.py): PyPI
wheels, pinned, downloaded once into a cache and unpacked into a site-packages directory per
release.

The cache is `$JAX_GRPO_WHEELS`, else `~/.cache/jax-grpo-wheels`: a wheel already there is never
fetched again, so a machine without network runs the tests from a cache filled elsewhere (copy
the directory, or run `python -m tests.rl.pytest_wheels` where PyPI is reachable). A wheel that
is neither there nor downloadable skips the tests that need it, naming it (`Missing`).

Each set is what an image of its time holds (python 3.11, pure-python wheels only):
- 6.2.5 / pluggy 0.13.1: the oldest pytest grading supports (MIN_PYTEST), and it runs on
  python 3.11 (its `py` library and `toml`, as 6.2 needs them);
- 7.2.1 / pluggy 1.0.0: Debian bookworm's python3-pytest (the image of issue 48);
- 8.3.5 / pluggy 1.5.0;
- 9.0.3 / pluggy 1.6.0 (the trainer's own pytest, 9.2 on pluggy 1.7 today, is the one
  tests/rl/test_repo_images.py copies into its image).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

SETS = {
    "6.2.5": (
        "pytest==6.2.5",
        "pluggy==0.13.1",
        "py==1.11.0",
        "attrs==21.4.0",
        "toml==0.10.2",
        "iniconfig==1.1.1",
        "packaging==21.3",
        "pyparsing==3.0.9",
    ),
    "7.2.1": (
        "pytest==7.2.1",
        "pluggy==1.0.0",
        "attrs==22.2.0",
        "iniconfig==1.1.1",
        "packaging==23.0",
    ),
    "8.3.5": ("pytest==8.3.5", "pluggy==1.5.0", "iniconfig==2.0.0", "packaging==24.2"),
    "9.0.3": (
        "pytest==9.0.3",
        "pluggy==1.6.0",
        "iniconfig==2.1.0",
        "packaging==25.0",
        "pygments==2.19.2",
    ),
}


class Missing(Exception):
    """A wheel neither in the cache nor downloadable: one line naming it."""


_offline: list[str] = []  # the first failed download's line: later ones are not tried


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("JAX_GRPO_WHEELS") or "~/.cache/jax-grpo-wheels")


def _wheel(cache: str, pin: str) -> str:
    """The cached wheel of `pin` (name==version), downloaded into `cache` when missing."""
    name, _, version = pin.partition("==")
    stem = f"{name.replace('-', '_')}-{version}-"

    def find():
        return next(
            (
                f
                for f in sorted(os.listdir(cache))
                if f.lower().startswith(stem) and f.endswith(".whl")
            ),
            None,
        )

    if (found := find()) is None and _offline:
        raise Missing(_offline[0])
    if found is None:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--retries",
            "1",
            "--timeout",
            "20",
            "--dest",
            cache,
            pin,
        ]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
            why = (r.stderr.strip().splitlines() or ["?"])[-1]
        except (OSError, subprocess.TimeoutExpired) as err:
            why = str(err)
        if (found := find()) is None:  # no second try in this process: offline, say so at once
            _offline.append(
                f"wheel {pin} is not in {cache} and pip download failed ({why}); "
                "fill the cache where PyPI is reachable: python -m tests.rl.pytest_wheels"
            )
            raise Missing(_offline[0])
    return os.path.join(cache, found)


def site_packages(release: str, cache: str | None = None) -> str:
    """A directory holding release `release`'s wheels (SETS) unpacked, as pip installs them
    into site-packages (made once, in the cache); raises Missing."""
    cache = cache or cache_dir()
    os.makedirs(cache, exist_ok=True)
    out = os.path.join(cache, f"site-pytest-{release}")
    if os.path.isfile(os.path.join(out, ".complete")):
        return out
    wheels = [_wheel(cache, pin) for pin in SETS[release]]
    tmp = f"{out}.tmp-{os.getpid()}"
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(tmp)  # pure-python wheels: no .data, no scripts the tests need
    open(os.path.join(tmp, ".complete"), "w").close()
    try:
        os.rename(tmp, out)
    except OSError:  # another process made it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    for release in SETS:
        print(site_packages(release))
