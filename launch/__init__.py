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


def library_module_run(orig_argv: list[str]) -> str | None:
    """The library module of this package that the command line `orig_argv` asks `python -m`
    to run (launch.validate, say), or None. Run, such a module would define its functions and
    exit 0, which reads as "the config is valid". Python imports this package first."""
    args, target = iter(orig_argv[1:]), ""
    for a in args:  # the interpreter's options, up to -m MODULE (or a script, -c, -)
        if a.startswith("-m"):
            target = a[2:] or next(args, "")
            break
        if a in ("-X", "-W", "--check-hash-based-pycs"):  # an option with a separate value
            next(args, None)
        elif not a.startswith("-") or a.startswith("-c") or a == "-":
            return None
    target = target.removesuffix(".__main__")  # launch.bench.__main__ is launch.bench
    if not target.startswith("launch.") or target.removeprefix("launch.") in COMMANDS:
        return None
    path = os.path.join(os.path.dirname(__file__), *target.split(".")[1:])
    return target if os.path.isfile(path + ".py") or os.path.isdir(path) else None


if (_module := library_module_run(getattr(sys, "orig_argv", []))) is not None:
    print(
        f"error: {_module} is a library module, not a command; the commands: "
        + ", ".join(f"python -m launch.{c}" for c in COMMANDS)
        + " (`python -m launch.train --config C --dry_run` checks a config and its memory "
        "without training)",
        file=sys.stderr,
    )
    sys.exit(2)  # as every entry point answers bad input
