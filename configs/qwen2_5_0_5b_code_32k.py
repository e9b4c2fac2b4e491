r"""Long multi-turn code episodes (32,768 tokens), Qwen2.5-0.5B-Instruct, for a TPU VM or a GPU host (8 chips).

    python -m launch.train --config configs/qwen2_5_0_5b_code_32k.py \
        --config.model.hf_checkpoint=/path/to/Qwen2.5-0.5B-Instruct \
        --config.data.train.path=/path/to/tasks/train.jsonl --config.data.eval.path=/path/to/tasks/test.jsonl

The episodes of configs/qwen2_5_0_5b_code.py (write code, run the tests in the sandbox, read the
failures, revise), sized like open coding-agent RL: a task statement of up to 4,096 tokens and an
episode of up to 28,672 more (model turns, tool calls and test output), so one episode is one
learner row of up to 32,768 tokens. What makes that fit:
- `model.attention = "auto"`: the learner's attention is blockwise (`models/flash.py`; splash or
  Pallas kernels where they lower), memory linear in the row length;
- `rl.micro_batches`: one 32k-token row per device per micro-batch (packed: short episodes share
  a row);
- `sampling.prefill_chunk`: the task statement and each observation are prefilled 512 tokens at a
  time over the KV pages, so the prefill never holds more than a chunk's activations.
Check the figures with `--dry_run` first (README, "Long episodes"). Every field not set here is
in configs/qwen2_5_0_5b_code.py, configs/qwen2_5_0_5b_gsm8k.py or configs/default.py.
"""

from configs import qwen2_5_0_5b_code


def get_config():
    c = qwen2_5_0_5b_code.get_config()
    c.model.attention = "auto"  # blockwise / splash / pallas_gpu: linear in the row length

    c.data.prompts_per_step = 32  # B tasks per step
    c.rl.num_generations = 8  # G episodes per task: 256 episodes per step, one per slot
    c.rl.micro_batches = 32  # 8 rows per micro-batch: one 32k-token row per device (fsdp=8)

    c.env.max_turns = 16  # attempts, tool calls and revisions
    c.env.max_turn_tokens = 4096  # model tokens per turn
    c.env.max_observation_chars = 16000  # test output fed back per turn (about 4k tokens)
    c.env.max_tool_seconds = 300.0  # sandbox time per episode

    c.sampling.max_prompt_len = 4096  # task statement (templated)
    c.sampling.max_new_tokens = 28672  # episode budget after it: 32,768 tokens in all
    c.sampling.prefill_chunk = 512  # prompt / observation tokens per prefill pass
    # Slots and pages are totals for the mesh, split over its 8 batch shards (fsdp=8), each
    # shard with its own pool and null page. An episode takes pages as it grows
    # (sampling.reserve="demand"; a shard that runs out preempts its newest episodes and
    # recomputes them later); the pool holds every slot's whole budget, per shard 32 slots x
    # 1,024 pages of 32 tokens, so none is preempted: 12 GiB of bf16 KV per device while
    # sampling, freed before learning; 256 episodes in flight on 8 devices.
    c.sampling.num_slots = 256
    c.sampling.page_size = 32
    c.sampling.num_pages = 8 * (32 * 1024 + 1)
    c.sampling.steps_per_call = 64
    return c
