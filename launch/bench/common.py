"""What the benchmarks of `launch.bench` share: model shapes, interleaved timing, random prompts,
an engine runner, and the command line (a parser whose errors are one line, the flag types, the
JSON output).

A module of its own so that the benchmarks import it and nothing here imports them, one way.
A bad flag is one `UsageError` line naming the flag, the value and what is allowed
(`--tokens=128,128: 128 is given twice (comma-separated integers >= 1, each once)`), which
`launch.bench.main` prints as `error: ...` with exit status 2, as the other entry points do
(launch/cli.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from launch.cli import UsageError
from models.config import RopeScaling
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.episodes import generate_all
from sampling.requests import group_pages

SMALL = dict(vocab_size=4096, d_model=256, d_ff=1024, num_layers=4, num_heads=8)
SMALL.update(num_kv_heads=2, head_dim=32)
TINY = dict(vocab_size=256, d_model=32, d_ff=64, num_layers=2, num_heads=4)
TINY.update(num_kv_heads=2, head_dim=8)

_BENCH = dict(family="qwen2", qkv_bias=True, tie_embeddings=True)  # bench-small's family
# The registered model shapes (--shape of the roofline and memory benchmarks): ModelConfig
# kwargs by name (the real ones as in tests/sampling/test_tpu_export.py).
SHAPES = {
    "tiny": dict(_BENCH, **TINY),
    "small": dict(_BENCH, **SMALL),
    # tiny with Qwen3-MoE's experts in every layer (the memory bench's --expert test shape)
    "tiny_moe": dict(
        TINY,
        family="qwen3_moe",
        d_model=64,
        head_dim=16,
        qk_norm=True,
        num_experts=8,
        experts_per_token=2,
        expert_d_ff=32,
        norm_topk_prob=True,
    ),
    "qwen2_5_0_5b": dict(
        family="qwen2",
        vocab_size=151936,
        d_model=896,
        d_ff=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1e6,
        qkv_bias=True,
        tie_embeddings=True,
        max_position_embeddings=32768,
    ),
    # Qwen2.5-7B(-Instruct)'s config.json: untied embeddings, GQA 28 query heads on 4 KV heads.
    "qwen2_5_7b": dict(
        family="qwen2",
        vocab_size=152064,
        d_model=3584,
        d_ff=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1e6,
        qkv_bias=True,
        tie_embeddings=False,
        norm_eps=1e-6,
        max_position_embeddings=32768,
    ),
    # Qwen2.5-32B(-Instruct)'s config.json: a 30B-class dense shape, GQA 40 query heads on 8.
    "qwen2_5_32b": dict(
        family="qwen2",
        vocab_size=152064,
        d_model=5120,
        d_ff=27648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1e6,
        qkv_bias=True,
        tie_embeddings=False,
        norm_eps=1e-6,
        max_position_embeddings=32768,
    ),
    "qwen3_0_6b": dict(
        family="qwen3",
        vocab_size=151936,
        d_model=1024,
        d_ff=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1e6,
        qk_norm=True,
        tie_embeddings=True,
        max_position_embeddings=40960,
    ),
    # Qwen3-30B-A3B's config.json (tests/fixtures/hub_configs/qwen3_30b_a3b.json): 48 layers, all
    # of them experts (moe_layers: every layer, whatever --layers cuts the shape to), 128 experts
    # of width 768, 8 per token.
    "qwen3_30b_a3b": dict(
        family="qwen3_moe",
        vocab_size=151936,
        d_model=2048,
        d_ff=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1e6,
        qk_norm=True,
        tie_embeddings=False,
        max_position_embeddings=40960,
        num_experts=128,
        experts_per_token=8,
        expert_d_ff=768,
        norm_topk_prob=True,
    ),
    "llama3_2_1b": dict(
        family="llama",
        vocab_size=128256,
        d_model=2048,
        d_ff=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
        tie_embeddings=True,
        norm_eps=1e-5,
        max_position_embeddings=131072,
    ),
}


def interleaved(runs: dict, reps: int) -> dict:
    """Median seconds of each run, the runs alternating so that load from other processes hits
    them alike (the ratios are what the bench is for). Each run is called once first (compile)."""
    for fn in runs.values():
        fn()
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


def square_matmuls(sizes=(1024, 2048)) -> dict:
    """{"matmul_n": run} timing one f32 n x n matmul each (2 n^3 FLOPs)."""
    f = jax.jit(lambda a: a @ a)
    runs = {}
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        runs[f"matmul_{n}"] = functools.partial(lambda a: f(a).block_until_ready(), a)
    return runs


def random_prompts(num_prompts: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """num_prompts random prompts of prompt_len token ids in [1, vocab)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, (num_prompts, prompt_len)).tolist()


def engine_runner(cfg, graphdef, params, prompts, g, new_tokens, num_slots=None, **ecfg_kw):
    """(run, engine): run() samples every prompt g times with `sampling.episodes.generate_all`."""
    plen = len(prompts[0])
    worst = group_pages(plen, new_tokens, ecfg_kw["page_size"], g)
    num_slots = num_slots or len(prompts) * g
    ecfg = EngineConfig(
        num_slots=num_slots,
        num_pages=worst * (num_slots // g) + 1,
        max_prompt_len=plen,
        max_new_tokens=new_tokens,
        **ecfg_kw,
    )
    engine = Engine(cfg, graphdef, ecfg, SamplingParams(temperature=1.0))
    box = {"state": engine.init_state()}

    def run():
        box["state"], results = generate_all(engine, params, box["state"], prompts, g, new_tokens)
        assert all(c.length == new_tokens for r in results for c in r)

    return run, engine


class Parser(argparse.ArgumentParser):
    """argparse whose errors raise one UsageError line instead of printing usage and exiting.
    The flag types below word their messages "=value: expected ..." (joined to the flag's name);
    argparse's own (a flag without its value, an unknown flag) keep its words."""

    def error(self, message):
        if message.startswith("unrecognized arguments"):
            message += f" ({self.prog} --help lists the flags)"
        elif message.startswith("argument "):
            name, _, why = message[len("argument ") :].partition(": ")
            message = name + why if why.startswith("=") else f"{name}: {why}"
        raise UsageError(message)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help: the module docstring as written, each flag with its default."""


def parser(what: str, doc: str) -> Parser:
    """The parser of benchmark `what`, with the flag they all have: --output."""
    p = Parser(
        prog=f"python -m launch.bench {what}", description=doc, formatter_class=HelpFormatter
    )
    p.add_argument("--output", default=f"bench_{what}.json", help="JSON results file")
    return p


def parse(p: Parser, argv) -> argparse.Namespace:
    """p's flags from argv; an --output that `finish` could not write (a directory, a file in a
    directory that does not exist, a path this process may not write) fails now, not after the
    benchmark has run. The file is opened for appending, as the write will open it, rather than
    asked about with os.access (which says yes to root under /proc or on a read-only mount);
    one that was not there is removed again, so a failed parse leaves no file."""
    args = p.parse_args(argv)
    out = args.output
    out_dir = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        name = os.path.join(out, p.get_default("output"))
        p.error(f"--output={out}: is a directory; name the JSON file (e.g. --output={name})")
    if not os.path.isdir(out_dir):
        p.error(f"--output={out}: {out_dir} is not a directory")
    existed = os.path.lexists(out)
    try:
        with open(out, "a"):
            pass
    except OSError as e:
        p.error(f"--output={out}: cannot be written ({e.strerror.lower()})")
    if not existed:
        os.remove(out)
    return args


def finish(args, r: dict, table: str) -> int:
    """Prints the table and writes the results to --output."""
    print(table)
    with open(args.output, "w") as f:
        json.dump(r, f, indent=2)
        f.write("\n")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def integer(low: int = 1):
    """Flag type: an integer >= low."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"={text}: expected an integer >= {low}")
        return value

    return convert


def integers(low: int = 1, empty: bool = False):
    """Flag type: comma-separated distinct integers >= low (none at all only when `empty`)."""
    allowed = f"comma-separated integers >= {low}, each once"

    def convert(text: str) -> list[int]:
        out = []
        for item in (x.strip() for x in text.split(",") if x.strip()):
            try:
                value = int(item)
            except ValueError:
                value = None
            if value is None or value < low:
                raise argparse.ArgumentTypeError(
                    f"={text}: {item!r} is not an integer >= {low} (expected {allowed})"
                )
            if value in out:
                raise argparse.ArgumentTypeError(f"={text}: {value} is given twice ({allowed})")
            out.append(value)
        if not out and not empty:
            raise argparse.ArgumentTypeError(f"={text}: expected {allowed}, at least one")
        return out

    return convert


def one_of(names):
    """Flag type: one of `names`."""
    names = tuple(names)

    def convert(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"={text}: expected one of {', '.join(names)}")
        return text

    return convert


def some_of(names, empty: bool = False):
    """Flag type: a comma-separated list of distinct `names` (none at all only when `empty`)."""
    names = tuple(names)
    allowed = f"comma-separated, each once, of {', '.join(names)}"

    def convert(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        for i, item in enumerate(out):
            if item not in names:
                raise argparse.ArgumentTypeError(
                    f"={text}: {item!r} is not one of them ({allowed})"
                )
            if item in out[:i]:
                raise argparse.ArgumentTypeError(f"={text}: {item!r} is given twice ({allowed})")
        if not out and not empty:
            raise argparse.ArgumentTypeError(f"={text}: expected {allowed}, at least one")
        return out

    return convert
