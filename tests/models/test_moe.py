"""The mixture-of-experts block (models/moe.py) on a mesh with an expert axis (issue 52 item 2),
against one device, and its bad inputs.

A tiny Qwen3-MoE shape (8 experts, top-2, layers 0 and 2 of 3 with experts) on the 8 fake CPU
devices: expert=4 (x data=2) and expert=2 x fsdp=2 x tensor=2. The log-prob pass and its
gradient (what the learner differentiates) equal one device's within 1e-5 in f32, greedy decoding
of the sampler equals one device's exactly, each device holds 1/expert of the experts' bytes (or
less), and the decode step and the learner's train step lowered for tpu and cuda hold the
experts' matmuls as ragged_dot (a grouped matmul), no dot over all experts at once. A bf16
model's train step on expert=2 x fsdp=4 gathers the experts in bf16 and sums their gradients in
grad_reduce_dtype.
"""

import dataclasses
import json
import math
import re
import shutil

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import ModelConfig
from models.hf_config import CheckpointError, config_from_hf
from models.moe import check_expert_axis, local_moe, route
from models.sharding import DEFAULT_RULES, init_params, make_mesh, state_shardings
from rl.logprobs import token_logprobs
from sampling.distribution import SamplingParams

CFG = ModelConfig(
    family="qwen3_moe",
    vocab_size=64,
    d_model=32,
    d_ff=40,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
    num_experts=8,
    experts_per_token=2,
    expert_d_ff=24,
    norm_topk_prob=True,
    moe_layers=(0, 2),
)
MESHES = {
    "expert4": {"data": 2, "expert": 4},
    "expert2_fsdp2_tensor2": {"expert": 2, "fsdp": 2, "tensor": 2},
}


@pytest.fixture(scope="module")
def one():
    mesh = make_mesh({}, devices=jax.devices()[:1])
    graphdef, params = init_params(CFG, mesh, DEFAULT_RULES, seed=3)
    return graphdef, jax.device_get(params)


def _on(mesh, params):
    shardings = state_shardings(params, mesh, DEFAULT_RULES)
    return jax.tree.map(lambda x, s: jax.device_put(x, s), params, shardings)


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CFG.vocab_size, (8, 12)).astype(np.int32)
    valid = np.ones_like(tokens, bool)
    valid[1, :3] = valid[5, :5] = False  # left padding
    positions = np.maximum(np.cumsum(valid, 1) - 1, 0).astype(np.int32)
    weights = rng.standard_normal((8, 11)).astype(np.float32)
    return tokens, positions, valid, weights


def _logp_and_grad(graphdef, params, tokens, positions, valid, weights):
    def loss(params):
        lp = token_logprobs(nnx.merge(graphdef, params), tokens, positions, valid, SamplingParams())
        return jnp.sum(lp.logp * weights * valid[:, 1:]), lp.logp

    (_, logp), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return logp, grads


_step = jax.jit(_logp_and_grad, static_argnums=0)


def test_grouped_block_equals_a_dense_reference():
    """local_moe (sorted pairs, ragged_dot) against a numpy loop over tokens and their experts."""
    rng = np.random.default_rng(1)
    n, d, f, e, k = 10, 6, 5, 4, 2
    x = rng.standard_normal((n, d)).astype(np.float32)
    router = rng.standard_normal((d, e)).astype(np.float32)
    gate, up = (rng.standard_normal((e, d, f)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((e, f, d)).astype(np.float32)
    for norm in (True, False):
        w, ids = route(jnp.asarray(x), jnp.asarray(router), k, norm)
        got = np.asarray(local_moe(jnp.asarray(x), w, ids, gate, up, down))
        logits = x @ router
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        want = np.zeros_like(x)
        for i in range(n):
            top = np.argsort(-p[i])[:k]
            g = p[i, top] / (p[i, top].sum() if norm else 1)
            for j, gj in zip(top, g):
                h = x[i] @ gate[j]
                want[i] += gj * ((h / (1 + np.exp(-h))) * (x[i] @ up[j])) @ down[j]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        # replaying the ids it chose gives the same output (routing replay's entry point)
        w2, ids2 = route(jnp.asarray(x), jnp.asarray(router), k, norm, experts=ids)
        np.testing.assert_array_equal(np.asarray(ids2), np.asarray(ids))
        np.testing.assert_array_equal(np.asarray(w2), np.asarray(w))


@pytest.mark.parametrize("name", MESHES)
def test_sharded_logprobs_and_gradients_equal_one_device(name, one):
    graphdef, params = one
    tokens, positions, valid, weights = _batch()
    want_lp, want_g = _step(graphdef, params, tokens, positions, valid, weights)
    mesh = make_mesh(MESHES[name])
    sharded = _on(mesh, params)
    ep = mesh.shape["expert"]
    for layer in CFG.moe_layers:  # each device holds 1/expert of the experts' bytes (or less)
        for p in ("gate", "up", "down"):
            x = sharded["blocks"][layer]["mlp"][p].get_value()
            shard = x.addressable_shards[0].data
            assert shard.shape[0] == CFG.num_experts // ep
            assert shard.nbytes * ep <= x.nbytes
    with jax.set_mesh(mesh):
        got_lp, got_g = _step(graphdef, sharded, tokens, positions, valid, weights)
    np.testing.assert_allclose(np.asarray(got_lp), np.asarray(want_lp), atol=1e-5, rtol=0)
    flat_want = jax.tree_util.tree_leaves_with_path(want_g)
    for (path, w), g in zip(flat_want, jax.tree.leaves(got_g)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5, err_msg=str(path)
        )
    assert any(float(np.abs(np.asarray(g)).max()) > 1e-3 for g in jax.tree.leaves(got_g))


def _loops_started_from_constants(jaxpr) -> int:
    """How many scan / while carries in jaxpr (and the jaxprs inside it) start as a value made
    from literals alone (zeros, pvary'd or cast: what XLA:CPU may make at the program's start)."""
    made, n = set(), 0
    const = lambda v: isinstance(v, jcore.Literal) or v in made
    for eqn in jaxpr.eqns:
        subs = list(jcore.jaxprs_in_params(eqn.params))
        if not subs and all(const(v) for v in eqn.invars):
            made.update(eqn.outvars)
        if eqn.primitive.name == "scan":
            first = eqn.params["num_consts"]
            inits = eqn.invars[first : first + eqn.params["num_carry"]]
        elif eqn.primitive.name == "while":
            inits = eqn.invars[eqn.params["cond_nconsts"] + eqn.params["body_nconsts"] :]
        else:
            inits = []
        n += sum(v in made for v in inits if not isinstance(v, jcore.Literal))
        n += sum(_loops_started_from_constants(sub) for sub in subs)
    return n


def test_dispatch_in_chunks_equals_one_device(one, monkeypatch):
    """models.moe.CHUNK = 4: on expert=2 x fsdp=2 x tensor=2 each device's 24 rows go through its
    experts in 6 rematerialised chunks (a loop in the program); log-probs and gradients still
    equal one device's within 1e-5."""
    from models import moe

    graphdef, params = one
    tokens, positions, valid, weights = _batch()
    want_lp, want_g = _step(graphdef, params, tokens, positions, valid, weights)
    mesh = make_mesh(MESHES["expert2_fsdp2_tensor2"])
    sharded = _on(mesh, params)
    args = (graphdef, sharded, tokens, positions, valid, weights)
    loops, zero_inits = {}, {}
    for chunk in (4096, 4):
        monkeypatch.setattr(moe, "CHUNK", chunk)
        # a function of its own each time: jit's trace cache is keyed on it, CHUNK is read there
        step = jax.jit(lambda *a: _logp_and_grad(*a), static_argnums=0)
        with jax.set_mesh(mesh):
            loops[chunk] = step.lower(*args).as_text().count("stablehlo.while")
            zero_inits[chunk] = _loops_started_from_constants(jax.make_jaxpr(step)(*args).jaxpr)
    assert moe._chunks(24) == 6 and moe._chunks(4) == 1 and moe._chunks(10) == 5
    assert loops[4] > loops[4096], loops  # the chunks' loops (forward, backward)
    # and those loops start from data: autodiff's backward of the chunk loop carried zeros made
    # from constants (the rows' cotangent, the weight gradients' sums), which XLA:CPU made for
    # every layer at the start of the step (docs/performance.md)
    assert zero_inits[4] == zero_inits[4096], zero_inits
    with jax.set_mesh(mesh):
        got_lp, got_g = step(*args)
    np.testing.assert_allclose(np.asarray(got_lp), np.asarray(want_lp), atol=1e-5, rtol=0)
    flat_want = jax.tree_util.tree_leaves_with_path(want_g)
    for (path, w), g in zip(flat_want, jax.tree.leaves(got_g)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5, err_msg=str(path)
        )


def _greedy(graphdef, params, mesh):
    from sampling.engine import Engine, EngineConfig
    from sampling.episodes import generate_all

    ecfg = EngineConfig(
        num_slots=8,
        page_size=8,
        num_pages=64,
        max_prompt_len=16,
        max_new_tokens=10,
        steps_per_call=5,
        record_routes=True,  # and each token's experts, a decode call's window at a time
    )
    engine = Engine(
        CFG, graphdef, ecfg, SamplingParams(temperature=0.0), mesh=mesh, rules=DEFAULT_RULES
    )
    prompts = [[3, 17, 42, 8, 5], [11, 2, 9, 30, 44, 12, 7], [50, 1, 33], [7, 7, 8, 9]] * 2
    _, results = generate_all(engine, params, engine.init_state(), prompts)
    return [(r[0].tokens, r[0].logprobs, r[0].routes) for r in results]


@pytest.mark.slow  # three samplers compiled (~20 s)
def test_sharded_sampler_greedy_equals_one_device(one):
    graphdef, params = one
    single = make_mesh({}, devices=jax.devices()[:1])
    want = _greedy(graphdef, _on(single, params), single)
    for shape in MESHES.values():
        mesh = make_mesh(shape)
        got = _greedy(graphdef, _on(mesh, params), mesh)
        for (t1, l1, r1), (t2, l2, r2) in zip(got, want):
            assert list(t1) == list(t2)
            np.testing.assert_allclose(l1, l2, atol=1e-5)
            np.testing.assert_array_equal(r1, r2)


def test_decode_loop_holds_one_layers_gathered_experts_at_a_time():
    """The sampler's decode loop on expert=2 x fsdp=4 (bf16 compute, f32 master weights, remat,
    as configs/qwen3_coder_30b_a3b_repo.py): the temporaries live at its peak hold at most two
    layers' experts gathered over fsdp (one layer and the next one's prefetch), and no layer's
    f32 master shard relaid out. Before (models.transformer.remat skipped decode steps), XLA:CPU
    hoisted every layer's gathered experts out of the loop, the weights being loop-invariant:
    18 such buffers here at 6 layers (docs/performance.md, "Qwen3-30B-A3B's rollout memory").
    The f32 relayout copies that the 30B shape then showed (models/moe.py `_gather`) XLA:CPU
    does not make at this size: measured there, not here."""
    from launch import estimate
    from models.sharding import abstract_model, with_shardings
    from sampling.engine import Engine, EngineConfig
    from sampling.lowering import lower_generate

    layers = 6
    cfg = dataclasses.replace(
        CFG, dtype="bfloat16", d_model=64, num_layers=layers, moe_layers=tuple(range(layers))
    )
    cfg = dataclasses.replace(cfg, remat=True)
    mesh = make_mesh({"expert": 2, "fsdp": 4})
    graphdef, shapes = abstract_model(cfg)
    params = with_shardings(shapes, state_shardings(shapes, mesh, DEFAULT_RULES))
    ecfg = EngineConfig(
        num_slots=8, page_size=8, num_pages=64, max_prompt_len=16, max_new_tokens=16
    )
    engine = Engine(cfg, graphdef, ecfg, SamplingParams(), mesh=mesh, rules=DEFAULT_RULES)
    with estimate.grouped_matmuls():
        est = estimate.compile(lower_generate(engine, params))
    e, d, f = cfg.num_experts // 2, cfg.d_model, cfg.expert_d_ff  # an expert device's experts
    gathered = [b for b in est.peak if b.type.startswith("bf16[") and _elements(b) == e * d * f]
    shards = [b for b in est.peak if b.type.startswith("f32[") and _elements(b) == e * d * f // 4]
    assert len(gathered) <= 2 * 3 * 2, [b.describe() for b in gathered]  # gather + its layout
    assert not shards, [b.describe() for b in shards]


def _elements(buffer) -> int:
    dims = re.fullmatch(r"\w+\[([\d,]*)\]", buffer.type)
    return math.prod(int(x) for x in dims.group(1).split(",") if x) if dims else -1


def _ragged_and_dense_expert_dots(text: str):
    """(ragged_dot ops, dot_generals whose operand has the expert count E leading a [E,D,F]
    or [E,F,D] weight) in a StableHLO module."""
    ragged = len(re.findall(r"ragged_dot", text))
    e, d, f = CFG.num_experts, CFG.d_model, CFG.expert_d_ff
    dense = [
        ln
        for ln in text.splitlines()
        if "dot_general" in ln and re.search(rf"tensor<{e}x({d}x{f}|{f}x{d})x", ln)
    ]
    return ragged, dense


@pytest.mark.slow  # four lowerings of the train step and decode step (~30 s)
@pytest.mark.parametrize("platform", ("tpu", "cuda"))
def test_decode_and_train_step_lower_with_ragged_dot(platform):
    from configs.default import get_config
    from launch.validate import engine_config, learner_config, sampling_params
    from models.sharding import abstract_model, with_shardings
    from rl.learner import Learner
    from sampling.engine import Engine
    from sampling.lowering import lower_generate
    from tests.sampling.test_tpu_export import _batch as abstract_batch

    c = get_config()
    c.mesh.update(data=2, expert=4)
    c.data.prompts_per_step, c.rl.num_generations = 4, 4
    c.sampling.max_prompt_len, c.sampling.max_new_tokens = 16, 16
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    graphdef, shapes = abstract_model(cfg)
    mesh = make_mesh(dict(c.mesh))
    shardings = state_shardings(shapes, mesh, DEFAULT_RULES)
    params = with_shardings(shapes, shardings)
    learner = Learner(learner_config(c, (63,)), graphdef, shardings)
    lowered = learner.lower_step(
        params, abstract_batch(c, mesh, DEFAULT_RULES), platforms=(platform,)
    )
    ragged, dense = _ragged_and_dense_expert_dots(lowered.as_text())
    assert ragged >= 3 * len(CFG.moe_layers) and dense == []
    ecfg = dataclasses.replace(engine_config(c, (63,)), num_slots=8, num_pages=64)
    engine = Engine(cfg, graphdef, ecfg, sampling_params(c), mesh=mesh, rules=DEFAULT_RULES)
    text = lower_generate(engine, params, platforms=(platform,)).as_text()
    ragged, dense = _ragged_and_dense_expert_dots(text)
    assert ragged >= 3 * len(CFG.moe_layers) and dense == []
    assert "all_to_all" in text


# --- bad inputs: one line naming the field, before anything is made -----------------------------


def _moe_config(tmp_path, **fields):
    hf = dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        eos_token_id=1,
    )
    hf.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return str(tmp_path)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_experts_per_tok=5), r"num_experts_per_tok=5: must be in \[1, num_experts = 4\]"),
        (
            dict(shared_expert_intermediate_size=64),
            r"shared_expert_intermediate_size=64 is not supported",
        ),
        (dict(n_shared_experts=1), r"n_shared_experts=1 is not supported"),
        (dict(routed_scaling_factor=2.5), r"routed_scaling_factor=2.5 is not supported"),
        (dict(moe_intermediate_size=None), r"missing field 'moe_intermediate_size'"),
        (dict(decoder_sparse_step=0), r"decoder_sparse_step=0: must be >= 1"),
        # fields no reader of this block knows: a part it would leave out, refused by name
        (dict(shared_expert_gate=True), r"shared_expert_gate=True is not a Qwen3-MoE field"),
        (dict(moe_router_bias=True), r"moe_router_bias=True is not a Qwen3-MoE field"),
        (dict(shared_expert_intermediate_size=0, output_router_logits=True), None),  # known, off
    ],
)
def test_bad_moe_config_is_one_line_naming_the_field(tmp_path, fields, message):
    fields = {k: v for k, v in fields.items() if v is not None}
    path = _moe_config(tmp_path, **fields)
    if message and "moe_intermediate_size" in message:
        hf = json.loads((tmp_path / "config.json").read_text())
        del hf["moe_intermediate_size"]
        (tmp_path / "config.json").write_text(json.dumps(hf))
    if message is None:
        assert config_from_hf(path).num_experts == 4
        return
    with pytest.raises(CheckpointError, match=message) as e:
        config_from_hf(path)
    assert "\n" not in str(e.value)


def test_expert_axis_must_divide_the_experts(tmp_path):
    with pytest.raises(
        ValueError, match=r"^mesh.expert=3: does not divide the model's num_experts=8"
    ):
        check_expert_axis(8, 3)
    with pytest.raises(ValueError, match=r"experts_per_token=9: must be in \[1, num_experts = 8\]"):
        dataclasses.replace(CFG, experts_per_token=9)
    from configs.default import get_config
    from launch.cli import UsageError
    from launch.validate import check_expert_mesh

    c = get_config()
    c.mesh.expert = 3
    with pytest.raises(
        UsageError, match=r"mesh.expert.*3.*does not divide the checkpoint's num_experts = 8"
    ):
        check_expert_mesh(c, 8)
    c.mesh.expert = 2
    check_expert_mesh(c, 8)
    with pytest.raises(UsageError, match=r"mesh.expert.*dense model"):
        check_expert_mesh(c, 0)
    shutil.rmtree(tmp_path)


def test_tensor_layout_decode_copy_keeps_the_experts_split(one):
    """sampling.weights_layout="tensor": the per-rollout decode copy drops the batch-shard axes
    (data, fsdp) from each weight's sharding, not `expert`: no device holds all the experts."""
    from sampling.engine import Engine, EngineConfig

    graphdef, params = one
    mesh = make_mesh({"data": 2, "expert": 4})
    ecfg = EngineConfig(
        num_slots=8,
        page_size=8,
        num_pages=64,
        max_prompt_len=16,
        max_new_tokens=8,
        weights_layout="tensor",
    )
    engine = Engine(
        CFG, graphdef, ecfg, SamplingParams(temperature=0.0), mesh=mesh, rules=DEFAULT_RULES
    )
    sharded = _on(mesh, params)
    copy = engine.decode_params(sharded)
    for layer in CFG.moe_layers:
        for p in ("gate", "up", "down"):
            x = copy["blocks"][layer]["mlp"][p].get_value()
            assert x.addressable_shards[0].data.shape[0] == CFG.num_experts // 4


@pytest.mark.slow  # two train steps compiled for the partitioned program (~14 s each)
@pytest.mark.parametrize("grad_reduce_dtype, dtype", [("float32", "f32"), ("bfloat16", "bf16")])
def test_bf16_step_gathers_experts_in_bf16_and_sums_their_gradients_in_grad_reduce_dtype(
    grad_reduce_dtype, dtype
):
    """A bf16 MoE model's train step on expert=2 x fsdp=4 (the partitioned program, as
    tests/rl/test_grad_reduce.py reads it): the experts' weights gathered over fsdp in bf16, and
    every gradient reduction across devices, the experts' and the router's included, in
    optim.grad_reduce_dtype (`models.transformer.weight_grads_in`)."""
    from launch import estimate
    from launch.bench import hlo
    from launch.dry_run import abstract_batch
    from models.sharding import abstract_model, flatten, with_shardings
    from rl.learner import Learner, LearnerConfig, batch_sharding
    from rl.losses import LossConfig

    cfg = dataclasses.replace(CFG, dtype="bfloat16", d_model=64, expert_d_ff=32, vocab_size=128)
    mesh = make_mesh({"expert": 2, "fsdp": 4})
    graphdef, shapes = abstract_model(cfg)
    shardings = state_shardings(shapes, mesh, DEFAULT_RULES)
    params = with_shardings(shapes, shardings)
    lcfg = LearnerConfig(
        loss=LossConfig(kl_coef=0.0), grad_reduce_dtype=grad_reduce_dtype, logprob_chunk=32
    )
    learner = Learner(lcfg, graphdef, shardings)
    batch = abstract_batch(8, 32, batch_sharding(mesh, DEFAULT_RULES))
    est = estimate.compile(learner.lower_step(params, batch))
    named = flatten(params)
    experts = {
        tuple(x.shape)
        for n, x in named.items()
        if n.endswith(("mlp.gate", "mlp.up", "mlp.down")) and x.ndim == 3
    }
    local = {(cfg.num_experts // 2, *s[1:]) for s in experts}  # an expert device's experts
    # gathered along a new leading axis of the 4 fsdp shards (models/moe.py `_gather`): D split
    # into [4, D/4] where it lies (gate, up: axis 1 of [E,D,F]; down: axis 2 of [E,F,D])
    stacked = {(4, e, a // 4, b) for e, a, b in local} | {(4, e, a, b // 4) for e, a, b in local}
    items = hlo.collectives(est.partitioned)
    gathers = [c for c in items if c.kind == "all-gather" and c.shapes[0][1] in stacked]
    assert gathers and {c.shapes[0][0] for c in gathers} == {"bf16"}, [
        (c.name, c.shapes) for c in gathers
    ]
    shapes_ = {tuple(x.shape) for x in named.values()}
    shapes_ |= {tuple(x.sharding.shard_shape(x.shape)) for x in named.values()}
    shapes_ |= local
    grads = estimate.gradient_reductions(est.partitioned, shapes_)
    # but the embedding's: its lookup's gradient is taken in the master dtype (f32), and on this
    # mesh summed over `expert` too (the rows leave the experts' block split over it)
    embed = tuple(sorted((cfg.vocab_size, cfg.d_model)))
    grads = [c for c in grads if not any(tuple(sorted(d)) == embed for _, d in c.shapes)]
    assert {d for c in grads for d, _ in c.shapes} == {dtype}, [(c.name, c.shapes) for c in grads]
    reduced = {tuple(sorted(dims)) for c in grads for _, dims in c.shapes}
    shards = {  # each expert weight's gradient reduce-scattered into its shard (E/2, D/4, F)
        tuple(sorted(x.sharding.shard_shape(x.shape)))
        for n, x in named.items()
        if n.endswith(("mlp.gate", "mlp.up", "mlp.down")) and x.ndim == 3
    }
    assert shards <= reduced, (shards, reduced)
    router = (cfg.d_model // 4, cfg.num_experts)  # reduce-scattered over fsdp too
    assert tuple(sorted(router)) in reduced


@pytest.mark.slow  # three learners compiled (~25 s)
def test_learner_grads_and_step_on_the_expert_meshes_equal_one_device(one):
    """rl.learner.Learner (GRPO loss, 2 micro-batches) on each expert mesh: the loss and every
    parameter's gradient within 1e-5 of one device's; an optimizer step on expert=2 x fsdp=2 x
    tensor=2 compiles and keeps the state's shardings."""
    from rl.learner import Learner, LearnerConfig, batch_sharding
    from rl.losses import LossConfig
    from tests.rl.test_learner import _batch as learner_batch

    graphdef, params = one
    batch = learner_batch()
    cfg = LearnerConfig(micro_batches=2, loss=LossConfig(max_new_tokens=17), logprob_chunk=8)
    results = {}
    for name, shape in {"one": None, **MESHES}.items():
        mesh = make_mesh({}, devices=jax.devices()[:1]) if shape is None else make_mesh(shape)
        sharded = _on(mesh, params)
        shardings = jax.tree.map(lambda x: x.sharding, sharded)
        learner = Learner(cfg, graphdef, shardings)
        b = jax.device_put(batch, batch_sharding(mesh, DEFAULT_RULES))
        grads, metrics = learner.grads(sharded, b)
        results[name] = (jax.tree.leaves(jax.device_get(grads)), float(metrics["loss"]))
        if name == "expert2_fsdp2_tensor2":  # the optimizer step compiles and keeps its layout
            state, _ = learner.step(learner.init_state(sharded), b)
            for x, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(shardings)):
                assert x.sharding.is_equivalent_to(s, x.ndim)
    want, loss = results.pop("one")
    assert max(float(np.abs(g).max()) for g in want) > 1e-3
    for got, got_loss in results.values():
        assert abs(got_loss - loss) < 1e-5
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_a_run_saved_before_the_expert_axis_resumes():
    """launch.resume_compat: a config.json without mesh.expert and the experts' rules (saved
    before them) resumes under the defaults (expert 1), not with an expert axis."""
    import copy

    from configs.default import get_config
    from launch.cli import UsageError
    from launch.resume_compat import check_resumable

    new = json.loads(get_config().to_json())
    old = copy.deepcopy(new)
    del old["mesh"]["expert"]
    old["rules"] = [r for r in old["rules"] if r[0] not in ("experts", "expert_mlp")]
    check_resumable(old, new)
    new["mesh"]["expert"] = 2
    with pytest.raises(UsageError, match=r"mesh.expert: None -> 2"):
        check_resumable(old, new)
