"""GRPO on GSM8K with Llama-3.2-1B-Instruct, for a TPU VM or a GPU host (8 chips by default).

    python -m launch.train --config configs/llama3_2_1b_gsm8k.py \
        --config.model.hf_checkpoint=/path/to/Llama-3.2-1B-Instruct \
        --config.data.train.path=/path/to/gsm8k/train.jsonl --config.data.eval.path=/path/to/gsm8k/test.jsonl

Everything else as in configs/qwen2_5_0_5b_gsm8k.py (data, reward, optimizer, sampler sizes).
"""

import os

from configs import qwen2_5_0_5b_gsm8k


def get_config():
    c = qwen2_5_0_5b_gsm8k.get_config()
    c.model.hf_checkpoint = os.path.join(
        os.path.expanduser("~"), "models", "Llama-3.2-1B-Instruct"
    )  # local HF dir
    c.mesh.fsdp = 4  # one host with 8 chips: weights and optimizer state 4 ways ...
    c.mesh.tensor = 2  # ... and heads / MLP / vocabulary 2 ways
    return c
