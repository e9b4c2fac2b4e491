"""`python -m tests.launch.jittered_tools MS [launch.train flags]`: `launch.train` with each of
the calculator's answers (rl/envs/calculator.py) delayed by a random 0..MS milliseconds, drawn
from the OS's entropy (unseeded: every run, every process, gets other delays). For
tests/launch/test_partial_tools.py; imports nothing of tests.conftest (the run keeps its own
devices)."""

import random
import sys
import time

from rl.envs.calculator import CalculatorEnv


def jitter(ms: float) -> None:
    """Delays every CalculatorEnv.step by uniform(0, ms) ms (a tool on a loaded host)."""
    step, rng = CalculatorEnv.step, random.SystemRandom()

    def slow(self, episode, turn):
        time.sleep(rng.uniform(0.0, ms / 1000))
        return step(self, episode, turn)

    CalculatorEnv.step = slow


if __name__ == "__main__":
    from launch.train import main

    jitter(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
