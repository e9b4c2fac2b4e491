"""The sampler's numerics with quantised KV pages and decode weights, against the f32 sampler:
`python -m launch.bench quant [--models arithmetic,llama,qwen2,qwen3,small] [--num_prompts 32]
[--new_tokens 32] [--rows ...] [--output F.json]`.

Models: the CPU demo's warm start (arithmetic: configs/assets/arithmetic_sft, a trained
character-level Llama of 4 layers, d_model 128, on held-out "a+b=" questions), the HF fixtures of
tests/fixtures/hf (llama, qwen2, qwen3: random weights of std 0.1, so logits are spread and
greedy decoding has no near-ties at f32, but small perturbations flip tokens, as the bf16 rows
show; random prompts of 4 to 24 tokens) and a registered bench shape
(`launch.bench.common.SHAPES`, e.g. small), random-initialised and scaled to the fixtures'
statistics (projections and embedding std 0.1, norm scales 1). One device, f32 master weights.

Rows (`ROWS`): a compute dtype, `sampling.weights_dtype` and `sampling.cache_dtype`, each
quantised part alone (the rest f32) and both together (int8 / fp8 rows "both" compute in bf16,
as a rollout on an accelerator does). Per row and model, `num_prompts` prompts, exactly
`new_tokens` new tokens each (no stop id):
- greedy: the fraction of prompts whose first `new_tokens` greedy tokens are those of the f32
  sampler (f32 weights, compute and KV), and (agree) the mean number of tokens before the first
  that differs (a random model's near-ties make one flip likely, and every later token differs);
- KL and max |diff|: the row's sampler draws at temperature 1 (same keys for every row); r =
  log p_f32(token) - log p_row(token) per drawn token, where p_row is the log-prob the sampler
  recorded and p_f32 the f32 model's, teacher-forced on the same tokens (one dense forward pass,
  no pages): KL(row || f32) estimated by k3 = mean(exp(r) - 1 - r) (what the learner logs as the
  sampler-vs-learner KL), and max |r|.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from launch.bench.common import SHAPES, finish, integer, one_of, parse, parser, some_of
from models.hf import load_hf
from models.sharding import init_params, make_mesh
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.episodes import generate_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = ("llama", "qwen2", "qwen3")  # tests/fixtures/hf/<name>
ARITHMETIC = "arithmetic"  # the demo's trained warm start:
ASSET = os.path.join(ROOT, "configs", "assets", "arithmetic_sft")

# name -> (compute dtype, weights_dtype, cache_dtype); "" weights: the params as given.
ROWS = {
    "f32": ("float32", "", "float32"),
    "kv_bf16": ("float32", "", "bfloat16"),
    "kv_int8": ("float32", "", "int8"),
    "kv_fp8": ("float32", "", "float8_e4m3fn"),
    "weights_bf16": ("bfloat16", "", "float32"),
    "weights_int8": ("float32", "int8", "float32"),
    "weights_fp8": ("float32", "float8_e4m3fn", "float32"),
    "both_bf16": ("bfloat16", "", "bfloat16"),
    "both_int8": ("bfloat16", "int8", "int8"),
    "both_fp8": ("bfloat16", "float8_e4m3fn", "float8_e4m3fn"),
}


def load(name: str, mesh):
    """(cfg, graphdef, params) of a fixture or a bench shape (module docstring), f32."""
    if name in (*FIXTURES, ARITHMETIC):
        path = ASSET if name == ARITHMETIC else os.path.join(ROOT, "tests", "fixtures", "hf", name)
        cfg, graphdef, params, _ = load_hf(path, mesh)
        return cfg, graphdef, params
    from models.config import ModelConfig

    cfg = ModelConfig(**SHAPES[name])
    graphdef, params = init_params(cfg, mesh, seed=0)
    # The fixtures' statistics: weights std 0.1 (init 0.02), norm scales 1 (as initialised).
    scale = lambda x: x if x.ndim == 1 else x * 5.0
    return cfg, graphdef, jax.tree.map(scale, params)


def sample(cfg, graphdef, params, row, prompts, new_tokens, temperature, backend):
    """(tokens [n, new], sampler log-probs [n, new]) of one row's sampler."""
    compute, weights, cache = ROWS[row]
    cfg = dataclasses.replace(cfg, dtype=compute)
    plen = max(map(len, prompts))
    page = 8
    per_seq = -(-(plen + new_tokens) // page)
    ecfg = EngineConfig(
        num_slots=len(prompts),
        page_size=page,
        num_pages=len(prompts) * per_seq + 1,
        max_prompt_len=plen,
        max_new_tokens=new_tokens,
        steps_per_call=8,
        backend=backend,
        cache_dtype=cache,
        weights_dtype=weights,
    )
    engine = Engine(cfg, graphdef, ecfg, SamplingParams(temperature))
    _, results = generate_all(engine, params, engine.init_state(), prompts, 1, new_tokens, seed=1)
    tokens = np.array([r[0].tokens for r in results])
    logprobs = np.array([r[0].logprobs for r in results], np.float64)
    assert tokens.shape == (len(prompts), new_tokens)  # no stop ids: exactly new_tokens each
    return tokens, logprobs


def teacher_forced(cfg, graphdef, params, prompts, tokens) -> np.ndarray:
    """log p_f32 [n, new] of `tokens` after each prompt: one dense f32 forward pass over
    prompt + tokens, right-padded (causal: the padding changes no real position)."""
    n, new = tokens.shape
    lens = [len(p) for p in prompts]
    seqs = [list(p) + list(t) for p, t in zip(prompts, tokens)]
    width = max(map(len, seqs))
    ids = np.zeros((n, width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), (n, width))
    model = nnx.merge(graphdef, params)
    logits, _ = jax.jit(lambda m, t, p: m(t, p))(model, jnp.asarray(ids), jnp.asarray(pos))
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)), np.float64)
    # Token j of row i sits at position lens[i] + j, predicted by the logits at the one before.
    at = np.array([[lens[i] + j - 1 for j in range(new)] for i in range(n)])
    return np.take_along_axis(logp[np.arange(n)[:, None], at], tokens[..., None], -1)[..., 0]


def bench_model(name, rows, num_prompts, new_tokens, backend) -> list[dict]:
    mesh = make_mesh({}, devices=jax.devices()[:1])
    cfg, graphdef, params = load(name, mesh)
    rng = np.random.default_rng(0)
    prompts = [
        [int(t) for t in rng.integers(1, cfg.vocab_size, size=rng.integers(4, 25))]
        for _ in range(num_prompts)
    ]
    if name == ARITHMETIC:  # its held-out questions, as the demo renders them ("12+34=")
        from models.tokenizer import load_tokenizer
        from rl.tasks import arithmetic_records

        tok = load_tokenizer(ASSET)
        records = arithmetic_records(seed=0, num=num_prompts, split="eval")
        prompts = [tok.encode(r["prompt"], add_bos=True) for r in records]
    args = (cfg, graphdef, params)
    greedy_f32, _ = sample(*args, "f32", prompts, new_tokens, 0.0, backend)
    out = []
    for row in rows:
        greedy, _ = sample(*args, row, prompts, new_tokens, 0.0, backend)
        tokens, lp = sample(*args, row, prompts, new_tokens, 1.0, backend)
        r = teacher_forced(cfg, graphdef, params, prompts, tokens) - lp
        same = greedy == greedy_f32  # [n, new]
        agree = np.where(same.all(1), new_tokens, np.argmin(same, 1))  # tokens before the first
        compute, weights, cache = ROWS[row]
        out.append(
            dict(
                model=name,
                row=row,
                compute=compute,
                weights=weights or compute,
                kv=cache,
                greedy_identical=float(np.mean(np.all(greedy == greedy_f32, axis=1))),
                greedy_agree_tokens=float(np.mean(agree)),
                kl_k3=float(np.mean(np.exp(r) - 1 - r)),
                max_abs_diff=float(np.abs(r).max()),
            )
        )
        print(table_row(out[-1]), flush=True)
    return out


HEADER = (
    f"{'model':>10s} {'row':>13s} {'compute':>9s} {'weights':>14s} {'KV':>14s} | "
    f"{'greedy =':>8s} {'agree':>5s} {'KL k3':>9s} {'max|diff|':>9s}"
)


def table_row(x: dict) -> str:
    return (
        f"{x['model']:>10s} {x['row']:>13s} {x['compute']:>9s} {x['weights']:>14s} "
        f"{x['kv']:>14s} | {x['greedy_identical']:8.0%} {x['greedy_agree_tokens']:5.1f} "
        f"{x['kl_k3']:9.2e} "
        f"{x['max_abs_diff']:9.2e}"
    )


def main(argv) -> int:
    p = parser("quant", __doc__)
    models = (*FIXTURES, ARITHMETIC, *SHAPES)
    p.add_argument(
        "--models",
        type=some_of(models),
        default="arithmetic,llama,qwen2,qwen3,small",
        help=f"comma-separated: {', '.join(models)}",
    )
    p.add_argument("--rows", type=some_of(tuple(ROWS)), default=",".join(ROWS), help="rows")
    p.add_argument("--num_prompts", type=integer(), default=32)
    p.add_argument("--new_tokens", type=integer(), default=32, help="exactly this many")
    p.add_argument(
        "--backend",
        type=one_of(("auto", "blockwise", "reference", "cpu_kernel")),
        default="auto",
        help="paged attention backend",
    )
    args = parse(p, argv)
    print(HEADER, flush=True)
    rows = []
    for name in args.models:
        rows += bench_model(name, args.rows, args.num_prompts, args.new_tokens, args.backend)
    r = dict(num_prompts=args.num_prompts, new_tokens=args.new_tokens, rows=rows)
    return finish(args, r, "\n".join([HEADER, *map(table_row, rows)]))
