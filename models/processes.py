"""The processes of a multi-process run: which process holds each batch shard of the mesh, and
`agree`, the one small collective through which they agree on what they must do alike. Beside
`models.sharding` (the mesh): the sampler (`sampling.engine`, its `Plan`) and the rollout
(`rl.rollout`, `rl.partial`, `rl.summary`, `rl.evaluation`) both use it, and neither owns it.

Each batch shard (`sampling.partitioned`) lives on the devices of one process, and that process
alone decides and feeds its slots: its requests, its tools, sandboxes and rewards, its results
read back from its own devices (`local_values`). What the processes must still do alike is the
sequence of jitted calls and their shapes (SPMD), and the few decisions that follow global
counts (when a partial rollout stops, how many records each shard draws): each process puts its
share in a fixed-size int32 vector, and `agree` gathers the vectors of all processes. No token,
log-prob or record travels this way; `global_array` builds a jitted call's input from each
process's rows of it, `shard_blocks` the learner batch from each process's shards' rows.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

CALLS = [0]  # collectives `agree` made in this process (the traffic test counts them)


def agree(values) -> np.ndarray:
    """int32 [P, n]: the vector `values` [n] of every process, in process order (one collective;
    none with one process)."""
    values = np.asarray(values, np.int32).reshape(-1)
    if jax.process_count() == 1:
        return values[None]
    CALLS[0] += 1
    return np.asarray(multihost_utils.process_allgather(values)).reshape(jax.process_count(), -1)


def agree_json(obj) -> list:
    """`obj` (JSON-able: counts, statistics) of every process, in process order: two
    collectives (the sizes, then the padded bytes); the object itself with one process."""
    if jax.process_count() == 1:
        return [obj]
    import json

    blob = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = agree([blob.size])[:, 0]
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: blob.size] = blob
    CALLS[0] += 1
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(bytes(r[:n]).decode()) for r, n in zip(rows, sizes)]


def shard_processes(mesh, shard_axes: tuple[str, ...]) -> list[int]:
    """The process that holds each of the S batch shards of `mesh` split over `shard_axes`
    (shard i = the devices at index i of those axes, major to minor), or ValueError when a
    shard's devices belong to several processes: a shard's slots are decided by one process."""
    names = list(mesh.axis_names)
    devices = np.moveaxis(
        mesh.devices, [names.index(a) for a in shard_axes], range(len(shard_axes))
    )
    per_shard = devices.reshape(int(np.prod([mesh.shape[a] for a in shard_axes])), -1)
    out = []
    for i, row in enumerate(per_shard):
        procs = sorted({d.process_index for d in row})
        if len(procs) > 1:
            raise ValueError(
                f"batch shard {i} of the mesh {dict(mesh.shape)} spans processes {procs}: a "
                "multi-process run needs each batch shard (the data x fsdp index) on one host's "
                "devices; split the axes that do not shard the batch (tensor) within a host"
            )
        out.append(procs[0])
    return out


def local_values(tree):
    """Numpy copies of (possibly sharded) arrays, full-size, with what this process's devices
    hold filled in and zeros elsewhere: reads nothing from another host (no collective)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)

    def one(x):
        out = np.zeros(x.shape, x.dtype)
        for s in x.addressable_shards:
            out[s.index] = np.asarray(s.data)
        return out

    return jax.tree.map(one, tree)


def global_array(host: np.ndarray, sharding):
    """The input of a jitted call from a full-size host array of which each process fills the
    rows of its own shards: with several processes a global array on `sharding`, each device's
    block taken from its own process's copy; with one, `host` itself (jit places it)."""
    if jax.process_count() == 1 or sharding is None:
        return host
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_blocks(blocks: dict, num_shards: int, sharding):
    """The [S*R, ...] array whose rows [i*R, (i+1)*R) are shard i's block [R, ...], from the
    blocks of this process's shards (`blocks`: shard -> numpy array), on `sharding` (rows split
    by shard, so each device's rows are one shard's: the learner batch)."""
    if jax.process_count() == 1:
        return jax.device_put(np.concatenate([blocks[i] for i in range(num_shards)]), sharding)
    block = next(iter(blocks.values()))
    r = block.shape[0]
    shape = (num_shards * r, *block.shape[1:])

    def rows(index):
        lo, hi, _ = index[0].indices(shape[0])
        i, off = divmod(lo, r)
        if hi - lo > r - off:
            raise ValueError(f"a device's rows [{lo}, {hi}) span two batch shards of {r} rows")
        return blocks[i][(slice(off, off + hi - lo), *index[1:])]

    return jax.make_array_from_callback(shape, sharding, rows)
