"""A mixture of experts' routers in the GRPO step: the load-balancing loss and the routers' logs.

The learner's loss pass asks the model for each MoE layer's `models.moe.RouterStats` (sums over
the micro-batch's real tokens: the router's softmax, the experts its own top-k chose, the experts
the tokens were sent to, the softmax entropy), stacked over the MoE layers ([L_moe, E], [L_moe]),
and for the experts each token used ([B,T,L_moe,k]). From them, per micro-batch:

- the load-balancing loss of Switch / Qwen3-MoE as transformers' `load_balancing_loss_func`
  computes it for `Qwen3MoeForCausalLM`: the MoE layers' tokens pooled (their router logits are
  concatenated), f_e = the fraction of (token, layer) pairs whose top-k holds expert e (summed over
  the k slots, so the f_e sum to k), P_e = the mean router probability of e over the same pairs,
  loss = E * sum_e f_e * P_e (k when perfectly balanced), over the real tokens (the attention
  mask: prompt and completion, not padding). Its gradient reaches the routers through P only (f
  counts choices). With a replayed route the f still counts the router's own top-k, as
  transformers does from the logits. The step adds coef x loss per micro-batch weighted by the
  micro-batch's share of the step's real tokens: one micro-batch on any mesh is exactly
  transformers' loss (the sums run over every device's rows); several are their token-weighted
  mean, as gradient accumulation averages per-forward losses;
- the logs, as contributions that add up over micro-batches (`finish` completes them):
  `router/aux_loss` (that loss, logged whether or not it is in the GRPO loss),
  `router/entropy` (the routers' softmax entropy in nats, mean over real tokens and MoE layers;
  log E = uniform), `router/load_max_over_mean` (per MoE layer, the busiest expert's tokens over
  the mean tokens per expert, N k / E: 1 = balanced, E / k = all on k experts; mean over the
  layers) and `router/load_max_over_mean_worst` (the worst layer), and, where the rollout
  recorded the sampler's experts and the learner does not replay them,
  `rollout/route_mismatch`: the fraction of recorded tokens whose experts (as a set) differ
  between the sampler and this pass in at least one MoE layer (launch.bench replay's measure;
  the sets compared by their 16-bit `digest`s, so that two sets that differ in more than one
  expert count as alike about 2^-16 of the time), and `rollout/route_mismatch_layers`: the
  fraction of (token, MoE layer) pairs that differ. A
  recorded token is a real one other than its sequence's last (never fed to the sampler: its
  record is zeros). The pass is the optimizer step's own: with one minibatch and one pass
  (mu = 1) the parameters the sampler used, else the step's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.moe import RouterStats

LOAD = "router_load"  # the [L_moe, E] sums `finish` turns into the load metrics


def balance_loss(stats: RouterStats, num_tokens) -> jax.Array:
    """f32 []: transformers' load-balancing loss over `num_tokens` real tokens (module
    docstring) from the MoE layers' stats ([L_moe, E] sums)."""
    layers, experts = stats.probs.shape
    pairs = jnp.maximum(layers * num_tokens, 1).astype(jnp.float32)
    f = jax.lax.stop_gradient(stats.chosen.sum(0)) / pairs  # [E]
    p = stats.probs.sum(0) / pairs  # [E]
    return experts * jnp.sum(f * p)


def recorded(segment_ids) -> jax.Array:
    """bool [B,T]: the tokens a sampler's record covers, real and not their sequence's last."""
    real = segment_ids != 0
    same_next = segment_ids[:, 1:] == segment_ids[:, :-1]  # [B,T-1]
    return real & jnp.pad(same_next, ((0, 0), (0, 1)))


# A bijection of 16-bit ids: multiplications by odd numbers and xor-shifts, each invertible
# mod 2^16, so that distinct experts get distinct codes and a set's sum of codes is no linear
# function of its ids (whose sums often agree).
_MIX = ((0x9E37, 0x79B9, 7), (0xA3B5, 0, 8), (0x2C1B, 0, 7))


def digest(experts, xp=jnp):
    """uint16 [..., L]: a digest of each expert set, experts int [..., L, k] (ids below 2^15, in
    any order), with xp numpy on the host (`rl.packing`) or jax.numpy in the learner, alike: the
    sum over the set of each id's code (`_MIX`, a bijection of 16-bit values) mod 2^16. The
    sampler's record goes to the learner as this, 2 bytes a (token, layer) instead of k ids
    (Qwen3-30B-A3B: 8), for rollout/route_mismatch. Sets that differ in one expert (the usual
    flip) never share a digest (distinct codes); sets that differ in more share one with
    probability about 2^-16, which `mismatch` then counts as alike."""
    if xp is np:  # the codes looked up: 6x faster than computing them (2.5 us a 30B token)
        return np.take(_codes(), np.asarray(experts).astype(np.uint16)).sum(-1, dtype=np.uint16)
    x = _mixed(jnp.asarray(experts).astype(jnp.uint32) & 0xFFFF, jnp)
    return (jnp.sum(x, axis=-1, dtype=jnp.uint32) & 0xFFFF).astype(jnp.uint16)


def _mixed(x, xp):
    """uint32 x < 2^16 -> its code (`_MIX`), < 2^16."""
    for mul, add, shift in _MIX:
        x = (x * xp.uint32(mul) + xp.uint32(add)) & 0xFFFF
        x = x ^ (x >> shift)
    return x


@functools.cache
def _codes() -> np.ndarray:
    """uint16 [2^16]: every 16-bit value's code, the host's lookup table."""
    return _mixed(np.arange(2**16, dtype=np.uint32), np).astype(np.uint16)


def mismatch(used, sampler, where) -> tuple[jax.Array, jax.Array]:
    """used int [B,T,L,k] (the experts this pass used in each token's MoE layers), sampler
    uint16 [B,T,L] (the sampler's, as `digest`s), where bool [B,T] -> (tokens whose expert sets
    differ in some layer, (token, layer) pairs that differ): f32 []."""
    differ = (digest(used) != sampler) & where[..., None]  # [B,T,L]
    return jnp.sum(jnp.any(differ, -1), dtype=jnp.float32), jnp.sum(differ, dtype=jnp.float32)


def step_terms(
    stats: RouterStats,
    segment_ids,
    global_real,
    used=None,
    sampler=None,
    global_recorded=None,
) -> tuple[jax.Array, dict]:
    """One micro-batch's (balance loss weighted by its share of the step's real tokens, metric
    contributions), from its stats, segment ids [B,T], the step's real-token count and, for the
    mismatch, the experts this pass used [B,T,L,k] and the sampler's digests [B,T,L]
    (`Batch.route_digest`) with the step's count of recorded tokens (`recorded`)."""
    layers = stats.probs.shape[0]
    real = jnp.sum(segment_ids != 0, dtype=jnp.float32)
    total = jnp.maximum(global_real, 1).astype(jnp.float32)
    aux = balance_loss(stats, real) * real / total
    metrics = {
        "router/aux_loss": jax.lax.stop_gradient(aux),
        "router/entropy": jnp.sum(stats.entropy) / (total * layers),
        LOAD: stats.load,
    }
    if sampler is not None:
        tokens, pairs = mismatch(used, sampler, recorded(segment_ids))
        n = jnp.maximum(global_recorded, 1).astype(jnp.float32)
        metrics["rollout/route_mismatch"] = tokens / n
        metrics["rollout/route_mismatch_layers"] = pairs / (n * layers)
    return aux, metrics


def finish(metrics: dict) -> dict:
    """The step's summed metrics with the experts' load [L_moe, E] turned into its two ratios
    (module docstring); metrics without it are returned as they are."""
    if LOAD not in metrics:
        return metrics
    metrics = dict(metrics)
    load = metrics.pop(LOAD)
    ratio = jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9)  # [L_moe]
    metrics["router/load_max_over_mean"] = jnp.mean(ratio)
    metrics["router/load_max_over_mean_worst"] = jnp.max(ratio)
    return metrics


def placeholder(num_layers: int, num_experts: int) -> RouterStats:
    """Zero stats of the MoE layers' shapes (the learner's metric structure, traced once)."""
    zeros = jnp.zeros((num_layers, num_experts), jnp.float32)
    return RouterStats(zeros, zeros, zeros, jnp.zeros((num_layers,), jnp.float32))
