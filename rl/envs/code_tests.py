"""Code with test feedback: the model writes a solution, the environment runs the record's tests
in the sandbox and returns the failures, and the model may revise for up to `env.max_turns` turns.

Records are HumanEval/MBPP-style jsonl rows: `prompt` (the task), `tests` (Python code with
asserts), optional `entry_point` (the function the tests call; `check(entry_point)` is appended
when the tests define `check` and never call it, HumanEval's convention).

A turn is one of:
- a `python` tool call, `<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`
  (the Qwen tool-call format; `</tool_call>` is a stop id when it is one token): the code runs in the
  episode's sandbox workspace (kept across its turns) and stdout/stderr, truncated, come back as a
  tool message (at most `env.max_observation_chars`). A malformed call gets an error message and counts as a tool error;
- anything else: a solution attempt. Its last ```python block (`rl.envs.code_rewards.extract_code`) runs
  with the tests; when they pass the episode ends, otherwise the failure (reason and stderr tail)
  comes back as a user message.
The reward is 1.0 when the tests pass on the last attempt (run at the end if the turn limit cut the
episode before its test run), else 0.0. Runs go through `rl.envs.code_rewards`' shared sandbox under
config.env.isolation.
"""

from __future__ import annotations

import json

from rl.environment import Environment, Episode, Turn, register_env
from rl.envs.code_rewards import (
    extract_code,
    failure_message,
    run_tests,
    shared_sandbox,
    use_isolation,
)
from rl.sandbox import isolation_of

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def full_tests(record: dict) -> str:
    tests = record["tests"]
    entry = record.get("entry_point")
    if entry and "def check(" in tests and "check(" not in tests.split("def check(", 1)[1][1:]:
        tests += f"\n\ncheck({entry})\n"
    return tests


@register_env("code_tests")
class CodeTestsEnv(Environment):
    runs_code = True

    @classmethod
    def check_sandbox(cls, config) -> str:
        return use_isolation(isolation_of(config.env))

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        self.sandbox = shared_sandbox(isolation_of(config.env))
        self.max_chars = config.env.max_observation_chars

    def stop_ids(self) -> tuple[int, ...]:
        ids = self.tokenizer.encode(CALL_CLOSE, special=True)  # the added token where there is one
        return tuple(ids) if len(ids) == 1 else ()

    def start(self, record: dict) -> Episode:
        ep = Episode(record)
        ep.workspace = self.sandbox.workspace()
        ep.passed = None  # the last attempt's test result; None: not run yet
        ep.tested_turn = 0
        return ep

    def _python(self, episode: Episode, turn: Turn) -> str:
        episode.tool_calls += 1
        body = turn.text.rpartition(CALL_OPEN)[2].strip().removesuffix(CALL_CLOSE).strip()
        try:
            call = json.loads(body)
            if call.get("name") != "python":
                raise ValueError(f"unknown tool {call.get('name')!r}; the only tool is 'python'")
            code = call["arguments"]["code"]
            if not isinstance(code, str):
                raise ValueError("arguments.code must be a string")
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            episode.tool_errors += 1
            return f"error: malformed tool call ({err})"
        r = self.sandbox.run(code, episode.workspace)
        if not r.ok:
            episode.tool_errors += 1
        out = r.stdout + (("\n" if r.stdout else "") + r.stderr if r.stderr else "")
        out = out if r.ok else f"{failure_message(r, self.max_chars)}\n{out}".strip()
        return out if len(out) <= self.max_chars else out[: self.max_chars] + "\n...(truncated)"

    def _test(self, episode: Episode) -> str:
        code = extract_code(episode.turns[-1].text)
        r = run_tests(code, full_tests(episode.record), self.sandbox, episode.workspace)
        episode.passed, episode.tested_turn = r.ok, episode.num_turns
        return "" if r.ok else "The tests failed:\n" + failure_message(r, self.max_chars)

    def step(self, episode: Episode, turn: Turn) -> list[int] | None:
        if (
            CALL_OPEN in turn.text
            and turn.finish_reason == "stop"
            and not turn.text.rstrip().endswith("```")
        ):
            return self.observation_ids(self._python(episode, turn), turn, role="tool")
        failure = self._test(episode)
        if not failure:
            return None
        episode.observations.append(failure)
        return self.observation_ids(failure + "\nFix the code.", turn, role="user")

    def reward(self, episode: Episode) -> float:
        if not episode.turns:
            return 0.0
        if episode.tested_turn != episode.num_turns:  # a limit ended it before its test run
            self._test(episode)
        return float(bool(episode.passed))

    def close(self, episode: Episode) -> None:
        if episode.workspace is not None:
            episode.workspace.close()
            episode.workspace = None
