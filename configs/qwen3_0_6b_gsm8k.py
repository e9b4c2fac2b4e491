"""GRPO on GSM8K with Qwen3-0.6B (thinking off), for a TPU VM or a GPU host (8 chips by default).

    python -m launch.train --config configs/qwen3_0_6b_gsm8k.py \
        --config.model.hf_checkpoint=/path/to/Qwen3-0.6B \
        --config.data.train.path=/path/to/gsm8k/train.jsonl --config.data.eval.path=/path/to/gsm8k/test.jsonl

Everything else as in configs/qwen2_5_0_5b_gsm8k.py (data, reward, optimizer, sampler sizes).
"""

import os

from configs import qwen2_5_0_5b_gsm8k


def get_config():
    c = qwen2_5_0_5b_gsm8k.get_config()
    c.model.hf_checkpoint = os.path.join(
        os.path.expanduser("~"), "models", "Qwen3-0.6B"
    )  # local HF dir
    c.data.chat_template_kwargs = {"enable_thinking": False}  # Qwen3: answer without <think>
    return c
