"""The `python_tests` reward: run each completion's code against its record's asserts in the sandbox.

    python_tests(prompts, completions, *, tests, **_) -> [1.0 | 0.0, ...]

`tests[i]` is Python code (asserts) run after completion i's code, as one program with empty stdin
(`__name__ == "__main__"`): 1.0 when it finishes with exit status 0 within the sandbox's limits, and
0.0 otherwise. The code is the completion's last fenced python block (```python, ```py, ```python3),
else its last untagged fenced block, else the whole text (`extract_code`). The G completions run in
parallel through one shared `Sandbox`, created on first use with min(8, cpu_count) workers, under
the isolation `use_isolation` set (launch.validate calls it at start-up with config.env.isolation;
"auto" until then: bubblewrap, or a RuntimeError where it does not work).

An early `sys.exit(0)` / `os._exit(0)` / `exit()` in the code must not count as passing: the harness
prints a random nonce after the last test and a run passes only if the nonce is there. The nonce
lives in the harness process, so code that goes looking for it (frame or gc introspection) still
can; so can code returning objects whose `__eq__` is always True. Those need a checker in a separate
process and are not attempted here (docs/sandbox.md, "Known limits").

`run_tests(code, tests)` and `failure_message(result)` are for environments that show the model why
its code failed (the stderr tail).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import secrets
import threading

from rl.rewards import register_reward
from rl.sandbox import RunResult, Sandbox, Workspace

_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})\s*([\w+.-]*)")
_PYTHON = ("python", "py", "python3")

# Solution and tests arrive on stdin (not as files in the workspace); the traceback module (with
# linecache) shows their source lines; the nonce line is written last, straight to fd 1.
_HARNESS = """\
import json, linecache, os, sys, traceback


def _main():
    payload = json.loads(sys.stdin.read())
    sys.stdin = open(os.devnull)
    env = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        for name in ("solution.py", "tests.py"):
            src = payload[name]
            linecache.cache[name] = (len(src), None, src.splitlines(True), name)
            exec(compile(src, name, "exec"), env)
    except Exception as e:  # printed here, without this frame and with the lines of source
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)
    sys.stdout.flush()
    os.write(1, ("\\n" + payload["nonce"] + "\\n").encode())


_main()
"""

_shared: dict[str, Sandbox] = {}  # isolation -> the module's Sandbox
_shared_lock = threading.Lock()
_isolation = "auto"  # of the python_tests reward's sandbox: set by use_isolation


def shared_sandbox(isolation: str | None = None) -> Sandbox:
    """The module's Sandbox (default limits) for `isolation` (None: the one `use_isolation`
    set), created on first use."""
    isolation = isolation or _isolation
    with _shared_lock:
        if isolation not in _shared:
            _shared[isolation] = sb = Sandbox(min(8, os.cpu_count() or 1), isolation=isolation)
            atexit.register(sb.close)
        return _shared[isolation]


def use_isolation(isolation: str) -> str:
    """Makes `isolation` (config.env.isolation) the python_tests reward's and starts its
    sandbox: "" when it runs here, else the one-line refusal (rl.sandbox.refusal)."""
    global _isolation
    _isolation = isolation
    try:
        shared_sandbox(isolation)
    except RuntimeError as err:
        return str(err)
    return ""


def extract_code(text: str) -> str:
    """The last ```python block, else the last untagged ``` block, else `text`.

    A fence still open at the end (a completion cut at its length limit) counts as a block.
    """
    blocks, fence, lang, body = [], None, "", []
    for line in text.splitlines(keepends=True):
        if fence is None:
            if m := _FENCE.match(line):
                fence, lang, body = m.group(1), m.group(2).lower(), []
        elif line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            blocks.append((lang, "".join(body)))
            fence = None
        else:
            body.append(line)
    if fence is not None:
        blocks.append((lang, "".join(body)))
    for wanted in (lambda t: t in _PYTHON, lambda t: t == ""):
        found = [code for tag, code in blocks if wanted(tag)]
        if found:
            return found[-1]
    return text


def _submit(code: str, tests: str, sandbox: Sandbox | None, workspace: Workspace | None = None):
    nonce = secrets.token_hex(16)
    payload = json.dumps({"solution.py": code, "tests.py": tests, "nonce": nonce})
    return nonce, (sandbox or shared_sandbox()).submit(_HARNESS, workspace, stdin=payload)


def _verdict(nonce: str, r: RunResult) -> RunResult:
    marker = f"\n{nonce}\n"
    if r.stdout.endswith(marker):
        return dataclasses.replace(r, stdout=r.stdout[: -len(marker)])
    if r.ok:  # exit status 0 but the tests never finished
        return dataclasses.replace(r, reason="exited_early")
    return r


def run_tests(
    code: str, tests: str, sandbox: Sandbox | None = None, workspace: Workspace | None = None
) -> RunResult:
    """Runs `code` then `tests` (in `workspace` if given); `.ok` iff every test ran and passed."""
    nonce, future = _submit(code, tests, sandbox, workspace)
    return _verdict(nonce, future.result())


def failure_message(r: RunResult, max_chars: int = 1000) -> str:
    """A short account of why a run failed, for the model: the reason and the stderr tail."""
    if r.ok:
        return ""
    head = {
        "timeout": f"timed out after {r.seconds:.1f} s",
        "cpu_limit": "CPU time limit exceeded",
        "output_limit": "output limit exceeded",
        "exited_early": "the program exited before the tests finished",
    }.get(r.reason, f"exit status {r.returncode}")
    tail = r.stderr.strip()
    if len(tail) > max_chars:
        tail = "..." + tail[-max_chars:]
    return f"{head}\n{tail}".strip()


@register_reward("python_tests", runs_code=True)
def python_tests(prompts, completions, *, tests, **_):
    """1.0 when completion i's code passes `tests[i]` in the sandbox, else 0.0."""
    runs = [_submit(extract_code(c), t, None) for c, t in zip(completions, tests)]
    return [float(_verdict(nonce, fut.result()).ok) for nonce, fut in runs]
