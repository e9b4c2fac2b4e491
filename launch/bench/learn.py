"""Learner benchmark: `python -m launch.bench learn [--output bench_learn.json]`.

One jitted GRPO optimizer step (`rl.learner.Learner.step`: forward, backward, AdamW) of a
random-init Qwen2-style model of ~25M parameters ("bench-learn": V 4096, D 512, 8 layers, 8 heads,
2 KV heads, H 64, F 1536, tied embeddings), one device, f32, measured in one process:

- `tokens_per_s`: learner tokens/s on full rows of 512 tokens (every token scored);
- `flops_per_token`: 6 x params + attention, 12 x layers x heads x head_dim x 512 (the dense
  attention computes all 512 x 512 scores, forward and backward: PaLM's count);
- `mfu`: tokens_per_s x flops_per_token / the f32 matmul peak (square matmuls of 1024 and 2048,
  timed interleaved with the steps);
- `packed_tokens_per_s` / `padded_tokens_per_s`: real (non-padding) tokens/s of a step over the
  same long-tailed sequences (prompt 64, completions 8..448 from a seeded log-normal), packed
  into rows (`rl.packing`) and one per row, padded to 512; `packed_speedup` is their ratio.

Timing: every step runs once first (compile), then the median of `--reps` runs, the runs
alternating so that load from other processes hits them alike.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from launch.bench.common import TINY, finish, integer, interleaved, parse, parser, square_matmuls
from models.config import ModelConfig
from models.sharding import DEFAULT_RULES, init_params, make_mesh, param_count, state_shardings
from rl.groups import Group
from rl.learner import Learner, LearnerConfig, batch_sharding
from rl.losses import LossConfig
from rl.packing import build_batch
from sampling.requests import Completion

LEARN = dict(vocab_size=4096, d_model=512, d_ff=1536, num_layers=8, num_heads=8)
LEARN.update(num_kv_heads=2, head_dim=64)


def skewed_lengths(n: int, low: int, high: int, seed: int = 0) -> np.ndarray:
    """n completion lengths in [low, high], long-tailed: log-normal with median ~ 4 x low, so a
    few sequences come near the budget and most are far shorter (reasoning / coding rollouts)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(4 * low), 1.1, n), low, high).astype(int)
    lengths[0] = high  # the budget is reached at least once
    return lengths


def groups_of(prompt_len: int, lengths, vocab: int, g: int = 8, seed: int = 0) -> list[Group]:
    """Groups of g scored completions with random tokens (the learner's cost does not depend on
    their values)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(0, len(lengths), g):
        prompt = rng.integers(1, vocab, prompt_len).tolist()
        cs = [
            Completion(rng.integers(1, vocab, n).tolist(), [-1.0] * n, "stop", int(n))
            for n in lengths[i : i + g]
        ]
        out.append(Group({}, prompt, cs, [], np.zeros(len(cs), np.float32), {}))
    return out


def _step_runner(learner, state_box, batch):
    def run():
        state_box[0], metrics = learner.step(state_box[0], batch)
        jax.device_get(metrics["loss"])  # block every step

    return run


def bench_learn(args) -> dict:
    shape = TINY if args.quick else LEARN
    seq = 64 if args.quick else 512
    rows = 2 if args.quick else args.rows
    cfg = ModelConfig(family="qwen2", qkv_bias=True, tie_embeddings=True, **shape)
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(cfg, mesh, seed=0)
    n_params = param_count(params)
    shardings = state_shardings(params, mesh, DEFAULT_RULES)
    lcfg = LearnerConfig(learning_rate=1e-5, loss=LossConfig(kl_coef=0.0))
    learner = Learner(lcfg, graphdef, shardings)
    box = [learner.init_state(params)]
    place = functools.partial(jax.device_put, device=batch_sharding(mesh, DEFAULT_RULES))

    # Full rows: every position real and scored.
    prompt = seq // 8
    full = groups_of(prompt, [seq - prompt] * rows, cfg.vocab_size, g=rows)
    batch, _ = build_batch(full, seq, 0, pack=False)
    runs = {"full": _step_runner(learner, box, place(_with_advantages(batch)))}
    # Long-tailed sequences, packed and padded.
    n_seqs = 8 if args.quick else args.skewed_seqs
    lengths = skewed_lengths(n_seqs, 2 if args.quick else 8, seq - prompt, seed=args.seed)
    skewed = groups_of(prompt, lengths, cfg.vocab_size)
    real = int(sum(prompt + lengths))
    layouts = {}
    for name, pack in (("packed", True), ("padded", False)):
        batch, layouts[name] = build_batch(skewed, seq, 0, pack=pack)
        runs[name] = _step_runner(learner, box, place(_with_advantages(batch)))
    sizes = (256, 512) if args.quick else (1024, 2048)
    runs.update(square_matmuls(sizes))  # the peak, timed alongside: load hits both alike
    t = interleaved(runs, args.reps)
    peak = max(2 * n**3 / t[f"matmul_{n}"] for n in sizes)
    tps = rows * seq / t["full"]
    flops = 6 * n_params + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq
    return {
        "device": jax.devices()[0].platform,
        "params": n_params,
        "model": shape,
        "seq_len": seq,
        "rows": rows,
        "tokens_per_s": tps,
        "flops_per_token": flops,
        "matmul_peak_flops": peak,
        "mfu": tps * flops / peak,
        "step_seconds": t["full"],
        "skewed_lengths": dict(
            num=len(lengths), mean=float(lengths.mean()), max=int(lengths.max()), prompt_len=prompt
        ),
        "packed_rows": layouts["packed"].rows,
        "padded_rows": layouts["padded"].rows,
        "packed_tokens_per_s": real / t["packed"],
        "padded_tokens_per_s": real / t["padded"],
        "packed_speedup": t["padded"] / t["packed"],
    }


def _with_advantages(batch):
    """Alternating +1 / -1 advantages on the scored positions (a nonzero, finite gradient)."""
    sign = np.where(np.arange(batch.loss_mask.shape[0]) % 2, 1.0, -1.0)[:, None]
    return batch.replace(advantages=(batch.loss_mask * sign).astype(np.float32))


def table(r: dict) -> str:
    rows = [
        (f"learner step, {r['rows']} x {r['seq_len']} tokens", f"{r['tokens_per_s']:.0f} tok/s"),
        ("FLOPs per token", f"{r['flops_per_token'] / 1e6:.1f} M"),
        ("matmul peak (f32, measured)", f"{r['matmul_peak_flops'] / 1e9:.1f} GFLOP/s"),
        ("MFU", f"{r['mfu']:.1%}"),
        (f"packed ({r['packed_rows']} rows)", f"{r['packed_tokens_per_s']:.0f} real tok/s"),
        (f"padded ({r['padded_rows']} rows)", f"{r['padded_tokens_per_s']:.0f} real tok/s"),
        ("packed / padded", f"{r['packed_speedup']:.2f}x"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main(argv) -> int:
    p = parser("learn", __doc__)
    p.add_argument("--quick", action="store_true", help="tiny model and workload (tests)")
    p.add_argument("--rows", type=integer(), default=4, help="rows of 512 tokens per step")
    p.add_argument("--skewed_seqs", type=integer(), default=16, help="long-tailed sequences")
    p.add_argument("--seed", type=integer(0), default=0, help="seed of the lengths")
    p.add_argument("--reps", type=integer(), default=3, help="timed repetitions (median)")
    args = parse(p, argv)
    r = bench_learn(args)
    return finish(args, r, table(r))
