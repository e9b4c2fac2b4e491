"""Reference episodes of the `repo` environment: a record's own fix applied through the tools, then
submit, graded as a training episode is (`rl/envs/repo/env.py`: its sandbox or image, its setup, the
test files put back, GRADE). Two uses, both `python -m launch.make_repo_tasks`:

- `validate(env, record)`: SWE-bench's check of a gold patch. One episode submits the repository
  as it is, one applies the reference fix and submits; the record is valid when every
  FAIL_TO_PASS test fails before and passes after and every PASS_TO_PASS test passes in both.
  Otherwise the reason: FAIL_TO_PASS already passing, still failing after the fix, PASS_TO_PASS
  failing before or broken by it, a fix that does not apply, an infrastructure error (a
  workspace, setup or sandbox that failed; test ids the repository does not define).
- `reference_episode(env, record)`: the episode with the fix, its reward (1.0 for a valid record):
  a smoke test of the sandbox, the tools and the grading on a laptop, without a model.

The reference fix is the record's `patch` (a unified diff, SWE-bench's gold patch; carried over
by `rl.envs.repo.tasks.from_swe_row`), written with str_replace_editor `create` and applied with
`git apply`, else `patch -p1` (SWE-bench's harness tries both), by bash in the workspace; or its
`fix` ({path, old, new}, the generated tasks'), one str_replace. Observations become ids through
`CodePoints`, one id per character, since no model reads them here.
"""

from __future__ import annotations

import json
import string

import ml_collections

from models.tokenizer import CharTokenizer
from rl.environment import Turn
from rl.envs.repo.env import RepoEnv, RepoEpisode
from rl.envs.repo.tools import CALL_CLOSE, CALL_OPEN

PATCH_FILE = ".reference.patch"  # in the workspace while it is applied, then deleted
APPLY = (
    f"if command -v git >/dev/null && git apply --whitespace=nowarn {PATCH_FILE}; then rc=0; "
    f"else patch -p1 --batch --forward -i {PATCH_FILE}; rc=$?; fi; rm -f {PATCH_FILE}; exit $rc"
)
SHOWN = 6  # test ids named in a reason


class CodePoints(CharTokenizer):
    """One id per Unicode code point (after the three specials): any text encodes."""

    def __init__(self):
        super().__init__(string.printable)  # (its specials and chat template; ids below)
        self.vocab_size = 0x110000 + len(self.SPECIALS)

    def encode(self, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
        return [self.bos_id] * add_bos + [ord(c) + len(self.SPECIALS) for c in text]

    def decode(self, ids, skip_special: bool = True) -> str:
        return "".join(chr(i - len(self.SPECIALS)) for i in ids if i >= len(self.SPECIALS))


def make_env(isolation: str = "auto", images_dir: str = "", workers: int = 4, **env) -> RepoEnv:
    """A repo environment for reference episodes: the training defaults of `env` (rl/envs/repo/env.py)
    but `isolation`, `images_dir`, `tool_workers` and the keyword arguments. Raises RuntimeError
    (one line) when its sandbox cannot run here."""
    env = {"isolation": isolation, "images_dir": images_dir, "tool_workers": workers, **env}
    data = {"use_chat_template": False, "system_prompt": "", "chat_template_kwargs": {}}
    return RepoEnv(CodePoints(), ml_collections.ConfigDict({"data": data, "env": env}))


def call(name: str, **args) -> str:
    """A tool call in the Qwen format the environment parses (rl/envs/repo/tools.py)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{CALL_CLOSE}"


def fix_calls(record: dict) -> list[tuple[str, dict]]:
    """The tool calls, (name, arguments), that apply the record's reference fix (module
    docstring); [] without one."""
    if isinstance(record.get("patch"), str) and record["patch"].strip():
        patch = record["patch"] if record["patch"].endswith("\n") else record["patch"] + "\n"
        return [
            ("str_replace_editor", {"command": "create", "path": PATCH_FILE, "file_text": patch}),
            ("bash", {"command": APPLY}),
        ]
    if isinstance(record.get("fix"), dict):
        f = record["fix"]
        return [
            (
                "str_replace_editor",
                {
                    "command": "str_replace",
                    "path": f["path"],
                    "old_str": f["old"],
                    "new_str": f["new"],
                },
            )
        ]
    return []


def episode(env: RepoEnv, record: dict, calls) -> tuple[float, RepoEpisode, str]:
    """(reward, episode, the output of the first call that failed, or "") of one episode whose
    model turns are `calls`, one each, then submit."""
    ep, failed = env.start(record), ""
    try:
        for name, args in [*calls, ("submit", {})]:
            text = call(name, **args)
            turn = Turn(env.tokenizer.encode(text), text, "stop")
            ep.turns.append(turn)
            errors = ep.tool_errors
            if env.step(ep, turn) is None:  # submitted, or an infrastructure error
                break
            out = ep.observations[-1]  # the call's output
            if ep.tool_errors > errors or (name == "bash" and not out.endswith("[exit code 0]")):
                failed = failed or " ".join(out.split())[-300:]
        return env.reward(ep), ep, failed
    finally:
        env.close(ep)


def reference_episode(env: RepoEnv, record: dict) -> tuple[float, RepoEpisode, str]:
    """The record's reference fix through the tools, then submit: (reward, episode, the output
    of the call that failed to apply it, or "")."""
    return episode(env, record, fix_calls(record))


def _ids(nodes) -> str:
    nodes = list(nodes)
    return str(nodes[:SHOWN])[:-1] + (f", ... {len(nodes) - SHOWN} more]" if nodes[SHOWN:] else "]")


def _not_graded(ep: RepoEpisode, when: str) -> str:
    """Why the episode's graded run tells nothing of its tests ("" when it does)."""
    if ep.missing:  # (masked in training, as an infrastructure error)
        return (
            f"infrastructure error {when}: test ids the repository does not define (renamed?"
            f" the test patch not applied?): {_ids(ep.missing)}"
        )
    if ep.infra_error:
        return f"infrastructure error {when}: {' '.join(ep.infra_error.split())}"
    if ep.tamper or ep.grade_timeout:
        what = ep.tamper or f"a hang past env.per_test_timeout_s ({ep.grade_timeout})"
        return f"the graded run {when} scored 0 without a verdict per test: {what}"
    return ""


def validate(env: RepoEnv, record: dict) -> str:
    """Why the record's reference fix does not validate, in one line (module docstring); ""
    when it does."""
    if not fix_calls(record):
        return "no reference fix (neither a `patch` nor a `fix` field)"
    _, before, _ = episode(env, record, [])
    if why := _not_graded(before, "before the fix"):
        return why
    _, after, failed = reference_episode(env, record)
    if why := _not_graded(after, "after the fix"):
        return why
    if failed:
        return f"the reference fix does not apply: {failed}"
    f2p, p2p = record["fail_to_pass"], record["pass_to_pass"]
    checks = (
        ("FAIL_TO_PASS already passing before the fix", f2p, before, False),
        ("FAIL_TO_PASS still failing after the fix", f2p, after, True),
        ("PASS_TO_PASS failing before the fix", p2p, before, True),
        ("PASS_TO_PASS broken by the fix", p2p, after, True),
    )
    reasons = [
        (what, [n for n in nodes if ep.results.get(n) != want]) for what, nodes, ep, want in checks
    ]
    return "; ".join(f"{what}: {_ids(bad)}" for what, bad in reasons if bad)
