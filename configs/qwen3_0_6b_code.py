r"""Multi-turn code RL with test feedback, Qwen3-0.6B (thinking off), for a TPU VM or a GPU host.

    python -m launch.train --config configs/qwen3_0_6b_code.py \
        --config.data.train.path=/path/to/mbpp/train.jsonl --config.data.eval.path=/path/to/humaneval.jsonl

The model is Qwen/Qwen3-0.6B from the Hub (or --config.model.hf_checkpoint=/path/to/Qwen3-0.6B;
`--dry_run` fetches its config.json only). Everything else as in configs/qwen2_5_0_5b_code.py. With thinking on, Qwen3's template would drop
earlier <think> blocks on re-rendering; episodes never re-render (models/chat.py), so both work.
"""

from configs import qwen2_5_0_5b_code


def get_config():
    c = qwen2_5_0_5b_code.get_config()
    c.model.hf_checkpoint = "Qwen/Qwen3-0.6B"  # Hub id (or a local HF directory)
    c.data.chat_template_kwargs = {"enable_thinking": False}  # Qwen3: answer without <think>
    return c
