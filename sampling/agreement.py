"""Multi-process agreement: every process of a run runs the same episode loop on the same host
values, so a tool's answer counts once it is done everywhere, and must be the same everywhere
(`sampling.episodes`); and host values that decide what is sampled or trained next (the
rewards: dynamic sampling's replacements, the learner batch) must agree (`check_agreed`), or the
processes would part ways and wait in different collectives forever."""

from __future__ import annotations

import zlib
from concurrent.futures import Future

import jax
import numpy as np
from jax.experimental import multihost_utils


def agreed_done(
    futures: list[Future], what="an environment's observations", need="deterministic tools"
) -> list[Future]:
    """The futures that are done, on every process of a multi-process run: each process decides
    the same resumes and admissions, as SPMD needs (`futures` is in the same order everywhere).
    Their answers must agree too (`check_agreed` with `what` and `need`)."""
    done = np.array([f.done() for f in futures], bool)
    if jax.process_count() == 1 or not futures:
        return [f for f, d in zip(futures, done) if d]
    done = multihost_utils.process_allgather(done).reshape(-1, len(futures)).all(axis=0)
    agreed = [f for f, d in zip(futures, done) if d]
    check_answers(agreed, what, need)
    return agreed


def check_answers(futures: list[Future], what="an environment's observations",
                  need="deterministic tools") -> None:  # fmt: skip
    """Raises unless the answers of `futures` (done) are the same on every process of a
    multi-process run (`check_agreed`); the futures that every process takes at the same point
    of the loop, whether by `agreed_done` or on the loop's logical clock (`sampling.episodes`)."""
    if jax.process_count() == 1 or not futures:
        return
    # every process must append the same ids: a mismatch fails here, not later
    check_agreed(np.array([_digest(f) for f in futures], np.int32), what, need)


def check_agreed(values: np.ndarray, what: str, need: str) -> None:
    """Raises (naming `what`, and `need`: what a multi-process run needs) unless `values` are
    the same on every process of a multi-process run. One small collective; none with one
    process."""
    if jax.process_count() == 1:
        return
    digest = np.array([_crc(np.ascontiguousarray(values).tobytes())], np.int32)
    everywhere = multihost_utils.process_allgather(digest).reshape(-1)
    if (everywhere != digest[0]).any():
        raise RuntimeError(
            f"{what} differ between processes (process {jax.process_index()} of "
            f"{jax.process_count()}); multi-process runs need {need}"
        )


def _digest(future: Future) -> int:
    """A process-independent digest of a future's answer (-1: None, -2: it raised)."""
    if future.exception() is not None:
        return -2
    answer = future.result()
    if answer is None:
        return -1
    values = np.asarray(list(answer))  # ids (tools) or floats (rewards), compared exactly
    return _crc(values.dtype.str.encode() + values.tobytes())


def _crc(data: bytes) -> int:
    """CRC-32 as a signed 32-bit int: collectives carry int32 (int64 only with jax_enable_x64),
    and a crc of 2**31 or more would come back changed and differ from the process's own."""
    return int(np.array(zlib.crc32(data), np.uint32).view(np.int32))
