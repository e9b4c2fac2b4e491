r"""Load a model onto a mesh and show how it is sharded: `python -m launch.inspect`.

    python -m launch.inspect --hf_checkpoint tests/fixtures/hf/qwen3 --mesh data=2,fsdp=2,tensor=2 \
        --fake_devices 8   # on a CPU; on 8 chips leave it out

Reads an HF checkpoint directory straight into its shardings (one tensor at a time), prints every
parameter's shape, logical axes and PartitionSpec, the bytes each device holds, and a greedy
continuation of a few token ids (`--prompt_ids`, ids of the checkpoint's vocabulary). The mesh
must use every device; on a CPU-only machine `--fake_devices N` splits the CPU into N devices so
that a multi-device mesh can be tried. It is the quickest check that a checkpoint loads and that
a rules table shards it the way you meant.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from launch.cli import ArgumentParser, fail
from models.hf import load_hf
from models.hf_config import CheckpointError, config_from_hf
from models.sharding import flatten, make_mesh, param_count, run_devices


def parse_mesh(text: str) -> dict[str, int]:
    """Parses "data=2,fsdp=2,tensor=2" into {"data": 2, ...}; "" gives {}. ValueError (one
    line naming the flag) for anything else."""
    out = {}
    for part in filter(None, text.split(",")):
        name, _, size = part.partition("=")
        if not size.isdigit():
            raise ValueError(f"--mesh: expected name=size, got {part!r}")
        out[name.strip()] = int(size)
    return out


def parse_ids(text: str, vocab_size: int) -> list[int]:
    """Token ids from "5,17,42"; ValueError (one line naming the flag) for anything but a
    non-empty list of ids of a vocabulary of `vocab_size`."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--prompt_ids: expected comma-separated token ids, got {text!r}"
        ) from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"--prompt_ids: {bad[0]} is not a token id of the checkpoint "
            f"(its vocabulary is [0, {vocab_size}))"
        )
    return ids


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="python -m launch.inspect",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--hf_checkpoint", required=True, help="HF checkpoint directory")
    p.add_argument("--mesh", default="", help="e.g. data=2,fsdp=2,tensor=2 (default: data=all)")
    p.add_argument("--fake_devices", type=int, default=0, help="split the CPU into N devices")
    p.add_argument("--prompt_ids", default="5,17,42,7", help="comma-separated token ids")
    p.add_argument("--steps", type=int, default=8, help="greedy tokens to generate")
    args = p.parse_args(argv)
    if not os.path.isdir(args.hf_checkpoint):
        return fail(f"--hf_checkpoint: {args.hf_checkpoint} is not a directory")

    if args.fake_devices:  # before the first use of a device initialises the backend
        jax.config.update("jax_num_cpu_devices", args.fake_devices)
    try:
        mesh_shape = parse_mesh(args.mesh) or {"data": len(run_devices())}
        devices, need = run_devices(), math.prod(mesh_shape.values())
        if need != len(devices):  # the fix for a CPU named (the README's example is one)
            cpu = devices[0].platform == "cpu"
            raise ValueError(
                f"--mesh {args.mesh}: uses {need} devices but {len(devices)} are "
                "available"
                + (f"; on a CPU, --fake_devices {need} splits it into {need}" if cpu else "")
            )
        tokens = parse_ids(args.prompt_ids, config_from_hf(args.hf_checkpoint).vocab_size)
        mesh = make_mesh(mesh_shape)
        cfg, graphdef, params, ids = load_hf(args.hf_checkpoint, mesh)
    except (ValueError, CheckpointError) as e:
        return fail(str(e))
    print(f"{cfg.family}: {param_count(params) / 1e6:.3f}M parameters on mesh {dict(mesh.shape)}")
    per_device = {d: 0 for d in mesh.devices.flat}
    for name, x in flatten(params).items():
        print(f"  {name:32s} {str(x.shape):18s} {x.dtype}  {x.sharding.spec}")
        for shard in x.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    print(f"bytes per device: {sorted(set(per_device.values()))}")

    @jax.jit
    def next_token(params, tokens, positions):
        return jnp.argmax(nnx.merge(graphdef, params)(tokens, positions)[0][:, -1], axis=-1)

    for _ in range(args.steps):  # full recomputation: a smoke test, not the sampler
        x = np.asarray([tokens], np.int32)
        tokens.append(int(next_token(params, x, np.arange(x.shape[1])[None])[0]))
    print(f"greedy: {tokens} (stop ids {list(ids.eos_ids)}, pad id {ids.pad_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
