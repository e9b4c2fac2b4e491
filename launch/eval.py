"""Held-out evaluation of a training run: `python -m launch.eval --workdir W [--step N]`.

Restores the checkpoint (latest unless --step) and runs the run's own evaluation (config.eval,
config.data.eval): greedy accuracy and pass@k with the unbiased estimator. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from launch.build import load_run
from launch.cli import ArgumentParser, UsageError, fail
from launch.validate import load_source


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="python -m launch.eval",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--workdir", required=True, help="training run directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    args = p.parse_args(argv)
    try:
        run, step = load_run(args.workdir, args.step)
    except UsageError as e:
        return fail(str(e))
    try:  # the run's held-out data (a Hub dataset at the commit it recorded), one-line errors
        records = load_source(run.config, "eval")
    except (ValueError, OSError) as e:
        return fail(str(e))
    result = run.evaluate(run.state.params, records)
    print(json.dumps({"step": step, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
