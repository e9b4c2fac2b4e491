"""Multi-turn code RL with test feedback, Qwen3-0.6B (thinking off), for a TPU VM or a GPU host.

    python -m launch.train --config configs/qwen3_0_6b_code.py \
        --config.model.hf_checkpoint=/path/to/Qwen3-0.6B \
        --config.data.train.path=/path/to/mbpp/train.jsonl --config.data.eval.path=/path/to/humaneval.jsonl

Everything else as in configs/qwen2_5_0_5b_code.py. With thinking on, Qwen3's template would drop
earlier <think> blocks on re-rendering; episodes never re-render (models/chat.py), so both work.
"""

import os

from configs import qwen2_5_0_5b_code


def get_config():
    c = qwen2_5_0_5b_code.get_config()
    c.model.hf_checkpoint = os.path.join(os.path.expanduser("~"), "models", "Qwen3-0.6B")
    c.data.chat_template_kwargs = {"enable_thinking": False}  # Qwen3: answer without <think>
    return c
