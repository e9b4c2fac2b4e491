"""Sampler throughput: `python -m launch.bench sampler [--output bench_sampler.json]`.

Runs on whatever JAX backend is present (one device) with a random-init Qwen2-style model
("bench-small": V 4096, D 256, 4 layers, 8 heads, 2 KV heads, H 32, F 1024, tied embeddings)
and reports, all measured in this one process so that ratios are fair on a noisy machine:

- engine tokens/s for 8 prompts x 8 samples (64 sequences), prompt 64, exactly 128 new tokens,
  temperature 1, no top-k/top-p, and the peak KV pages against a dense (unshared) cache;
- HF `generate` tokens/s on the same weights and workload (torch on CPU), when torch and
  transformers are installed; else null;
- at 256 sequences (32 prompts x 8): the fraction of the compute floor (2 x params FLOPs per
  token at the matmul peak measured here on square f32 matmuls) and the fraction of an
  attention-free decode loop's tokens/s.

The attention-free loop is the engine's decode step (same model, same sampling, same key
schedule, same host sync every `steps_per_call` steps) with attention replaced by "output = v
of the current token" and no KV cache at all, so 1 - fraction is what the paged cache costs:
writes, attention and page tables. It is written out here rather than added as an engine
backend so that the library has no debugging path.

Timing: one warm-up run compiles everything, then the median of `--reps` runs; tokens/s counts
generated tokens only (prefill time is included in the engine's wall time, as a user sees it).

With `--shape NAME` or `--num_seqs B` the sampler bench instead times one engine run of a
registered model shape and sets it against the memory roofline (bytes per decode step, fraction
of the HBM bandwidth): `launch/bench/roofline.py`.
"""

from __future__ import annotations

import functools
import os
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx, struct

from launch.bench import roofline
from launch.bench.common import (
    SHAPES,
    SMALL,
    TINY,
    engine_runner,
    finish,
    integer,
    integers,
    interleaved,
    one_of,
    parse,
    parser,
    random_prompts,
    some_of,
    square_matmuls,
)
from launch.validate import DTYPES
from models.config import ModelConfig
from models.hf import save_hf
from models.hf_config import GenerationIds
from models.quant import DTYPES as QUANT
from models.sharding import init_params, make_mesh, param_count
from sampling.distribution import SamplingParams, sample
from sampling.paged_attention import BACKENDS


def matmul_peak_flops(sizes=(1024, 2048), reps: int = 5) -> float:
    """Best f32 FLOP/s of square matmuls measured on the spot (the compute floor's peak)."""
    t = interleaved(square_matmuls(sizes), reps)
    return max(2 * n**3 / t[f"matmul_{n}"] for n in sizes)


def attention_free_runner(cfg, graphdef, params, num_seqs, prompt_len, new_tokens, steps_per_call):
    """run() decodes num_seqs x new_tokens without attention or KV cache (module docstring)."""

    @struct.dataclass
    class CurrentV:
        def attend(self, layer, q, k, v):
            return jnp.repeat(v, q.shape[2] // k.shape[2], axis=2), self

    sampling = SamplingParams(temperature=1.0)
    rows = jnp.arange(num_seqs)

    @functools.partial(jax.jit, static_argnums=(0, 3), donate_argnums=2)
    def decode(graphdef, params, carry, num_steps, root):
        model = nnx.merge(graphdef, params)

        def key_of(req, g, n):  # the engine's key schedule, 8 samples per request
            return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(root, req), g), n)

        def step(_, c):
            last, length, n, toks, lps = c
            logits, _ = model(last[:, None], length[:, None], None, CurrentV())
            keys = jax.vmap(key_of)(rows // 8, rows % 8, n)
            tok, tok_lp = sample(logits[:, 0], sampling, None, keys)  # as the engine draws
            col = jnp.minimum(n, toks.shape[1] - 1)
            toks, lps = toks.at[rows, col].set(tok), lps.at[rows, col].set(tok_lp)
            return tok, length + 1, n + 1, toks, lps

        return jax.lax.fori_loop(0, num_steps, step, carry)

    def run():
        zeros = jnp.zeros((num_seqs,), jnp.int32)
        carry = (zeros + 1, zeros + prompt_len - 1, zeros)
        carry += (jnp.zeros((num_seqs, new_tokens), jnp.int32),)
        carry += (jnp.zeros((num_seqs, new_tokens), jnp.float32),)
        for _ in range(0, new_tokens, steps_per_call):
            carry = decode(graphdef, params, carry, steps_per_call, jax.random.key(0))
            jax.device_get(carry[1])  # the host sync the engine does after each call

    return run


def hf_runner(cfg, params, prompts, g, new_tokens):
    """run() calls HF `generate` on the same weights; None without torch / transformers."""
    try:
        import torch
        import transformers
    except ImportError:
        return None

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as d:
        save_hf(d, cfg, params, GenerationIds(eos_ids=(0,), pad_id=0))
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.eval()
    ids = torch.tensor([p for p in prompts for _ in range(g)], dtype=torch.long)
    # HF's default top_k is 50; 0 turns it off, as in the engine's SamplingParams.
    kw = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0)

    def run():
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                **kw,
            )
        assert out.shape == (ids.shape[0], ids.shape[1] + new_tokens)

    return run


def bench_sampler(args) -> dict:

    shape = TINY if args.small_test else SMALL
    cfg = ModelConfig(family="qwen2", qkv_bias=True, tie_embeddings=True, **shape)
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(cfg, mesh, seed=0)
    n_params = param_count(params)
    g, new, plen = args.num_samples, args.new_tokens, args.prompt_len
    ekw = dict(steps_per_call=args.steps_per_call, backend=args.backend, page_size=args.page_size)
    r = {"device": jax.devices()[0].platform, "params": n_params, "model": shape}
    r["workload"] = dict(prompt_len=plen, new_tokens=new, num_samples=g, temperature=1.0)

    # 64 sequences: engine against HF generate.
    prompts = random_prompts(args.num_prompts, plen, cfg.vocab_size)
    n64 = len(prompts) * g
    run, engine = engine_runner(cfg, graphdef, params, prompts, g, new, **ekw)
    r["engine"] = dict(ekw, backend_resolved=engine.backend)  # what "auto" picked here
    runs = {"engine": run}
    hf = None if args.no_hf else hf_runner(cfg, params, prompts, g, new)
    if hf is not None:
        runs["hf"] = hf
    t = interleaved(runs, args.reps)
    r.update(num_seqs=n64, tokens_per_s=n64 * new / t["engine"])
    r["hf_generate_tokens_per_s"] = n64 * new / t["hf"] if hf else None
    r["ratio_vs_hf"] = t["hf"] / t["engine"] if hf else None
    r["peak_pages"] = engine.allocator.peak_used
    r["dense_pages"] = n64 * engine.ecfg.pages_per_seq  # one unshared row per sequence

    # 256 sequences: engine against the attention-free loop and the compute floor.
    prompts = random_prompts(args.num_prompts_256, plen, cfg.vocab_size, seed=1)
    n256 = len(prompts) * g
    runs = {"engine": engine_runner(cfg, graphdef, params, prompts, g, new, **ekw)[0]}
    runs["free"] = attention_free_runner(
        cfg, graphdef, params, n256, plen, new, args.steps_per_call
    )
    for backend in args.compare_backends:
        kw = dict(ekw, backend=backend)
        runs[backend] = engine_runner(cfg, graphdef, params, prompts, g, new, **kw)[0]
    t = interleaved(runs, args.reps)
    peak = matmul_peak_flops(reps=args.reps + 2)
    floor = peak / (2 * n_params)  # tokens/s if every parameter's 2 FLOPs ran at the peak
    tps = n256 * new / t["engine"]
    r.update(num_seqs_256=n256, tokens_per_s_256=tps)
    r["attention_free_tokens_per_s_256"] = n256 * new / t["free"]
    r.update(matmul_peak_flops=peak, compute_floor_tokens_per_s=floor)
    r["compute_floor_fraction_256"] = tps / floor
    r["attention_free_fraction_256"] = t["free"] / t["engine"]
    r["attention_free_floor_fraction_256"] = n256 * new / t["free"] / floor
    r["backends_256"] = {b: n256 * new / t[b] for b in args.compare_backends}
    if args.sweep:
        r["sweep_256"] = _sweep(cfg, graphdef, params, prompts, g, new, ekw, args.reps)
    if args.batch_sweep:
        r["batch_sweep"] = _batch_sweep(cfg, graphdef, params, g, new, plen, ekw, args)
    return r


def _batch_sweep(cfg, graphdef, params, g, new, plen, ekw, args) -> list[dict]:
    """Engine tokens/s against the number of sequences decoded together (all in their own slot)."""
    runs = {}
    for n in args.batch_sweep:
        prompts = random_prompts(max(1, n // g), plen, cfg.vocab_size, seed=2)
        runs[n] = engine_runner(cfg, graphdef, params, prompts, g, new, **ekw)[0]
    t = interleaved(runs, args.reps)
    return [
        dict(num_seqs=max(1, n // g) * g, tokens_per_s=max(1, n // g) * g * new / t[n])
        for n in runs
    ]


def _sweep(cfg, graphdef, params, prompts, g, new, ekw, reps) -> list[dict]:
    """Engine tokens/s at 256 sequences over steps_per_call x num_slots (fewer slots than
    sequences: continuous batching refills freed slots)."""
    runs, rows = {}, []
    for steps in (16, 32, 64, 128):
        for slots in (64, 128, len(prompts) * g):
            kw = dict(ekw, steps_per_call=steps)
            runs[(steps, slots)] = engine_runner(
                cfg, graphdef, params, prompts, g, new, num_slots=slots, **kw
            )[0]
    for (steps, slots), t in interleaved(runs, reps).items():
        tps = len(prompts) * g * new / t
        rows.append(dict(steps_per_call=steps, num_slots=slots, tokens_per_s=tps))
    return rows


def _table(r: dict) -> str:
    hf = r["hf_generate_tokens_per_s"]
    rows = [
        (f"engine, {r['num_seqs']} seqs", f"{r['tokens_per_s']:.0f} tok/s"),
        ("HF generate, same workload", "n/a" if hf is None else f"{hf:.0f} tok/s"),
        ("engine / HF", "n/a" if hf is None else f"{r['ratio_vs_hf']:.2f}x"),
        ("peak / dense pages", f"{r['peak_pages']} / {r['dense_pages']}"),
        (f"engine, {r['num_seqs_256']} seqs", f"{r['tokens_per_s_256']:.0f} tok/s"),
        ("attention-free loop", f"{r['attention_free_tokens_per_s_256']:.0f} tok/s"),
        ("compute floor", f"{r['compute_floor_tokens_per_s']:.0f} tok/s"),
        ("engine / attention-free", f"{r['attention_free_fraction_256']:.1%}"),
        ("engine / compute floor", f"{r['compute_floor_fraction_256']:.1%}"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main(argv) -> int:
    p = parser("sampler", __doc__)
    p.add_argument("--small_test", action="store_true", help="tiny model and workload (tests)")
    p.add_argument("--no_hf", action="store_true", help="skip HF generate even if installed")
    p.add_argument("--reps", type=integer(), default=3, help="timed repetitions (median)")
    p.add_argument("--num_prompts", type=integer(), default=8)
    p.add_argument(
        "--num_prompts_256", type=integer(), default=32, help="prompts of the 256-seq run"
    )
    p.add_argument("--num_samples", type=integer(), default=8, help="G samples per prompt")
    p.add_argument("--prompt_len", type=integer(), default=64)
    p.add_argument("--new_tokens", type=integer(), default=128, help="exactly this many (no stop)")
    p.add_argument(
        "--steps_per_call", type=integer(), default=32, help="EngineConfig.steps_per_call"
    )
    p.add_argument("--page_size", type=integer(), default=16)
    p.add_argument(
        "--backend",
        type=one_of(BACKENDS),
        default="auto",
        help=f"paged attention backend: {', '.join(BACKENDS)}",
    )
    p.add_argument(
        "--compare_backends",
        type=some_of(BACKENDS, empty=True),
        default="",
        help="comma-separated backends also timed at 256 seqs",
    )
    p.add_argument("--sweep", action="store_true", help="also sweep steps_per_call x num_slots")
    p.add_argument(
        "--batch_sweep",
        type=integers(empty=True),
        default="",
        help="comma-separated sequence counts to time",
    )
    p.add_argument(
        "--shape",
        type=one_of(SHAPES),
        default=None,
        help=f"roofline bench of a model shape: {', '.join(SHAPES)}",
    )
    p.add_argument(
        "--num_seqs", type=integer(), default=None, help="roofline bench of B seqs (default 256)"
    )
    p.add_argument(
        "--dtype",
        type=one_of(("auto", *DTYPES)),
        default="auto",
        help="roofline: weights/cache dtype (auto: f32 on CPU, else bf16)",
    )
    p.add_argument(
        "--weights_dtype",
        type=one_of(("", *QUANT)),
        default="",
        help="roofline: decode from a copy with int8 / fp8 projections ('' = none)",
    )
    p.add_argument(
        "--cache_dtype",
        type=one_of(("", *DTYPES, *QUANT)),
        default="",
        help="roofline: KV cache dtype ('' = --dtype's)",
    )
    p.add_argument(
        "--decode_copy",
        action="store_true",
        help="roofline: f32 masters, with and without a decode-dtype copy",
    )
    args = parse(p, argv)
    if args.shape or args.num_seqs:
        b, g = args.num_seqs or 256, args.num_samples
        if b % g:
            p.error(f"--num_seqs={b}: must be a multiple of --num_samples={g}")
        r = roofline.bench_shape(args)
        return finish(args, r, roofline.table(r))
    if args.small_test:
        args.num_prompts, args.num_prompts_256, args.num_samples = 2, 4, 2
        args.prompt_len, args.new_tokens, args.steps_per_call, args.reps = 8, 8, 4, 1
        args.page_size = 4
    r = bench_sampler(args)
    return finish(args, r, _table(r))
