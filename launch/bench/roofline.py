"""Sampler decode against the memory roofline: `python -m launch.bench sampler --shape NAME
[--num_seqs B] [--prompt_len --new_tokens --num_samples --page_size ...]` (the path the sampler
benchmark takes when --shape or --num_seqs is given; default shape "small", 256 sequences).

A random-init model of a registered shape (`launch.bench.common.SHAPES`: the real Qwen2.5-0.5B,
Qwen3-0.6B and Llama-3.2-1B architectures, and the bench's own "small" and "tiny") decodes B
sequences at once (B / G prompts x G samples, every sequence in its own slot, exactly
`new_tokens` each) on one device, in the decode dtype: weights, compute and KV cache in bfloat16
on accelerators, float32 on CPU (`--dtype` overrides). The weights are stored in that dtype, as a
server would hold them; the training loop instead keeps f32 master weights and casts them inside
the jitted step.

Reported, all measured in this one process:
- engine tokens/s = B x new_tokens / wall seconds of `generate_all` (median of `--reps`
  after a compile run). The wall time includes the prefill, so steps/s = new_tokens / seconds
  and everything derived from it is a lower bound for the decode steps alone;
- bytes one decode step must move (`decode_step_bytes`), each read or written once:
    weights  all parameters x their bytes, except that an untied input embedding is read only for
             the B rows it gathers (min(B, V) x D); a tied one is read whole by the logits matmul;
    KV       B x mean_len x L x K x H x 2 (k and v) x cache bytes, where mean_len = prompt_len +
             (new_tokens - 1) / 2 is the mean number of tokens a step attends to (step n of
             0..new-1 feeds the token at position prompt_len - 1 + n and attends to positions
             0..prompt_len - 1 + n). Every sequence is counted as reading its own copy: the
             blockwise backend reads a group's shared prompt pages once, so it may move less;
    logits   B x V x 4 (f32, written).
  Ignored: activations, the KV of the new token written (1 / mean_len of the KV read), page
  tables, sampling's [B,V] passes (one read of the logits, `sampling.distribution.sample`);
- achieved bytes/s = bytes_per_step x steps/s, as a fraction of the HBM bandwidth: the peak of
  the chip from `HBM_PEAK` (matched on `jax.devices()[0].device_kind`, null when unknown, as on
  CPU) and the bandwidth of a large on-device copy measured here (x = x + 1 in place over a
  256 MiB array on CPU, 1 GiB on accelerators; bytes = read + write, median of `max(5, reps)`
  calls). On CPU a small model's weights sit in the caches, so the fraction can pass 1 there.

Quantised rollouts: `--weights_dtype int8|float8_e4m3fn` decodes from the per-rollout copy with
its block projections quantised (`models.quant`: 1 byte per weight and an f32 scale per output
channel; the rest in the decode dtype), `--cache_dtype int8|float8_e4m3fn` from quantised KV
pages (`sampling.kv_quant`: H bytes and one bf16 scale per token and KV head); the bytes above
count them so (`decode_step_bytes`'s `weights_dtype`, `projections`, cache dtype).

`--decode_copy` keeps f32 master weights, as the training loop does, and times decoding from
them (cast to the decode dtype inside every step) against decoding from a copy in the decode
dtype made once per `generate_all` (`EngineConfig.weights_dtype`), with the copy's size.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp

from launch.bench.common import SHAPES, engine_runner, interleaved, random_prompts
from models import quant
from models.config import ModelConfig
from models.sharding import init_params, make_mesh, param_count

# HBM bytes/s by device_kind: the first row whose substrings all occur (lower case) wins, so
# the more specific kinds come first. Vendor datasheet figures.
HBM_PEAK = (
    (("gh200",), 4.0e12),  # Grace Hopper, 96 GB HBM3 (the 144 GB HBM3e one: 4.9e12)
    (("h200",), 4.8e12),
    (("h100", "pcie"), 2.0e12),
    (("h100", "nvl"), 3.9e12),
    (("h100",), 3.35e12),  # SXM
    (("a100", "80gb", "pcie"), 1.935e12),
    (("a100", "80gb"), 2.039e12),  # SXM
    (("a100",), 1.555e12),  # 40GB
    (("tpu v4",), 1.2e12),
    (("tpu v5 lite",), 8.19e11),  # v5e
    (("tpu v5e",), 8.19e11),
    (("tpu v5",), 2.765e12),  # v5p ("TPU v5" or "TPU v5p")
    (("tpu v6",), 1.64e12),  # v6e ("TPU v6 lite" or "TPU v6e")
)


def hbm_peak(device_kind: str) -> float | None:
    """The table's HBM bandwidth (bytes/s) of a device kind, None if it is not in the table."""
    kind = device_kind.lower()
    return next((bw for subs, bw in HBM_PEAK if all(s in kind for s in subs)), None)


def mean_kv_len(prompt_len: int, new_tokens: int) -> float:
    """Mean tokens attended per decode step over a run (module docstring)."""
    return prompt_len + (new_tokens - 1) / 2


def projections(params) -> tuple[int, int]:
    """(weights, output channels) of the projections `models.quant` quantises in params: what
    a weights_dtype int8 / fp8 copy holds in 1 byte, and its f32 scales."""
    counts = []
    count = lambda x, c: counts.append((x.size, x.size // math.prod(x.shape[:c])))
    quant.map_params(count, lambda x: None, params)
    return sum(n for n, _ in counts), sum(s for _, s in counts)


def decode_step_bytes(
    cfg: ModelConfig,
    n_params: int,
    num_seqs: int,
    kv_len: float,
    cache_dtype: str,
    weights_dtype: str = "",
    quantized: tuple[int, int] = (0, 0),
) -> dict:
    """{weights, kv, logits, total}: bytes one decode step of num_seqs sequences moves (module
    docstring), weights of n_params in cfg.param_dtype, kv_len tokens per sequence. With
    weights_dtype int8 / float8_e4m3fn the `quantized` (weights, scales) of `projections` are
    read as 1 byte and 4 bytes each; a quantised cache_dtype adds a 2-byte scale per token and
    KV head."""
    v, d = cfg.vocab_size, cfg.d_model
    read = n_params if cfg.tie_embeddings else n_params - v * d + min(num_seqs, v) * d
    weights = read * jnp.dtype(cfg.param_dtype).itemsize
    if weights_dtype in quant.DTYPES:
        n, scales = quantized
        weights = (read - n) * jnp.dtype(cfg.param_dtype).itemsize + n + 4 * scales
    scale = 2 / cfg.head_dim if cache_dtype in quant.DTYPES else 0  # bf16 per (token, head)
    kv_token = (
        cfg.num_layers
        * cfg.num_kv_heads
        * cfg.head_dim
        * 2
        * (jnp.dtype(cache_dtype).itemsize + scale)
    )
    kv = num_seqs * kv_len * kv_token
    logits = num_seqs * v * 4
    return dict(weights=weights, kv=kv, logits=logits, total=weights + kv + logits)


def copy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """bytes/s of x = x + 1 over an f32 array of nbytes (read + write), median of reps calls.
    x is donated, so it is updated in place: a fresh output buffer would be paged in on every
    call on CPU (first touch), which costs more than the copy."""
    f = jax.jit(lambda x: x + 1, donate_argnums=0)
    x = f(jnp.zeros((nbytes // 4,), jnp.float32))
    x.block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x = f(x)
        x.block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes / statistics.median(times)


def bench_shape(args) -> dict:
    name, b = args.shape or "small", args.num_seqs or 256  # checked by the sampler's parser
    g, new, plen = args.num_samples, args.new_tokens, args.prompt_len
    dev = jax.devices()[0]
    dtype = (
        args.dtype if args.dtype != "auto" else "float32" if dev.platform == "cpu" else "bfloat16"
    )
    # --decode_copy: f32 master weights, as in training, decoded with and without a copy in the
    # decode dtype (EngineConfig.weights_dtype); the roofline is the copy's.
    masters = "float32" if args.decode_copy else dtype
    cache, wq = args.cache_dtype or dtype, args.weights_dtype  # quantised KV / weights, or not
    cfg = ModelConfig(**SHAPES[name], dtype=dtype, param_dtype=masters)
    graphdef, params = init_params(cfg, make_mesh({}, devices=[dev]), seed=0)
    n_params = param_count(params)
    ekw = dict(steps_per_call=args.steps_per_call, backend=args.backend, page_size=args.page_size)
    prompts = random_prompts(b // g, plen, cfg.vocab_size)
    runs = {}
    for copy in ("", dtype) if args.decode_copy else (wq,):
        kw = dict(ekw, cache_dtype=cache, weights_dtype=copy)
        runs[copy or "none"], engine = engine_runner(cfg, graphdef, params, prompts, g, new, **kw)
        runs[copy or "none"]()  # a second warm-up: the second generate_all compiles prefill again
    times = interleaved(runs, args.reps)
    seconds = times[dtype if args.decode_copy else wq or "none"]
    cfg = dataclasses.replace(cfg, param_dtype=dtype)  # the weights decoding reads
    copy_bytes = (256 if dev.platform == "cpu" else 1024) << 20
    copy_bw = copy_bandwidth(copy_bytes, max(5, args.reps))
    kv_len = mean_kv_len(plen, new)
    step = decode_step_bytes(cfg, n_params, b, kv_len, cache, wq, projections(params))
    steps_per_s = new / seconds
    achieved = step["total"] * steps_per_s
    peak = hbm_peak(dev.device_kind)
    r = dict(shape=name, model=dataclasses.asdict(cfg), params=n_params)
    r.update(device=dev.platform, device_kind=dev.device_kind, dtype=dtype, cache_dtype=cache)
    r["weights_dtype"] = wq
    r["workload"] = dict(num_seqs=b, prompt_len=plen, new_tokens=new, num_samples=g)
    r["engine"] = dict(
        ekw,
        backend_resolved=engine.backend,
        num_pages=engine.ecfg.num_pages,
        pages_per_seq=engine.ecfg.pages_per_seq,
    )
    r.update(num_seqs=b, seconds=seconds, tokens_per_s=b * new / seconds, steps_per_s=steps_per_s)
    r.update(mean_kv_len=kv_len, bytes_per_step=step, achieved_bytes_per_s=achieved)
    r["kv_formula"] = "num_seqs x mean_kv_len x L x K x 2 x (H x cache bytes + 2 if quantised)"
    r.update(
        copy_bytes=copy_bytes, copy_bytes_per_s=copy_bw, hbm_fraction_measured=achieved / copy_bw
    )
    r.update(table_bytes_per_s=peak, hbm_fraction_table=achieved / peak if peak else None)
    if args.decode_copy:
        r["decode_copy"] = dict(
            tokens_per_s_masters=b * new / times["none"],
            tokens_per_s_copy=b * new / seconds,
            speedup=times["none"] / seconds,
            extra_bytes=n_params * jnp.dtype(dtype).itemsize,  # resident during the rollout
        )
    return r


def table(r: dict) -> str:
    s, wl = r["bytes_per_step"], r["workload"]
    cpu_f32 = r["device"] == "cpu" and r["dtype"] == "float32"
    note = " (f32 on CPU; bf16 on accelerators)" if cpu_f32 else ""
    peak, frac = r["table_bytes_per_s"], r["hbm_fraction_table"]
    rows = [
        ("shape", f"{r['shape']}, {r['params']:,} params, {r['dtype']}{note}"),
        ("device", f"{r['device']} ({r['device_kind']})"),
        (
            "workload",
            f"{r['num_seqs']} seqs, prompt {wl['prompt_len']}, {wl['new_tokens']} new, "
            f"backend {r['engine']['backend_resolved']}",
        ),
        ("engine", f"{r['tokens_per_s']:.0f} tok/s, {1e3 / r['steps_per_s']:.2f} ms/step"),
        ("weights / KV dtype", f"{r.get('weights_dtype') or r['dtype']} / {r['cache_dtype']}"),
        ("bytes/step: weights", f"{s['weights'] / 1e6:.2f} MB"),
        (f"bytes/step: KV (mean len {r['mean_kv_len']:g})", f"{s['kv'] / 1e6:.2f} MB"),
        ("bytes/step: logits f32", f"{s['logits'] / 1e6:.2f} MB"),
        ("bytes/step: total", f"{s['total'] / 1e6:.2f} MB"),
        ("achieved", f"{r['achieved_bytes_per_s'] / 1e9:.2f} GB/s"),
        ("measured copy bandwidth", f"{r['copy_bytes_per_s'] / 1e9:.2f} GB/s"),
        ("fraction of measured copy", f"{r['hbm_fraction_measured']:.1%}"),
        ("table HBM peak", "n/a" if peak is None else f"{peak / 1e9:.0f} GB/s"),
        ("fraction of table peak", "n/a" if frac is None else f"{frac:.1%}"),
    ]
    if "decode_copy" in r:
        c = r["decode_copy"]
        rows[3:3] = [
            ("engine, f32 masters (no copy)", f"{c['tokens_per_s_masters']:.0f} tok/s"),
            (
                f"engine, {r['dtype']} decode copy",
                f"{c['tokens_per_s_copy']:.0f} tok/s, "
                f"{c['speedup']:.2f}x, +{c['extra_bytes'] / 2**20:.1f} MiB",
            ),
        ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
