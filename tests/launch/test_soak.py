"""Soak: many GRPO iterations of a tiny config compile nothing after the first, and neither host
memory nor the number of live device buffers grows.

`python -m tests.launch.test_soak 200` runs the long version and prints the figures."""

import ctypes
import json
import os
import sys

import jax
import pytest
from jax import monitoring

import launch.train as train_module
from rl import rollout as rollout_module
from tests.conftest import train_here

pytestmark = pytest.mark.slow  # twenty training iterations

LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # every trace that is lowered
CHECKPOINT_EVERY = 5  # the first save compiles orbax's per-device copies once
LIBC = ctypes.CDLL(None)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def _rss_bytes() -> int:
    """Host RSS after malloc_trim(0) (glibc): protobuf's upb, which encodes the TensorBoard
    events, calls it every 10,000 frees, so an untrimmed sample depends on where in that cycle
    it falls (about 18 steps of this config: RSS saw-tooths by 100-230 MiB while malloc's bytes
    in use stay flat). Trimming returns free pages only: a leak stays."""
    trim = getattr(LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pin_malloc_thresholds() -> None:
    """Pins glibc's mmap and trim thresholds at their defaults (128 KiB) for the rest of the
    process (in a pytest session the later tests keep them: only their speed can differ). Left
    dynamic, glibc raises them when a large mmapped block is freed (the mmap threshold to its
    size, the trim threshold to twice that): the learn step's 15.3 MiB scratch buffer per fake
    device is then carved from the arenas of XLA's threads, and those arenas' free tops stay
    resident (malloc_trim(0) trims the main arena's top only). Over 200 steps RSS then wandered
    over 80 MiB (9%) while malloc's bytes in use rose by 10 MiB, and the soak read -4.1% to
    +4.9% growth, packed or not. Pinned, RSS follows the bytes in use; a leak stays."""
    mallopt = getattr(LIBC, "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, 128 * 1024)
        mallopt(M_TRIM_THRESHOLD, 128 * 1024)


def soak(steps: int, workdir) -> list[dict]:
    """Runs the demo config for `steps` steps (in this process, tests.conftest.train_here, on a
    data=2 mesh of 2 of the fake devices: sharded state, so a recompile from a sharding mismatch
    or a per-shard copy that grows would show) and returns, per
    step and once after the loop (before the final evaluation), the lowerings so far, the host
    RSS and the live device arrays."""
    _pin_malloc_thresholds()
    lowerings, rows = [0], []

    def count(event, duration, **_):
        if event == LOWERING:
            lowerings[0] += 1

    original, evaluate = rollout_module.Rollouts.__call__, train_module._evaluate

    def snapshot(step):
        rows.append(dict(step=step, lowerings=lowerings[0], rss=_rss_bytes(),
                         live=len(jax.live_arrays())))  # fmt: skip

    def rollout(self, step, params, data, drain=False, stop=None):
        snapshot(step + 1)
        return original(self, step, params, data, drain, stop)

    def final_evaluate(run, state, records, log, step):
        if step == steps:
            snapshot(step + 1)  # the loop is over
        return evaluate(run, state, records, log, step)

    monitoring.register_event_duration_secs_listener(count)
    rollout_module.Rollouts.__call__ = rollout
    train_module._evaluate = final_evaluate
    try:
        # 8 held-out prompts, not 200: the evaluations before and after the loop are not soaked
        args = [f"--config.num_steps={steps}", "--config.eval_every=0", "--config.data.eval.num=8",
                "--config.mesh.data=2",
                f"--config.checkpoint_every={CHECKPOINT_EVERY}", f"--workdir={workdir}"]  # fmt: skip
        assert train_here(args, devices=2) == 0
    finally:
        rollout_module.Rollouts.__call__ = original
        train_module._evaluate = evaluate
        monitoring.unregister_event_duration_listener(count)
    return rows


def check(rows, settle: int) -> dict:
    """The soak's figures. Asserts that nothing is lowered after the first iteration except by
    the first checkpoint save (rows[i] is the start of step i + 1, rows[-1] the end of the loop),
    and that RSS and live device arrays do not grow from step `settle` (after that save) to the
    start of the last step.

    RSS is compared as the least reading over one checkpoint cycle at each end (steps settle to
    settle + 4, and the last five): work still in flight on other threads when RSS is read
    (scratch buffers of devices whose learn step has not released them, an async save) only adds
    to a reading, 15-60 MiB in about one reading in twenty. A leak raises every reading. Live
    device arrays are compared alike: an asynchronous save holds arrays of the state it copies
    until its thread has written them, on a loaded machine up to two steps after the save began
    (one device: 123 live arrays at every reading without a save in flight, 240 or 357 with one)."""
    save = CHECKPOINT_EVERY  # rows[save] is the start of the step after the first save
    first = min(r["rss"] for r in rows[settle - 1 : settle - 1 + CHECKPOINT_EVERY])
    last = min(r["rss"] for r in rows[-1 - CHECKPOINT_EVERY : -1])
    live = [min(r["live"] for r in rows[settle - 1 : settle - 1 + CHECKPOINT_EVERY]),
            min(r["live"] for r in rows[-1 - CHECKPOINT_EVERY : -1])]  # fmt: skip
    figures = {
        "lowerings_in_first_iteration": rows[1]["lowerings"] - rows[0]["lowerings"],
        "lowerings_by_first_save": rows[save]["lowerings"] - rows[save - 1]["lowerings"],
        "lowerings_otherwise": rows[save - 1]["lowerings"]
        - rows[1]["lowerings"]
        + rows[-1]["lowerings"]
        - rows[save]["lowerings"],
        "rss_growth": last / first - 1,
        "rss_mib": (round(first / 2**20), round(last / 2**20)),
        "live_arrays": tuple(live),
    }
    assert figures["lowerings_otherwise"] == 0, figures
    assert figures["rss_growth"] < 0.05, figures
    assert live[0] == live[1], figures
    return figures


def test_twenty_iterations_compile_once_and_do_not_grow(tmp_path):
    print(check(soak(20, tmp_path / "run"), settle=CHECKPOINT_EVERY + 2))


if __name__ == "__main__":
    import tempfile

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    jax.config.update("jax_num_cpu_devices", 8)
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(check(soak(n, os.path.join(d, "run")), settle=20), indent=2))
