r"""GRPO on GSM8K with Qwen2.5-0.5B-Instruct (Qwen2 architecture), for a TPU VM or a GPU host (8 chips by default).

    python -m launch.train --config configs/qwen2_5_0_5b_gsm8k.py --dry_run   # then without

The model and the data are Hub ids, fetched on first use into the Hugging Face cache (HF_HOME;
HF_HUB_OFFLINE=1 reads the cache alone; HF_TOKEN for gated repos): Qwen/Qwen2.5-0.5B-Instruct
(`model.revision` pins a commit, branch or tag; the commit used is recorded in config.json) and
openai/gsm8k, subset `main`, splits train / test, with the columns `question` and `answer` (the
solution, ending in `#### <number>`). Local copies work too:

        --config.model.hf_checkpoint=/path/to/Qwen2.5-0.5B-Instruct \
        --config.data.train.type=jsonl --config.data.train.path=/path/to/gsm8k/train.jsonl \
        --config.data.eval.type=jsonl --config.data.eval.path=/path/to/gsm8k/test.jsonl

Prompts go through the tokenizer's chat template; the reward is the exact `#### n` (or last)
number. Check the memory first: add `--dry_run`. Every field not set here is in configs/default.py.
"""

from configs import default


def get_config():
    c = default.get_config()
    c.num_steps = 200  # GRPO steps
    c.checkpoint_every = 25  # steps between checkpoints
    c.eval_every = 25  # steps between held-out evaluations

    c.mesh.data = 1  # data parallel
    c.mesh.fsdp = 8  # one host with 8 chips: shard weights and optimizer state 8 ways
    c.mesh.tensor = 1  # 0.5B needs no tensor parallelism

    c.model.hf_checkpoint = "Qwen/Qwen2.5-0.5B-Instruct"  # Hub id (or a local HF directory)
    c.model.dtype = "bfloat16"  # compute dtype; master weights stay float32
    c.model.remat = True  # recompute blocks in the backward pass

    c.data.prompts_per_step = 64  # B prompts per step
    c.data.use_chat_template = True  # system + user messages through the chat template
    c.data.system_prompt = "Solve the problem step by step. End with a line '#### <number>'."
    c.data.train.type = "hf"  # a Hub dataset (or "jsonl" / "parquet" with local files)
    c.data.train.path = "openai/gsm8k"
    c.data.train.name = "main"
    c.data.train.split = "train"
    c.data.train.prompt_field = "question"
    c.data.eval.type = "hf"
    c.data.eval.path = "openai/gsm8k"
    c.data.eval.name = "main"
    c.data.eval.split = "test"
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
