"""Mesh construction and logical-axis sharding of parameters (the pjit / GSPMD model).

Parameters name their dimensions logically (`models.transformer`); a rules table, written in the
config, maps each logical name to zero or more mesh axes (`data`, `fsdp`, `expert`, `tensor`):

    rules = (("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"), ...)

Two choices a reader may question:
- A dimension whose size the mesh axes do not divide is replicated instead of raising. Tiny test
  models and GQA with fewer KV heads than the tensor axis need this; real models rarely hit it.
- A mesh axis used by an earlier dimension of the same array is not used again (a PartitionSpec may
  name each mesh axis once).

Parameters are created directly sharded: `init_params` jits the initialiser with `out_shardings`, so
no device ever holds a full unsharded copy (`init_adapters` likewise for a LoRA model's adapters).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from models import lora
from models.config import ModelConfig
from models.transformer import Transformer, shapes_only

# `expert` splits a mixture-of-experts model's experts (models/moe.py); for everything else it is
# one more axis that the rows are split over inside the experts' block only (size 1: absent).
MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Defaults for a (data, fsdp, expert, tensor) mesh: FSDP shards the model dimension, tensor
# parallelism the heads, MLP and vocabulary dimensions, expert parallelism the experts (and
# tensor each expert's width). Configs may override the whole table.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
    ("batch", ("data", "fsdp")),
)


_RUN_DEVICES: list | None = None  # `on_devices`; None: all of jax.devices()


def run_devices() -> list:
    """The devices a run's mesh is made of (`make_mesh`'s default): all of `jax.devices()`, or
    those of the enclosing `on_devices`."""
    return list(jax.devices()) if _RUN_DEVICES is None else list(_RUN_DEVICES)


@contextlib.contextmanager
def on_devices(devices: Sequence[jax.Device]) -> Iterator[None]:
    """Runs started in the block (`launch.train.main`, `launch.build.load_run`) use `devices`, a
    subset of this process's devices, and put unsharded arrays on the first: a notebook that
    trains on one of its chips, a test that trains on one of its 8 fake CPU devices in the test
    process, as a one-device process would (the same programs, so bitwise the same run), without
    the interpreter start and retracing of a subprocess. Single-process runs only."""
    global _RUN_DEVICES
    if jax.process_count() > 1:
        raise ValueError("on_devices: a multi-process run uses every process's devices")
    # Process-wide, like the run itself: a run's worker threads (tools, checkpoint saves) see the
    # same default device (jax.default_device would set the entering thread's only).
    previous = _RUN_DEVICES, jax.config.jax_default_device
    _RUN_DEVICES = list(devices)
    jax.config.update("jax_default_device", _RUN_DEVICES[0])
    try:
        yield
    finally:
        _RUN_DEVICES = previous[0]
        jax.config.update("jax_default_device", previous[1])


def make_mesh(
    shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
    """A mesh with axes (data, fsdp, expert, tensor) in that order over `devices` (default
    `run_devices()`); missing axes have size 1.

    Axis types are Auto (GSPMD propagation): jax 0.10's make_mesh defaults to Explicit.
    """
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh: unknown axis name(s) {unknown}; expected a subset of {MESH_AXES}")
    sizes = tuple(int(shape.get(a, 1)) for a in MESH_AXES)
    devices = run_devices() if devices is None else list(devices)
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh: {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices but "
            f"{len(devices)} are available; make the product of the axis sizes equal the device count"
        )
    return jax.make_mesh(
        sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def spec_axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry (None, a name or a tuple of names) as a tuple of mesh axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: Sequence[str]):
    """The PartitionSpec entry of a tuple of mesh axes: None, a name or the tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def hashable_rules(rules) -> tuple:
    """Sharding rules as nested tuples (a static jit argument, a cache key), also when a config
    writes them as lists."""
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rules)


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    rules: Iterable[tuple[str, str | Sequence[str] | None]],
    mesh: jax.sharding.Mesh,
) -> PartitionSpec:
    """The PartitionSpec of one array from its logical axis names (see the module docstring)."""
    table = {name: spec_axes(target) for name, target in rules}
    used: set[str] = set()
    spec = []
    for name, size in zip(axes, shape):
        if name is not None and name not in table:
            raise ValueError(f"sharding rules have no entry for logical axis {name!r}")
        targets = tuple(a for a in table.get(name, ()) if a not in used and mesh.shape[a] > 1)
        if targets and size % math.prod(mesh.shape[a] for a in targets):
            targets = ()  # not divisible: replicate this dimension
        used.update(targets)
        spec.append(spec_entry(targets))
    return PartitionSpec(*spec)


def is_var(x) -> bool:
    """Leaf test for parameter States: an nnx.Variable is one leaf (its metadata included)."""
    return isinstance(x, nnx.Variable)


def with_shardings(tree, shardings=None):
    """ShapeDtypeStructs of tree's leaves (arrays or shape structs) carrying `shardings` (a tree of
    the same structure), or each leaf's own sharding when None: abstract inputs for lowering and
    orbax restore targets, with nothing allocated."""
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings
    )


def state_shardings(state, mesh, rules):
    """NamedSharding for every leaf of a parameter State (abstract or concrete)."""

    def one(v):
        axes = v.get_metadata().get("axes")
        if axes is None:
            raise ValueError(f"parameter of shape {v.shape} has no logical `axes` metadata")
        return v.replace(NamedSharding(mesh, logical_to_spec(axes, v.shape, rules, mesh)))

    return jax.tree.map(one, state, is_leaf=is_var)


@functools.lru_cache(maxsize=16)
def abstract_model(cfg: ModelConfig):
    """(graphdef, abstract params) without allocating anything.

    Cached per config (a frozen dataclass): tracing the constructor costs ~0.4 s even for a tiny
    model, and a run's build, checkpoint reads and dry run ask for it several times. Callers must
    not mutate the returned State (none does: they map over it).
    """
    with shapes_only():  # shapes and dtypes only: no initializer's random draw is traced
        return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))


def init_params(cfg: ModelConfig, mesh, rules=DEFAULT_RULES, seed: int = 0):
    """(graphdef, params) with random weights created directly in their shardings. The seed's
    key is an argument of one jitted initializer per (config, mesh, rules), so another seed
    traces and compiles nothing again; the weights are those of `nnx.Rngs(seed)`, bit for bit."""
    graphdef, init = _initializer(cfg, mesh, hashable_rules(rules))
    with jax.set_mesh(mesh):
        return graphdef, init(jax.random.key(seed))


@functools.lru_cache(maxsize=64)
def _initializer(cfg: ModelConfig, mesh, rules):
    graphdef, abstract = abstract_model(cfg)
    shardings = state_shardings(abstract, mesh, rules)
    init = lambda key: nnx.state(Transformer(cfg, nnx.Rngs(key)))
    return graphdef, jax.jit(init, out_shardings=shardings)


def base_graphdef(cfg: ModelConfig):
    """The graph of the same model without LoRA adapters (for `lora.base(params)`)."""
    return abstract_model(lora.base_config(cfg))[0]


def init_adapters(cfg: ModelConfig, mesh, rules, seed: int) -> nnx.State:
    """The adapters of a fresh LoRA model (A random, B zero), created in their shardings. The
    whole model is traced, but only the adapters are outputs: XLA computes nothing else."""
    abstract = abstract_model(cfg)[1]
    shardings = state_shardings(lora.split(abstract)[0], mesh, rules)
    init = jax.jit(
        lambda: lora.split(nnx.state(Transformer(cfg, nnx.Rngs(seed))))[0], out_shardings=shardings
    )
    with jax.set_mesh(mesh):
        return init()


def path_name(path) -> str:
    """The dotted name ("blocks.0.attn.q") of a pytree path into a params State."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
    return ".".join(str(k) for k in keys if k != "value")


def flatten(params) -> dict[str, jax.Array]:
    """{"blocks.0.attn.q": array, ...} for a params State."""
    return {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def param_count(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
