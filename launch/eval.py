"""Held-out evaluation of a training run: `python -m launch.eval --workdir W [--step N]`.

Restores the checkpoint (latest unless --step) and runs the run's own evaluation (config.eval,
config.data.eval): greedy accuracy and pass@k with the unbiased estimator. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from launch.build import load_run
from launch.cli import UsageError, fail
from rl.data import load_records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", required=True, help="training run directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    args = p.parse_args(argv)
    try:
        run, step = load_run(args.workdir, args.step)
    except UsageError as e:
        return fail(str(e))
    result = run.evaluate(run.state.params, load_records(run.config.data.eval))
    print(json.dumps({"step": step, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
