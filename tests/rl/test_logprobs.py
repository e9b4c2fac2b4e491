"""The chunked vocabulary projection (`rl.logprobs`): its gradient is accumulated over chunks in
f32 whatever the compute dtype, so the chunk size does not change it beyond f32 rounding. With
the gradient summed in the compute dtype (bf16) chunk by chunk, 64 chunks moved the lm_head
gradient by 1.6e-2 of its largest entry; summed in f32, by 1.5e-6."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.sharding import init_params, make_mesh
from rl.logprobs import token_logprobs
from sampling.distribution import SamplingParams

CFG = ModelConfig(
    family="qwen2", vocab_size=512, d_model=64, d_ff=128, num_layers=1, num_heads=4,
    num_kv_heads=2, head_dim=16, dtype="bfloat16", tie_embeddings=False,
)  # fmt: skip


def test_bf16_unembedding_gradient_does_not_depend_on_the_chunk():
    graphdef, params = init_params(CFG, make_mesh({}, devices=jax.devices()[:1]), seed=0)
    b, t = 2, 512
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    valid = jnp.ones((b, t), bool)
    weights = jnp.asarray(rng.normal(size=(b, t - 1)), jnp.float32)

    def lm_head_grad(chunk):
        def loss(params):
            model = nnx.merge(graphdef, params)
            lp = token_logprobs(model, tokens, pos, valid, SamplingParams(), chunk).logp
            return jnp.sum(weights * lp)

        return np.asarray(jax.jit(jax.grad(loss))(params)["lm_head"][...])

    one, many = lm_head_grad(t), lm_head_grad(8)  # one chunk, 64 chunks
    assert one.dtype == np.float32
    assert np.abs(many - one).max() < 1e-4 * np.abs(one).max(), np.abs(many - one).max()


def test_the_gradient_is_accumulated_a_vocabulary_slice_at_a_time():
    """`_accumulate` adds a chunk's [D,V] gradient in VOCAB_TILES slices, in place: the same dot
    products as one einsum over the whole vocabulary, in either layout of the matrix."""
    from rl.logprobs import VOCAB_TILES, _accumulate

    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(1, 3, 16, 24)), jnp.bfloat16)  # [S,B/S,c,D]
    dz = jnp.asarray(rng.normal(size=(1, 3, 16, 8 * VOCAB_TILES)), jnp.bfloat16)  # [S,B/S,c,V]
    for letters in ("DV", "VD"):
        shape = (1, *(24 if a == "D" else dz.shape[-1] for a in letters))
        acc = jnp.asarray(rng.normal(size=shape), jnp.float32)
        got = jax.jit(lambda a, letters=letters: _accumulate(a, h, dz, letters, None, ()))(acc)
        whole = jnp.einsum(f"SBCD,SBCV->S{letters}", h, dz, preferred_element_type=jnp.float32)
        np.testing.assert_allclose(got, acc + whole, rtol=1e-6, atol=1e-6)
