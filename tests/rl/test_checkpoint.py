"""Checkpointer: a damaged latest checkpoint falls back to the previous complete one with the
reason; with none usable, one clear error and the files untouched; the integrity checksums."""

import glob
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from rl.checkpoint import Checkpointer, CheckpointError, _leaf_sum, checksums


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def _state(mesh, step: int):
    """A small sharded pytree; `w` is large enough to be stored in its own OCDBT data file."""
    w = jax.random.normal(jax.random.key(0), (64, 256)) + step
    return {
        "w": jax.device_put(w, NamedSharding(mesh, P("data"))),
        "b": jax.device_put(jnp.full((3,), step, jnp.bfloat16), NamedSharding(mesh, P())),
        "step": jax.device_put(jnp.int32(step), NamedSharding(mesh, P())),
    }


@pytest.fixture(scope="module")
def saved(mesh, tmp_path_factory):
    """A workdir with the checkpoints of steps 1, 2, 3 (copied by each test before damaging)."""
    workdir = tmp_path_factory.mktemp("saved")
    ckpt = Checkpointer(str(workdir))
    for step in (1, 2, 3):
        ckpt.save(step, _state(mesh, step), {"step": step})
    ckpt.close()
    return workdir


def _copy(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run"


def _data_file(step_dir):
    """The OCDBT data file that holds the chunks of `w` (the largest one)."""
    return max(glob.glob(f"{step_dir}/state/**/d/*", recursive=True), key=os.path.getsize)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _garble(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x55  # one byte of a zstd chunk: it still decodes, to other floats
    open(path, "wb").write(bytes(data))


def _tmp_dir_of_step_4(d):
    """What a kill -9 in the middle of the save of step 4 leaves (orbax renames on commit)."""
    shutil.copytree(d, d.parent / "4.orbax-checkpoint-tmp")
    os.remove(d.parent / "4.orbax-checkpoint-tmp" / "commit_success.txt")


def _snapshot(root):
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _equal(a, b):
    return a.keys() == b.keys() and all(
        np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a
    )


CORRUPTIONS = {
    "truncated array file": (lambda d: _truncate(_data_file(d)), "OUT_OF_RANGE"),
    "deleted array file": (lambda d: os.remove(_data_file(d)), 'Error reading "w/'),
    "garbled array file": (lambda d: _garble(_data_file(d)), "corrupt: w does not match the checksum"),
    "garbled b-tree": (lambda d: _garble(glob.glob(f"{d}/state/d/*")[0]), "DATA_LOSS"),
    "deleted manifest": (lambda d: os.remove(d / "state/manifest.ocdbt"), "NOT_FOUND"),
    "deleted meta": (lambda d: os.remove(d / "meta/metadata"), "meta/metadata is missing"),
    "deleted commit marker": (lambda d: os.remove(d / "commit_success.txt"), "commit_success.txt is missing"),
    "deleted checkpoint metadata": (lambda d: os.remove(d / "_CHECKPOINT_METADATA"), "_CHECKPOINT_METADATA is missing"),
    "truncated checkpoint metadata": (lambda d: _truncate(d / "_CHECKPOINT_METADATA"), "_CHECKPOINT_METADATA is unreadable"),
}  # fmt: skip


# Three corruptions whose failure (an array file, the b-tree) a fast case already reaches run in the
# full suite only: restoring a damaged array costs ~3.5 s each.
SLOW_CORRUPTIONS = ("deleted array file", "truncated array file", "garbled b-tree")


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow if n in SLOW_CORRUPTIONS else ()) for n in CORRUPTIONS],
)
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(name, saved, mesh, tmp_path):
    damage, reason = CORRUPTIONS[name]
    workdir = _copy(saved, tmp_path)
    damage(workdir / "checkpoints" / "3")
    ckpt = Checkpointer(str(workdir))
    state, meta, skipped = ckpt.restore_latest(_state(mesh, 0))
    assert meta == {"step": 2} and _equal(state, _state(mesh, 2))
    assert [s for s, _ in skipped] == [3] and reason in skipped[0][1], skipped
    with pytest.raises(CheckpointError, match=f"checkpoint step 3 in {ckpt.directory}: "):
        ckpt.restore(_state(mesh, 0), 3)
    # Set aside, step 3 is out of orbax's way: training from step 2 saves step 3 again.
    state, meta, skipped = ckpt.restore_latest(_state(mesh, 0), set_aside=True)
    assert meta["step"] == 2 and skipped[0][1].endswith(f"kept as {ckpt.directory}/3.unusable")
    assert sorted(os.listdir(ckpt.directory)) == ["1", "2", "3.unusable"]
    ckpt.save(3, _state(mesh, 33), {"step": 3})
    ckpt.close()
    state, meta, skipped = Checkpointer(str(workdir)).restore_latest(_state(mesh, 0))
    assert meta == {"step": 3} and skipped == [] and _equal(state, _state(mesh, 33))


def test_an_interrupted_save_is_not_the_latest_checkpoint(saved, mesh, tmp_path):
    workdir = _copy(saved, tmp_path)
    _tmp_dir_of_step_4(workdir / "checkpoints" / "3")
    ckpt = Checkpointer(str(workdir))
    assert ckpt.latest_step() == 3
    state, meta, skipped = ckpt.restore_latest(_state(mesh, 0), set_aside=True)
    assert meta == {"step": 3} and _equal(state, _state(mesh, 3))
    assert skipped == [(4, "its save did not finish: only 4.orbax-checkpoint-tmp exists")]
    ckpt.save(4, _state(mesh, 4), {"step": 4})  # orbax replaces the unfinished directory
    ckpt.close()
    assert sorted(os.listdir(ckpt.directory)) == ["2", "3", "4"]  # keep=3
    state, meta, skipped = Checkpointer(str(workdir)).restore_latest(_state(mesh, 0))
    assert meta == {"step": 4} and skipped == [] and _equal(state, _state(mesh, 4))


def test_with_no_usable_checkpoint_restore_fails_clearly_and_touches_nothing(saved, mesh, tmp_path):
    workdir = _copy(saved, tmp_path)
    checkpoints = workdir / "checkpoints"
    CORRUPTIONS["garbled array file"][0](checkpoints / "3")
    CORRUPTIONS["truncated array file"][0](checkpoints / "2")
    CORRUPTIONS["deleted commit marker"][0](checkpoints / "1")
    _tmp_dir_of_step_4(checkpoints / "3")
    before = _snapshot(workdir)
    ckpt = Checkpointer(str(workdir))
    for set_aside in (False, True):
        with pytest.raises(CheckpointError) as e:
            ckpt.restore_latest(_state(mesh, 0), set_aside=set_aside)
        message = str(e.value)
        assert message.startswith(f"no usable checkpoint in {checkpoints} (step 3: corrupt: w ")
        assert "; step 2: cannot read it: OUT_OF_RANGE" in message
        assert message.endswith("; step 1: not committed: commit_success.txt is missing); its "
                                "files are left as they are")  # fmt: skip
        assert "\n" not in message
    ckpt.close()
    assert _snapshot(workdir) == before


def test_checksums_see_one_changed_word_and_not_the_sharding(mesh):
    state = _state(mesh, 1)
    replicated = jax.device_put(state, NamedSharding(mesh, P()))
    assert checksums(state) == checksums(replicated)
    assert set(checksums(state)) == {"w", "b", "step"}
    w = np.asarray(state["w"]).copy()
    w.view(np.uint32)[37, 200] ^= 1  # the last bit of one float
    changed = checksums({**state, "w": jax.device_put(w, state["w"].sharding)})
    assert changed["w"] != checksums(state)["w"] and changed["b"] == checksums(state)["b"]
    key = {"key": jax.random.key(3), "flag": jnp.array([True, False])}
    assert len(checksums(key)["key"]) == len(checksums(key)["flag"]) == 16


def _reference_sums(x: np.ndarray) -> str:
    """The checksum in numpy: the leaf's bits as uint32 words (a trailing axis of 2 for 8-byte
    items), i = each word's flat index; a = sum(w * (2i + 1)), b = sum(mix(w ^ mix(i))), both
    mod 2**32, with murmur3's 32-bit finaliser as mix."""
    x = x.astype(np.uint8) if x.dtype == np.bool_ else x
    w = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[x.dtype.itemsize])
    w = w.astype(np.uint32).reshape(-1)
    i = np.arange(w.size, dtype=np.uint32)

    def mix(h):
        h = (h ^ (h >> np.uint32(16))) * np.uint32(0x85EBCA6B)
        h = (h ^ (h >> np.uint32(13))) * np.uint32(0xC2B2AE35)
        return h ^ (h >> np.uint32(16))

    a = np.sum(w * (np.uint32(2) * i + np.uint32(1)), dtype=np.uint32)
    b = np.sum(mix(w ^ mix(i)), dtype=np.uint32)
    return f"{int(a):08x}{int(b):08x}"


def test_checksums_equal_numpy_and_compile_once_per_leaf_signature(mesh, caplog):
    """Twelve leaves of three signatures (shape, dtype, sharding), as a model's layers repeat
    theirs: each leaf's checksum is the numpy reference's, and XLA compiles three programs, not
    one that grows with the leaves (a whole-state program over a Qwen3-0.6B state compiled in
    158 s on XLA:CPU)."""
    rng = np.random.default_rng(5)
    rows = NamedSharding(mesh, P("data"))
    state = {}
    for layer in range(4):  # three signatures, repeated as layers repeat theirs
        state[f"{layer}/q"] = rng.standard_normal((40, 24)).astype(np.float32)
        state[f"{layer}/norm"] = rng.standard_normal(23).astype(jnp.bfloat16)
        state[f"{layer}/mask"] = rng.integers(0, 2, (7, 3)).astype(bool)
    on_mesh = {
        k: jax.device_put(
            v, rows if v.ndim == 2 and v.dtype == np.float32 else NamedSharding(mesh, P())
        )
        for k, v in state.items()
    }
    _leaf_sum.clear_cache()  # compiled here, whatever this worker's earlier tests compiled
    with caplog.at_level("WARNING"), jax.log_compiles(True):
        got = checksums(on_mesh)
    compiled = [
        r for r in caplog.records if "_leaf_sum" in r.getMessage() and "Compiling" in r.getMessage()
    ]
    assert got == {k: _reference_sums(np.asarray(v)) for k, v in state.items()}
    assert len(compiled) == 3, [r.getMessage()[:120] for r in compiled]
