r"""Module docstrings that show a shell command over several lines (`cmd \` then the rest
indented) are raw strings: in a plain string the backslash-newline is a line continuation, and the
docstring that `--help` prints (launch.generate, launch.sft, ...) runs the lines together."""

import ast

import pytest

from tests.test_imports import modules


def _collapsed(path: str) -> bool:
    """Whether the module's docstring is a plain string literal whose source continues a line."""
    with open(path) as f:
        source = f.read()
    body = ast.parse(source).body
    first = body[0] if body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
        return False
    if not isinstance(first.value.value, str):
        return False
    literal = ast.get_source_segment(source, first.value)
    return "\\\n" in literal and literal[:1].lower() != "r"


def test_docstrings_with_continued_commands_are_raw():
    bad = sorted(name for name, path in modules().items() if _collapsed(path))
    assert not bad, f"plain docstrings whose shell commands collapse in --help: {bad}"


def test_the_help_keeps_the_commands_lines(capsys):
    from launch.generate import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--output out.jsonl \\\n        --num_samples 4" in capsys.readouterr().out


def test_the_check_sees_a_plain_docstring_with_a_continuation(tmp_path):
    plain, raw = tmp_path / "plain.py", tmp_path / "raw.py"
    plain.write_text('"""Run:\n\n    python -m x --a \\\n        --b\n"""\n')
    raw.write_text('r"""Run:\n\n    python -m x --a \\\n        --b\n"""\n')
    assert _collapsed(str(plain)) and not _collapsed(str(raw))
