"""Preemption: SIGTERM or SIGINT asks the run to stop after the current step, with a checkpoint.

A preempted TPU VM or spot instance gets SIGTERM before it goes (GCE gives spot and preemptible
VMs about 30 s; TPU VM maintenance events and `gcloud ... tpu-vm stop` send SIGTERM to the
processes too), and Ctrl-C sends SIGINT. Either sets a flag; `launch.train` checks it after each
step, saves that step's checkpoint, prints one line and exits 0, so a restart of the same command
resumes exactly. A second signal is not caught (the handlers are restored on the first), so
pressing Ctrl-C twice still stops at once. In a multi-process run every process stops once any of
them was signalled (`requested` agrees across processes), so all save the same step.
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """Context manager: while inside, SIGTERM / SIGINT set `signal_name` instead of killing."""

    def __init__(self):
        self.signal_name: str | None = None
        self._old = {}

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        for s, old in self._old.items():  # a second signal acts as usual
            signal.signal(s, old)

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # handlers need the main thread
            self._old = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def catching(self, iterable):
        """Yields from iterable with the handlers installed, restoring them afterwards."""
        with self:
            yield from iterable

    def requested(self) -> bool:
        """Whether any process has been signalled (the same answer on every process)."""
        asked = self.signal_name is not None
        if jax.process_count() > 1:
            asked = bool(multihost_utils.process_allgather(np.array(asked)).any())
        return asked
