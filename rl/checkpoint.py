"""Training checkpoints through orbax: train state, step, PRNG state and data-iterator state.

One `CheckpointManager` per workdir (`<workdir>/checkpoints/<step>/`), async saves, keep-N. A
checkpoint holds two items:
- `state`: the learner's TrainState (params, optimizer state, step) saved as sharded arrays;
  restoring targets the live state's abstract shapes and shardings, so arrays come back directly
  in their NamedShardings on the current mesh;
- `meta`: JSON with the step, the PRNG key data and the data iterator state, so that a resumed run
  draws the same prompts and the same random numbers as an uninterrupted one.

Orbax writes each checkpoint to a temporary directory and renames it when complete, so the latest
step listed is always a complete checkpoint, also after a crash in the middle of a save.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from models.sharding import flatten, with_shardings
from sampling.state import host_values


class Checkpointer:
    def __init__(self, workdir: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict[str, Any]) -> None:
        """Starts an async save; the previous one is finished first by orbax."""
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
        )

    def restore(self, state_like, step: int | None = None):
        """(state, meta) at `step` (default: latest), in the shardings of `state_like`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = with_shardings(state_like)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return restored.state, restored.meta

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def fingerprint(params) -> str:
    """sha256 of every parameter's bytes in a fixed order: equal iff the params are bitwise equal
    (what resume tests compare; a run's summary.json records it)."""
    h = hashlib.sha256()
    for name, x in sorted(flatten(params).items()):
        h.update(name.encode())
        h.update(np.ascontiguousarray(host_values(x)).tobytes())
    return h.hexdigest()
