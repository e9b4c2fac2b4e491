"""GRPO on GSM8K with Llama-3.2-1B-Instruct, for a TPU VM or a GPU host (8 chips by default).

    HF_TOKEN=... python -m launch.train --config configs/llama3_2_1b_gsm8k.py --dry_run

meta-llama/Llama-3.2-1B-Instruct from the Hub, a gated repo: accept its licence on huggingface.co
and set HF_TOKEN (or --config.model.hf_checkpoint=/path/to/Llama-3.2-1B-Instruct). Everything
else as in configs/qwen2_5_0_5b_gsm8k.py (openai/gsm8k, reward, optimizer, sampler sizes).
"""

from configs import qwen2_5_0_5b_gsm8k


def get_config():
    c = qwen2_5_0_5b_gsm8k.get_config()
    c.model.hf_checkpoint = "meta-llama/Llama-3.2-1B-Instruct"  # Hub id (gated: HF_TOKEN)
    c.mesh.fsdp = 4  # one host with 8 chips: weights and optimizer state 4 ways ...
    c.mesh.tensor = 2  # ... and heads / MLP / vocabulary 2 ways
    return c
