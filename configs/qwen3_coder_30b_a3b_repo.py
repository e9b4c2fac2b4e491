r"""Repository-level coding episodes of 32,768 tokens, Qwen3-Coder-30B-A3B-Instruct (a mixture of experts), on one 8 x H100 host.

    python -m launch.make_repo_tasks --out ~/data/repo_tasks --num 512 --seed 0
    python -m launch.make_repo_tasks --out ~/data/repo_tasks_eval --num 64 --seed 1
    python -m launch.train --config configs/qwen3_coder_30b_a3b_repo.py --workdir runs/coder30b \
        --config.data.train.path=$HOME/data/repo_tasks/tasks.jsonl \
        --config.data.eval.path=$HOME/data/repo_tasks_eval/tasks.jsonl

Check that it fits first: the same command with `--dry_run` (on a CPU host add
JAX_NUM_CPU_DEVICES=8; it reads config.json only). The repository environment of
configs/qwen3_0_6b_repo.py (rl/envs/repo/env.py, docs/repo_env.md: bash, str_replace_editor and
submit in the bubblewrap sandbox, reward 1 when FAIL_TO_PASS and PASS_TO_PASS pass) on
`Qwen/Qwen3-Coder-30B-A3B-Instruct` by Hub id (`Qwen3MoeForCausalLM`: 48 layers, 128 experts,
8 per token; models/moe.py). The tools reach the prompt through the checkpoint's own chat template
(`tools`), which describes them and asks for Qwen3-Coder's XML calls
(`<tool_call><function=bash><parameter=command>ls</parameter></function></tool_call>`);
rl/envs/repo/tools.py parses those as well as Qwen's JSON calls. Episodes are 32k tokens as in
configs/qwen2_5_0_5b_code_32k.py (a task of up to 4,096 tokens, 28,672 of turns and tool output).

Mesh: fsdp=4 x expert=2 (README "Mixtures of experts"): each device holds 64 of a layer's 128
experts, split once more over fsdp on the model dimension, and 1/4 of everything else; the batch
is split over the 4 fsdp shards (each its own KV pool and episodes), and within the experts'
block the two devices of a shard's expert axis each route half its rows. What fits (per-device
peaks from --dry_run, slots, LoRA, int8 KV) is in README "Mixtures of experts". Every field not
set here is in configs/qwen3_0_6b_repo.py, configs/qwen3_0_6b_code.py,
configs/qwen2_5_0_5b_code.py, configs/qwen2_5_0_5b_gsm8k.py or configs/default.py.
"""

from configs import qwen3_0_6b_repo


def get_config():
    c = qwen3_0_6b_repo.get_config()
    c.model.hf_checkpoint = "Qwen/Qwen3-Coder-30B-A3B-Instruct"  # Hub id (or a local HF directory)
    c.data.chat_template_kwargs = {}  # Qwen3-Coder has no thinking mode to switch off
    c.model.dtype = "bfloat16"  # compute dtype; master weights and AdamW state in float32
    c.model.remat = True  # recompute each block in the backward pass (one layer's activations)
    c.model.attention = "auto"  # splash / pallas_gpu / blockwise: memory linear in the row length

    c.mesh.data = 1  # no pure data parallelism: the weights need every device
    c.mesh.fsdp = 4  # 4 batch shards; weights, gradients and AdamW state split 4 ways
    c.mesh.expert = 2  # each device holds 64 of every layer's 128 experts
    c.mesh.tensor = 1  # 4 KV heads: no tensor parallelism needed on one host

    c.data.prompts_per_step = 8  # B tasks per step
    c.rl.num_generations = 8  # G episodes per task: 64 per step
    c.rl.micro_batches = 16  # 4 rows per micro-batch: one 32k-token row per batch shard
    c.optim.learning_rate = 1e-6  # peak AdamW learning rate (full fine-tune)
    c.rl.kl_coef = 0.0  # no KL term, so no f32 reference copy (15 GiB a device on this mesh)

    c.env.max_turns = 32  # model turns (each may hold several tool calls)
    c.env.max_turn_tokens = 2048  # model tokens per turn
    c.env.max_tool_calls = 48  # tool calls per episode
    c.env.max_observation_chars = 16000  # tool output per call, head and tail (about 4k tokens)

    c.sampling.max_prompt_len = 4096  # instructions, tool schemas and the issue, templated
    c.sampling.max_new_tokens = 28672  # episode budget after it: 32,768 tokens in all
    c.sampling.prefill_chunk = 512  # prompt / observation tokens per prefill pass
    # bf16 KV of 30B-A3B: 48 layers x 4 KV heads x 128 x 2 x 2 bytes = 96 KiB a token, 3 GiB an
    # episode of 32k. Slots and pages are totals over the 4 batch shards (each its own pool and
    # null page); pages are taken as episodes grow (reserve="demand": a shard that runs out
    # preempts its newest episodes and recomputes them later). Per shard: 16 slots and a pool of
    # 8 whole 32k episodes (a group of G = 8 must fit one shard), 24 GiB of bf16 KV a device.
    c.sampling.num_slots = 64
    c.sampling.page_size = 32
    c.sampling.num_pages = 4 * (8 * 1024 + 1)
    c.sampling.steps_per_call = 64
    # Decode from the training arrays: a per-rollout bf16 copy ("tensor") would add 61 GB / 4 per
    # device beside the f32 train state.
    c.sampling.weights_layout = "training"
    return c
