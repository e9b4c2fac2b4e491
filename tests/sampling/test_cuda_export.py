"""The shipped real configs lower for CUDA from this CPU host, as tests/sampling/test_tpu_export.py
checks for TPU (same models, meshes and helpers): the sampler's decode step with the backend
`resolve_backend("auto", platform="gpu", ...)` picks (the Pallas Triton kernel, inside a
shard_map on a mesh), its prefill, and the learner's train step.

Lowering for CUDA needs no GPU: the Pallas Triton lowering runs on the host and puts the kernel's
Triton IR in a `__gpu$xla.gpu.triton` custom call; Triton compiles it only when XLA compiles the
module on a GPU, so what Triton rejects at compile time is not seen here. `jax.export` refuses
to serialize that custom call unless told to (`DisabledSafetyCheck.custom_call`): JAX gives no
compatibility guarantee for it. The engine lowers with `.lower(lowering_platforms=...)`, which
runs the same lowering without that check.

Coverage: the decode step and prefill of all three configs on one device and on the config's
mesh, as for TPU; the train step (its "auto" attention is the Pallas Triton flash attention of
models/attention_kernels.py, in a shard_map) on the mesh only, where it is partitioned, to keep
the cost down. The models have test_tpu_export.LAYERS of their layers, as there. The kernel itself is
also lowered alone at the head shapes of all three configs (7, 2 and 4 q heads per KV head,
head_dim 64 and 128) with the configs' bf16 pages of 32 tokens.
"""

import dataclasses
import functools
import re

import jax
import pytest

from configs import qwen3_0_6b_gsm8k
from launch.validate import learner_config
from models.sharding import make_mesh
from rl.learner import Learner
from sampling.lowering import lower_generate
from sampling.paged_attention import paged_attention
from tests.sampling.test_tpu_export import (
    MESHES,
    MODELS,
    _attention_args,
    _batch,
    _engine,
    _setup,
    check_pool_read_in_place,
    check_prefill_lowers,
)

pytestmark = pytest.mark.slow  # lowers every real config for CUDA

TRITON = "__gpu$xla.gpu.triton"  # the custom call of a Pallas Triton kernel


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", MODELS)
def test_decode_step_lowers_for_cuda(name, mesh_name):
    engine, params, mesh = _engine(name, mesh_name, "gpu")
    # Power-of-two head_dim (64, 128) and page_size (32), >= 16: the kernel, in a shard_map on
    # the mesh.
    assert engine.backend == "pallas_gpu"
    lowered = lower_generate(engine, params, platforms=("cuda",))
    text = lowered.as_text()
    assert f"mhlo.num_partitions = {mesh.size}" in text
    assert TRITON in text
    assert ("manual" in text) == (mesh.size > 1)
    check_pool_read_in_place(engine, lowered)


@pytest.mark.parametrize("resume", (False, True), ids=("prompts", "resume"))
@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", MODELS)
def test_prefill_lowers_for_cuda(name, mesh_name, resume):
    check_prefill_lowers(name, mesh_name, resume, "cuda")


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", MODELS)
def test_train_step_lowers_for_cuda(name, mesh_name):
    c, cfg, eos, graphdef, mesh, rules, shardings, params = _setup(name, mesh_name)
    learner = Learner(learner_config(c, eos), graphdef, shardings)
    lowered = learner.lower_step(params, _batch(c, mesh, rules), platforms=("cuda",))
    text = lowered.as_text()
    assert f"mhlo.num_partitions = {mesh.size}" in text
    # "auto" attention lowered for CUDA: the Triton flash-attention kernel
    # (models/attention_kernels.py) and no other custom call.
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {TRITON}
    state_out = jax.tree.leaves(lowered.out_info[0])
    want = jax.tree.leaves(learner.state_shardings)
    assert len(state_out) == len(want)
    for out, sharding in zip(state_out, want):
        assert out.sharding.is_equivalent_to(sharding, len(out.shape)), (out, sharding)


def test_pallas_gpu_lowers_for_cuda_but_jax_export_refuses_its_custom_call():
    """The Triton kernel lowers for the configs' head shapes without a GPU; `jax.export`
    serializes it only with the custom-call check disabled. Non-power-of-two head_dim fails in
    the Triton lowering itself (why "auto" needs powers of two). Unlike the TPU kernel, JAX
    lowers it on a replicated multi-device mesh (opaque to GSPMD: each device would run it on
    the whole cache), which is why the engine runs it inside a shard_map."""
    f = jax.jit(functools.partial(paged_attention, backend="pallas_gpu"))
    export = jax.export.export(f, platforms=["cuda"])
    unchecked = jax.export.export(
        f, platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]
    )
    for _, cfg, _ in MODELS.values():
        with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
            export(*_attention_args(cfg))
        assert TRITON in unchecked(*_attention_args(cfg)).mlir_module()
    qwen3 = MODELS["qwen3-0.6b"][1]
    with pytest.raises(ValueError, match="size is a power of 2. Encountered an array of shape"):
        unchecked(*_attention_args(dataclasses.replace(qwen3, head_dim=96)))
    mesh = make_mesh(dict(qwen3_0_6b_gsm8k.get_config().mesh))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    exported = unchecked(*_attention_args(qwen3, sharding=replicated))
    assert exported.nr_devices == 8 and TRITON in exported.mlir_module()
