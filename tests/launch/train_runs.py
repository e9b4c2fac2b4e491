"""Several `launch.train` runs one after the other in one process, for the multi-process tests
(tests/launch/test_multiprocess.py; tests/launch/host_tools.py splits its arguments alike):
`python -m tests.launch.train_runs FLAGS [--then FLAGS ...]`. One process start and one compile
for all of them: the later runs reuse the first's compiled programs, as the runs of
tests.conftest.train_here do in the test process. jax.distributed, started by the first run,
stays up for the others. Imports nothing of tests.conftest (a subprocess keeps its own
devices)."""

import sys

import launch.train as train


def segments(argv: list[str]) -> list[list[str]]:
    """The arguments of each run: `--then` between them."""
    runs = [[]]
    for a in argv:
        runs.append([]) if a == "--then" else runs[-1].append(a)
    return runs


def run(args: list[str], first: bool) -> int:
    """launch.train.main(args); a run after the first does not start jax.distributed again."""
    if not first:
        train.init_distributed = lambda config: None  # (started by the first run)
    return train.main(args)


if __name__ == "__main__":
    code = 0
    for i, args in enumerate(segments(sys.argv[1:])):
        code = run(args, first=i == 0)
        if code:
            break
    sys.exit(code)
