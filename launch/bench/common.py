"""What the benchmarks share (`launch.bench` and the bench_learn / bench_loop / bench_roofline
modules it dispatches to): model shapes, interleaved timing, random prompts, an engine runner.

A module of its own so that the benchmarks import it and `launch.bench` imports them, one way.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.page_allocator import group_pages

SMALL = dict(vocab_size=4096, d_model=256, d_ff=1024, num_layers=4, num_heads=8)
SMALL.update(num_kv_heads=2, head_dim=32)
TINY = dict(vocab_size=256, d_model=32, d_ff=64, num_layers=2, num_heads=4)
TINY.update(num_kv_heads=2, head_dim=8)


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
    """(run, engine): run() samples every prompt g times with `Engine.generate_all`."""
    plen = len(prompts[0])
    worst = group_pages(plen, new_tokens, ecfg_kw["page_size"], g)
    num_slots = num_slots or len(prompts) * g
    ecfg = EngineConfig(
        num_slots=num_slots, num_pages=worst * (num_slots // g) + 1,
        max_prompt_len=plen, max_new_tokens=new_tokens, **ecfg_kw,
    )  # fmt: skip
    engine = Engine(cfg, graphdef, ecfg, SamplingParams(temperature=1.0))
    box = {"state": engine.init_state()}

    def run():
        box["state"], results = engine.generate_all(params, box["state"], prompts, g, new_tokens)
        assert all(c.length == new_tokens for r in results for c in r)

    return run, engine
