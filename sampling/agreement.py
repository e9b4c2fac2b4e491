"""Multi-process agreement on tool answers: every process of a run runs the same episode loop on
the same host values, so an answer counts once it is done everywhere, and must be the same
everywhere (`sampling.episodes`)."""

from __future__ import annotations

import zlib
from concurrent.futures import Future

import jax
import numpy as np
from jax.experimental import multihost_utils


def agreed_done(futures: list[Future]) -> list[Future]:
    """The futures that are done, on every process of a multi-process run: each process decides
    the same resumes and admissions, as SPMD needs (`futures` is in the same order everywhere)."""
    done = np.array([f.done() for f in futures], bool)
    if jax.process_count() == 1 or not futures:
        return [f for f, d in zip(futures, done) if d]
    done = multihost_utils.process_allgather(done).reshape(-1, len(futures)).all(axis=0)
    agreed = [f for f, d in zip(futures, done) if d]
    # Every process must append the same ids: a mismatch fails here instead of hanging later.
    digest = np.array([_digest(f) for f in agreed], np.int64)
    if agreed:
        all_digests = multihost_utils.process_allgather(digest).reshape(-1, len(agreed))
        if (all_digests != digest).any():
            raise RuntimeError(
                "an environment gave different observations on different processes; "
                "multi-process runs need deterministic tools"
            )
    return agreed


def _digest(future: Future) -> int:
    """A process-independent digest of a future's answer (-1: None, -2: it raised)."""
    if future.exception() is not None:
        return -2
    answer = future.result()
    if answer is None:
        return -1
    return zlib.crc32(np.asarray(list(answer), np.int64).tobytes())
