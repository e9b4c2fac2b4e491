"""The calculator's answers (rl/envs/calculator.py) delayed by a random 0..MS milliseconds each,
drawn from the OS's entropy (unseeded: every run, every process, gets other delays), for
tests/launch/test_partial_tools.py: `with jittered(MS): train_here(...)` in the test process, and
`python -m tests.launch.jittered_tools MS [launch.train flags]` for a run that is killed (a
subprocess). Imports nothing of tests.conftest (the subprocess keeps its own devices)."""

import contextlib
import random
import sys
import time

from rl.envs.calculator import CalculatorEnv


@contextlib.contextmanager
def jittered(ms: float):
    """Within the block, every CalculatorEnv.step is delayed by uniform(0, ms) ms (a tool on a
    loaded host); the instant tool is back after it."""
    step, rng = CalculatorEnv.step, random.SystemRandom()

    def slow(self, episode, turn):
        time.sleep(rng.uniform(0.0, ms / 1000))
        return step(self, episode, turn)

    CalculatorEnv.step = slow
    try:
        yield
    finally:
        CalculatorEnv.step = step


if __name__ == "__main__":
    from launch.train import main

    with jittered(float(sys.argv[1])):
        code = main(sys.argv[2:])
    sys.exit(code)
