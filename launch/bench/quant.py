"""The sampler's numerics with quantised KV pages and decode weights, against the f32 sampler:
`python -m launch.bench quant [--models arithmetic,calc,llama,qwen2,qwen3,small]
[--num_prompts 32] [--new_tokens 32] [--rows ...] [--output F.json]`.

Models: the demos' trained warm starts (arithmetic: configs/assets/arithmetic_sft, a
character-level Llama of 4 layers, d_model 128, on held-out "a+b=" questions; calc:
configs/assets/calc_sft, the calculator demo's, on held-out "abc*def=" questions), the HF fixtures of
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
  sampler-vs-learner KL), and max |r|;
- through the stop (the trained models, whose rollouts end at a stop token: end of text, and
  the calculator's ">" that ends a tool call): the same greedy share over each prompt's f32
  completion up to and including its first stop token (at most `new_tokens`), and the KL over
  each drawn sample's tokens up to its own first stop: the tokens a rollout keeps. Past its stop
  a trained model is off its training distribution and its near-ties flip; the fixtures have no
  stop and these equal the columns above;
- the fake-quant reference (rows computing in f32, KV f32 or quantised): `reference_logprobs`, a float64 numpy forward
  pass with the row's weights, activations and KV quantised and read back as the scheme says,
  written apart from models/quant.py and sampling/kv_quant.py. "ref |diff|" is the median and max
  |log p_row - log p_ref| over the drawn tokens (f32 against float64 arithmetic: a value within
  an f32 ulp of a rounding boundary may round the other way), and "ref KL" the reference's own
  k3 against the f32 model: the error the scheme itself makes, which the sampler's KL matches
  when the implementation adds none.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from launch.bench.common import SHAPES, finish, integer, one_of, parse, parser, some_of
from models.attention import rope_inv_freq
from models.hf import load_hf
from models.sharding import abstract_model, init_params, make_mesh
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.episodes import generate_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = ("llama", "qwen2", "qwen3")  # tests/fixtures/hf/<name>
# The demos' trained warm starts: name -> (asset folder, held-out questions' digits and ops).
TRAINED = {"arithmetic": ("arithmetic_sft", 2, "+"), "calc": ("calc_sft", 3, "*")}

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


def asset(name: str) -> str:
    """The folder of a trained warm start (`TRAINED`)."""
    return os.path.join(ROOT, "configs", "assets", TRAINED[name][0])


def load(name: str, mesh):
    """(cfg, graphdef, params) of a fixture or a bench shape (module docstring), f32."""
    if name in (*FIXTURES, *TRAINED):
        path = (
            asset(name) if name in TRAINED else os.path.join(ROOT, "tests", "fixtures", "hf", name)
        )
        cfg, graphdef, params, _ = load_hf(path, mesh)
        return cfg, graphdef, params
    from models.config import ModelConfig

    cfg = ModelConfig(**SHAPES[name])
    graphdef, params = init_params(cfg, mesh, seed=0)
    # The fixtures' statistics: weights std 0.1 (init 0.02), norm scales 1 (as initialised).
    scale = lambda x: x if x.ndim == 1 else x * 5.0
    return cfg, graphdef, jax.tree.map(scale, params)


def _round_trip(y, dtype):
    """y, already scaled and clipped, rounded to `dtype` and back, in float64."""
    if dtype == "int8":
        return np.round(y)
    return y.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def fake_quant_kv(x, dtype):
    """x [..., H] as a quantised KV pool reads it back (sampling/kv_quant.py): a bf16 scale
    absmax / 127 (int8) or / 448 (fp8) per row of H, x / scale clipped to +-127 / 448."""
    q = 127.0 if dtype == "int8" else 448.0
    s = np.abs(x).max(-1, keepdims=True) / q
    s = s.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    return _round_trip(np.clip(x / np.where(s > 0, s, 1.0), -q, q), dtype) * s


def fake_quant_matmul(x, dtype, axes):
    """x [..] (float64) quantised for a decode projection (models/quant.py) and read back: an
    f32 scale absmax / 127 (int8, rounded half to even) or / 448 (fp8, ml_dtypes' rounding) per
    entry of the axes not in `axes`, x / scale in f32 as the sampler computes it."""
    bound = 127.0 if dtype == "int8" else 448.0
    x32 = x.astype(np.float32)
    s = np.abs(x32).max(axis=axes, keepdims=True) / np.float32(bound)
    y = (x32 / np.where(s > 0, s, np.float32(1))).astype(np.float64)
    s = s.astype(np.float64)
    return _round_trip(np.clip(y, -bound, bound), dtype) * s


def reference_logprobs(cfg, params, prompts, tokens, weights="", kv=""):
    """log p(tokens[i, j] | prompts[i] + tokens[i, :j]) [n, new] from a float64 numpy forward
    pass of the model, with the projections' weights (per output channel) and activations (per
    token) fake-quantised to `weights` and every key and value (per token and KV head) to `kv`
    ("" for neither): the scheme of models/quant.py and sampling/kv_quant.py, independent of
    their code. Dense models (Llama / Qwen2 / Qwen3 blocks) only."""
    p = nnx.to_pure_dict(params)
    f = lambda x: np.asarray(x, np.float64)
    inv_freq = f(rope_inv_freq(cfg))

    def matmul(spec, x, w, contract):
        if weights:
            lhs = spec.split(",")[0]
            x = fake_quant_matmul(x, weights, tuple(range(len(lhs) - contract, len(lhs))))
            w = fake_quant_matmul(f(w), weights, tuple(range(contract)))
        return np.einsum(spec, x, f(w))

    def norm(x, scale):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * f(scale)

    def rope(x, pos):  # x [T, #, H], HF's rotate-half
        ang = pos[:, None] * inv_freq  # [T, H/2]
        cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
        x1, x2 = np.split(x, 2, -1)
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    out = []
    for prompt, toks in zip(prompts, tokens):
        ids = np.asarray([*prompt, *toks])
        t = len(ids)
        pos = np.arange(t, dtype=np.float64)
        x = f(p["embed"])[ids]  # [T, D]
        for blk in p["blocks"].values():
            a = blk["attn"]
            h = norm(x, blk["attn_norm"]["scale"])
            q = matmul("td,dnh->tnh", h, a["q"], 1)
            k = matmul("td,dkh->tkh", h, a["k"], 1)
            v = matmul("td,dkh->tkh", h, a["v"], 1)
            if cfg.qkv_bias:
                q, k, v = q + f(a["q_bias"]), k + f(a["k_bias"]), v + f(a["v_bias"])
            if cfg.qk_norm:
                q, k = norm(q, a["q_norm"]["scale"]), norm(k, a["k_norm"]["scale"])
            q, k = rope(q, pos), rope(k, pos)
            if kv:
                k, v = fake_quant_kv(k, kv), fake_quant_kv(v, kv)
            r = cfg.num_heads // cfg.num_kv_heads
            k, v = np.repeat(k, r, 1), np.repeat(v, r, 1)  # [T, N, H]
            s = np.einsum("tnh,snh->nts", q, k) / np.sqrt(cfg.head_dim)
            s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            o = np.einsum("nts,snh->tnh", w / w.sum(-1, keepdims=True), v)
            x = x + matmul("tnh,nhd->td", o, a["o"], 2)
            m = blk["mlp"]
            h = norm(x, blk["mlp_norm"]["scale"])
            g, u = matmul("td,df->tf", h, m["gate"], 1), matmul("td,df->tf", h, m["up"], 1)
            x = x + matmul("tf,fd->td", g / (1 + np.exp(-g)) * u, m["down"], 1)
        h = norm(x, p["final_norm"]["scale"])
        logits = h @ (f(p["embed"]).T if cfg.tie_embeddings else f(p["lm_head"]))
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        at = np.arange(len(prompt) - 1, t - 1)  # the logits that predict each new token
        out.append(logp[at, np.asarray(toks)])
    return np.stack(out)


def sample(cfg, graphdef, params, row, prompts, new_tokens, temperature, backend):
    """(tokens [n, new], sampler log-probs [n, new]) of one row's sampler."""
    compute, weights, cache = ROWS[row]
    if compute != cfg.dtype:  # the model's own compute dtype: the graphdef holds it
        cfg = dataclasses.replace(cfg, dtype=compute)
        graphdef = abstract_model(cfg)[0]
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


def prompts_and_stops(name, cfg, num_prompts):
    """(prompts, stop ids) of a model: a trained warm start's held-out questions as its demo
    renders them ("12+34=", "123*456=") and its rollouts' stop ids (end of text; the
    calculator's ">" too), else random prompts of 4 to 24 tokens and no stop."""
    if name not in TRAINED:
        rng = np.random.default_rng(0)
        return [
            [int(t) for t in rng.integers(1, cfg.vocab_size, size=rng.integers(4, 25))]
            for _ in range(num_prompts)
        ], ()
    from models.tokenizer import load_tokenizer
    from rl.tasks import CALL_CLOSE, arithmetic_records

    tok = load_tokenizer(asset(name))
    _, digits, ops = TRAINED[name]
    records = arithmetic_records(seed=0, num=num_prompts, digits=digits, ops=ops, split="eval")
    stops = tuple(tok.eos_ids)
    if name == "calc":
        stops += tuple(tok.encode(CALL_CLOSE, special=True))
    return [tok.encode(r["prompt"], add_bos=True) for r in records], stops


def through_stop(tokens, stops) -> np.ndarray:
    """bool [n, new]: each row's tokens up to and including its first stop id (all without)."""
    hit = np.isin(tokens, stops)
    first = np.where(hit.any(1), np.argmax(hit, 1), tokens.shape[1] - 1)
    return np.arange(tokens.shape[1])[None] <= first[:, None]


def k3(r) -> float:
    """KL estimate mean(exp(r) - 1 - r) of log-ratios r (what the learner logs)."""
    return float(np.mean(np.exp(r) - 1 - r))


def bench_model(name, rows, num_prompts, new_tokens, backend) -> list[dict]:
    mesh = make_mesh({}, devices=jax.devices()[:1])
    cfg, graphdef, params = load(name, mesh)
    prompts, stops = prompts_and_stops(name, cfg, num_prompts)
    args = (cfg, graphdef, params)
    greedy_f32, _ = sample(*args, "f32", prompts, new_tokens, 0.0, backend)
    keep_f32 = through_stop(greedy_f32, stops)  # the f32 completions' tokens [n, new]
    out = []
    for row in rows:
        greedy, _ = sample(*args, row, prompts, new_tokens, 0.0, backend)
        tokens, lp = sample(*args, row, prompts, new_tokens, 1.0, backend)
        f32 = teacher_forced(cfg, graphdef, params, prompts, tokens)
        r = f32 - lp
        same = greedy == greedy_f32  # [n, new]
        agree = np.where(same.all(1), new_tokens, np.argmin(same, 1))  # tokens before the first
        keep = through_stop(tokens, stops)
        compute, weights, cache = ROWS[row]
        x = dict(
            model=name,
            row=row,
            compute=compute,
            weights=weights or compute,
            kv=cache,
            greedy_identical=float(np.mean(np.all(same, axis=1))),
            greedy_agree_tokens=float(np.mean(agree)),
            kl_k3=k3(r),
            max_abs_diff=float(np.abs(r).max()),
            greedy_identical_stop=float(np.mean(np.all(same | ~keep_f32, axis=1))),
            kl_k3_stop=k3(r[keep]),
            max_abs_diff_stop=float(np.abs(r[keep]).max()),
            ref_median_abs_diff=None,
            ref_max_abs_diff=None,
            ref_kl_k3=None,
        )
        if compute == "float32" and cache != "bfloat16":  # the scheme's float64 reference
            kv = "" if cache == "float32" else cache
            ref = reference_logprobs(cfg, params, prompts, tokens, weights, kv)
            x.update(
                ref_median_abs_diff=float(np.median(np.abs(lp - ref))),
                ref_max_abs_diff=float(np.abs(lp - ref).max()),
                ref_kl_k3=k3(f32 - ref),
            )
        out.append(x)
        print(table_row(out[-1]), flush=True)
    return out


HEADER = (
    f"{'model':>10s} {'row':>13s} {'compute':>9s} {'weights':>14s} {'KV':>14s} | "
    f"{'greedy =':>8s} {'agree':>5s} {'KL k3':>9s} {'max|diff|':>9s} | through stop: "
    f"{'greedy =':>8s} {'KL k3':>9s} {'max|diff|':>9s} | fake-quant ref: "
    f"{'|diff| med':>10s} {'max':>9s} {'ref KL':>9s}"
)


def table_row(x: dict) -> str:
    e = lambda v: "-" if v is None else f"{v:.2e}"
    return (
        f"{x['model']:>10s} {x['row']:>13s} {x['compute']:>9s} {x['weights']:>14s} "
        f"{x['kv']:>14s} | {x['greedy_identical']:8.0%} {x['greedy_agree_tokens']:5.1f} "
        f"{x['kl_k3']:9.2e} {x['max_abs_diff']:9.2e} | {'':14s}"
        f"{x['greedy_identical_stop']:8.0%} {x['kl_k3_stop']:9.2e} "
        f"{x['max_abs_diff_stop']:9.2e} | {'':16s}{e(x['ref_median_abs_diff']):>10s} "
        f"{e(x['ref_max_abs_diff']):>9s} {e(x['ref_kl_k3']):>9s}"
    )


def main(argv) -> int:
    p = parser("quant", __doc__)
    models = (*TRAINED, *FIXTURES, *SHAPES)
    p.add_argument(
        "--models",
        type=some_of(models),
        default="arithmetic,calc,llama,qwen2,qwen3,small",
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
