"""Run logging: TensorBoard event files, metrics.jsonl and sample texts, from process 0 only.

TensorBoard events are written with the `tensorboard` package's own event-file writer and summary
protos (no TensorFlow needed). metrics.jsonl holds one JSON object per logged step; samples.jsonl
holds a few decoded completions per logged step, which TensorBoard also shows as text.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from tensorboard.compat.proto import event_pb2
from tensorboard.plugins.scalar.summary_v2 import scalar_pb
from tensorboard.plugins.text.summary_v2 import text_pb
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class RunLogger:
    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        self.events = EventFileWriter(os.path.join(workdir, "tensorboard"))
        self.metrics = open(os.path.join(workdir, "metrics.jsonl"), "a")
        self.samples = open(os.path.join(workdir, "samples.jsonl"), "a")

    def _event(self, step: int, summary) -> None:
        self.events.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in values.items() if np.ndim(v) == 0}
        for tag, value in clean.items():
            self._event(step, scalar_pb(tag, value))
        self.metrics.write(json.dumps({"step": step, **clean}) + "\n")
        self.metrics.flush()

    def texts(self, step: int, prompts: list[str], completions: list[str], rewards) -> None:
        if not self.enabled:
            return
        rows = [
            {"step": step, "prompt": p, "completion": c, "reward": float(r)}
            for p, c, r in zip(prompts, completions, rewards)
        ]
        for row in rows:
            self.samples.write(json.dumps(row) + "\n")
        self.samples.flush()
        table = "\n\n".join(
            f"`{r['prompt']}` → `{r['completion']}` (reward {r['reward']:.2f})" for r in rows
        )
        self._event(step, text_pb("samples", table))

    def close(self) -> None:
        if self.enabled:
            self.events.close()
            self.metrics.close()
            self.samples.close()
