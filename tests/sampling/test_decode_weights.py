"""`EngineConfig.weights_dtype` (with weights_layout="training"): decoding from a copy of the
weights in the compute dtype, made once per `generate_all`, gives the same bits as decoding from the f32 master weights (the model
casts every weight to the compute dtype where it uses it), on the (2,2,2) mesh, and the copy is
sharded like the params."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.sharding import init_params, make_mesh
from sampling.distribution import SamplingParams
from sampling.engine import Engine
from sampling.episodes import generate_all
from tests.conftest import CFG, ECFG, random_prompts

# f32 master weights, bf16 compute; q/k/v biases and q/k norms, whose q and k parts are applied
# to f32 values (models.transformer.Attention) and must still be the compute dtype's
BF16 = dataclasses.replace(CFG, dtype="bfloat16", qk_norm=True)


def _off_grid(params):
    """Every float leaf moved off bf16's grid (the biases and norm scales init to 0 and 1,
    which bf16 holds exactly, so a learner-side f32 bias would go unseen), shardings kept."""
    return jax.tree.map(lambda x: x * 1.0009 + 3.3e-3, params)


def _run(engine, params):
    prompts = random_prompts([5, 17, 9], BF16.vocab_size, seed=2)
    _, results = generate_all(engine, params, engine.init_state(), prompts, num_samples=2, seed=1)
    return [c.tokens for r in results for c in r], [c.logprobs for r in results for c in r]


@pytest.mark.parametrize(
    "temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0], ids=["greedy", "t1"]
)
def test_decode_copy_gives_the_same_bits(temperature):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, params = init_params(BF16, mesh, seed=5)
    params = _off_grid(params)
    sampling = SamplingParams(temperature)
    training = dataclasses.replace(ECFG, backend="reference", weights_layout="training")
    plain = Engine(BF16, graphdef, training, sampling, mesh)
    ecfg = dataclasses.replace(training, weights_dtype="bfloat16")
    copied = Engine(BF16, graphdef, ecfg, sampling, mesh)
    assert plain.decode_params(params) is params  # zero copy by default
    copy = copied.decode_params(params)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(copy)):
        assert x.dtype == jnp.float32 and y.dtype == jnp.bfloat16
        assert y.sharding.is_equivalent_to(x.sharding, x.ndim)
        np.testing.assert_array_equal(
            np.asarray(y, np.float32), np.asarray(x.astype(jnp.bfloat16), np.float32)
        )
    tokens, logprobs = _run(plain, params)
    tokens_c, logprobs_c = _run(copied, params)
    assert tokens == tokens_c
    assert logprobs == logprobs_c  # bitwise
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))  # masters untouched


def test_decode_copy_in_another_dtype_is_refused():
    graphdef, _ = init_params(CFG, make_mesh({}, devices=jax.devices()[:1]), seed=0)
    ecfg = dataclasses.replace(ECFG, weights_dtype="bfloat16")
    with pytest.raises(ValueError, match="weights_dtype='bfloat16'.*compute dtype 'float32'"):
        Engine(CFG, graphdef, ecfg, SamplingParams(1.0))
