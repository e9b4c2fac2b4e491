"""The entry points (`python -m launch.<command>`) and the modules they share."""

import os
import sys

# The modules a user runs (`python -m launch.train`, ...); the others here are library modules.
COMMANDS = (
    "bench",
    "eval",
    "export",
    "generate",
    "images",
    "inspect",
    "make_repo_tasks",
    "sft",
    "train",
)


def library_module_run(argv: list[str], orig_argv: list[str]) -> str | None:
    """The library module of this package (launch.validate, say) that `python -m` is importing
    this package to run, or None; `argv` and `orig_argv` are sys's. Run, such a module would
    define its functions and exit 0, which reads as "the config is valid". While `-m` looks for
    its module, sys.argv is ["-m", *the module's arguments]."""
    if argv[:1] != ["-m"] or len(orig_argv) < len(argv):
        return None
    target = orig_argv[-len(argv)]  # the module's name, or the option group it ends ("-Bmx.y")
    target = target.partition("m")[2] if target.startswith("-") else target
    target = target.removesuffix(".__main__")  # launch.bench.__main__ is launch.bench
    if not target.startswith("launch.") or target.removeprefix("launch.") in COMMANDS:
        return None
    path = os.path.join(os.path.dirname(__file__), *target.split(".")[1:])
    return target if os.path.isfile(path + ".py") or os.path.isdir(path) else None


if (_module := library_module_run(sys.argv, sys.orig_argv)) is not None:
    print(
        f"error: {_module} is a library module, not a command; the commands: "
        + ", ".join(f"python -m launch.{c}" for c in COMMANDS)
        + " (`python -m launch.train --config C --dry_run` checks a config and its memory "
        "without training)",
        file=sys.stderr,
    )
    sys.exit(2)  # as every entry point answers bad input
