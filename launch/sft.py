r"""Supervised warm starts for the CPU demos: `python -m launch.sft`.

    python -m launch.sft --out configs/assets/arithmetic_sft              # the GRPO demo's
    python -m launch.sft --task calc --out configs/assets/calc_sft        # the tool-use demo's
    python -m launch.sft --task repo_fix --out configs/assets/repo_fix_sft  # the repository demo's
    python -m launch.sft --moe --steps 1000 --out configs/assets/arithmetic_moe_sft  # the MoE demo's,
    python -m launch.sft --moe --init configs/assets/arithmetic_moe_sft --steps 600 \
        --learning_rate 2e-3 --seed 1 --out DIR    # then 600 more steps (README: Mixtures of experts)

Trains a tiny Llama-family, character-level transformer with teacher forcing on one of three tasks
(`repo_fix`, scripted episodes of the CPU repository demo, is described in launch/sft_repo_fix.py);
with `--moe` a Qwen3-MoE of the same width and depth (every layer 8 experts, 2 per token):

- `arithmetic` (default): `a+b=` -> `sum<eos>` (2-digit operands). The data teach the arithmetic
  and also a bad habit (`encode_arithmetic`): on answers ending in 1-7 a spurious "0" usually
  follows. Greedy decoding follows the habit, so the held-out greedy accuracy is about 30%
  (between 10% and 60% leaves GRPO room to show), while sampling still produces the clean answer
  often enough for GRPO to learn from.
- `calc`: `a*b=` with 3-digit operands, as multi-turn episodes with a calculator tool (the format
  is in `rl.tasks`). Each example calls the tool with probability `--tool_prob`
  ("123*456=<123*456>56088;56088<eos>", the observation "56088;" not trained on) and answers
  directly otherwise ("123*456=56088<eos>"). A model this small cannot multiply 3-digit numbers,
  so its direct answers are mostly wrong, while it copies the calculator's result reliably. The
  tool-call decision is learned as a coin of bias ~tool_prob, independent of the prompt: sampling
  calls the tool on about that fraction of prompts, greedy decoding mostly answers directly (its
  likeliest first digit beats "<"), so the held-out greedy accuracy is low and GRPO has to learn
  that calling the tool pays. The final line reports greedy and sampled (T=1) tool-call rates and
  episode accuracies, the greedy direct-answer accuracy and the tool-path accuracy (call and
  observation forced, the answer decoded greedily). The shipped warm start (tool_prob 0.3, 1200
  steps): greedy calls 5.5% and scores 5.5% (direct answers 0%), sampling calls 26% and scores
  24%, the tool path 96.5%. The greedy call rate is the fragile number: it falls as training
  sharpens the first digit and rises steeply with tool_prob (0.35 at 1000 steps: greedy 29%).

Writes an HF checkpoint directory (`models.hf.save_hf`) with the tokenizer beside the weights
(`char_tokenizer.json`, over `rl.tasks.ARITHMETIC_ALPHABET` or `CALC_ALPHABET`, so every operator
is encodable), which a config loads like any other.

Simplifications: the loss is the mean negative log-likelihood of the model's tokens (answers, tool
calls, end tokens), computed with the learner's own chunked log-prob function (`rl.logprobs`); one
device; no checkpoints (on a 2-core CPU, arithmetic's 2000 steps take about 4 minutes, calc's
1200 steps of 31-token episodes about 5).
The held-out evaluation of `calc` decodes the two turns of a tool call by re-prefilling the whole
sequence for the second turn; the RL environment instead keeps the episode's pages.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from launch import sft_repo_fix
from launch.cli import ArgumentParser
from models.config import ModelConfig
from models.hf import load_hf, save_hf
from models.hf_config import GenerationIds
from models.sharding import init_params, make_mesh
from models.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer
from rl.envs.repo_fix_tasks import REPO_FIX_ALPHABET
from rl.logprobs import token_logprobs
from rl.tasks import (
    ARITHMETIC_ALPHABET,
    CALC_ALPHABET,
    CALL_CLOSE,
    CALL_OPEN,
    arithmetic_records,
    calc_observation,
)
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.episodes import generate_all

# Per-task defaults: alphabet, operand digits, operators, optimizer steps.
TASKS = {
    "arithmetic": dict(alphabet=ARITHMETIC_ALPHABET, digits=2, ops="+", steps=2000),
    "calc": dict(alphabet=CALC_ALPHABET, digits=3, ops="*", steps=1200),
    "repo_fix": dict(alphabet=REPO_FIX_ALPHABET, digits=0, ops="", steps=600),
}


def model_config(vocab_size: int, max_positions: int = 64, moe: bool = False) -> ModelConfig:
    """The tiny Llama of the demos, or with `moe` a Qwen3-MoE of the same width and depth whose
    every layer has 8 experts of width 96, 2 per token (models/moe.py)."""
    dense = ModelConfig(
        family="llama",
        vocab_size=vocab_size,
        d_model=128,
        d_ff=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        tie_embeddings=True,
        norm_eps=1e-5,
        max_position_embeddings=max_positions,
    )
    if not moe:
        return dense
    return dataclasses.replace(
        dense,
        family="qwen3_moe",
        qk_norm=True,  # Qwen3's attention
        num_experts=8,  # E
        experts_per_token=2,  # k
        expert_d_ff=96,  # each expert's width
        norm_topk_prob=True,
        moe_layers=tuple(range(dense.num_layers)),
    )


def encode_arithmetic(
    records, tok, seq_len: int, ramble_prob: float, ramble_digits: str, seed: int
):
    """tokens/valid [N,T], loss_mask [N,T-1] on the answer and its end token.

    When an answer ends in one of `ramble_digits`, it is followed with probability `ramble_prob`
    by a spurious "0" before the end token. The warm start learns the arithmetic and also this
    input-dependent bad habit, which greedy decoding follows (probability > 1/2) and which the
    exact-answer reward punishes: GRPO has to remove it, and sampling finds the cure often enough.
    """
    rng = np.random.default_rng(seed)
    n = len(records)
    tokens = np.zeros((n, seq_len), np.int32)
    mask = np.zeros((n, seq_len - 1), np.float32)
    for i, r in enumerate(records):
        p = tok.encode(r["prompt"])
        habit = r["answer"][-1] in ramble_digits
        ramble = "0" if habit and rng.random() < ramble_prob else ""
        a = tok.encode(r["answer"] + ramble) + [tok.eos_ids[0]]
        tokens[i, : len(p) + len(a)] = p + a
        mask[i, len(p) - 1 : len(p) + len(a) - 1] = 1.0
    return tokens, tokens != 0, mask


def calc_example(record: dict, tok, use_tool: bool) -> tuple[list[int], list[int]]:
    """Token ids of one calculator episode and a per-token mask, 1 on the model's own tokens (the
    tool call "<a*b>" and the answer with its end token), 0 on the prompt and the observation."""
    expr = record["prompt"].removesuffix("=")
    parts = [(record["prompt"], 0)]
    if use_tool:
        parts += [(CALL_OPEN + expr + CALL_CLOSE, 1), (calc_observation(expr), 0)]
    ids, mask = [], []
    for text, trained in parts:
        ids += tok.encode(text)
        mask += [trained] * len(text)
    answer = tok.encode(record["answer"]) + [tok.eos_ids[0]]
    return ids + answer, mask + [1] * len(answer)


def encode_calc(records, tok, seq_len: int, tool_prob: float, seed: int):
    """tokens/valid [N,T], loss_mask [N,T-1]: `calc_example`s, each calling the tool with
    probability `tool_prob`; loss_mask[:, t] scores token t+1."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(records), seq_len), np.int32)
    mask = np.zeros((len(records), seq_len - 1), np.float32)
    for i, r in enumerate(records):
        ids, m = calc_example(r, tok, bool(rng.random() < tool_prob))
        if len(ids) > seq_len:
            raise ValueError(f"episode of {len(ids)} tokens > seq_len={seq_len}: {r}")
        tokens[i, : len(ids)] = ids
        mask[i, : len(ids) - 1] = m[1:]
    return tokens, tokens != 0, mask


def greedy_accuracy(graphdef, params, records, tok, max_new: int) -> float:
    cfg = nnx.merge(graphdef, params).cfg
    ecfg = EngineConfig(
        num_slots=128,
        page_size=8,
        num_pages=512,
        max_prompt_len=16,
        max_new_tokens=max_new,
        steps_per_call=max_new,
        stop_ids=tok.eos_ids,
    )
    engine = Engine(cfg, graphdef, ecfg, SamplingParams(temperature=0.0))
    prompts = [tok.encode(r["prompt"]) for r in records]
    _, results = generate_all(engine, params, engine.init_state(), prompts)
    answers = [tok.decode(group[0].tokens) for group in results]
    return float(np.mean([a == r["answer"] for a, r in zip(answers, records)]))


def calc_report(graphdef, params, records, tok, digits: int, samples: int, seed: int) -> dict:
    """Held-out tool use and accuracy of a calc warm start (see the module docstring); episodes
    are decoded as the RL environment runs them: a turn that ends on ">" gets the observation."""
    cfg = nnx.merge(graphdef, params).cfg
    eos, close = tok.eos_ids[0], tok.encode(CALL_CLOSE, special=True)[0]
    turn = 2 * digits + 3  # the longest model turn: "<a*b>"
    ecfg = EngineConfig(
        num_slots=128,
        page_size=8,
        num_pages=1024,
        max_prompt_len=8 * digits + 8,
        max_new_tokens=turn,
        steps_per_call=turn,
        stop_ids=(eos, close),
    )
    prompts = [tok.encode(r["prompt"]) for r in records]
    wants = [tok.encode(r["answer"]) + [eos] for r in records]

    def decode(engine, prompts, g=1):
        _, results = generate_all(engine, params, engine.init_state(), prompts, g, seed=seed)
        return [[c.tokens for c in group] for group in results]

    def observation(turn_ids):  # as rl/envs/calculator.py: the text after the last "<"
        _, opened, expr = tok.decode(turn_ids)[:-1].rpartition(CALL_OPEN)
        return tok.encode(calc_observation(expr if opened else ""))

    out = {}
    greedy = Engine(cfg, graphdef, ecfg, SamplingParams(temperature=0.0))
    sampled = Engine(cfg, graphdef, ecfg, SamplingParams(temperature=1.0))
    for name, engine, g in (("greedy", greedy, 1), ("sampled", sampled, samples)):
        first = [(i, t) for i, group in enumerate(decode(engine, prompts, g)) for t in group]
        calls = [k for k, (_, t) in enumerate(first) if t[-1:] == [close]]
        second = decode(
            engine, [prompts[first[k][0]] + first[k][1] + observation(first[k][1]) for k in calls]
        )
        final = [t for _, t in first]
        for k, group in zip(calls, second):
            final[k] = group[0]
        correct = [f == wants[i] for f, (i, _) in zip(final, first)]
        out[f"{name}_call_rate"] = len(calls) / len(first)
        out[f"{name}_episode_acc"] = float(np.mean(correct))
        if name == "greedy":
            direct = [c for k, c in enumerate(correct) if k not in calls]
            out["greedy_direct_acc"] = float(np.mean(direct)) if direct else 0.0
    forced = [
        p
        + tok.encode(CALL_OPEN + r["prompt"][:-1] + CALL_CLOSE + calc_observation(r["prompt"][:-1]))
        for p, r in zip(prompts, records)
    ]
    answers = decode(greedy, forced)
    out["tool_path_acc"] = float(np.mean([a[0] == w for a, w in zip(answers, wants)]))
    return out


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="python -m launch.sft",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--out", required=True, help="HF checkpoint directory to write")
    p.add_argument("--task", default="arithmetic", choices=sorted(TASKS))
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (task default)")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--digits", type=int, default=None, help="digits per operand (task default)")
    p.add_argument("--eval_size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ramble_prob", type=float, default=0.8, help="arithmetic: see encode_arithmetic"
    )
    p.add_argument("--ramble_digits", default="1234567", help="arithmetic: endings with the habit")
    p.add_argument("--tool_prob", type=float, default=0.3, help="calc: share of tool-path examples")
    p.add_argument("--eval_samples", type=int, default=4, help="calc: T=1 samples per prompt")
    p.add_argument("--init", default="", help="start from this HF checkpoint of the same model")
    p.add_argument(
        "--moe",
        action="store_true",
        help="a tiny Qwen3-MoE (8 experts, top-2): configs/moe_tiny.py",
    )
    args = p.parse_args(argv)
    task = TASKS[args.task]
    steps = task["steps"] if args.steps is None else args.steps
    digits = task["digits"] if args.digits is None else args.digits

    tok = CharTokenizer(task["alphabet"])
    repo_fix = args.task == "repo_fix"
    cfg = model_config(tok.vocab_size, sft_repo_fix.MAX_POSITIONS if repo_fix else 64, args.moe)
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(cfg, mesh, seed=args.seed)
    if args.init:  # go on from a checkpoint of this same model (e.g. more steps for an asset)
        loaded, graphdef, params, _ = load_hf(args.init, mesh)
        if loaded != cfg:
            raise SystemExit(f"error: --init {args.init}: not the model this task and --moe make")
    if repo_fix:
        train = sft_repo_fix.records(args.seed, steps * args.batch_size, "train")
        held_out = sft_repo_fix.records(args.seed + 1, args.eval_size, "eval")
    else:
        train = arithmetic_records(args.seed, steps * args.batch_size, digits, task["ops"])
        held_out = arithmetic_records(args.seed + 1, args.eval_size, digits, task["ops"], "eval")
    if repo_fix:
        seq_len = sft_repo_fix.SEQ_LEN
        data = sft_repo_fix.encode(train, tok, seq_len, args.seed)
    elif args.task == "arithmetic":
        seq_len = 2 * digits + 2 + digits + 3  # "a+b=" + answer (<= digits+1) + "0" + eos
        data = encode_arithmetic(
            train, tok, seq_len, args.ramble_prob, args.ramble_digits, args.seed
        )
    else:
        seq_len = 8 * digits + 8  # "a*b=" + "<a*b>" + "result;" + "result" + eos
        data = encode_calc(train, tok, seq_len, args.tool_prob, args.seed)
    tokens, valid, mask = data
    positions = np.tile(np.arange(seq_len, dtype=np.int32), (args.batch_size, 1))
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0, args.learning_rate, 20, steps))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens, valid, mask):
        def loss_fn(params):
            model = nnx.merge(graphdef, params)
            logp = token_logprobs(model, tokens, positions, valid, SamplingParams(), 16).logp
            return -jnp.sum(logp * mask) / jnp.sum(mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    start = time.perf_counter()
    for i in range(steps):
        sl = slice(i * args.batch_size, (i + 1) * args.batch_size)
        params, opt_state, loss = step(params, opt_state, tokens[sl], valid[sl], mask[sl])
        loss = float(loss)  # block every step
        if (i + 1) % 50 == 0 or i + 1 == steps:
            print(f"step {i + 1}/{steps}: loss {loss:.4f}", file=sys.stderr)
    save_hf(  # before the report: a report that fails does not lose the weights
        args.out,
        cfg,
        params,
        GenerationIds(eos_ids=tok.eos_ids, pad_id=tok.pad_id, bos_id=tok.bos_id),
    )
    with open(os.path.join(args.out, CHAR_TOKENIZER_FILE), "w") as f:
        json.dump(tok.to_dict(), f, indent=2)
    if repo_fix:
        r = sft_repo_fix.report(graphdef, params, held_out, tok, args.eval_samples, args.seed)
        result = "held-out " + ", ".join(f"{k} {v:.3f}" for k, v in r.items())
    elif args.task == "arithmetic":
        acc = greedy_accuracy(graphdef, params, held_out, tok, digits + 3)
        result = f"held-out greedy accuracy {acc:.3f}"
    else:
        r = calc_report(graphdef, params, held_out, tok, digits, args.eval_samples, args.seed)
        result = "held-out " + ", ".join(f"{k} {v:.3f}" for k, v in r.items())
    print(f"{result} after {steps} steps ({time.perf_counter() - start:.0f} s); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
