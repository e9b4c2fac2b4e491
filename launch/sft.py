"""Supervised warm start for the CPU demo: `python -m launch.sft`.

    python -m launch.sft --out configs/assets/arithmetic_sft      # remakes the shipped warm start

Trains a tiny Llama-family, character-level transformer on `a+b=` -> `sum<eos>` (2-digit operands)
with teacher forcing. The data teach the arithmetic and also a bad habit (`encode_examples`): on
answers ending in 1-7 a spurious "0" usually follows. Greedy decoding follows the habit, so the
held-out greedy accuracy is about 30% (between 10% and 60% leaves GRPO room to show), while
sampling still produces the clean answer often enough for GRPO to learn from. Writes an HF
checkpoint directory (`models.hf.save_hf`) with the tokenizer beside the weights
(`char_tokenizer.json`, over `rl.tasks.ARITHMETIC_ALPHABET`, so every operator is encodable), which
`configs/default.py` loads like any other.

Simplifications: the loss is the mean negative log-likelihood of the answer tokens, computed with
the learner's own chunked log-prob function (`rl.logprobs`); one device; no checkpoints (2000
steps take about 4 minutes on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.config import ModelConfig
from models.hf import save_hf
from models.hf_config import GenerationIds
from models.sharding import init_params, make_mesh
from models.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer
from rl.logprobs import token_logprobs
from rl.tasks import ARITHMETIC_ALPHABET, arithmetic_records
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig


def model_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(
        family="llama", vocab_size=vocab_size, d_model=128, d_ff=384, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0, tie_embeddings=True,
        norm_eps=1e-5, max_position_embeddings=64,
    )  # fmt: skip


def encode_examples(records, tok, seq_len: int, ramble_prob: float, ramble_digits: str, seed: int):
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


def greedy_accuracy(graphdef, params, records, tok, max_new: int) -> float:
    cfg = nnx.merge(graphdef, params).cfg
    ecfg = EngineConfig(num_slots=128, page_size=8, num_pages=512, max_prompt_len=16,
                        max_new_tokens=max_new, steps_per_call=max_new, stop_ids=tok.eos_ids)  # fmt: skip
    engine = Engine(cfg, graphdef, ecfg, SamplingParams(temperature=0.0))
    prompts = [tok.encode(r["prompt"]) for r in records]
    _, results = engine.generate_all(params, engine.init_state(), prompts)
    answers = [tok.decode(group[0].tokens) for group in results]
    return float(np.mean([a == r["answer"] for a, r in zip(answers, records)]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="HF checkpoint directory to write")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--eval_size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ramble_prob", type=float, default=0.8, help="see encode_examples")
    p.add_argument("--ramble_digits", default="1234567", help="answer endings with the habit")
    args = p.parse_args(argv)

    tok = CharTokenizer(ARITHMETIC_ALPHABET)
    cfg = model_config(tok.vocab_size)
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(cfg, mesh, seed=args.seed)
    train = arithmetic_records(args.seed, args.steps * args.batch_size, args.digits)
    held_out = arithmetic_records(args.seed + 1, args.eval_size, args.digits, split="eval")
    seq_len = 2 * args.digits + 2 + args.digits + 3  # "a+b=" + answer (<= digits+1) + "0" + eos
    tokens, valid, mask = encode_examples(
        train, tok, seq_len, args.ramble_prob, args.ramble_digits, args.seed
    )
    positions = np.tile(np.arange(seq_len, dtype=np.int32), (args.batch_size, 1))
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0, args.learning_rate, 20, args.steps))
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
    for i in range(args.steps):
        sl = slice(i * args.batch_size, (i + 1) * args.batch_size)
        params, opt_state, loss = step(params, opt_state, tokens[sl], valid[sl], mask[sl])
        loss = float(loss)  # block every step
        if (i + 1) % 50 == 0 or i + 1 == args.steps:
            print(f"step {i + 1}/{args.steps}: loss {loss:.4f}", file=sys.stderr)
    acc = greedy_accuracy(graphdef, params, held_out, tok, args.digits + 3)
    save_hf(
        args.out,
        cfg,
        params,
        GenerationIds(eos_ids=tok.eos_ids, pad_id=tok.pad_id, bos_id=tok.bos_id),
    )
    with open(os.path.join(args.out, CHAR_TOKENIZER_FILE), "w") as f:
        json.dump(tok.to_dict(), f, indent=2)
    print(f"held-out greedy accuracy {acc:.3f} after {args.steps} steps "
          f"({time.perf_counter() - start:.0f} s); wrote {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
