"""Command-line plumbing shared by the entry points: config files, overrides, workdirs.

    python -m launch.train --config configs/default.py --workdir runs/x --config.rl.num_generations=16

A config file is a python file with `get_config() -> ml_collections.ConfigDict`. Overrides
`--config.a.b=value` are parsed as python literals where possible (`3`, `1e-3`, `True`, `(1, 2)`,
`None`) and strings otherwise, then assigned through ConfigDict, which keeps each field's type.
A typo'd field fails with one line that names it and suggests the closest existing field, and
a config file that fails to load (any exception while it runs) with one line naming the file, the
line in it and the error.

absl's config_flags does the same job but answers a typo with a traceback; this module is small
enough to own.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import difflib
import importlib.machinery
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Sequence

import ml_collections

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "default.py")


class UsageError(ValueError):
    """Bad command-line input; the message is one line meant for the user."""


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """The ConfigDict of `path`'s get_config(). Whatever goes wrong, from a missing file to an
    exception raised while the file runs, is one UsageError naming the file (and its line)."""
    if not os.path.exists(path):
        raise UsageError(f"--config: {path} does not exist")
    if os.path.isdir(path):
        files = sorted(
            os.path.join(path, f)
            for f in os.listdir(path)
            if f.endswith(".py") and not f.startswith("_")
        )
        hint = f" (it holds {', '.join(files[:3])}{', ...' * (len(files) > 3)})" if files else ""
        raise UsageError(f"--config: {path} is a directory, not a config file{hint}")
    # An explicit loader, so that a name without .py loads too (importlib finds none for it).
    loader = importlib.machinery.SourceFileLoader(f"_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    try:
        loader.exec_module(module)
    except SyntaxError as e:  # the file's own line, not a traceback through importlib
        # A syntax error in a module the config imports names that module, not the config.
        other = e.filename and os.path.exists(e.filename) and not os.path.samefile(e.filename, path)
        bad = e.filename if other else path
        raise UsageError(f"--config: {bad}:{e.lineno}: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 (a config is user code: any error is the user's)
        raise _config_error(path, e) from None
    if not callable(getattr(module, "get_config", None)):
        raise UsageError(f"--config: {path} defines no get_config()")
    try:
        config = module.get_config()
    except Exception as e:  # noqa: BLE001
        raise _config_error(path, e) from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise UsageError(
            f"--config: {path}: get_config() returned a {type(config).__name__}, "
            "not an ml_collections.ConfigDict"
        )
    return config


def _config_error(path: str, e: Exception) -> UsageError:
    """`--config: path:line: Type: message`, the line of the innermost frame in the config file
    (an error raised in a module it imports points at the import or the call)."""
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if _same(f.filename, path)]
    where = f"{path}:{lines[-1]}" if lines else path
    what = " ".join(str(e).split())  # one line, whatever the message
    return UsageError(f"--config: {where}: {type(e).__name__}" + (f": {what}" if what else ""))


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # e.g. "<string>"
        return False


def _all_fields(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        out.append(name)
        if isinstance(value, ml_collections.ConfigDict):
            out += _all_fields(value, name + ".")
    return out


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_override(config: ml_collections.ConfigDict, dotted: str, text: str) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for i, part in enumerate(parents):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            _unknown(config, ".".join(parents[: i + 1]))
        node = node[part]
    if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
        _unknown(config, dotted)
    value = _parse_value(text)
    old = node[leaf]
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(old, str) and not isinstance(value, str):
        value = text  # e.g. a path that happens to parse as a number
    if isinstance(old, tuple) and isinstance(value, list):
        value = tuple(value)
    try:
        node[leaf] = value
    except (TypeError, ValueError) as e:
        reason = str(e)
        if old is not None:  # ConfigDict's own message is a paragraph about casting
            reason = f"expected {type(old).__name__}, got {type(value).__name__} {value!r}"
        raise UsageError(f"--config.{dotted}={text}: {reason}") from None


def _unknown(config, dotted):
    close = difflib.get_close_matches(dotted, _all_fields(config), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise UsageError(f"--config.{dotted}: no such config field{hint}")


def parse_args(argv: Sequence[str], flags: dict[str, object], usage: str = ""):
    """(config, config_path, options) from argv (`split_args`), the overrides applied."""
    config_path, overrides, options = split_args(argv, flags, usage)
    return load_config(config_path, overrides), config_path, options


def split_args(
    argv: Sequence[str], flags: dict[str, object], usage: str = ""
) -> tuple[str, list[tuple[str, str]], dict[str, object]]:
    """(config_path, overrides [(dotted field, text)], options) from argv.

    `flags` maps the other accepted `--name` options to their defaults; a bool default makes a
    switch (`--dry_run`), anything else takes a value (`--workdir DIR` or `--workdir=DIR`).
    `--help` (or `-h`) prints `usage` and the accepted options to stdout and exits 0, as
    argparse does.
    """
    options = dict(flags)
    config_path = DEFAULT_CONFIG
    overrides: list[tuple[str, str]] = []
    known = ", ".join(f"--{k}" for k in ["config", *options]) + ", --config.<field>=<value>"
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("--help", "-h"):
            print(usage.rstrip("\n") if usage else f"options: {known}")
            sys.exit(0)
        if not arg.startswith("--"):
            raise UsageError(f"unexpected argument {arg!r}")
        name, eq, value = arg[2:].partition("=")
        if name.startswith("config."):
            if not eq:
                if not args:
                    raise UsageError(f"--{name} needs a value")
                value = args.pop(0)
            overrides.append((name[len("config.") :], value))
        elif name == "config" or (name in options and not isinstance(options[name], bool)):
            if not eq:
                if not args:
                    raise UsageError(f"--{name} needs a value")
                value = args.pop(0)
            if name == "config":
                config_path = value
            else:
                options[name] = value
        elif name in options:
            options[name] = True
        else:
            raise UsageError(f"unknown option --{name} (known: {known}; --help explains them)")
    return config_path, overrides, options


def load_config(
    config_path: str, overrides: Sequence[tuple[str, str]]
) -> ml_collections.ConfigDict:
    """The config file's config with the overrides applied, in order."""
    config = load_config_file(config_path)
    for dotted, value in overrides:
        apply_override(config, dotted, value)
    return config


def config_json(config: ml_collections.ConfigDict) -> dict:
    return json.loads(config.to_json())


def workdir_for(config_path: str, given: str) -> str:
    """--workdir, or runs/<config name>-<timestamp>."""
    if given:
        return given
    name = os.path.splitext(os.path.basename(config_path))[0]
    return os.path.join("runs", f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the side entry points (eval, export, generate, images, inspect, sft,
    make_repo_tasks): a usage error is one line, `error: <what> (<prog> --help lists the
    flags)`, exit code 2, as every entry point answers bad input; --help as argparse's."""

    def error(self, message):
        print(f"error: {message} ({self.prog} --help lists the flags)", file=sys.stderr)
        sys.exit(2)


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2
