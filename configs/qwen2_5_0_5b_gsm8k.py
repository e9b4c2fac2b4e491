"""GRPO on GSM8K with Qwen2.5-0.5B-Instruct (Qwen2 architecture), for a TPU VM or a GPU host (8 chips by default).

    python -m launch.train --config configs/qwen2_5_0_5b_gsm8k.py \
        --config.model.hf_checkpoint=/path/to/Qwen2.5-0.5B-Instruct \
        --config.data.train.path=/path/to/gsm8k/train.jsonl --config.data.eval.path=/path/to/gsm8k/test.jsonl

Nothing is downloaded: the checkpoint is a local HF directory (config.json, *.safetensors,
tokenizer.json, tokenizer_config.json) and the data are local jsonl (or parquet) files with the
GSM8K columns `question` and `answer` (the solution, ending in `#### <number>`). Prompts go through
the tokenizer's chat template; the reward is the exact `#### n` (or last) number.
Check the memory first: add `--dry_run`. Every field not set here is in configs/default.py.
"""

import os

from configs import default

HOME = os.path.expanduser("~")


def get_config():
    c = default.get_config()
    c.num_steps = 200  # GRPO steps
    c.checkpoint_every = 25  # steps between checkpoints
    c.eval_every = 25  # steps between held-out evaluations

    c.mesh.data = 1  # data parallel
    c.mesh.fsdp = 8  # one host with 8 chips: shard weights and optimizer state 8 ways
    c.mesh.tensor = 1  # 0.5B needs no tensor parallelism

    c.model.hf_checkpoint = os.path.join(HOME, "models", "Qwen2.5-0.5B-Instruct")  # local HF dir
    c.model.dtype = "bfloat16"  # compute dtype; master weights stay float32
    c.model.remat = True  # recompute blocks in the backward pass

    c.data.prompts_per_step = 64  # B prompts per step
    c.data.use_chat_template = True  # system + user messages through the chat template
    c.data.system_prompt = "Solve the problem step by step. End with a line '#### <number>'."
    c.data.train.type = "jsonl"  # or "parquet"
    c.data.train.path = os.path.join(HOME, "data", "gsm8k", "train.jsonl")
    c.data.train.prompt_field = "question"
    c.data.eval.type = "jsonl"
    c.data.eval.path = os.path.join(HOME, "data", "gsm8k", "test.jsonl")
    c.data.eval.prompt_field = "question"

    c.rl.num_generations = 8  # G
    c.rl.rewards = {"gsm8k_answer": 1.0}
    c.rl.kl_coef = 0.04  # k3 KL to the reference model in the loss
    c.rl.micro_batches = 4  # 512 sequences per step in 4 accumulation chunks
    c.rl.overlong_buffer = 64  # DAPO soft length penalty over the last 64 tokens
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 10
    c.optim.decay_steps = 190

    c.sampling.max_prompt_len = 320  # longest templated prompt
    c.sampling.max_new_tokens = 512
    c.sampling.num_slots = 256
    c.sampling.page_size = 32
    c.sampling.num_pages = 8192
    c.sampling.steps_per_call = 32

    c.eval.reward = "gsm8k_answer"
    c.eval.temperature = 0.6
    return c
