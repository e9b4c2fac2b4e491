"""On an FSDP mesh every device projects its own rows to the vocabulary (`rl.logprobs`, `rows`):
the compiled log-prob pass and gradient hold no logits block of the whole global batch, the
[D,V] matrix is gathered and its gradient reduced once per micro-batch, not in every chunk, and
the log-probs and gradients equal one device's within 1e-5 (f32), also with micro-batches whose
rows do not split over the devices (left to GSPMD)."""

import re

import jax
import numpy as np
import pytest

from models.config import ModelConfig
from models.sharding import DEFAULT_RULES, flatten, init_params, make_mesh, state_shardings
from rl.learner import Batch, Learner, LearnerConfig, batch_sharding
from rl.losses import LossConfig
from sampling.distribution import SamplingParams

V, B, T, CHUNK = 512, 8, 40, 16
TOP_K = SamplingParams(temperature=0.7, top_k=50)
CFG = ModelConfig(
    family="qwen2", vocab_size=V, d_model=32, d_ff=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, qkv_bias=True, tie_embeddings=True, remat=True,
)  # fmt: skip


def _batch() -> Batch:
    """Packed rows: two sequences each, some rows with padding at the end."""
    rng = np.random.default_rng(0)
    seg = np.ones((B, T), np.int32)
    seg[:, 25:] = 2
    seg[1, 33:] = 0
    seg[4, 12:] = 0
    pos = np.concatenate([np.arange(25), np.arange(T - 25)])[None].repeat(B, 0).astype(np.int32)
    logp = -rng.uniform(0.5, 3, (B, T - 1)).astype(np.float32)
    return Batch(
        tokens=rng.integers(1, V, (B, T)).astype(np.int32), positions=pos, segment_ids=seg,
        loss_mask=(seg[:, 1:] > 0).astype(np.float32),
        advantages=rng.normal(size=(B, T - 1)).astype(np.float32),
        sampler_logp=logp, old_logp=logp + 0.2, ref_logp=logp - 0.1,
    )  # fmt: skip


def _learner(mesh, micro=1, sampling=TOP_K):
    graphdef, params = init_params(CFG, mesh, seed=1)
    cfg = LearnerConfig(
        micro_batches=micro, logprob_chunk=CHUNK, loss=LossConfig(kl_coef=0.05),
        sampling=sampling,
    )  # fmt: skip
    learner = Learner(cfg, graphdef, state_shardings(params, mesh, DEFAULT_RULES))
    return learner, params, jax.device_put(_batch(), batch_sharding(mesh, DEFAULT_RULES))


def test_no_device_holds_the_logits_of_every_row():
    """Without top-k / top-p (the RL default). Their sorted-order scatter in
    `sampling.distribution` still builds [B*chunk,V] masks of every row on each device."""
    learner, params, batch = _learner(make_mesh({"fsdp": 8}), sampling=SamplingParams(0.7))
    texts = [
        learner._logprobs.lower(params, batch, "logp", True).compile().as_text(),
        learner._grads.lower(params, batch).compile().as_text(),
    ]
    every_row = (f"[{B},{CHUNK},{V}]", f"[{B * CHUNK},{V}]", f"[{V},{B * CHUNK}]", f"[{V},{B},")
    for text in texts:
        assert not [s for s in every_row if s in text], [s for s in every_row if s in text]
        assert f"[1,{CHUNK},{V}]" in text  # one row's block per device


def test_unembedding_gathered_and_reduced_outside_the_chunk_loop():
    """No all-gather / all-reduce / reduce-scatter of a V-sized array in any loop body of the
    compiled gradient. Differentiating through the chunk scan put both the gather of the [D,V]
    matrix and the all-reduce of its gradient in the loop over chunks (256 of each for a row of
    32k tokens)."""
    learner, params, batch = _learner(make_mesh({"fsdp": 8}), sampling=SamplingParams(0.7))
    text = learner._grads.lower(params, batch).compile().as_text()
    computations, name = {}, None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?(\S+) .*\{$", line)
        if header:
            name = header.group(1)
            computations[name] = []
        elif name:
            computations[name].append(line)
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    assert bodies  # the chunk scans, the attention loops
    collective = re.compile(r"= (\S+) (all-gather|all-reduce|reduce-scatter)\(")
    in_loops = [
        line.strip()[:120]
        for body in bodies
        for line in computations[body]
        if (m := collective.search(line)) and str(V) in m.group(1)
    ]
    assert not in_loops, in_loops


@pytest.mark.parametrize("micro", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_fsdp_logprobs_and_grads_equal_one_device(micro):
    results = []
    for mesh in (make_mesh({}, devices=jax.devices()[:1]), make_mesh({"fsdp": 8})):
        learner, params, batch = _learner(mesh, micro)
        grads, metrics = learner.grads(params, batch)
        logp = learner.logprobs(params, batch)
        full = learner.logprobs(params, batch, "full")
        results.append((flatten(jax.device_get(grads)), metrics["loss"], logp, full))
    (g1, l1, *lp1), (g8, l8, *lp8) = results
    for a, b in zip(lp1, lp8):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(l8), float(l1), atol=1e-5, rtol=0)
    assert max(np.abs(g).max() for g in g1.values()) > 1e-3  # a real gradient
    for k in g1:
        np.testing.assert_allclose(g8[k], g1[k], atol=1e-5, rtol=0, err_msg=k)
