"""CPU demo: GRPO removes a bad habit from a tiny character-level adder.

    python -m launch.train                                   # = --config configs/default.py
    python -m launch.train --config.num_steps=20 --workdir runs/quick

The policy starts from a warm start made by this project and shipped in configs/assets/arithmetic_sft
(3 MB; remade by `python -m launch.sft --out configs/assets/arithmetic_sft`, about 4 minutes). It
has learned 2-digit addition, and also a habit: on answers ending in 1-7 it usually appends a
spurious "0", which greedy decoding follows, so its held-out greedy accuracy is about 30%. The
reward is exact (the answer string equals the sum), sampling finds the clean answers often enough,
and GRPO raises held-out greedy accuracy to about 90% in 60 steps: about a minute on a 2-core CPU,
on a mesh of one device.
"""

import os

import ml_collections

ASSETS = os.path.join(os.path.dirname(__file__), "assets")


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0  # root of every PRNG key and of the data order
    c.num_steps = 60  # GRPO steps (one rollout + learn phase each)
    c.checkpoint_every = 20  # steps between checkpoints (the last step is always saved)
    c.keep_checkpoints = 2  # orbax keeps this many most recent checkpoints
    c.resume = None  # None: resume when the workdir has a checkpoint; True: require; False: refuse
    c.log_every = 1  # steps between metric lines / TensorBoard points
    c.eval_every = 20  # steps between held-out evaluations (also run before step 0 and at the end)
    c.num_samples_logged = 4  # completions written as text summaries per logged step
    c.log = ml_collections.ConfigDict()  # extra metric sinks beside TensorBoard (launch/logger.py)
    c.log.wandb = False  # also send the scalars, config and summary to Weights & Biases
    c.log.wandb_project = "jax-grpo"
    c.log.wandb_entity = ""  # "" = the default entity of the W&B login
    c.log.wandb_name = ""  # run name ("" = the workdir's name)
    c.log.wandb_tags = ()
    # steps between progress lines on stderr when it is no terminal (a file, a pipe); on one, a bar
    c.log.progress_every = 10
    c.max_nonfinite_steps = (
        3  # stop after this many steps in a row with a skipped non-finite update
    )
    c.distributed = False  # jax.distributed.initialize() (multi-host); or JAX_COORDINATOR_ADDRESS
    # multi-process: a process silent this long is declared dead and the others stop (not hang)
    c.heartbeat_timeout_s = 30

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel axis size
    c.mesh.fsdp = 1  # FSDP axis size (shards the model dimension of weights)
    c.mesh.tensor = 1  # tensor-parallel axis size (heads, MLP, vocabulary)
    c.mesh.expert = 1  # expert-parallel axis size (a mixture of experts' experts; models/moe.py)
    c.rules = (  # logical axis -> mesh axes (models/sharding.py)
        ("vocab", "tensor"),
        ("embed", "fsdp"),
        ("mlp", "tensor"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("head_dim", None),
        ("norm", None),
        ("experts", "expert"),
        ("expert_mlp", "tensor"),
        ("batch", ("data", "fsdp")),
    )

    c.model = ml_collections.ConfigDict()
    c.model.hf_checkpoint = os.path.join(ASSETS, "arithmetic_sft")  # HF dir or Hub id ("org/name")
    c.model.revision = ""  # Hub id: commit, branch or tag ("" = the default branch)
    c.model.hf_commit = ""  # set by launch.train: the commit a Hub id resolved to (config.json)
    c.model.dtype = "float32"  # compute dtype (bfloat16 on accelerators)
    c.model.param_dtype = "float32"  # master weights
    c.model.remat = False  # rematerialise transformer blocks in the backward pass
    c.model.attention = "auto"  # learner attention: auto | dense | blockwise | splash | pallas_gpu
    c.model.lora = ml_collections.ConfigDict()  # LoRA adapters (models/lora.py)
    c.model.lora.rank = 0  # 0 = off (full fine-tune); > 0: only adapters train, KL needs no copy
    c.model.lora.alpha = 16.0  # adapters' output scaled by alpha / rank
    c.model.lora.dropout = 0.0  # only 0 is implemented
    c.model.lora.targets = ("q", "k", "v", "o", "gate", "up", "down")  # projections adapted

    c.data = ml_collections.ConfigDict()
    c.data.prompts_per_step = 16  # prompts per GRPO step (B); B * G sequences per rollout
    c.data.use_chat_template = False  # wrap prompts in the tokenizer's chat template
    c.data.system_prompt = ""  # prepended to every prompt ("" = none)
    c.data.chat_template_kwargs = {}  # extra chat-template variables, e.g. {"enable_thinking": False}
    c.data.train = ml_collections.ConfigDict()  # training prompts (rl/sources.py source config)
    c.data.train.type = "arithmetic"  # arithmetic (built-in) | jsonl | parquet | hf
    c.data.train.path = ""  # file path or glob (jsonl / parquet); hf: Hub id or local directory
    c.data.train.name = ""  # hf: the dataset's subset (config name; "" = its default)
    c.data.train.revision = ""  # hf: commit, branch or tag of a Hub dataset ("" = default)
    c.data.train.hf_commit = ""  # set by launch.train: the commit a Hub dataset id resolved to
    c.data.train.prompt_field = "prompt"  # record field holding the prompt
    c.data.train.num = 20000  # arithmetic: records generated
    c.data.train.digits = 2  # arithmetic: digits per operand
    c.data.train.ops = "+"  # arithmetic: operators
    c.data.train.split = "train"  # arithmetic: train | eval (disjoint by prompt hash); hf: split
    c.data.train.seed = 0  # arithmetic: generator seed
    c.data.eval = ml_collections.ConfigDict()  # held-out prompts, same fields as data.train
    c.data.eval.type = "arithmetic"
    c.data.eval.path = ""
    c.data.eval.name = ""
    c.data.eval.revision = ""
    c.data.eval.hf_commit = ""  # set by launch.train: what launch.eval reads the rows at
    c.data.eval.prompt_field = "prompt"
    c.data.eval.num = 200  # held-out prompts per evaluation
    c.data.eval.digits = 2
    c.data.eval.ops = "+"
    c.data.eval.split = "eval"
    c.data.eval.seed = 1

    # Every field of rl.losses.LossConfig, rl.learner.LearnerConfig, sampling.engine.EngineConfig
    # and sampling.distribution.SamplingParams is set here under its own name
    # (launch.validate.from_config maps them): rl and optim -> the learner, sampling -> the sampler.
    c.rl = ml_collections.ConfigDict()
    c.rl.num_generations = 8  # G completions per prompt
    c.rl.rewards = {"arithmetic_exact": 1.0}  # reward name -> weight (rl/rewards.py)
    c.rl.advantage = "group_std"  # group_std | group_mean (Dr.GRPO) | batch_std
    c.rl.advantage_eps = 1e-6  # added to the std
    c.rl.policy_loss = "ppo_clip"  # ppo_clip | dual_clip | gspo | cispo
    c.rl.eps_low = 0.2  # clip the ratio below at 1 - eps_low (ppo_clip, dual_clip, cispo)
    c.rl.eps_high = 0.28  # clip above at 1 + eps_high (> eps_low: DAPO clip-higher)
    c.rl.dual_clip_c = 3.0  # dual_clip: for A < 0 the loss is at most c * |A|
    c.rl.gspo_eps_low = 3e-4  # gspo: clip range of the length-normalised sequence ratio, below ...
    c.rl.gspo_eps_high = 4e-4  # ... and above
    c.rl.aggregation = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum | ...
    # ... drgrpo_constant (Dr. GRPO: sum / (sequences * max_new_tokens)); rl/losses.py aggregate
    c.rl.kl_coef = 0.0  # beta; 0 = no reference model is loaded or run
    c.rl.kl_estimator = "k3"  # loss: k3 (grad KL(ref||pi)) | k2 (grad KL(pi||ref)); reward: k1
    c.rl.kl_in = "loss"  # "loss": + beta * KL in the loss | "reward": - beta * sum_t k1 in rewards
    c.rl.kl_clamp = 10.0  # |log ref - log pi| per token is clamped to this before any estimator
    c.rl.entropy_coef = 0.0  # entropy bonus (entropy of the tempered full softmax)
    # Sampler-vs-learner mismatch correction (rl/mismatch.py, README "Mismatch corrections"):
    # auto = tis when sampling.cache_dtype or weights_dtype is int8 or float8_e4m3fn (and
    # old_logp="recompute"), else none; resolved when the config is validated
    c.rl.is_correction = "auto"  # none | tis | mis | icepop | auto (above)
    c.rl.is_level = "token"  # ratio per token | "sequence" (product) | "geometric" (mean of logs)
    c.rl.is_cap = 2.0  # tis: weight = min(ratio, is_cap)
    c.rl.mis_low = 0.5  # mis, icepop: tokens (or sequences) with ratio outside [mis_low, ...
    c.rl.mis_high = 2.0  # ... mis_high] get no policy loss (icepop weighs those inside by ratio)
    # DPPO trust region, pi vs pi_old: tv (prob.) and log (log-prob.) mask a token with A > 0 that
    # moved up by more than high, or with A <= 0 down by more than low; abs_log (two-sided) one
    # whose log pi - log pi_old left [-low, high] whatever A (|d| > delta when low = high = delta)
    c.rl.trust_region = "none"  # none | tv | log | abs_log (above)
    c.rl.trust_region_low = 0.2  # the band's lower half-width (above; prime-rl: 0.2)
    c.rl.trust_region_high = 0.2  # the band's upper half-width (above; prime-rl: 0.2)
    c.rl.old_logp = "recompute"  # π_old: recompute (learner) | sampler (bypass)
    c.rl.routing_replay = "none"  # MoE: none | rollout (learner uses the sampler's experts)
    # MoE load-balancing loss in the GRPO loss (rl/router.py): off by default, as verl's Megatron
    # bridge sets for RL and transformers does unless output_router_logits
    c.rl.router_aux_loss_coef = 0.0  # its coefficient; None = config.json's router_aux_loss_coef
    c.rl.num_iterations = 1  # μ: passes over each rollout
    c.rl.minibatches = 1  # optimizer steps per pass
    c.rl.micro_batches = 1  # gradient accumulation chunks per optimizer step
    c.rl.pack = True  # pack several sequences per learner row (segment ids); False: one per row
    c.rl.logprob_chunk = 128  # sequence positions per vocabulary projection in the learner
    c.rl.overlong_buffer = 0  # DAPO soft overlong penalty: ramp over this many last tokens (0 off)
    c.rl.overlong_penalty = 1.0  # penalty at the length limit
    c.rl.mask_truncated = False  # DAPO: truncated completions get no loss
    c.rl.dynamic_sampling = False  # DAPO: drop zero-variance groups and sample more
    c.rl.dynamic_sampling_max_tries = 3  # sampling rounds per step at most
    c.rl.reward_timeout_s = 60.0  # a reward call running longer scores 0 (counted); 0 = no limit
    # Partial rollouts (rl/partial.py): episodes not ended when B groups are complete stay parked,
    # KV and all, across the learner step and go on under the new weights; decoupled PPO
    # corrects for the older policies (needs is_correction tis, mis or icepop: auto resolves to
    # none unless the rollout is quantised).
    c.rl.partial_rollouts = False
    c.rl.extra_groups = 4  # groups in flight beyond B (over-provisioning), 1..B
    c.rl.max_staleness = 4  # eta: no token older than this many policy versions is trained
    c.rl.refresh_kv_on_update = False  # re-prefill a carried episode's history under new weights

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 2e-4  # peak AdamW learning rate
    c.optim.warmup_steps = 5  # linear warmup from 0
    c.optim.decay_steps = 0  # cosine decay length after warmup (0 = constant)
    c.optim.end_lr_fraction = 0.1  # the cosine decays to this fraction of the peak
    c.optim.weight_decay = 0.0  # decoupled, matrices only
    c.optim.b1 = 0.9  # AdamW first-moment decay
    c.optim.b2 = 0.999  # AdamW second-moment decay
    c.optim.max_grad_norm = 1.0  # global-norm clipping (0 = off)
    c.optim.grad_reduce_dtype = "float32"  # weight gradients' sum over devices (or model.dtype)

    c.sampling = ml_collections.ConfigDict()
    c.sampling.temperature = 1.0  # rollout temperature (> 0); the learner scores with the same
    c.sampling.top_k = 0  # 0 = off (RL default: the learner then sees the exact distribution)
    c.sampling.top_p = 1.0  # 1.0 = off
    c.sampling.max_new_tokens = 5  # completion budget (answer + end token)
    c.sampling.min_new_tokens = 0  # stop ids are banned before this many tokens (the learner too)
    c.sampling.stop_ids = ()  # token ids that end a completion, besides the tokenizer's end ids
    c.sampling.num_slots = 128  # sequences decoded together
    c.sampling.page_size = 8  # tokens per KV page
    c.sampling.num_pages = 512  # KV pages in the pool (page 0 is reserved)
    c.sampling.steps_per_call = 5  # decode steps per jitted generate call
    c.sampling.max_prompt_len = 8  # longest prompt (tokens); longer prompts are an error
    # paged attention: auto | cpu_kernel | blockwise | reference | pallas_gpu | pallas_tpu
    c.sampling.backend = "auto"  # auto: the fastest that lowers for this platform, shape and mesh
    c.sampling.cache_dtype = ""  # KV cache dtype; "" = model.dtype; int8 / float8_e4m3fn: + scales
    # "" decodes from the training params (no copy); "bfloat16" (= model.dtype) decodes from a
    # bf16 copy made once per rollout: less HBM traffic per step, +2 bytes/param during rollouts;
    # "int8" / "float8_e4m3fn": that copy with the block projections quantised per output
    # channel and int8 / fp8 matmuls, activations per token (models/quant.py; either layout)
    c.sampling.weights_dtype = ""  # "", model.dtype, int8 or float8_e4m3fn (see above)
    # The weights decoding reads, made once per rollout and freed before learning:
    # "tensor" = a copy in model.dtype split over `tensor` only (replicated over data x fsdp):
    #   each device decodes its own slots, and a decode step sends nothing over data or fsdp
    #   (+ bytes(model.dtype) x params / tensor per device while sampling; docs/performance.md);
    # "training" = the training arrays as they lie (no copy; every decode step all-reduces
    #   partial sums of every slot over fsdp). Chosen by launch.bench mesh's collective bytes.
    c.sampling.weights_layout = "tensor"  # "tensor" or "training" (see above)
    # KV pages of an admitted episode: "demand" = taken as it grows (vLLM's scheduler); a shard
    #   that runs out preempts its newest sequences, whose pages are freed and whose history is
    #   recomputed (chunked prefill) when they resume: same tokens, log-probs to ~1e-6
    #   (rollout/preemptions, rollout/recomputed_tokens); "budget" = the worst case of its whole
    #   budget reserved at admission: fewer episodes at once, never preempted.
    c.sampling.reserve = "demand"  # "demand" or "budget" (see above)
    c.sampling.kv_watermark = 0.01  # "demand": a new admission leaves this fraction of a pool free
    c.sampling.release_kv_between_phases = True  # free the KV cache before learning
    # Prompts and observations are prefilled this many tokens at a time, each chunk attending
    # over the KV pages where they lie: prefill memory then stays flat in the prompt length.
    c.sampling.prefill_chunk = 512  # 0 = one dense pass over the whole prompt (the reference)

    # Multi-turn episodes (rl/envs, README "Tools and multi-turn episodes"): the model's turn ends
    # on a stop id, the environment answers with observation tokens, decoding resumes.
    c.env = ml_collections.ConfigDict()
    c.env.name = ""  # "" = single-turn completions scored by rl.rewards | calculator | code_tests
    c.env.max_turns = 4  # model turns per episode at most
    c.env.max_turn_tokens = 0  # model tokens per turn at most (0 = sampling.max_new_tokens)
    c.env.max_tool_seconds = 30.0  # tool (env.step) wall time per episode before it is ended
    c.env.tool_workers = 8  # tool calls running in parallel (threads; sandboxed processes)
    # Partial rollouts: a tool's answer (and a multi-turn group's grading, for dynamic sampling)
    # is taken this many decode calls after the call that ended its turn, waited for if not done
    # by then, so that a run repeats itself whatever the tools' latency (sampling.episodes,
    # "Logical time"); 0 = as soon as done (wall-clock: such runs do not repeat themselves)
    c.env.tool_answer_calls = 4
    c.env.max_observation_chars = 1000  # tool output / test failures shown to the model, at most
    # The repository environment (env.name="repo", rl/envs/repo/env.py, docs/repo_env.md):
    c.env.command_timeout_s = 30.0  # repo: wall-clock seconds per bash command
    c.env.max_tool_calls = 40  # repo: tool calls per episode; the episode ends there
    c.env.workspace_bytes = 256 << 20  # repo: disk bytes of an episode's workspace (tmpfs size)
    c.env.test_timeout_s = 300.0  # repo: the graded test run; past it = harness timeout (masked)
    c.env.per_test_timeout_s = 30  # repo: seconds per graded test (its alarm fails that test)
    c.env.setup_timeout_s = 300.0  # repo: a record's `setup` command; failing it is masked
    c.env.sandbox_memory_bytes = 4 << 30  # repo: address space per sandboxed process
    c.env.sandbox_processes = 64  # repo: processes per sandbox (a fork bomb stops here)
    # Model-written code (code_tests, repo, python_tests; docs/sandbox.md): auto = bubblewrap or
    # refuse to start, bwrap = the same, rlimits = the weak mode without namespaces (uid as root)
    c.env.isolation = "auto"  # auto | bwrap | rlimits
    c.env.images_dir = ""  # repo: where records' image names are unpacked (launch.images unpack)
    # A run whose episodes are masked (infrastructure errors: no sandbox, a harness that cannot
    # run) trains on nothing: it stops, naming the most frequent error, after max_masked_steps
    # steps in a row with at least this fraction of their episodes masked.
    c.env.max_masked_fraction = 1.0  # in (0, 1]; 1.0 = every episode of the step
    c.env.max_masked_steps = 2  # >= 1
    # sampling.max_new_tokens is the episode's budget after the prompt: model + observation tokens.

    c.eval = ml_collections.ConfigDict()
    c.eval.pass_k = 4  # pass@k reported with the unbiased estimator ...
    c.eval.pass_n = 8  # ... from n >= k samples per prompt
    c.eval.temperature = 1.0  # sampling temperature for pass@k
    c.eval.reward = "arithmetic_exact"  # 0/1 reward that defines a correct answer
    return c
