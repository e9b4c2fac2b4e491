"""Run logging: TensorBoard event files, metrics.jsonl and sample texts, from process 0 only.

TensorBoard events are written with the `tensorboard` package's own event-file writer and summary
protos (no TensorFlow needed). metrics.jsonl holds one JSON object per logged step; samples.jsonl
holds a few decoded completions per logged step, which TensorBoard also shows as text.
summary.json, written once at the end, holds the run's accuracy before and after, its throughput
and a fingerprint of the final parameters.

With `config.log.wandb` the same scalars (at the same steps) also go to Weights & Biases, with the
run's config and, at the end, summary.json as the W&B summary (WANDB_MODE, WANDB_API_KEY and the
rest of W&B's environment apply). The W&B run id is kept in the workdir (`wandb_run_id`), so a
resumed run continues the same W&B run.

Every step is logged once, also after a kill -9 and a resume. A resumed run computes again the
steps since its checkpoint, bitwise as the killed run did; what the killed run logged of them
stands, and the resumed run skips a record (a step's scalars, its samples) that metrics.jsonl
already holds. That is exact because each record goes to TensorBoard (flushed) and W&B before
its line is written to metrics.jsonl: a line there means the other two have it. (W&B itself
drops points below the last step it holds; TensorBoard would keep both.)
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sys
import threading
import time
import traceback

import numpy as np
from tensorboard.compat.proto import event_pb2
from tensorboard.plugins.scalar.summary_v2 import scalar_pb
from tensorboard.plugins.text.summary_v2 import text_pb
from tensorboard.summary.writer.event_file_writer import EventFileWriter

WANDB_ID_FILE = "wandb_run_id"  # in the workdir: the W&B run a resumed run continues
WANDB_IN_USE_S = 90.0  # how long a resume waits for a killed run's W&B process to let its run go


class RunLogger:
    def __init__(self, workdir: str, enabled: bool = True, config=None):
        """Process 0 logs (`enabled`); `config.log.wandb` adds the W&B run."""
        self.enabled, self.workdir, self.wandb = enabled, workdir, None
        if not enabled:
            return
        # (step, keys) of the scalar records a killed run of this workdir logged already
        self.logged = _logged_records(os.path.join(workdir, "metrics.jsonl"))
        self.sampled = _logged_steps(os.path.join(workdir, "samples.jsonl"))
        self.events = EventFileWriter(os.path.join(workdir, "tensorboard"))
        _quiet_writer_thread()  # its disk errors reach the run through _events_errors
        self.metrics = _append(os.path.join(workdir, "metrics.jsonl"))
        self.samples = _append(os.path.join(workdir, "samples.jsonl"))
        if config is not None and config.get("log", {}).get("wandb"):
            self.wandb = _wandb_run(workdir, config)
            self._catch_up_wandb()

    def _catch_up_wandb(self) -> None:
        """A resumed W&B run gets the records of metrics.jsonl that W&B does not hold: W&B
        buffers its history (an offline run's transaction log is written in 32 KiB blocks), so
        a kill -9 loses what it had not written, while metrics.jsonl has every line."""
        rows = list(_rows(os.path.join(self.workdir, "metrics.jsonl")))
        if not rows:
            return
        held = _wandb_held(self.workdir, self.wandb)
        for row in rows:
            step = row.pop("step")
            if (step, frozenset(row)) not in held:
                self.wandb.log(row, step=step)

    @contextlib.contextmanager
    def _events_errors(self):
        """The event files' writer thread failed (a full disk): its OSError, raised here again,
        names the event files (launch.train stops on it in one line)."""
        try:
            yield
        except OSError as e:
            raise OSError(e.errno, e.strerror, os.path.join(self.workdir, "tensorboard")) from None

    def _event(self, step: int, summary) -> None:
        self.events.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One record: TensorBoard (flushed), W&B, then its line in metrics.jsonl. A record the
        workdir's metrics.jsonl holds already (a resumed run redoing a step) is skipped."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in values.items() if np.ndim(v) == 0}
        if (step, frozenset(clean)) in self.logged:
            return
        with self._events_errors():
            for tag, value in clean.items():
                self._event(step, scalar_pb(tag, value))
            self.events.flush()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        self.metrics.write((json.dumps({"step": step, **clean}) + "\n").encode())

    def texts(self, step: int, prompts: list[str], completions: list[str], rewards) -> None:
        """A step's sample texts, skipped when samples.jsonl holds that step already."""
        if not self.enabled or step in self.sampled:
            return
        rows = [
            {"step": step, "prompt": p, "completion": c, "reward": float(r)}
            for p, c, r in zip(prompts, completions, rewards)
        ]
        table = "\n\n".join(
            f"`{r['prompt']}` → `{r['completion']}` (reward {r['reward']:.2f})" for r in rows
        )
        with self._events_errors():
            self._event(step, text_pb("samples", table))
            self.events.flush()
        self.samples.write("".join(json.dumps(row) + "\n" for row in rows).encode())

    def completions(self, step: int, rollout, prompt_field: str, n: int) -> None:
        """texts() of a rollout's first n completions (`rl.rollout.Rollout`), with their prompts."""
        rows = [(grp.record[prompt_field], t) for grp in rollout.groups for t in grp.texts][:n]
        self.texts(step, [p for p, _ in rows], [t for _, t in rows], rollout.rewards[:n])

    def finish(self, config, summary, totals, after, wall, params_fingerprint) -> None:
        """summary.json and the run's last line: accuracy before and after, throughput, params
        fingerprint, and pass@k where it was measured (eval.pass_k > 0 and a record had k
        unmasked samples): a metric that was not measured is left out, never null or NaN.
        `summary` is updated on every process, written by process 0."""
        k = f"pass@{config.eval.pass_k}"
        summary.update(
            accuracy_after=after["accuracy"],
            steps=config.num_steps,
            wall_seconds=wall,
            rollout_seconds=totals["rollout_seconds"],
            learn_seconds=totals["learn_seconds"],
            rollout_tokens_per_s=totals["rollout_tokens"] / max(totals["rollout_seconds"], 1e-9),
            learn_tokens_per_s=totals["learn_tokens"] / max(totals["learn_seconds"], 1e-9),
            params_fingerprint=params_fingerprint,
        )
        if config.eval.pass_k and _measured(after.get(k)):
            summary[k] = after[k]
        if not self.enabled:
            return
        path = os.path.join(self.workdir, "summary.json")
        with open(f"{path}.tmp", "w") as f:  # whole or not at all (a full disk)
            json.dump(summary, f, indent=2)
        os.replace(f"{path}.tmp", path)
        if self.wandb is not None:
            self.wandb.summary.update(summary)
        before = summary.get("accuracy_before", float("nan"))
        steps = f"{config.num_steps} step{'s' * (config.num_steps != 1)}"
        print(
            f"held-out greedy accuracy: before {before:.3f}, after {after['accuracy']:.3f} "
            f"({steps}, {wall:.0f} s); {self.workdir}"
        )

    def close(self) -> None:
        if self.enabled:
            self.events.close()
            self.metrics.close()
            self.samples.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _measured(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _quiet_writer_thread() -> None:
    """TensorBoard's writer thread re-raises a disk error after keeping it for the next write,
    so threading prints its traceback too: not for disk errors (the run says them in one line)."""
    previous = threading.excepthook
    if getattr(previous, "event_writer", False):
        return

    def hook(args):
        disk = isinstance(args.exc_value, OSError) and args.exc_value.errno in DISK_ERRNOS
        frames = traceback.extract_tb(args.exc_traceback)
        if not (disk and any("event_file_writer" in f.filename for f in frames)):
            previous(args)

    hook.event_writer = True
    threading.excepthook = hook


DISK_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)


def _append(path: str):
    """`path` opened to append whole lines, unbuffered: each record is one write(2), which a
    kill -9 does not cut. A last line without its newline (cut by a full disk) is dropped."""
    if os.path.exists(path):
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    return open(path, "ab", buffering=0)


def _logged_records(path: str) -> set[tuple[int, frozenset]]:
    """(step, keys) of each record in a metrics.jsonl; a line cut short by a kill is ignored."""
    out = set()
    for row in _rows(path):
        out.add((row.pop("step"), frozenset(row)))
    return out


def _logged_steps(path: str) -> set[int]:
    return {row["step"] for row in _rows(path)}


def _rows(path: str):
    if not os.path.exists(path):
        return
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # the last line of a killed run, cut short
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                yield row


def _wandb_held(workdir: str, run) -> _Held:
    """What a resumed W&B run holds already: online, every step below the one W&B resumes at
    (its server drops lower steps anyway); offline, the history of the workdir's earlier
    offline runs of this id, read with W&B's own reader (`wandb leet inspect`). W&B merges the
    records of one step (a training step's and its evaluation's) into one row: a record is held
    when its step's row has all its keys."""
    if not run.offline:
        return _Held(below=run.step)
    import shutil
    import subprocess

    exe = shutil.which("wandb", path=os.path.dirname(sys.executable)) or shutil.which("wandb")
    held, top = _Held(), os.path.join(workdir, "wandb")
    for name in sorted(os.listdir(top)):
        path = os.path.join(top, name)
        if not name.startswith("offline-run-") or not name.endswith(run.id):
            continue
        if os.path.samefile(path, os.path.dirname(run.dir)):
            continue
        try:
            out = subprocess.run(
                [exe or "wandb", "leet", "inspect", "--json", path],
                capture_output=True,
                text=True,
                timeout=300,
            )
        except OSError as e:  # no wandb command
            out = subprocess.CompletedProcess([], 1, "", str(e))
        if out.returncode:
            why = " ".join((out.stderr or out.stdout).split())[:200]
            print(
                f"W&B: the history of {path} cannot be read (wandb leet inspect: {why}); the "
                "records a killed run's W&B lost are not sent again",
                file=sys.stderr,
            )
            return _Held(below=float("inf"))
        for line in out.stdout.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("type") == "history":
                item = record["history"]["item"]
                keys = {k for k in item if not k.startswith("_")}
                held.keys.setdefault(item.get("_step"), set()).update(keys)
    return held


class _Held:
    """The records W&B holds: every one at a step below `below`, and each whose keys its
    step's row (`keys`) has."""

    def __init__(self, below: float = 0):
        self.below, self.keys = below, {}

    def __contains__(self, record: tuple[int, frozenset]) -> bool:
        step, keys = record
        return step < self.below or keys <= self.keys.get(step, set())


def _wandb_run(workdir: str, config):
    """wandb.init for this workdir: the run id saved there (a resumed run), else a new run whose
    id is saved. launch.validate has checked that wandb imports."""
    import wandb

    from launch.cli import config_json

    w, id_file = config.log, os.path.join(workdir, WANDB_ID_FILE)
    run_id = open(id_file).read().strip() if os.path.exists(id_file) else None
    waited_since = None
    while True:
        try:
            run = wandb.init(
                project=w.wandb_project or None,
                entity=w.wandb_entity or None,
                name=w.wandb_name or os.path.basename(os.path.normpath(workdir)),
                tags=list(w.wandb_tags) or None,
                id=run_id,
                resume="allow" if run_id else None,
                dir=workdir,
                config=config_json(config),
            )
            break
        except Exception as e:  # noqa: BLE001 (no key, the server unreachable: one line)
            from launch.cli import UsageError
            from launch.pin import wandb_error

            if run_id and "in use" in str(e) and os.environ.get("WANDB_SERVICE"):
                # not a dying process: the W&B service of the process that started this one
                # (its WANDB_SERVICE) still holds the run of a killed run it also started
                raise UsageError(
                    f"config.log.wandb=True: W&B run {run_id} is still in use by the W&B service "
                    "this process inherited (WANDB_SERVICE is set: the process that started it "
                    "uses W&B itself and also started the killed run): unset WANDB_SERVICE or "
                    "restart that process, and run the same command"
                ) from None
            # A run killed a moment ago (kill -9) leaves its W&B service process behind for a
            # few seconds, holding the run id: wait for it rather than fail the resume.
            now = time.monotonic()
            if run_id and "in use" in str(e) and now - (waited_since or now) < WANDB_IN_USE_S:
                if waited_since is None:
                    waited_since = now
                    print(
                        f"W&B run {run_id} is still held by the W&B process of the run before "
                        f"this one; waiting up to {WANDB_IN_USE_S:.0f} s",
                        file=sys.stderr,
                    )
                time.sleep(2.0)
                continue
            if run_id and "in use" in str(e):
                raise UsageError(
                    f"config.log.wandb=True: W&B run {run_id} is still in use, most likely by the "
                    "W&B process (wandb-core) of a killed run of this workdir: end it (pkill -f "
                    "wandb-core) and run the same command"
                ) from None
            raise UsageError(wandb_error(e)) from None
    if run_id is None:
        with open(id_file, "w") as f:
            f.write(run.id)
    return run
