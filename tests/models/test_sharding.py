"""Parameters land in the shardings their logical axes and the rules say; sharded logits equal
single-device logits on padded batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.sharding import DEFAULT_RULES, flatten, init_params, logical_to_spec, make_mesh

CFG = ModelConfig(
    family="qwen2", vocab_size=96, d_model=32, d_ff=64, num_layers=2, num_heads=4,
    num_kv_heads=1, head_dim=8, qkv_bias=True, tie_embeddings=False,
)  # fmt: skip

# Written out by hand from DEFAULT_RULES: embed->fsdp, vocab/mlp/heads/kv_heads->tensor.
# kv_heads has size 1 here, which the tensor axis (2) does not divide, so it is replicated.
EXPECTED = {
    "embed": P("tensor", "fsdp"),
    "lm_head": P("fsdp", "tensor"),
    "final_norm.scale": P(None),
    "blocks.0.attn.q": P("fsdp", "tensor", None),
    "blocks.0.attn.k": P("fsdp", None, None),
    "blocks.0.attn.v": P("fsdp", None, None),
    "blocks.0.attn.o": P("tensor", None, "fsdp"),
    "blocks.0.attn.q_bias": P("tensor", None),
    "blocks.0.attn.k_bias": P(None, None),
    "blocks.0.mlp.gate": P("fsdp", "tensor"),
    "blocks.0.mlp.up": P("fsdp", "tensor"),
    "blocks.0.mlp.down": P("tensor", "fsdp"),
    "blocks.0.attn_norm.scale": P(None),
}


def _normalise(spec):
    return tuple(spec) + (None,) * 4


def test_every_parameter_has_the_sharding_its_axes_say():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    _, params = init_params(CFG, mesh, seed=0)
    flat = flatten(params)
    for name, spec in EXPECTED.items():
        sh = flat[name].sharding
        assert sh.mesh.shape == mesh.shape, name
        assert _normalise(sh.spec)[: flat[name].ndim] == _normalise(spec)[: flat[name].ndim], name
    # Every parameter is actually split over the devices its spec names (no hidden replication).
    q = flat["blocks.0.attn.q"]
    assert q.addressable_shards[0].data.shape == (16, 2, 8)


def test_rules_edge_cases():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = (("a", ("fsdp", "tensor")), ("b", "tensor"))
    assert logical_to_spec(("a", "b"), (8, 8), rules, mesh) == P(("fsdp", "tensor"), None)
    assert logical_to_spec(("b", "a"), (8, 8), rules, mesh) == P("tensor", "fsdp")
    assert logical_to_spec(("a",), (6,), rules, mesh) == P(None)  # 6 % 4 != 0
    with pytest.raises(ValueError, match="'nope'"):
        logical_to_spec(("nope",), (8,), rules, mesh)
    with pytest.raises(ValueError, match="16 devices but 8"):
        make_mesh({"data": 4, "fsdp": 2, "tensor": 2})


def _padded_batch():
    rng = np.random.default_rng(0)
    lengths, pad_left = [3, 9, 12, 6], [True, True, False, False]
    t = 12
    tokens = np.zeros((4, t), np.int32)
    valid = np.zeros((4, t), bool)
    positions = np.zeros((4, t), np.int32)
    for i, (n, left) in enumerate(zip(lengths, pad_left)):
        sl = slice(t - n, t) if left else slice(0, n)
        tokens[i, sl] = rng.integers(3, CFG.vocab_size, n)
        valid[i, sl] = True
        positions[i, sl] = np.arange(n)
    return tokens, positions, valid


def _logits(mesh):
    graphdef, params = init_params(CFG, mesh, seed=1)
    tokens, positions, valid = _padded_batch()

    @jax.jit
    def fwd(params, tokens, positions, valid):
        return nnx.merge(graphdef, params)(tokens, positions, valid)[0]

    with jax.set_mesh(mesh):
        out = fwd(params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(valid))
    return np.asarray(out), valid


def test_sharded_logits_equal_single_device():
    sharded, valid = _logits(make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
    single, _ = _logits(make_mesh({}, devices=jax.devices()[:1]))
    np.testing.assert_allclose(sharded[valid], single[valid], atol=1e-5, rtol=0)


def test_init_params_is_the_seeds_init_and_compiles_once_per_config_and_mesh():
    """`init_params` takes the seed's key as an argument of one jitted initializer per (config,
    mesh, rules): each seed's weights are bitwise those of the seed baked into the program (as
    `nnx.Rngs(seed)` gave them before), and another seed traces nothing again."""
    from models.sharding import _initializer, abstract_model, hashable_rules, state_shardings
    from models.transformer import Transformer

    mesh = make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
    _, abstract = abstract_model(CFG)
    shardings = state_shardings(abstract, mesh, DEFAULT_RULES)
    for seed in (0, 7):
        init = lambda seed=seed: nnx.state(Transformer(CFG, nnx.Rngs(seed)))
        baked = jax.jit(init, out_shardings=shardings)
        with jax.set_mesh(mesh):
            want = flatten(baked())
        got = flatten(init_params(CFG, mesh, seed=seed)[1])
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].sharding == want[name].sharding, name
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), name)
    init = _initializer(CFG, mesh, hashable_rules(DEFAULT_RULES))[1]
    assert init._cache_size() == 1  # both seeds ran one compiled program
