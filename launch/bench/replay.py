"""Routing replay's numerics on a tiny mixture of experts in bf16 (issue 52 must-show 3, from the
sampler's own record): `python -m launch.bench replay [--num_prompts 32] [--new_tokens 32]
[--seeds 0,1,2] [--num_experts 16 --experts_per_token 4 --num_layers 4] [--no-dense_twin]
[--hf_checkpoint DIR]
[--output F.json]`.

With --hf_checkpoint an HF mixture-of-experts checkpoint with a tokenizer (e.g. the MoE demo's
warm start, configs/assets/arithmetic_moe_sft) is measured instead, in bf16, on
configs/default.py's arithmetic prompts ("a+b=", seeded by each seed).

Model: a random tiny Qwen3-MoE (16 experts, top-4, layers 0..3 all MoE, d_model 64, vocab 128;
--num_experts, --experts_per_token and --num_layers change its routing and depth, e.g. 128 and
8 for Qwen3-30B-A3B's routing), weights of std 0.1 (norm scales 1) so routers are decisive
but near-ties occur, compute in bf16, f32 master weights, one CPU device. The sampler
(`sampling.engine.Engine` with `record_routes`) draws `new_tokens` tokens at temperature 1
after random prompts of 4..16 tokens and records, at each decode step, the experts of the
token it feeds. The learner's pass (`rl.logprobs.token_logprobs`, bf16, one sequence per row,
right-padded) then scores the same tokens:
- replay off: its routers route every token;
- own routes (a control): the experts the learner's routers chose in a pass of their own, given
  back as replayed routes: the same routing as off through the replay path's program, which in
  bf16 rounds otherwise (a difference that is not the sampler's routing);
- decode replay: the experts the sampler's decode steps used replace the learner's top-k at the
  fed positions (the prompt's last token and every sampled token); the prompt's other tokens
  are routed by the learner;
- replay: and the prefill's experts at the prompt's other tokens (`Prefix.routes`): every token
  routed as the sampler routed it (the last sampled token, never fed, scores nothing).
- dense twin (random models only; `twin_model`): the same model with nothing routed, each MoE
  block replaced by the dense block of its first k experts (down projections / k: every token
  sent to experts 0..k-1 at gate weight 1/k), every other weight the mixture's, the same
  prompts, its own samples. A reference for what replay leaves: the sampler-vs-learner KL of
  a model whose numerics differ between the two programs only where no router is involved
  (the paged decode and the learner's pass sum attention in other orders, and in bf16 a sum
  that differs in its last f32 bit can round to another bf16 value). It is not a bound: a
  different model, drawing other tokens.
Per setting: route mismatch = the fraction of tokens (the prompt's and the fed ones) whose
experts in the learner's pass (as a set, in any MoE layer; the record of the same pass that
gave the row's log-probs, `token_logprobs(stats=True)`) differ from the sampler's; KL = k3 =
mean(exp(r) - 1 - r) with r = log p_learner - log p_sampler over the sampled tokens (the
sampler-vs-learner KL the learner logs), max |r|.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from launch.bench.common import finish, integer, parse, parser
from models.config import ModelConfig
from models.hf import load_hf
from models.sharding import init_params, make_mesh
from models.tokenizer import load_tokenizer
from rl.logprobs import token_logprobs
from rl.tasks import arithmetic_records
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig

CFG = ModelConfig(
    family="qwen3_moe",
    vocab_size=128,
    d_model=64,
    d_ff=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
    num_experts=16,
    experts_per_token=4,
    expert_d_ff=32,
    norm_topk_prob=True,
    moe_layers=(0, 1, 2, 3),
    dtype="bfloat16",
)


def _scaled(params):
    """Projections and embedding of std 0.1 (the HF fixtures' statistics), norm scales 1."""

    scale = lambda path, x: x if "norm" in jax.tree_util.keystr(path) else x * 5.0  # 0.02 -> 0.1
    return jax.tree_util.tree_map_with_path(scale, params)


def random_model(seed: int, num_prompts: int, cfg: ModelConfig = CFG):
    """(config, graphdef, params, prompts, stop ids): the random tiny MoE `cfg` (CFG above, or
    its expert count, top-k and depth changed by `shaped`) and random prompts of 4..16 tokens;
    no stop ids (every sample draws --new_tokens tokens)."""
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(cfg, mesh, seed=seed)
    rng = np.random.default_rng(seed)
    prompts = [
        rng.integers(1, cfg.vocab_size, rng.integers(4, 17)).tolist() for _ in range(num_prompts)
    ]
    return cfg, graphdef, _scaled(params), prompts, ()


def shaped(num_experts: int, experts_per_token: int, num_layers: int) -> ModelConfig:
    """CFG with another routing shape (every layer MoE), e.g. 128 experts, top-8 as in
    Qwen3-30B-A3B: more experts and more chosen per token make near-ties, hence flips, more
    frequent."""
    return dataclasses.replace(
        CFG,
        num_experts=num_experts,
        experts_per_token=experts_per_token,
        num_layers=num_layers,
        moe_layers=tuple(range(num_layers)),
    )


def trained_model(path: str, seed: int, num_prompts: int):
    """(config, graphdef, params, prompts, stop ids): an HF mixture-of-experts checkpoint with its
    tokenizer in bf16, `num_prompts` of configs/default.py's arithmetic prompts ("a+b=", the task
    configs/moe_tiny.py's warm start learned), and its end-of-sequence ids: a sample ends there,
    as a rollout's does (the tokens a trained model draws past its end are off its distribution,
    where a flipped route moves a log-prob by nats, and no rollout trains on them)."""
    mesh = make_mesh({}, devices=jax.devices()[:1])
    cfg, graphdef, params, ids = load_hf(path, mesh, dtype="bfloat16")
    if not cfg.num_experts:
        raise SystemExit(f"error: --hf_checkpoint {path}: a dense model (no experts to replay)")
    tokenizer = load_tokenizer(path)
    records = arithmetic_records(seed, num_prompts)
    prompts = [tokenizer.encode(r["prompt"]) for r in records]
    return cfg, graphdef, params, prompts, tuple(ids.eos_ids)


def _sample(model, seed: int, new_tokens: int, record_routes: bool):
    """The sampler's draw for `model`'s prompts: (engine result, prefixes, the learner's rows
    (ids, positions, valid) [n, width], fed positions [n, new], drawn bool [n, new])."""
    cfg, graphdef, params, prompts, stop_ids = model
    num_prompts = len(prompts)
    plen = max(map(len, prompts))
    per_seq = -(-(plen + new_tokens) // 8)
    ecfg = EngineConfig(
        num_slots=num_prompts,
        page_size=8,
        num_pages=num_prompts * per_seq + 1,
        max_prompt_len=plen,
        max_new_tokens=new_tokens,
        steps_per_call=new_tokens,
        record_routes=record_routes,
        stop_ids=stop_ids,
    )
    engine = Engine(cfg, graphdef, ecfg, SamplingParams(1.0))
    state = engine.init_state()
    state, prefixes = engine.prefill_many(params, state, prompts)
    for slot, prefix in enumerate(prefixes):
        state = engine.insert(state, prefix, slot, slot, new_tokens)
    state, ticket = engine.dispatch(params, state, jax.random.key(seed))
    r = engine.collect(ticket)
    g = np.asarray(r.num_generated[:num_prompts])  # [n] tokens drawn (fewer at a stop id)
    assert stop_ids or (g == new_tokens).all()
    live = np.arange(new_tokens) < g[:, None]  # [n, new]: the drawn tokens
    width = plen + new_tokens
    ids = np.zeros((num_prompts, width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p) + g[i]] = p + r.tokens[i][: g[i]].tolist()
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), ids.shape)
    valid = np.arange(width) < np.array([len(p) for p in prompts])[:, None] + g[:, None]
    fed = np.array([[len(p) - 1 + j for j in range(new_tokens)] for p in prompts])  # [n, new]
    return r, prefixes, (ids, pos, valid), fed, live


@functools.cache  # one per model graph: seeds whose rows are as wide trace it once
def _learner(graphdef):
    @jax.jit
    def learner(params, rows, routes):
        """The learner's pass: log-probs [n, width-1] (position t scores token t+1) and the
        experts it used [n, width, L_moe, k], from one program, as the learner's loss pass has
        them. The params and rows are arguments, as in the learner's step: closed over, they
        are constants that XLA:CPU folds into the program, which then rounds otherwise in bf16."""
        model = nnx.merge(graphdef, params)
        out = token_logprobs(model, *rows, SamplingParams(1.0), routes=routes, stats=True)
        return out.logp, out.routes

    return learner


def _kl(logp, fed, r, live) -> dict:
    """KL k3 and max |r| of the learner's log-probs `logp` [n, width-1] against the sampler's,
    over the drawn tokens."""
    scored = np.take_along_axis(np.asarray(logp, np.float64), fed, 1)
    rr = (scored - np.asarray(r.logprobs[: len(fed)], np.float64))[live]
    return {"kl_k3": float(np.mean(np.exp(rr) - 1 - rr)), "max_abs_r": float(np.abs(rr).max())}


def run(model, seed: int, new_tokens: int) -> dict:
    """The four settings' route mismatch and KL for `model` (`random_model`, `trained_model`)."""
    cfg, graphdef, params, prompts, stop_ids = model
    num_prompts = len(prompts)
    r, prefixes, rows, fed, live = _sample(model, seed, new_tokens, record_routes=True)
    g = live.sum(1)
    learner = _learner(graphdef)
    routed = learner(params, rows, None)  # replay off: the learner's routers route
    own = np.asarray(routed[1])  # [n, width, L_moe, k]: their choice
    decode = own.copy()  # the decode steps' experts at the fed positions, the learner's elsewhere
    decode[np.arange(num_prompts)[:, None], fed] = r.routes[:num_prompts]
    full = decode.copy()  # and the prefill's for the prompt's other tokens: the whole record
    for i, x in enumerate(prefixes):
        full[i, : len(x.routes)] = x.routes
    out = {}
    settings = (
        ("off", None),
        ("own routes", own),  # control: the off pass's routes through the replay path
        ("decode replay", decode),
        ("replay", full),
    )
    for name, routes in settings:
        # what the pass gave and the experts it used
        lp, used = routed if routes is None else learner(params, rows, routes)
        used = np.asarray(used)
        got, want = [], []  # every recorded token: the prompt's (prefill) and the fed ones
        for i, x in enumerate(prefixes):
            got.append(used[i, : len(x.routes) + g[i]])
            want.append(np.concatenate([x.routes, r.routes[i][: g[i]]]))
        got, want = np.sort(np.concatenate(got), -1), np.sort(np.concatenate(want), -1)
        differ = (got != want).any(-1)  # [tokens, L_moe]: the layer's expert set differs
        out[name] = {
            "route_mismatch": float(differ.any(-1).mean()),
            "layer_route_mismatch": float(differ.mean()),
            **_kl(lp, fed, r, live),
        }
    return out


def dense_twin(cfg: ModelConfig) -> ModelConfig:
    """`cfg` without experts: the same attention, embedding and depth, every feed-forward block
    dense at the active width (k x the expert width): Qwen3 proper."""
    return dataclasses.replace(
        cfg,
        family="qwen3",
        d_ff=cfg.experts_per_token * cfg.expert_d_ff,
        num_experts=0,
        experts_per_token=0,
        expert_d_ff=0,
        moe_layers=(),
    )


def twin_model(model):
    """(config, graphdef, params, prompts, stop ids): `model`'s dense twin (`dense_twin`) with
    its weights: every weight but the experts' is the mixture's, and each MoE block becomes
    the dense block of its first k experts side by side, down projections divided by k: the
    mixture with every token sent to experts 0..k-1 at gate weight 1/k, so its feed-forward
    output has the mixture's scale. Nothing is routed."""
    cfg, _, params, prompts, stop_ids = model
    twin = dense_twin(cfg)
    graphdef, shape = init_params(twin, make_mesh({}, devices=jax.devices()[:1]), seed=0)
    flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    k = cfg.experts_per_token

    def take(path, x):
        key = jax.tree_util.keystr(path)
        if "['mlp']" not in key or flat[key].ndim == x.ndim:  # not an expert weight
            return flat[key]
        experts = flat[key][:k]  # gate, up [k, D, F] / down [k, F, D]
        if "['down']" in key:
            return (experts.reshape(-1, experts.shape[-1]) / k).astype(x.dtype)  # [kF, D]
        return jnp.moveaxis(experts, 0, 1).reshape(experts.shape[1], -1).astype(x.dtype)

    return twin, graphdef, jax.tree_util.tree_map_with_path(take, shape), prompts, stop_ids


def run_dense(model, seed: int, new_tokens: int) -> dict:
    """The sampler-vs-learner KL of a dense model (`twin_model`): nothing routed."""
    r, _, rows, fed, live = _sample(model, seed, new_tokens, record_routes=False)
    logp, _ = _learner(model[1])(model[2], rows, None)
    return {"route_mismatch": 0.0, "layer_route_mismatch": 0.0, **_kl(logp, fed, r, live)}


HEADER = (
    "| seed | setting | route mismatch (tokens) | (token, layer) pairs | KL k3 | max abs r |\n"
    "|---|---|---|---|---|---|"
)


def main(argv) -> int:
    p = parser("replay", __doc__)
    p.add_argument("--num_prompts", type=integer(1), default=32)
    p.add_argument("--new_tokens", type=integer(1), default=32)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated model / prompt seeds")
    p.add_argument(
        "--hf_checkpoint",
        default="",
        help="an HF MoE checkpoint with a tokenizer, prompted with arithmetic "
        "(e.g. configs/assets/arithmetic_moe_sft); default: the random tiny MoE",
    )
    shape = ("num_experts", "experts_per_token", "num_layers")
    p.add_argument("--num_experts", type=integer(2), help=f"random MoE (default {CFG.num_experts})")
    p.add_argument(
        "--experts_per_token", type=integer(1), help=f"random MoE ({CFG.experts_per_token})"
    )
    p.add_argument("--num_layers", type=integer(1), help=f"random MoE, all MoE ({CFG.num_layers})")
    p.add_argument(
        "--dense_twin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="random MoE: also the dense twin's row per seed (`twin_model`)",
    )
    args = parse(p, argv)
    given = [f"--{k}" for k in shape if getattr(args, k) is not None]
    if args.hf_checkpoint and given:
        p.error(
            f"{'/'.join(given)}: shape the random model; --hf_checkpoint's config.json is its own"
        )
    for k in shape:
        setattr(args, k, getattr(CFG, k) if getattr(args, k) is None else getattr(args, k))
    if args.experts_per_token > args.num_experts:
        p.error(f"--experts_per_token {args.experts_per_token} > --num_experts {args.num_experts}")
    cfg = shaped(args.num_experts, args.experts_per_token, args.num_layers)
    rows, lines = [], [HEADER]
    for seed in (int(s) for s in args.seeds.split(",")):
        if args.hf_checkpoint:
            model = trained_model(args.hf_checkpoint, seed, args.num_prompts)
        else:
            model = random_model(seed, args.num_prompts, cfg)
        res = run(model, seed, args.new_tokens)
        if args.dense_twin and not args.hf_checkpoint:  # the mixture with nothing routed
            res["dense twin"] = run_dense(twin_model(model), seed, args.new_tokens)
        for name, m in res.items():
            rows.append({"seed": seed, "setting": name, **m})
            lines.append(
                f"| {seed} | {name} | {m['route_mismatch']:.4f} | {m['layer_route_mismatch']:.4f}"
                f" | {m['kl_k3']:.3e} | {m['max_abs_r']:.3e} |"
            )
    kl = {(x["seed"], x["setting"]): x["kl_k3"] for x in rows}
    seeds = sorted({x["seed"] for x in rows})
    # How many times replay cuts the KL; inf where the replayed learner's log-probs are the
    # sampler's exactly (KL 0), written as null in the JSON.
    falls = [kl[s, "off"] / kl[s, "replay"] if kl[s, "replay"] > 0 else np.inf for s in seeds]
    median = float(np.median(falls))
    shown = lambda f: f"{f:.1f}x" if np.isfinite(f) else "exact (replay's KL is 0)"
    # inf: replay exact on at least half the seeds (not necessarily on each)
    mid = f"{median:.1f}x" if np.isfinite(median) else "inf"
    lines.append(
        f"KL off / replay: {', '.join(map(shown, falls))} (median {mid} over {len(seeds)} seeds)"
    )
    # The replayed KL over the dense twin's, per seed (None where the twin's is 0).
    twin = {
        s: kl[s, "replay"] / kl[s, "dense twin"] if kl[s, "dense twin"] else None
        for s in seeds
        if (s, "dense twin") in kl
    }
    if twin:
        shown = lambda f: "n/a (the twin's KL is 0)" if f is None else f"{f:.2f}"
        each = ", ".join(f"seed {s} {shown(f)}" for s, f in twin.items())
        lines.append(f"KL replay / dense twin: {each}")
    finite = lambda f: f if np.isfinite(f) else None
    r = {
        "config": vars(args),
        "model": str(model[0]),
        "rows": rows,
        "kl_falls": {s: finite(f) for s, f in zip(seeds, falls)},
        "kl_falls_median": finite(median),
        "kl_replay_over_dense_twin": twin or None,
    }
    return finish(args, r, "\n".join(lines))
