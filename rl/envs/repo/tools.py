"""The `repo` environment's tool-call format: the tools' schemas (`TOOLS`, OpenAI function
format), the task instructions, the parsing of a turn's calls (Qwen `<tool_call>` blocks, JSON
or Qwen3-Coder's XML, or a Llama 3 JSON object) and the cutting of long observations. The episodes that use them, and the
tools themselves, are `rl/envs/repo/env.py`.
"""

from __future__ import annotations

import json
import re

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    params = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": params},
    }


TOOLS = [
    _fn(
        "bash",
        "Run a bash command in the repository (cwd). Long output is cut in the middle.",
        {"command": {"type": "string", "description": "The command to run."}},
        ["command"],
    ),
    _fn(
        "str_replace_editor",
        "View, create and edit files. `view` shows a file with line numbers (or a directory "
        "two levels deep); `create` writes a new file; `str_replace` replaces `old_str`, which "
        "must occur exactly once, by `new_str`; `insert` puts `new_str` after line "
        "`insert_line`; `undo_edit` reverts the last edit of `path`.",
        {
            "command": {
                "type": "string",
                "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
            },
            "path": {"type": "string", "description": "Absolute path, or relative to the repo."},
            "file_text": {"type": "string"},
            "old_str": {"type": "string"},
            "new_str": {"type": "string"},
            "insert_line": {"type": "integer"},
            "view_range": {"type": "array", "items": {"type": "integer"}},
        },
        ["command", "path"],
    ),
    _fn("submit", "Submit the repository as it is now; ends the episode.", {}, []),
]
# The tools described in text, in Qwen's wording, with the exact call syntax: the prompt of a
# tokenizer without a chat template, or with one that ignores its `tools` argument.
TOOLS_TEXT = (
    "# Tools\n\nYou may call these functions:\n<tools>\n"
    + "\n".join(json.dumps(t) for t in TOOLS)
    + f"\n</tools>\n\nFor each call, write {CALL_OPEN}\n"
    + '{"name": <function-name>, "arguments": <args-json-object>}'
    + f"\n{CALL_CLOSE}, e.g. {CALL_OPEN}\n"
    + json.dumps({"name": "bash", "arguments": {"command": "ls"}})
    + f"\n{CALL_CLOSE}"
)
INSTRUCTIONS = (
    "The Python repository at {root} has an issue. Find the cause and fix it by editing the "
    "code, so that its tests pass. Use the tools: bash to run commands (e.g. `python -m pytest "
    "tests`), str_replace_editor to view and edit files, and submit when you are done.\n\n"
    "<issue>\n{problem}\n</issue>"
)
NO_CALL = (
    'No tool call found. Call a tool in the format <tool_call>{"name": ..., "arguments": '
    "{...}}</tool_call>, or submit when you are done."
)


# Qwen3-Coder's template writes a call as XML inside <tool_call> (vLLM's qwen3_coder parser):
# <function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...\n</function>
_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
_TYPES = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in TOOLS}


def _xml_value(tool: str, key: str, raw: str):
    """A parameter's text as its schema's type says: strings as written (less the newline after
    the tag and before the close), anything else (integer, array, ...) as JSON."""
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    if _TYPES.get(tool, {}).get(key, {}).get("type", "string") == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        kind = _TYPES[tool][key]["type"]
        raise ValueError(f"parameter {key!r} of {tool} must be a JSON {kind}") from None


def _xml_call(block: str) -> tuple[str, dict]:
    """(name, arguments) of a Qwen3-Coder call block; ValueError for a malformed one."""
    found = _FUNCTION.search(block)
    if found is None or not found.group(1).strip():
        raise ValueError("a call is <function=NAME> with <parameter=KEY> blocks")
    name = found.group(1).strip()
    return name, {
        k.strip(): _xml_value(name, k.strip(), v) for k, v in _PARAMETER.findall(found.group(2))
    }


def parse_calls(text: str) -> list[tuple[str, dict] | str]:
    """The tool calls of a turn in order: (name, arguments) each, or an error message for a
    malformed one. Qwen `<tool_call>` blocks (JSON, or Qwen3-Coder's `<function=...>` XML), else a
    turn that is one JSON object (Llama 3)."""
    blocks = _CALL.findall(text)
    if not blocks:
        s = text.strip()
        if not (s.startswith("{") and '"name"' in s):
            return []
        blocks = [s]
    calls = []
    for block in blocks:
        try:
            if block.strip().startswith("<function="):
                calls.append(_xml_call(block))
                continue
            call = json.loads(block.strip())
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError('a call is a JSON object with a string "name"')
            args = call.get("arguments", call.get("parameters", {}))
            args = json.loads(args) if isinstance(args, str) else args
            if not isinstance(args, dict):
                raise ValueError('"arguments" must be a JSON object')
            calls.append((call["name"], args))
        except ValueError as err:
            calls.append(f"error: malformed tool call ({err})")
    return calls


def cut(text: str, limit: int) -> str:
    """`text`, or its head and tail around a marker saying how much was left out."""
    if len(text) <= limit:
        return text
    half = max(1, limit // 2)
    return f"{text[:half]}\n<... {len(text) - 2 * half} characters elided ...>\n{text[-half:]}"
