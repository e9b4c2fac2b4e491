"""The CPU repository demo's environment: env `repo` cut down to what a character-level model can
drive in a few minutes on a 2-core CPU (configs/repo_fix.py, docs/repo_env.md).

    prompt   "m.py:k=3\\nfix:5|7|9|2\\n"       the file and the issue's candidate fixes
    edit     "<k=3/k=7>"                      str_replace(old="k=3", new="k=7") in m.py
    output   "assert 7==9;"                    the tests, run after every edit (or "passed;")
    edit     "<k=7/k=9>"  -> "passed;"
    submit   <eos>                            a turn that is not a call ends the episode

Shared with env `repo`: each episode owns its copy of the repository (here the file's text, kept
in the episode); the editor's str_replace semantics (`old` must occur exactly once, else an error
observation); malformed calls get an error observation and count in `episode.tool_errors`; the
reward after submit, or when a limit ends the episode, is 1.0 iff every FAIL_TO_PASS and
PASS_TO_PASS test of the record passes on the final files, and their pass fractions are
`episode/fail_to_pass_frac` and `episode/pass_to_pass_frac`; `env.max_tool_calls` caps the calls (a call past
it ends the episode unapplied).

Simplified: one file, so the call names no path; one tool (str_replace) in a compact syntax that
ends on the stop id of ">" instead of the chat template's JSON tool calls; no bash: the tests run
after each applied edit and their output is the observation (`rl.envs.repo_fix_tasks.run_tests`,
in process, a restricted parser instead of pytest in a sandbox, so nothing is executed and there
are no infrastructure errors to mask); submit is the end token.

Per-episode metrics: `first_try_fix_rate` (the first applied edit made the tests pass) and, over
the episodes whose first applied edit failed, `second_try_fix_rate` (the repository is fixed at the
end): the demo's measure of reading the failure output; of those, `first_edit_noop_rate` (the
first edit left the file unchanged: it only ran the tests) and, over those whose first edit set a
wrong candidate, `fix_after_wrong_candidate_rate`.
"""

from __future__ import annotations

import dataclasses

from rl.environment import Environment, Episode, Turn, register_env
from rl.envs.repo_fix_tasks import (
    CALL_CLOSE,
    CALL_OPEN,
    MODULE,
    PASSED,
    candidates,
    observation,
    parse_module,
    run_tests,
    str_replace,
)


@dataclasses.dataclass
class RepoFixEpisode(Episode):
    source: str = ""  # the episode's copy of m.py
    edits: int = 0  # applied edits
    first_fixed: bool | None = None  # whether the first applied edit made the tests pass
    first_kind: str = ""  # the first applied edit: "noop" (file unchanged), "candidate", "other"


@register_env("repo_fix")
class RepoFixEnv(Environment):
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(CALL_CLOSE, special=True))

    def start(self, record: dict) -> RepoFixEpisode:
        return RepoFixEpisode(record, source=record["files"][MODULE])

    def step(self, episode: Episode, turn: Turn) -> list[int] | None:
        if turn.finish_reason != "stop" or not turn.text.endswith(CALL_CLOSE):
            return None  # submit (or a turn cut at its token cap): the episode ends
        if episode.tool_calls >= int(self.config.env.get("max_tool_calls", 2)):
            return None  # past the call limit: ends, unapplied
        episode.tool_calls += 1
        before, opened, body = turn.text[: -len(CALL_CLOSE)].rpartition(CALL_OPEN)
        before_source = episode.source
        source, error = str_replace(episode.source, body) if opened else (None, "E bad call")
        if source is None:
            episode.tool_errors += 1
            output = error
        else:
            episode.source, episode.edits = source, episode.edits + 1
            output = run_tests(episode.record, source)[2]
            if episode.edits == 1:
                episode.first_fixed = output == PASSED
                episode.first_kind = _kind(episode.record, before_source, source)
        episode.observations.append(observation(output))
        return self.observation_ids(observation(output), turn)

    def reward(self, episode: Episode) -> float:
        f2p, p2p, _ = run_tests(episode.record, episode.source)
        fixed = float(f2p == 1.0 and p2p == 1.0)
        episode.metrics.update(
            fail_to_pass_frac=f2p,
            pass_to_pass_frac=p2p,
            first_try_fix_rate=float(bool(episode.first_fixed)),
        )
        if episode.first_fixed is False:
            episode.metrics["second_try_fix_rate"] = fixed
            episode.metrics["first_edit_noop_rate"] = float(episode.first_kind == "noop")
            if episode.first_kind == "candidate":
                episode.metrics["fix_after_wrong_candidate_rate"] = fixed
        return fixed


def _kind(record: dict, before: str, after: str) -> str:
    """What the first applied edit did: "noop" (the file is unchanged: the edit only ran the
    tests), "candidate" (the constant now holds one of the issue's candidates), else "other"."""
    if after == before:
        return "noop"
    values = parse_module(after) or {}
    name = record["files"][MODULE].split("=")[0]
    return "candidate" if str(values.get(name)) in candidates(record) else "other"
