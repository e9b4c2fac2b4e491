"""GRPO on GSM8K with Qwen3-0.6B (thinking off), for a TPU VM or a GPU host (8 chips by default).

    python -m launch.train --config configs/qwen3_0_6b_gsm8k.py --dry_run   # then without

Qwen/Qwen3-0.6B from the Hub (or --config.model.hf_checkpoint=/path/to/Qwen3-0.6B); everything
else as in configs/qwen2_5_0_5b_gsm8k.py (openai/gsm8k, reward, optimizer, sampler sizes).
"""

from configs import qwen2_5_0_5b_gsm8k


def get_config():
    c = qwen2_5_0_5b_gsm8k.get_config()
    c.model.hf_checkpoint = "Qwen/Qwen3-0.6B"  # Hub id (or a local HF directory)
    c.data.chat_template_kwargs = {"enable_thinking": False}  # Qwen3: answer without <think>
    return c
