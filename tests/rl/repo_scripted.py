"""The scripted policy of the `repo` environment's engine-loop tests: the engine samples the turns
(a tiny random model), the script decides what they say. Shared by tests/rl/test_repo_env.py and
the multi-process run of tests/launch/host_repo.py; imports nothing of tests.conftest (a
subprocess keeps its own devices)."""

import json

from rl.environment import Turn
from rl.envs import register_env
from rl.envs.repo import RepoEnv
from rl.envs.repo.sandbox import WORKDIR


def call(name, **args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def workdir(env: RepoEnv) -> str:
    """The repository's path as the model sees it: /testbed in bubblewrap mode; without
    bubblewrap "" (a relative path: the tools join it to the episode's workspace,
    `RepoSandbox.root`)."""
    return WORKDIR if env.tools.mode == "bwrap" else ""


def fix_script(task, wrong=False, root=WORKDIR):
    """The turns that fix (or, wrong, do not fix) the task's bug: a relative view, then an edit
    at root/<path> (root "": relative)."""
    fix = task["fix"]
    new = fix["old"] if wrong else fix["new"]  # wrong: a no-op edit that keeps the bug
    path = f"{root}/{fix['path']}" if root else fix["path"]
    return [call("str_replace_editor", command="view", path=fix["path"]),
            call("str_replace_editor", command="str_replace", path=path,
                 old_str=fix["old"], new_str=new),
            call("submit")]  # fmt: skip


@register_env("test_repo_scripted")
class ScriptedRepo(RepoEnv):
    """The environment reads the script's text in place of the sampled text, and answers with a
    fixed observation id (the repo's output is not in the model's alphabet). Sample 0 of each
    group fixes the bug, sample 1 starts with a malformed call and then makes a wrong edit."""

    def prompt(self, record, prompt_field="problem"):
        return [3, 4, 5]

    def start(self, record):
        ep = super().start(record)
        self.counts = getattr(self, "counts", {})
        ep.k = self.counts.get(record["instance_id"], 0)
        self.counts[record["instance_id"]] = ep.k + 1
        return ep

    def step(self, episode, turn):
        script = fix_script(episode.record, wrong=episode.k == 1, root=workdir(self))
        if episode.k == 1:
            script = ["<tool_call>{oops</tool_call>"] + script[1:]
        text = script[min(episode.num_turns, len(script)) - 1]
        return super().step(episode, Turn(turn.ids, text, "stop"))

    def _observe(self, texts, turn, role="tool"):
        self.seen = getattr(self, "seen", []) + list(texts)
        return [6]


def args(tasks_path: str, isolation: str, prompts: int = 10) -> list[str]:
    """launch.train flags of a run of the scripted policy over the tasks of a jsonl file."""
    return [
        f"--config.data.prompts_per_step={prompts}",
        "--config.rl.num_generations=2", "--config.sampling.num_slots=16",
        "--config.env.name=test_repo_scripted", "--config.env.max_turns=4",
        "--config.env.max_turn_tokens=2", "--config.sampling.max_new_tokens=16",
        "--config.data.train.type=jsonl", f"--config.data.train.path={tasks_path}",
        "--config.data.train.prompt_field=problem", "--config.env.max_observation_chars=2000",
        f"--config.env.isolation={isolation}",
    ]  # fmt: skip


def check(rollout) -> None:
    """The script's outcome: sample 0 of every group fixed its task, sample 1 did not."""
    for grp in rollout.groups:
        for ep, r in zip(grp.episodes, grp.rewards):
            assert r == (1.0 if ep.k == 0 else 0.0), (grp.record["instance_id"], ep.k, r)
            assert ep.submitted and ep.num_turns == 3 and ep.workspace is None
            assert ep.tool_errors == (1 if ep.k == 1 else 0)


def rollout(run, config, batch_size: int):
    """(step 0's Rollout of the built `run`, the sandbox runs it started), the script's outcome
    checked; the run's rollouts and environment are closed after it."""
    from rl.data import make_prompt_stream
    from rl.sandbox import process as sandbox

    data = make_prompt_stream(config.data.train, batch_size=batch_size, seed=0)
    rollouts, before = run.rollouts(), sandbox.RUNS[0]
    try:
        r = rollouts(0, run.state.params, data)
    finally:
        rollouts.close()
        run.env.shutdown()
    check(r)
    return r, sandbox.RUNS[0] - before
