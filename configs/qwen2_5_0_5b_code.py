r"""Multi-turn code RL with test feedback, Qwen2.5-0.5B-Instruct, for a TPU VM or a GPU host (8 chips).

    python -m launch.train --config configs/qwen2_5_0_5b_code.py \
        --config.model.hf_checkpoint=/path/to/Qwen2.5-0.5B-Instruct \
        --config.data.train.path=/path/to/mbpp/train.jsonl --config.data.eval.path=/path/to/humaneval.jsonl

The data are HumanEval/MBPP-style jsonl rows: `prompt` (the task), `tests` (Python asserts, or
HumanEval's `def check(candidate)`), optional `entry_point`. Each episode (rl/envs/code_tests.py):
the model writes a solution, the environment runs the tests in the sandbox (rl/sandbox/process.py) and
returns the failures, and the model may revise, for up to `env.max_turns` turns; the model may also
call a `python` tool to try code first. The reward is 1 when the last attempt passes the tests.
The test output comes back as the chat template's rendering of a user message (models/chat.py);
the model's turns are the sampled ids, never re-rendered. Every field not set here is in
configs/qwen2_5_0_5b_gsm8k.py or configs/default.py.
"""

import os

from configs import qwen2_5_0_5b_gsm8k

HOME = os.path.expanduser("~")


def get_config():
    c = qwen2_5_0_5b_gsm8k.get_config()
    c.data.system_prompt = (
        "Write a Python solution in one ```python block. You may run code first with the python "
        'tool: <tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>'
    )
    for split in (c.data.train, c.data.eval):  # local jsonl (the GSM8K config reads the Hub)
        split.type, split.name = "jsonl", ""
    c.data.train.path = os.path.join(HOME, "data", "mbpp", "train.jsonl")
    c.data.train.prompt_field = "prompt"
    c.data.eval.path = os.path.join(HOME, "data", "humaneval", "test.jsonl")
    c.data.eval.prompt_field = "prompt"

    c.env.name = "code_tests"  # rl/envs/code_tests.py
    c.env.max_turns = 3  # a first attempt and up to two revisions (or tool calls)
    c.env.max_turn_tokens = 512  # model tokens per turn
    c.env.max_tool_seconds = 60.0  # sandbox time per episode
    c.env.tool_workers = 16  # test runs in parallel (sandboxed processes)

    c.rl.rewards = {}  # the environment scores episodes
    c.rl.overlong_buffer = 0  # episodes are scored by the environment
    c.sampling.max_prompt_len = 512  # longest templated task
    c.sampling.max_new_tokens = 2048  # episode budget: model turns + test feedback
    c.sampling.num_pages = 16384
    c.eval.reward = "python_tests"  # unused with an environment (its reward decides)
    return c
