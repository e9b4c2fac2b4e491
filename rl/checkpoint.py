"""Training checkpoints through orbax: train state, step, PRNG state and data-iterator state.

One `CheckpointManager` per workdir (`<workdir>/checkpoints/<step>/`), async saves, keep-N. A
checkpoint holds two items:
- `state`: the learner's TrainState (params, optimizer state, step) saved as sharded arrays;
  restoring targets the live state's abstract shapes and shardings, so arrays come back directly
  in their NamedShardings on the current mesh;
- `meta`: JSON with the step, the PRNG key data and the data iterator state, so that a resumed run
  draws the same prompts and the same random numbers as an uninterrupted one; plus, under
  `integrity`, a checksum of every leaf of the state (below).

Orbax writes each checkpoint to `<step>.orbax-checkpoint-tmp` and renames it when complete, so a
save killed midway leaves only that directory, which orbax does not list as a step (and deletes
when it saves that step again). A listed step can still be damaged afterwards: a file cut short,
deleted or overwritten on disk. `restore_latest` therefore tries the steps newest first and uses
the first one that passes every check, returning the reasons for those it skipped:
1. committed: `_CHECKPOINT_METADATA` holds orbax's commit timestamp, and `commit_success.txt` is
   there whenever the item directories have theirs (orbax >= 0.12.3 writes the step's last, just
   before the rename; older versions wrote none on local disks);
2. orbax reads both items (any exception: a missing or truncated file, an undecodable b-tree or
   chunk, a tree or shape that does not match the live state);
3. the meta is a JSON object for this step, and the restored state matches its checksums.
Why checksums: a garbled OCDBT b-tree node fails to decode, but array chunks are only
zstd-compressed, and a garbled byte in one usually still decodes, to wrong numbers, without an
error (tests/rl/test_checkpoint.py does exactly that). The record is computed on the device, one
small jitted program per leaf signature (two uint32 sums per leaf: sum of word * (2i + 1), which
changes with any single word, and a sum of mixed words): no host copy of the parameters (what
`fingerprint` would need, at every save), independent of the sharding (integer sums), and it
covers the optimizer state too. Checkpoints without the record (older saves) are checked by 1
and 2 only.
Restoring deletes and rewrites nothing: with `set_aside` (training), unusable steps newer than
the one restored are renamed to `<step>.unusable`, kept for inspection until someone deletes them
(orbax would otherwise skip saving those steps again); with no usable step, nothing is touched.
After a failed read orbax leaves reads in flight whose errors nobody awaits: they are silenced.

A save that fails (a full disk, a workdir turned read-only) is a `SaveError` naming the step,
the reason and the last complete checkpoint, raised by `save` or `check`: the training loop calls
`check` after every step, which waits for the previous step's save, so a run stops within one
step of a save that could not be written instead of training on with nothing saved. The failed
save's temporary directory is removed where orbax has let it go (it holds space a resume needs);
one left behind is never read, and the next save of that step replaces it.
"""

from __future__ import annotations

import gc
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import traceback
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from models.processes import local_values
from models.sharding import flatten, with_shardings

TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")  # a save that did not finish


class CheckpointError(ValueError):
    """No usable checkpoint (the message names the directory and why each step was refused)."""


class SaveError(RuntimeError):
    """A checkpoint could not be written; the message is one line saying what to do."""


class Checkpointer:
    def __init__(self, workdir: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self.pending: int | None = None  # the step of a save that may still be running
        _quiet_orbax_errors()  # a failed save is reported by SaveError, in one line

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict[str, Any]) -> None:
        """Starts an async save, once the previous one has finished (`check`)."""
        self.check()
        meta = {**meta, "integrity": {"checksums": checksums(state)}}
        self.pending = step
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
            )
        except Exception as e:  # noqa: BLE001 (a directory that cannot be made, ...)
            self._failed(e)

    def check(self) -> None:
        """Waits for the save in flight; raises SaveError if it failed."""
        if self.pending is None:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 (orbax re-raises the background save's error)
            self._failed(e)
        self.pending = None

    def _failed(self, e: BaseException) -> None:
        step, self.pending = self.pending, None
        try:  # orbax's threads end (their own errors again, unread)
            self.manager.close()
        except Exception:  # noqa: BLE001
            pass
        for name in os.listdir(self.directory) if os.path.isdir(self.directory) else ():
            m = TMP.match(name)
            if m and int(m.group(1)) == step:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        _quiet_abandoned_reads()
        raise SaveError(
            f"checkpoint {step} could not be written to {self.directory}: {_write_reason(e)} "
            f"({self.resume_hint(step)})"
        ) from None

    def resume_hint(self, failed: int | None = None) -> str:
        """What a run stopped by its disk says: the last complete checkpoint and what to do."""
        complete = sorted(s for s in _step_dirs(self.directory) if s != failed)
        last = f"step {complete[-1]}" if complete else "none"
        return (
            f"the last complete checkpoint is {last}; free the space, or make the workdir "
            "writable, and run the same command to resume"
        )

    def restore(self, state_like, step: int | None = None):
        """(state, meta) at `step` (default: the latest usable one), in the shardings of
        `state_like`. Raises CheckpointError when that checkpoint is unusable."""
        if step is None:
            return self.restore_latest(state_like)[:2]
        restored, reason = self._try(step, with_shardings(state_like))
        if reason:
            raise CheckpointError(f"checkpoint step {step} in {self.directory}: {reason}")
        return restored

    def restore_latest(self, state_like, set_aside: bool = False):
        """(state, meta, skipped) from the newest usable step; skipped lists (step, reason) for
        each newer step that was refused, unfinished saves included. With `set_aside`, refused
        steps are renamed out of orbax's way. When no step is usable, raises CheckpointError and
        touches nothing."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        abstract, refused = with_shardings(state_like), []
        for step in steps:
            restored, reason = self._try(step, abstract)
            if restored is None:
                refused.append((step, reason))
                continue
            if set_aside and refused:
                refused = [(s, f"{why}; kept as {self._set_aside(s)}") for s, why in refused]
            return (*restored, self._unfinished(after=step) + refused)
        details = "; ".join(f"step {s}: {why}" for s, why in refused)
        raise CheckpointError(
            f"no usable checkpoint in {self.directory} ({details}); its files are left as they are"
        )

    def _try(self, step: int, abstract):
        """((state, meta), None), or (None, why step is unusable), agreed by every process."""
        path = os.path.join(self.directory, str(step))
        restored, reason = None, _commit_problem(path)
        if reason is None:
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                    ),
                )
            except Exception as e:  # noqa: BLE001 - any failure to read makes the step unusable
                reason = _describe(e, path)
                _quiet_abandoned_reads()
        if reason is None:
            meta = restored.meta
            if not isinstance(meta, dict) or meta.get("step", step) != step:
                reason = f"meta/metadata is not the meta of step {step}: {str(meta)[:80]}"
            else:
                record = meta.pop("integrity", None)
                reason = _checksum_problem(restored.state, record) if record else None
        if jax.process_count() > 1:  # one process failing to read its shards fails them all
            failed = multihost_utils.process_allgather(np.int32(reason is not None))
            if failed.any() and reason is None:
                reason = "another process could not read it"
        return (None, reason) if reason else ((restored.state, meta), None)

    def _unfinished(self, after: int) -> list[tuple[int, str]]:
        """(step, reason) for saves of steps after `after` that did not finish."""
        out = []
        for name in sorted(os.listdir(self.directory), reverse=True):
            m = TMP.match(name)
            if m and int(m.group(1)) > after and os.path.isdir(os.path.join(self.directory, name)):
                out.append((int(m.group(1)), f"its save did not finish: only {name} exists"))
        return out

    def _set_aside(self, step: int) -> str:
        src = os.path.join(self.directory, str(step))
        dst, n = f"{src}.unusable", 1
        while os.path.exists(dst):
            dst, n = f"{src}.unusable-{n}", n + 1
        if jax.process_index() == 0:
            os.rename(src, dst)
        multihost_utils.sync_global_devices(f"checkpoint {step} set aside")
        self.manager.reload()
        return dst

    def close(self) -> None:
        """Waits for the last save (SaveError if it failed), then lets orbax go."""
        self.check()
        self.manager.close()


def host_values(tree):
    """Numpy copies of (possibly sharded) arrays, the same on every process (gathered from
    every host in a multi-process run)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def _step_dirs(directory: str) -> list[int]:
    """The steps whose directories a save renamed into place (orbax lists these as steps)."""
    try:
        return [int(n) for n in os.listdir(directory) if n.isdigit()]
    except OSError:
        return []


def _write_reason(e: BaseException) -> str:
    """One line for a failed write: the OS error's own words where one is named ("No space
    left on device"), else the innermost message's first line."""
    chain = [e]
    while len(chain) < 8 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    for x in chain:
        if isinstance(x, OSError) and x.errno:
            return os.strerror(x.errno) + (f" ({x.filename})" if x.filename else "")
        code = re.search(r"os_error_code='?(\d+)", str(x))
        if code:
            return os.strerror(int(code.group(1)))
    text = str(chain[-1]).strip().splitlines()
    return f"{type(chain[-1]).__name__}: {text[0][:300] if text else ''}"


def _quiet_orbax_errors() -> None:
    """orbax's save threads log their failure (absl, at ERROR, with its traceback) before the
    loop learns of it; SaveError says it in one line instead."""
    absl = logging.getLogger("absl")
    if not any(getattr(f, "orbax_errors", False) for f in absl.filters):

        def drop(record):
            return not (record.levelno >= logging.ERROR and _ORBAX in record.pathname)

        drop.orbax_errors = True
        absl.addFilter(drop)
        # and asyncio reports each of the save's writes that failed after the first
        logging.getLogger("asyncio").addFilter(
            lambda r: not ("never retrieved" in r.getMessage() and _from_orbax(r.exc_info))
        )
    # tensorstore then completes the failed save's writes into orbax's event loop, closed by
    # now: each callback prints "RuntimeError: Event loop is closed" through sys.excepthook,
    # from no Python frame of ours (call_soon_threadsafe is the outermost one).
    previous = sys.excepthook
    if not getattr(previous, "orbax_errors", False):

        def hook(kind, value, tb):
            frames = traceback.extract_tb(tb)
            if not (
                kind is RuntimeError
                and str(value) == "Event loop is closed"
                and frames
                and frames[0].name == "call_soon_threadsafe"
            ):
                previous(kind, value, tb)

        hook.orbax_errors = True
        sys.excepthook = hook
    previous_unraisable = sys.unraisablehook
    if not getattr(previous_unraisable, "orbax_errors", False):

        def unraisable(u):
            frames = traceback.extract_tb(u.exc_traceback)
            if not (
                u.exc_type is RuntimeError
                and str(u.exc_value) == "Event loop is closed"
                and frames
                and frames[0].name == "call_soon_threadsafe"
            ):
                previous_unraisable(u)

        unraisable.orbax_errors = True
        sys.unraisablehook = unraisable


def _from_orbax(exc_info) -> bool:
    tb = exc_info[2] if exc_info else None
    return any(_ORBAX in f.filename for f in traceback.extract_tb(tb))


def _commit_problem(path: str) -> str | None:
    """Why the step directory at `path` is not a committed orbax checkpoint, or None."""
    name = "_CHECKPOINT_METADATA"
    try:
        with open(os.path.join(path, name)) as f:
            committed = json.load(f).get("commit_timestamp_nsecs")
    except FileNotFoundError:
        return f"{name} is missing"
    except (OSError, ValueError, AttributeError) as e:
        return f"{name} is unreadable ({type(e).__name__}: {e})"
    if not committed:
        return f"not committed: {name} has no commit timestamp"
    marker = "commit_success.txt"
    if not os.path.exists(os.path.join(path, marker)) and glob.glob(
        os.path.join(path, "*", marker)
    ):
        return f"not committed: {marker} is missing"
    return None


def _quiet_abandoned_reads() -> None:
    """After a failed restore, orbax's reads still in flight end in errors that nothing awaits:
    printed, possibly later, as unraisable exceptions, asyncio's "Task exception was never
    retrieved" and warnings of coroutines never awaited. Drop those that come from orbax (the
    reason of the failure has been reported) and collect the abandoned tasks now."""
    previous = sys.unraisablehook
    if not getattr(previous, "abandoned_reads", False):

        def hook(u):
            code = getattr(u.object, "cr_code", None)
            if _ORBAX in getattr(code, "co_filename", "") or (
                u.exc_type is RuntimeError and str(u.exc_value) == "Event loop is closed"
            ):
                return
            previous(u)

        hook.abandoned_reads = True
        sys.unraisablehook = hook
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
        logging.getLogger("asyncio").addFilter(
            lambda r: not ("never retrieved" in r.getMessage() and _ORBAX in r.getMessage())
        )
    gc.collect()


_ORBAX = f"{os.sep}orbax{os.sep}"


def _describe(e: BaseException, path: str) -> str:
    """One line for an orbax / tensorstore read error: the innermost status message (it names
    the array and file), paths relative to the step directory `path`."""
    chain = [e]
    while len(chain) < 8 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    inner = next((x for x in chain if re.match(r"[A-Z_]+: ", str(x))), chain[0])
    text = str(inner).split(" [tensorstore_spec")[0].splitlines()[0]
    text = re.sub(r'Error opening "\w+" driver: ', "", text).replace(path + "/", "")
    missing = re.match(r"File (\S+) not found", text)
    if isinstance(inner, FileNotFoundError) and missing:
        return f"{missing.group(1)} is missing"
    if not re.match(r"[A-Z_]+: ", text):
        text = f"{type(inner).__name__}: {text}"
    return f"cannot read it: {text[:300]}"


def _words(x):
    """x's bits as uint32 words, elementwise: no reshape, so a sharded leaf stays sharded."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # a trailing axis of 2 words
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32)


def _mix(h):
    """murmur3's 32-bit finaliser: every input bit flips about half of the output bits."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@jax.jit
def _leaf_sum(x):  # uint32 [2]
    """One leaf's two sums: compiled once per (shape, dtype, sharding), which the layers of a
    model share."""
    w = _words(x)
    i, stride = jnp.zeros(w.shape, jnp.uint32), 1  # each word's flat index, mod 2**32
    for d in reversed(range(w.ndim)):
        i = i + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride % 2**32)
        stride *= w.shape[d]
    a = jnp.sum(w * (2 * i + 1), dtype=jnp.uint32)  # odd weights: any one word changes it
    b = jnp.sum(_mix(w ^ _mix(i)), dtype=jnp.uint32)
    return jnp.stack([a, b])


def _read(sums: jax.Array) -> np.ndarray:
    """A leaf's sums on the host: replicated (a full reduction's result), every process reads
    its own copy, with no collective; otherwise gathered."""
    return local_values(sums) if sums.is_fully_replicated else host_values(sums)


def checksums(state) -> dict[str, str]:
    """{leaf path: 16 hex digits} of every array in `state`, the same on every process and for
    any sharding of it: the integrity record of a checkpoint.

    One small program per leaf signature, dispatched per leaf: a single program over every leaf
    took a compile time that grew with the state (a Qwen3-0.6B state of params and Adam
    moments, 930 leaves on fsdp=8: 158 s of XLA:CPU compile at its default level, against 1.5 s
    for its 8 signatures; a Qwen2.5-7B state, 1,017 leaves: 273 s against 2.8 s for 10), and a
    run paid it at its first save and again at each resume."""
    named = jax.tree_util.tree_flatten_with_path(state)[0]
    # Each leaf's sums read before the next leaf's program starts: on XLA:CPU's devices of one
    # host, a hundred of these programs in flight, each with its all-reduce, deadlocked the
    # devices' rendezvous (7 of 8 arrived; the process aborts after 40 s).
    sums = [_read(_leaf_sum(x)) for _, x in named]
    return {
        jax.tree_util.keystr(p, simple=True, separator="/"): f"{int(a):08x}{int(b):08x}"
        for (p, _), (a, b) in zip(named, sums)
    }


def _checksum_problem(state, record: dict) -> str | None:
    saved, now = record.get("checksums", {}), checksums(state)
    if set(saved) != set(now):
        return "its integrity record lists other arrays than the state"
    bad = [k for k in now if now[k] != saved[k]]
    if not bad:
        return None
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return f"corrupt: {bad[0]}{more} does not match the checksum recorded at save"


def fingerprint(params) -> str:
    """sha256 of every parameter's bytes in a fixed order: equal iff the params are bitwise equal
    (what resume tests compare; a run's summary.json records it)."""
    h = hashlib.sha256()
    for name, x in sorted(flatten(params).items()):
        h.update(name.encode())
        h.update(np.ascontiguousarray(host_values(x)).tobytes())
    return h.hexdigest()
