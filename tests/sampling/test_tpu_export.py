"""The shipped real configs lower for TPU: the sampler's decode step and prefill (fresh prompts
and a multi-turn resume) and the learner's train step of Qwen2.5-0.5B, Qwen3-0.6B and
Llama-3.2-1B, lowered for platform "tpu" from this CPU host (what `jax.export` does), on one
device and on the config's 8-device mesh.

Lowering for TPU runs the real TPU lowering, Mosaic's included, without a TPU: a Pallas kernel
that cannot lower for a shape fails here as it would on the chip. Everything is abstract
(ShapeDtypeStruct, `models.sharding.abstract_model`): model shapes and sampler and batch sizes
are the configs' own, and nothing is allocated. The decode step uses the backend that
`resolve_backend("auto", platform="tpu", ...)` picks for its shape and mesh (the Mosaic kernel for
head_dim 128, inside a shard_map on the mesh), and its lowered module must copy no KV pool
(`pool_copies`); a test exports the Pallas TPU kernel alone with `jax.export` to pin why "auto"
avoids it for head_dim 64 and why a mesh needs the shard_map.

The models are lowered with LAYERS = 2 of their layers, not 16-28: every other shape (widths,
heads, vocabulary, KV pool, batch, sequence lengths, meshes) is the config's own. The layers are a
Python loop of identical blocks (`models.transformer`), so each block lowers as in the full
model, and what is checked here (the kernels chosen, the partitioning, the pools read in place,
the state's shapes and shardings) does not depend on how many there are; tracing the real layer
counts took several seconds per model and mesh for the train step (115 s of CPU for this file
and test_cuda_export.py, 2 cores) to check nothing more. launch.bench memory and --dry_run
lower the full models.
tests/sampling/test_cuda_export.py does the same for platform "cuda" with these helpers.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from configs import llama3_2_1b_gsm8k, qwen2_5_0_5b_gsm8k, qwen3_0_6b_gsm8k
from launch.validate import engine_config, learner_config, sampling_params
from models.config import ModelConfig, RopeScaling
from models.sharding import abstract_model, make_mesh, state_shardings, with_shardings
from rl.learner import Batch, Learner, batch_sharding
from sampling.engine import MAX_PREFILL_BATCH, Engine, bucket
from sampling.lowering import lower_generate, lower_prefill
from sampling.paged_attention import paged_attention, resolve_backend

pytestmark = pytest.mark.slow  # lowers every real config for TPU

# The HF config.json of each checkpoint, as `models.hf_config.config_from_hf` reads it, with
# the configs' compute settings (bf16 compute, f32 master weights, remat); eos ids for stops.
MODELS = {
    "qwen2.5-0.5b": (
        qwen2_5_0_5b_gsm8k,
        ModelConfig(
            family="qwen2", vocab_size=151936, d_model=896, d_ff=4864, num_layers=24,
            num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6, qkv_bias=True,
            tie_embeddings=True, max_position_embeddings=32768,
        ),
        (151645, 151643),
    ),
    "qwen3-0.6b": (
        qwen3_0_6b_gsm8k,
        ModelConfig(
            family="qwen3", vocab_size=151936, d_model=1024, d_ff=3072, num_layers=28,
            num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1e6, qk_norm=True,
            tie_embeddings=True, max_position_embeddings=40960,
        ),
        (151645, 151643),
    ),
    "llama3.2-1b": (
        llama3_2_1b_gsm8k,
        ModelConfig(
            family="llama", vocab_size=128256, d_model=2048, d_ff=8192, num_layers=16,
            num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
            rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_embeddings=True, norm_eps=1e-5,
            max_position_embeddings=131072,
        ),
        (128001, 128008, 128009),
    ),
}  # fmt: skip
MESHES = ("1-device", "config-mesh")
LAYERS = 2  # of each model's layers lowered (module docstring)


@functools.cache
def _model(name):
    """(config, ModelConfig, eos ids, graphdef, abstract param shapes) of one real model."""
    module, cfg, eos = MODELS[name]
    c = module.get_config()
    m = c.model
    cfg = dataclasses.replace(cfg, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat,
                              num_layers=LAYERS)  # fmt: skip
    assert cfg.dtype == "bfloat16"
    return (c, cfg, eos, *abstract_model(cfg))


@functools.cache
def _setup(name, mesh_name):
    """The model's abstract params in their shardings on a 1-device mesh or the config's."""
    c, cfg, eos, graphdef, shapes = _model(name)
    if mesh_name == "1-device":
        mesh = make_mesh({}, devices=jax.devices()[:1])
    else:
        mesh = make_mesh(dict(c.mesh))
        assert mesh.size == 8
    rules = tuple(tuple(r) for r in c.rules)
    shardings = state_shardings(shapes, mesh, rules)
    return c, cfg, eos, graphdef, mesh, rules, shardings, with_shardings(shapes, shardings)


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", MODELS)
def test_decode_step_lowers_for_tpu(name, mesh_name):
    engine, params, mesh = _engine(name, mesh_name, "tpu")
    # head_dim % 128 == 0 (Qwen3): the Mosaic kernel, inside a shard_map on the mesh.
    kernel = engine.cfg.head_dim % 128 == 0
    assert engine.backend == ("pallas_tpu" if kernel else "blockwise")
    lowered = lower_generate(engine, params, platforms=("tpu",))
    text = lowered.as_text()
    assert f"mhlo.num_partitions = {mesh.size}" in text
    # The Mosaic kernel is in the module exactly when "auto" chose it.
    assert ("tpu_custom_call" in text) == kernel
    # On a mesh every backend's KV write and attention run in a shard_map (per-shard pools).
    assert ("manual" in text) == (mesh.size > 1)
    check_pool_read_in_place(engine, lowered)


def check_pool_read_in_place(engine, lowered):
    """The decode step takes one bf16 pool [K,P,page_size,H] per layer, and no slice,
    dynamic-slice or copy in it has an operand shaped like a pool (any leading dims: a stacked
    pool, a layer's, a device's shard of one): the kernels read the pool where it lies."""
    cfg, e = engine.cfg, engine.ecfg
    pool = jax.ShapeDtypeStruct(
        (cfg.num_kv_heads, e.num_pages, e.page_size, cfg.head_dim), jnp.bfloat16
    )
    state = lowered.args_info[0][1]  # (params, state, root key)
    assert [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in state.k_pages] == [pool] * (
        cfg.num_layers
    )
    assert pool_copies(lowered.as_text(), pool.shape[1:]) == []
    local = (e.num_pages // engine.num_shards, *pool.shape[2:])  # a device's pages
    assert pool_copies(lowered.as_text(), local) == []


def pool_copies(text: str, trailing) -> list[str]:
    """Lines of a StableHLO or compiled HLO module that slice, dynamic-slice or copy an array
    of rank >= 4 whose last dims are `trailing` (P, page_size, H): a copy of a KV pool."""
    dims = "x".join(map(str, trailing))
    shaped = re.compile(rf"tensor<(\d+x)+{dims}x\w+>|\[(\d+,)+{','.join(map(str, trailing))}\]")
    # The instruction's own op: `= stablehlo.slice ...` (StableHLO) or `= f32[..]{..} copy(`
    # (compiled HLO), not a word in its metadata.
    op = re.compile(
        r"=\s*(\S+\s+)?\"?(stablehlo\.slice|stablehlo\.dynamic_slice|copy|slice|dynamic-slice)[\"\s(]"
    )
    return [
        line.strip()[:200] for line in text.splitlines() if op.search(line) and shaped.search(line)
    ]


def _engine(name, mesh_name, platform):
    """(engine, abstract params, mesh) of one real config, with the decode backend that
    `resolve_backend("auto", ...)` picks on `platform` for its shape and mesh."""
    c, cfg, eos, graphdef, mesh, rules, _, params = _setup(name, mesh_name)
    ecfg = engine_config(c, eos)
    assert ecfg.cache_dtype == "bfloat16" and ecfg.page_size == 32
    backend = resolve_backend(
        "auto", mesh.size > 1, ecfg.cache_dtype, cfg.head_dim, ecfg.page_size, platform=platform
    )
    ecfg = dataclasses.replace(ecfg, backend=backend)
    engine = Engine(cfg, graphdef, ecfg, sampling_params(c), mesh=mesh, rules=rules)
    assert engine.backend == backend
    # GRPO rollouts decode G samples per prompt: `generate_all` sets the cascade group to G.
    engine.pages.set_group(c.rl.num_generations)
    return engine, params, mesh


def check_prefill_lowers(name, mesh_name, resume, platform):
    """One full prefill call (MAX_PREFILL_BATCH prompts per batch shard padded to the bucket of
    max_prompt_len;
    with `resume`, new tokens after a cached history) lowers for `platform` on the mesh, takes
    the configs' shapes, donates the pages and returns a state of the same shapes."""
    engine, params, mesh = _engine(name, mesh_name, platform)
    cfg, e = engine.cfg, engine.ecfg
    lowered = lower_prefill(engine, params, platforms=(platform,), resume=resume)
    assert f"mhlo.num_partitions = {mesh.size}" in lowered.as_text()
    (_, state, tokens, lengths, page_rows, starts), _ = lowered.args_info
    length, rows = bucket(e.max_prompt_len - 1), MAX_PREFILL_BATCH * engine.num_shards  # per shard
    assert (tokens.shape, lengths.shape) == ((rows, length), (rows,))
    assert page_rows.shape == (rows, e.pages_per_seq)
    assert (starts is not None) == resume
    pool = (cfg.num_kv_heads, e.num_pages, e.page_size, cfg.head_dim)  # one per layer
    for kv in (*state.k_pages, *state.v_pages):
        assert kv.shape == pool and kv.dtype == jnp.bfloat16 and kv.donated
    assert len(state.k_pages) == cfg.num_layers
    # The state comes back with the shapes and dtypes it went in with (donation reuses it).
    aval = lambda x: (x.shape, x.dtype)
    assert jax.tree.map(aval, lowered.out_info) == jax.tree.map(aval, state)


@pytest.mark.parametrize("resume", (False, True), ids=("prompts", "resume"))
@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", MODELS)
def test_prefill_lowers_for_tpu(name, mesh_name, resume):
    check_prefill_lowers(name, mesh_name, resume, "tpu")


def _batch(c, mesh, rules):
    """One optimizer step's abstract batch (B*G/minibatches rows of prompt + completion), with
    the optional fields a real run fills given this config; fields Batch lacks are left out."""
    rows = c.data.prompts_per_step * c.rl.num_generations // c.rl.minibatches
    t = c.sampling.max_prompt_len + c.sampling.max_new_tokens
    sharding = batch_sharding(mesh, rules)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    fields = dict(
        tokens=spec((rows, t), jnp.int32),
        positions=spec((rows, t), jnp.int32),
        segment_ids=spec((rows, t), jnp.int32),
        loss_mask=spec((rows, t - 1), jnp.float32),
        advantages=spec((rows, t - 1), jnp.float32),
        sampler_logp=spec((rows, t - 1), jnp.float32),
    )
    if c.rl.old_logp == "sampler":
        fields["old_logp"] = spec((rows, t - 1), jnp.float32)
    if c.rl.kl_coef > 0:
        fields["ref_logp"] = spec((rows, t - 1), jnp.float32)
    if c.sampling.min_new_tokens > 0:
        fields["stop_masked"] = spec((rows, t - 1), jnp.bool_)
    known = {f.name for f in dataclasses.fields(Batch)}
    return Batch(**{k: v for k, v in fields.items() if k in known})


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", MODELS)
def test_train_step_lowers_for_tpu(name, mesh_name):
    c, cfg, eos, graphdef, mesh, rules, shardings, params = _setup(name, mesh_name)
    learner = Learner(learner_config(c, eos), graphdef, shardings)
    lowered = learner.lower_step(params, _batch(c, mesh, rules), platforms=("tpu",))
    assert f"mhlo.num_partitions = {mesh.size}" in lowered.as_text()
    # "auto" attention lowered for TPU is splash (models/attention_kernels.py), head_dim 64 too.
    assert "tpu_custom_call" in lowered.as_text()
    # The updated state comes back in the shardings it went in with (the sampler reads it).
    state_out = jax.tree.leaves(lowered.out_info[0])
    want = jax.tree.leaves(learner.state_shardings)
    assert len(state_out) == len(want)
    for out, sharding in zip(state_out, want):
        assert out.sharding.is_equivalent_to(sharding, len(out.shape)), (out, sharding)


def _attention_args(cfg, page_size=32, pages=64, slots=8, pages_per_seq=27, sharding=None):
    """Abstract per-layer decode attention inputs at the model's head shapes, bf16 cache."""
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    kv = s((cfg.num_kv_heads, pages, page_size, cfg.head_dim), jnp.bfloat16)
    q = s((slots, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    return q, kv, kv, s((slots,), jnp.int32), s((slots, pages_per_seq), jnp.int32)


def test_pallas_tpu_lowers_only_for_head_dim_multiple_of_128_and_not_partitioned():
    """Why "auto" avoids the Pallas TPU kernel for two of the three configs, and why the engine
    runs it inside a shard_map on a mesh: Mosaic needs a block's last dim divisible by 128 or
    whole, and the kernel's [..., 1] softmax-state outputs get blocks of head_dim; and JAX does
    not partition a Mosaic kernel outside shard_map."""
    f = jax.jit(functools.partial(paged_attention, backend="pallas_tpu"))
    export = jax.export.export(f, platforms=["tpu"])
    qwen3, qwen25, llama = (MODELS[n][1] for n in ("qwen3-0.6b", "qwen2.5-0.5b", "llama3.2-1b"))
    assert "tpu_custom_call" in export(*_attention_args(qwen3)).mlir_module()
    for cfg in (qwen25, llama):
        with pytest.raises(ValueError, match="divisible by 8 and 128"):
            export(*_attention_args(cfg))
    mesh = make_mesh(dict(qwen3_0_6b_gsm8k.get_config().mesh))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with pytest.raises(NotImplementedError, match="cannot be automatically partitioned"):
        export(*_attention_args(qwen3, sharding=replicated))


def test_pool_copy_detector_sees_a_layer_slice():
    """`pool_copies` finds what the old stacked pool did: a layer's slice (static or dynamic)
    of [L,K,P,page_size,H], in lowered StableHLO and in compiled HLO."""
    stacked = jax.ShapeDtypeStruct((4, 2, 64, 32, 64), jnp.bfloat16)
    for f in (lambda x: x[1] * 2, lambda x: jax.lax.dynamic_index_in_dim(x, 2, keepdims=False) * 2):
        lowered = jax.jit(f).lower(stacked)
        assert pool_copies(lowered.as_text(), (64, 32, 64))
        assert pool_copies(lowered.compile().as_text(), (64, 32, 64))
        assert not pool_copies(lowered.as_text(), (64, 16, 64))
