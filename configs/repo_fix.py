"""CPU repository demo: GRPO teaches a tiny character-level model to fix code from test failures.

    python -m launch.train --config configs/repo_fix.py

Episodes are multi-turn (rl/envs/repo_fix.py, docs/repo_env.md): a one-file repository with a
wrong constant and an issue listing 4 candidate fixes, "m.py:k=3\\nfix:5|7|9|2\\n". The model edits
with str_replace in a compact call syntax, "<k=3/k=7>", a turn that ends on the stop id of ">";
the environment applies it to the episode's copy of the file, runs the repository's tests (not in
the prompt, as SWE-bench hides its FAIL_TO_PASS tests) and appends their output as the
observation: "passed;", or the failing assertion "assert 7==9;" (the value the file now has, then
the one the test wants). The model may edit once more (env.max_tool_calls = 2) and submits with
the end token; the reward is 1 iff all FAIL_TO_PASS and PASS_TO_PASS tests pass on the final file.

The warm start (configs/assets/repo_fix_sft, made by
`python -m launch.sft --task repo_fix --out configs/assets/repo_fix_sft`) learned well-formed edits
from scripted episodes that pick a candidate at random and, after a failure, another at random,
whatever the failure said: its fix rate after a failed first attempt is about chance (1 in 3), and
its greedy held-out reward about 2 in 4. Only the failure output tells which candidate is right,
and GRPO has to learn to read it: the run prints, before GRPO and at the end,
eval/second_try_fix_rate (held-out greedy episodes whose first edit failed and that end fixed),
eval/fix_after_wrong_candidate_rate (the same, over first edits to a wrong candidate),
eval/first_try_fix_rate (no signal: nothing in the prompt tells) and eval/accuracy (held-out greedy
reward) in metrics.jsonl. Measured on a shared 2-core CPU, seed 0: second-try fix rate 0.285 ->
0.902, reward 0.485 -> 0.920, 4m14s for the whole run; seed 1: 0.285 -> 0.960, 0.485 -> 0.965,
5m34s (docs/repo_env.md). The first-try rate falls below chance (0.28 -> 0.18): some learned
first edits only probe (a non-candidate value, or a no-op edit that just runs the tests).

Shared with env `repo`: the episode's own copy of the repository, str_replace's semantics and
error observations, the FAIL_TO_PASS + PASS_TO_PASS reward after submit or a limit. Simplified:
one file, one tool in a compact syntax instead of JSON tool calls, tests run after each edit by an
in-process restricted runner instead of pytest in a sandbox (docs/repo_env.md).
"""

import os

from configs import default


def get_config():
    c = default.get_config()
    c.num_steps = 40  # GRPO steps
    c.checkpoint_every = 40
    c.eval_every = 40  # held-out greedy episodes (also before step 0 and at the end)

    c.model.hf_checkpoint = os.path.join(default.ASSETS, "repo_fix_sft")  # the warm start

    for split in (c.data.train, c.data.eval):
        split.type = "repo_fix"  # rl/envs/repo_fix_tasks.py: tiny repositories, split by prompt
    c.data.train.num = 20000
    c.data.eval.num = 200  # held-out repositories per evaluation
    c.data.prompts_per_step = 16

    c.env.name = "repo_fix"  # rl/envs/repo_fix.py; the reward is the tests' verdict
    c.env.max_turns = 3  # edit, edit, submit (a turn at the limit is not run)
    c.env.max_tool_calls = 2  # two attempts
    c.env.max_turn_tokens = 10  # "<k=3/k=7>" is 9 tokens
    c.rl.rewards = {}  # the environment scores the episodes

    c.optim.learning_rate = 5e-4
    c.sampling.max_prompt_len = 24  # "m.py:k=3\nfix:5|7|9|2\n" is 21
    c.sampling.max_new_tokens = 48  # 2 edits (18) + 2 outputs (<= 14 each) + submit, with room
    c.sampling.num_slots = 128  # B * G episodes decode together
    c.sampling.num_pages = 1280  # 128 episodes x 9 pages of 8 tokens, + the null page
    c.sampling.steps_per_call = 5  # decode steps between polls of the tool workers

    c.eval.pass_k = 0  # greedy episodes only
    return c
