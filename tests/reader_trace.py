"""The files one rollout enters, in the order it first enters them (docs/architecture.md, "One
iteration"): a training run whose `step`-th rollout (by default the second of three: after a
compiled first step, and not the last, which saves and so drains the loop) runs under
`sys.setprofile` in every thread, recording each project file (not tests/, not the virtual
environment) at its first call.

    python -m tests.reader_trace --config configs/default.py [--config.<field>=...]

prints the list. Jitted programs compiled before the traced step run without entering Python; a
program that compiles in the traced step (a new prefill length, say, which in a multi-turn run
depends on when the tools answer) enters the model's and the kernels' files while JAX traces it.
Those entries are the device programs', not the host's path: they are listed apart ("traced
programs"), so that the host list is the same whichever shapes happen to compile.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclasses.dataclass
class Trace:
    """host: the project files the rollout's Python enters, in first-entry order; traced: those
    entered only while JAX traced a program that compiled in the traced step."""

    host: list[str]
    traced: list[str]


def trace(run, step: int = 2) -> Trace:
    """The project files entered, in first-entry order, by rollout number `step` of
    `run()` (a callable that trains: `launch.train.main` with its argv, say)."""
    from jax._src.core import trace_state_clean  # False inside a jit's trace (this thread's)

    from rl.rollout import Rollouts

    host: list[str] = []
    traced: list[str] = []
    calls, on, lock = [0], [False], threading.Lock()  # the lists: every thread's profile

    def profile(frame, event, arg):
        if on[0] and event == "call":
            f = frame.f_code.co_filename
            if f.startswith(ROOT) and not f[len(ROOT) :].startswith(("tests", ".venv")):
                rel = f[len(ROOT) :].replace(os.sep, "/")
                if rel in host:
                    return
                clean = trace_state_clean()
                with lock:
                    if clean and rel not in host:
                        host.append(rel)
                        if rel in traced:
                            traced.remove(rel)
                    elif not clean and rel not in traced and rel not in host:
                        traced.append(rel)

    call = Rollouts.__call__

    def rollout(self, *args, **kwargs):
        calls[0] += 1
        on[0] = calls[0] == step
        try:
            return call(self, *args, **kwargs)
        finally:
            on[0] = False

    before = sys.getprofile(), threading.getprofile()
    Rollouts.__call__ = rollout
    sys.setprofile(profile)
    threading.setprofile(profile)  # the reward and tool workers start inside the run
    try:
        run()
    finally:
        Rollouts.__call__ = call
        sys.setprofile(before[0])
        threading.setprofile(before[1])
    if calls[0] < step:
        raise ValueError(f"the run made {calls[0]} rollouts; step {step} was not traced")
    return Trace(host, traced)


def main(argv) -> int:
    import shutil
    import tempfile

    from launch.train import main as train

    argv = list(argv)
    if not any(a.startswith("--config.num_steps") for a in argv):
        argv += ["--config.num_steps=3", "--config.eval_every=0"]
    workdir = None
    if not any(a.startswith("--workdir") for a in argv):
        workdir = tempfile.mkdtemp(prefix="reader_trace_")
        argv.append(f"--workdir={workdir}")
    codes = []
    try:
        files = trace(lambda: codes.append(train(argv)))
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if codes != [0]:
        print(f"the training run failed (exit code {codes})", file=sys.stderr)
        return 1
    for i, f in enumerate(files.host, 1):
        print(f"{i:3d}  {f}")
    if files.traced:
        print(f"traced programs (compiled in this step): {', '.join(files.traced)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
