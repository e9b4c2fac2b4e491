r"""Repository-level coding episodes (SWE-Gym style), Qwen3-0.6B (thinking off), for a TPU VM or a GPU host (8 chips).

    python -m launch.make_repo_tasks --out ~/data/repo_tasks --num 512 --seed 0
    python -m launch.make_repo_tasks --out ~/data/repo_tasks_eval --num 64 --seed 1
    python -m launch.train --config configs/qwen3_0_6b_repo.py \
        --config.model.hf_checkpoint=/path/to/Qwen3-0.6B \
        --config.data.train.path=$HOME/data/repo_tasks/tasks.jsonl \
        --config.data.eval.path=$HOME/data/repo_tasks_eval/tasks.jsonl

Each episode (rl/envs/repo/env.py, docs/repo_env.md) gets its own copy of a repository in the
bubblewrap sandbox, a bash tool, OpenHands' str_replace_editor and submit, whose schemas reach the
prompt through Qwen3's chat template (`tools`); the reward is 1 when every FAIL_TO_PASS and
PASS_TO_PASS test passes on the final workspace. Harness timeouts and sandbox failures are masked
out of the loss (`episode/infra_errors`). Rows of SWE-Gym / SWE-smith / R2E-Gym with their
repositories checked out locally work too: `python -m launch.make_repo_tasks --out DIR --from_rows
rows.jsonl --repos CHECKOUTS` writes their records (rl/envs/repo/tasks.py), and `python -m
launch.make_repo_tasks --validate DIR` keeps those whose gold patch validates in DIR/valid.jsonl
(train on that; docs/repo_env.md). Every
field not set here is in configs/qwen3_0_6b_code.py, configs/qwen2_5_0_5b_code.py,
configs/qwen2_5_0_5b_gsm8k.py or configs/default.py.
"""

import os

from configs import qwen3_0_6b_code

HOME = os.path.expanduser("~")


def get_config():
    c = qwen3_0_6b_code.get_config()
    c.model.attention = "auto"  # blockwise / splash / pallas_gpu: linear in the row length
    c.data.system_prompt = ""  # the instructions are in the user turn, the tools in the template's
    c.data.train.path = os.path.join(HOME, "data", "repo_tasks", "tasks.jsonl")
    c.data.train.prompt_field = "problem"  # the issue text
    c.data.eval.path = os.path.join(HOME, "data", "repo_tasks_eval", "tasks.jsonl")
    c.data.eval.prompt_field = "problem"
    c.data.prompts_per_step = 16  # B tasks per step
    c.rl.num_generations = 8  # G episodes per task: 128 per step
    c.rl.micro_batches = 8  # 16 rows of up to 16k tokens per micro-batch

    c.env.name = "repo"  # rl/envs/repo/env.py
    c.env.max_turns = 24  # model turns (each may hold several tool calls)
    c.env.max_turn_tokens = 1024  # model tokens per turn
    c.env.max_tool_calls = 32  # tool calls per episode
    c.env.max_tool_seconds = 600.0  # all tool time of an episode
    c.env.max_observation_chars = 10000  # tool output per call, head and tail (mini-swe-agent)
    c.env.tool_workers = 32  # tool calls and graded test runs in parallel (sandboxed processes)
    c.env.command_timeout_s = 30.0  # per bash command
    c.env.test_timeout_s = 300.0  # the graded run; past it the episode is masked
    c.env.per_test_timeout_s = 30  # a test that hangs fails (the model's fault)
    c.env.setup_timeout_s = 300.0  # a record's `setup` command
    c.env.workspace_bytes = 256 << 20  # tmpfs per episode
    c.env.isolation = "bwrap"  # refuse to run the model's commands without bubblewrap

    c.sampling.max_prompt_len = 2048  # instructions, tool schemas and the issue, templated
    c.sampling.max_new_tokens = 14336  # episode budget: model turns + tool output (16k in all)
    c.sampling.prefill_chunk = 512  # prompt / observation tokens per prefill pass
    # An episode takes KV pages as it grows (sampling.reserve="demand"; a shard that runs out
    # preempts its newest episodes and recomputes them later). The pool holds every slot's whole
    # budget, 64 slots x 512 pages of 32 tokens (16k), split over the 8 batch shards (fsdp=8),
    # each with its own pool and null page: no episode is ever preempted; a smaller pool
    # preempts only when long episodes meet.
    c.sampling.num_slots = 64
    c.sampling.page_size = 32
    c.sampling.num_pages = 8 * (8 * 512 + 1)
    c.sampling.steps_per_call = 64
    # Episodes here are long-tailed (a few run 10x the median, or wait on slow test runs). To
    # keep the slots busy through the tail, carry the unfinished ones across learner steps:
    # --config.rl.partial_rollouts=True --config.rl.is_correction=tis (README: Partial rollouts).
    return c
