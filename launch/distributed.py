"""Multi-process runs: `init_distributed` starts `jax.distributed` before anything touches a
device, and `peer_failed` is how one process of several reports its failure and exits.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn

import jax

from launch.cli import UsageError


def init_distributed(config) -> None:
    """Multi-process runs: `jax.distributed.initialize()` on TPU / GPU clusters (it finds the
    coordinator itself) when config.distributed is set, or from the environment variables
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (e.g. CPU processes on one
    machine, with JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo). A process that sends no heartbeat
    for config.heartbeat_timeout_s is declared dead, and the coordination service then stops the
    others, so that a dead host cannot leave the rest waiting in a collective forever."""
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not (address or config.distributed):
        return
    timeout = config.heartbeat_timeout_s
    if not (isinstance(timeout, int) and timeout >= 1):
        raise UsageError(f"config.heartbeat_timeout_s={timeout!r}: must be an integer >= 1")
    if address:
        n, i = int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
        jax.distributed.initialize(address, n, i, heartbeat_timeout_seconds=timeout)
    else:
        jax.distributed.initialize(heartbeat_timeout_seconds=timeout)


PEER_LOST = (
    "gloo",
    "nccl",
    "collective",
    "connection",
    "socket",
    "unavailable",
    "heartbeat",
    "coordination",
    "barrier",
)  # words of the errors a dead peer causes


def peer_failed(error: Exception) -> NoReturn:
    """One process of a multi-process run failed: often in a collective, because another process
    died. Says so in one line (with the traceback too unless the error is of that kind) and exits
    at once: a normal exit would wait for the others at jax.distributed's shutdown barrier."""
    text = str(error).strip()
    lost = isinstance(error, jax.errors.JaxRuntimeError) and any(
        w in text.lower() for w in PEER_LOST
    )
    if not lost:
        traceback.print_exception(error)
    first = (text.splitlines() or [type(error).__name__])[0][:300]
    advice = (
        (
            " If another process died, restart all of them with the same command: the run "
            "resumes from its last complete checkpoint."
        )
        if lost
        else ""
    )
    print(
        f"error: process {jax.process_index()} of {jax.process_count()} stopped: {first}.{advice}",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(1)
