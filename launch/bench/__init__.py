"""Benchmarks: `python -m launch.bench <what> [flags]`; `python -m launch.bench <what> --help` lists
its flags. Each measurement prints a table and writes JSON (--output, default bench_<what>.json);
plots draws PNGs from those files (--out, a directory, default docs/img).

    sampler   sampler tokens/s against HF generate, an attention-free loop and the compute floor;
              with --shape / --num_seqs a model shape against the memory roofline (roofline.py)
    learn     the learner step: tokens/s, MFU, packed against padded rows
    loop      GRPO iterations and their time split; with --partial_rollouts synchronous against
              partial rollouts (partial.py)
    memory    compiled per-device temporaries against the sequence length (nothing runs)
    mesh      per mesh: the sampler's KV pool and rollout peak per device, and the collectives of
              a decode step in the compiled HLO (nothing runs; hlo.py reads the HLO)
    quant     the sampler with int8 / fp8 KV pages and decode weights against the f32 sampler:
              greedy tokens, log-prob KL and max |diff| (quant.py)
    replay    a tiny bf16 mixture of experts: sampler-vs-learner route mismatch and log-prob KL
              with routing replay off and on (replay.py)
    plots     the plots of docs/performance.md, from the JSON files of the others

One module per benchmark, each with `main(argv) -> int` (launch/bench/common.py holds what they
share: shapes, timing, the parser). Adding one is a module and its name in BENCHES. A bad flag
or benchmark name is one `error:` line, exit status 2, as for the other entry points.
"""

from __future__ import annotations

import importlib
import sys

from launch.cli import UsageError, fail

# launch.bench.<x>
BENCHES = ("sampler", "learn", "loop", "memory", "mesh", "quant", "replay", "plots")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    what = argv[0] if argv else ""
    if what not in BENCHES:
        given = f"{what!r}: no such benchmark" if what else "no benchmark given"
        return fail(
            f"{given}; expected python -m launch.bench <what> [--help], <what> one of "
            f"{', '.join(BENCHES)}"
        )
    try:
        return importlib.import_module(f"launch.bench.{what}").main(argv[1:])
    except UsageError as e:
        return fail(str(e))
