"""Run logging: TensorBoard event files, metrics.jsonl and sample texts, from process 0 only.

TensorBoard events are written with the `tensorboard` package's own event-file writer and summary
protos (no TensorFlow needed). metrics.jsonl holds one JSON object per logged step; samples.jsonl
holds a few decoded completions per logged step, which TensorBoard also shows as text.
summary.json, written once at the end, holds the run's accuracy before and after, its throughput
and a fingerprint of the final parameters.
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
        self.enabled, self.workdir = enabled, workdir
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

    def completions(self, step: int, rollout, prompt_field: str, n: int) -> None:
        """texts() of a rollout's first n completions (`rl.rollout.Rollout`), with their prompts."""
        rows = [(grp.record[prompt_field], t) for grp in rollout.groups for t in grp.texts][:n]
        self.texts(step, [p for p, _ in rows], [t for _, t in rows], rollout.rewards[:n])

    def finish(self, config, summary, totals, after, wall, params_fingerprint) -> None:
        """summary.json and the run's last line: accuracy before and after, throughput, params
        fingerprint. `summary` is updated on every process, written by process 0."""
        k = f"pass@{config.eval.pass_k}"
        summary.update(
            accuracy_after=after["accuracy"], steps=config.num_steps, wall_seconds=wall,
            rollout_seconds=totals["rollout_seconds"], learn_seconds=totals["learn_seconds"],
            rollout_tokens_per_s=totals["rollout_tokens"] / max(totals["rollout_seconds"], 1e-9),
            learn_tokens_per_s=totals["learn_tokens"] / max(totals["learn_seconds"], 1e-9),
            params_fingerprint=params_fingerprint, **{k: after.get(k)},
        )  # fmt: skip
        if not self.enabled:
            return
        with open(os.path.join(self.workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        before = summary.get("accuracy_before", float("nan"))
        print(f"held-out greedy accuracy: before {before:.3f}, after {after['accuracy']:.3f} "
              f"({config.num_steps} steps, {wall:.0f} s); {self.workdir}")  # fmt: skip

    def close(self) -> None:
        if self.enabled:
            self.events.close()
            self.metrics.close()
            self.samples.close()
