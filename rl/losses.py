"""GRPO-family losses as pure jnp functions: policy surrogates, KL, IS correction, aggregation.

The learner's train step owns the model, optimizer, micro-batching and data parallelism; it calls
`grpo_loss` once per micro-batch and SUMS the results. Every number returned here is therefore a
*contribution*: normalisers (`global_tokens`, `global_seqs`) are counted once for the whole optimizer
step by the caller, so the sum over any split of the batch rows equals the full-batch loss exactly
(no mean-of-means bias from uneven padding across micro-batches). Metrics follow the same rule,
except `metrics["maxima"]`, which the caller reduces with max (`combine_metrics` does both).

Shapes: B rows in this micro-batch, T positions; masks are f32 0/1. A row holds one sequence, or
several packed ones (`rl.packing`): `segments` int [B,T] then says which sequence of its row each
position belongs to, and everything per sequence (lengths, GSPO's ratio, sequence-level IS, the
count of sequences) is reduced over segments (`segment_sum`), so a packed batch gives the loss and
gradient of the same sequences laid out one per row. Inputs at padded positions may be garbage
(e.g. -inf log-probs): `grpo_loss` zeroes them before any exp, so neither the value nor the
gradient can become NaN.

Three log-prob tensors of the same tokens take part in the policy term, all under the sampling
distribution (temperature, top-k, top-p: the probabilities of the actions actually taken):
- `logp`: current policy, the only one with a gradient;
- `old_logp`: the learner's log-probs under the parameters that sampled the batch (PPO's pi_old);
- `sampler_logp`: what the sampler reported for the same parameters. It differs from `old_logp` only
  by numerics (kernels, bf16, batch shapes), and `behaviour_weights` corrects for that mismatch
  (truncated / masked importance sampling, `rl.mismatch`); `mismatch_metrics` measures it.
The KL term compares the current policy's tempered full softmax (`full_logp`) with the
reference's: see `rl.logprobs` for why the KL is not taken between truncated distributions.

Choices a reader may question:
- The policy term is aggregated with `mask * keep` (MIS drops tokens), KL and entropy with `mask`:
  MIS rejects samples whose *surrogate* is untrustworthy, while the KL to the reference stays a
  property of every generated token. Normalisers are not recounted after MIS, so under token_mean
  a dropped token acts as a zero-weight token; under seq_mean_token_mean a sequence's remaining
  tokens share its full weight (the per-sequence length is the kept length).
- The IS weight multiplies only the policy term, never KL or entropy.
- The trust region (`trust_region`, DPPO: Qi et al. 2026, arXiv 2602.04879; prime-rl's default
  loss) drops a token from the policy term when pi has moved too far from pi_old in the
  direction its advantage pushes: for A > 0 when d > trust_region_high, otherwise when
  d < -trust_region_low, with d = pi - pi_old in probability ("tv", DPPO-Binary-TV) or
  log pi - log pi_old ("log"). A token beyond the region keeps the gradient that brings it back
  (A < 0 on a token that rose), as DPPO's and prime-rl's masks do; like MIS it acts on the
  policy term only, and normalisers are not recounted. "abs_log" is the literal two-sided rule:
  a token is dropped when d = log pi - log pi_old leaves [-trust_region_low, trust_region_high]
  whatever its advantage's sign (|d| > delta with low = high = delta), so it also drops the
  tokens that the sign-aware rules let bring themselves back. With pi_old = sg(logp)
  (recompute, one pass, one minibatch) d = 0 and no rule masks anything.
- GSPO's per-token form sg(s) * exp(logp - sg(logp)) makes every token carry the sequence ratio s
  with gradient s * grad(logp_t); with seq_mean_token_mean this is exactly GSPO's sequence loss,
  and the other aggregation modes choose a different weighting of sequences.
- CISPO's value (-w * A * logp) is a REINFORCE surrogate: only its gradient is meaningful. Its
  clip indicators mark tokens whose weight was truncated, whatever the sign of A.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rl.mismatch import CORRECTIONS, LEVELS, behaviour_weights, mismatch_metrics
from rl.segments import count_sequences, segment_sum

sg = jax.lax.stop_gradient

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "drgrpo_constant")
KL_ESTIMATORS = ("k1", "k2", "k3")
TRUST_REGIONS = ("none", "tv", "log", "abs_log")  # LossConfig.trust_region
# The metrics grpo_loss returns under "maxima": reduced with max over micro-batches and steps.
MAXIMA = ("ratio_max", "is_weight_max", "mismatch_abs_logp_max")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Loss hyper-parameters. Frozen (hashable) so it can be a static argument of jax.jit."""

    policy_loss: str = "ppo_clip"  # key of POLICY_LOSSES
    eps_low: float = 0.2  # clip ratio below at 1 - eps_low (ppo_clip, dual_clip, cispo)
    eps_high: float = 0.28  # clip ratio above at 1 + eps_high; > eps_low is DAPO's clip-higher
    dual_clip_c: float = 3.0  # dual-clip bound for A < 0: loss <= c * |A|
    gspo_eps_low: float = 3e-4  # GSPO clips the sequence ratio, hence the tiny range
    gspo_eps_high: float = 4e-4
    kl_coef: float = 0.04  # beta; 0 disables the KL term
    kl_estimator: str = "k3"  # k2 or k3 in the loss, k1 in the reward (see `kl_penalty`)
    kl_in: str = "loss"  # "loss": beta * KL in the loss; "reward": k1 folded into rewards
    kl_clamp: float = 10.0  # |ref_logp - logp| clamp before any estimator
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)
    aggregation: str = "token_mean"  # one of AGGREGATIONS
    max_new_tokens: int = 0  # Dr. GRPO's constant normaliser; must be > 0 for drgrpo_constant
    is_correction: str = "none"  # sampler-vs-learner correction: none, tis, mis, icepop
    is_level: str = "token"  # IS ratio per token, sequence (product) or geometric (mean)
    is_cap: float = 2.0  # TIS: weight = min(ratio, is_cap)
    mis_low: float = 0.5  # MIS and IcePop keep ratios in [mis_low, mis_high]
    mis_high: float = 2.0
    trust_region: str = "none"  # DPPO token mask: none, tv (prob.), log (log-prob), abs_log
    trust_region_low: float = 0.2  # masked when pi - pi_old < -low on a token with A <= 0
    trust_region_high: float = 0.2  # masked when pi - pi_old > high on a token with A > 0
    # (abs_log: masked when log pi - log pi_old < -low or > high, whatever the sign of A)

    def validate(self):
        """Raises ValueError naming the first bad field and why."""

        def bad(field, why):
            raise ValueError(f"LossConfig.{field}={getattr(self, field)!r}: {why}")

        choices = {
            "policy_loss": tuple(POLICY_LOSSES),
            "kl_estimator": KL_ESTIMATORS,
            "kl_in": ("loss", "reward"),
            "aggregation": AGGREGATIONS,
            "is_correction": CORRECTIONS,
            "is_level": LEVELS,
            "trust_region": TRUST_REGIONS,
        }
        for field, valid in choices.items():
            if getattr(self, field) not in valid:
                bad(field, f"must be one of {', '.join(valid)}")
        if not 0.0 <= self.eps_low < 1.0:
            bad("eps_low", "must be in [0, 1) so that 1 - eps_low > 0")
        if self.eps_high < 0.0:
            bad("eps_high", "must be >= 0")
        if self.dual_clip_c <= 1.0:
            bad("dual_clip_c", "must be > 1 (the dual clip bounds the loss above the PPO clip)")
        if not 0.0 <= self.gspo_eps_low < 1.0:
            bad("gspo_eps_low", "must be in [0, 1)")
        if self.gspo_eps_high < 0.0:
            bad("gspo_eps_high", "must be >= 0")
        if self.kl_coef < 0.0:
            bad("kl_coef", "must be >= 0 (0 disables the KL penalty)")
        if self.kl_coef > 0 and self.kl_in == "loss" and self.kl_estimator == "k1":
            bad(
                "kl_estimator",
                "k1 in the loss has zero expected gradient (no penalty); use k2 "
                "or k3, or kl_in='reward', where k1 is the right estimator",
            )
        if self.kl_coef > 0 and self.kl_in == "reward" and self.kl_estimator != "k1":
            bad(
                "kl_estimator",
                "kl_in='reward' folds k1 = log pi - log ref into the rewards; "
                "set kl_estimator='k1'",
            )
        if self.kl_clamp <= 0.0:
            bad("kl_clamp", "must be > 0")
        if self.entropy_coef < 0.0:
            bad("entropy_coef", "must be >= 0 (it is a bonus)")
        if self.aggregation == "drgrpo_constant" and self.max_new_tokens <= 0:
            bad("max_new_tokens", "must be > 0 with aggregation='drgrpo_constant'")
        # The bounds below that exclude on-policy tokens (ratio 1) are checked where the rule is
        # in use, so a run saved with another rule and such a value still loads.
        if not self.is_cap > 0.0:
            bad("is_cap", "must be > 0")
        if self.is_correction == "tis" and self.is_cap < 1.0:
            bad("is_cap", "must be >= 1 (a cap below 1 down-weights on-policy tokens, ratio 1)")
        if not 0.0 <= self.mis_low < self.mis_high:
            bad("mis_low", f"must satisfy 0 <= mis_low < mis_high ({self.mis_high})")
        for field, ok in (("mis_low", self.mis_low <= 1.0), ("mis_high", self.mis_high >= 1.0)):
            if self.is_correction in ("mis", "icepop") and not ok:
                bad(field, "the band [mis_low, mis_high] must hold 1, an on-policy token's ratio")
        for field in ("trust_region_low", "trust_region_high"):
            if not getattr(self, field) >= 0.0:
                bad(field, "must be >= 0 (the trust region's half-width)")
            if self.trust_region == "tv" and getattr(self, field) >= 1.0:
                bad(field, "must be < 1 with trust_region='tv' (a probability moves by at most 1)")
        return self


# ----------------------------------------------------------------------------------------------
# KL to the reference policy.


def kl_penalty(logp, ref_logp, estimator: str, clamp: float):
    """Per-token estimate of KL(pi || ref) from samples of pi. [B, T] -> [B, T].

    With d = ref_logp - logp, clamped to [-clamp, clamp] first (one token the reference finds
    absurd, or a -inf, must not blow up the step; the clamp also zeroes that token's gradient):
    - k1 = -d. Unbiased value, can be negative. As a loss its gradient grad(log pi) has expectation
      0 under pi: no penalty at all, so the config refuses it in the loss. As a reward
      (kl_in="reward", `rl.shaping.kl_reward`) the policy gradient of sum_t k1 is the gradient of
      KL(pi || ref): the InstructGPT / PPO-RLHF form.
    - k2 = d^2 / 2. Biased value (>= 0); as a loss its gradient (log pi - log ref) grad(log pi) has
      expectation grad KL(pi || ref) (per token, on-policy).
    - k3 = exp(d) - d - 1. Unbiased value, >= 0 (the GRPO paper's choice). As a loss its gradient
      (1 - ref/pi) grad(log pi) has expectation grad KL(ref || pi), the reverse direction: it also
      pulls pi towards ref, with a different weighting of the tokens.
    """
    d = jnp.clip(ref_logp - logp, -clamp, clamp)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return jnp.exp(d) - d - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


# ----------------------------------------------------------------------------------------------
# Policy surrogates: (logp, old_logp, adv, mask, cfg, segments) -> (loss[B, T], aux of [B, T]
# arrays). adv is [B] per row or [B, T] per position (packed rows); old_logp arrives
# stop-gradient'ed; aux indicators are f32 0/1.


def _per_token(adv):
    """Advantages per sequence [B] (one sequence per row) or per position [B, T]: [B, 1|T]."""
    return adv[:, None] if adv.ndim == 1 else adv


def _ppo_objective(ratio, a, low, high):
    """min(r A, clip(r) A) and where each clip is active (the gradient is zero there)."""
    obj = jnp.minimum(ratio * a, jnp.clip(ratio, 1.0 - low, 1.0 + high) * a)
    clipped_low = ((a < 0) & (ratio < 1.0 - low)).astype(jnp.float32)
    clipped_high = ((a > 0) & (ratio > 1.0 + high)).astype(jnp.float32)
    return obj, {"ratio": ratio, "clipped_low": clipped_low, "clipped_high": clipped_high}


def ppo_clip_loss(logp, old_logp, adv, mask, cfg, segments=None):
    ratio = jnp.exp(logp - old_logp)  # [B, T]
    obj, aux = _ppo_objective(ratio, _per_token(adv), cfg.eps_low, cfg.eps_high)
    return -obj, aux


def dual_clip_loss(logp, old_logp, adv, mask, cfg, segments=None):
    """PPO clip plus, for A < 0, a floor c*A on the objective: a huge ratio on a bad token cannot
    produce an unbounded step (Ye et al. 2020)."""
    ratio = jnp.exp(logp - old_logp)  # [B, T]
    a = _per_token(adv)  # [B, 1|T]
    obj, aux = _ppo_objective(ratio, a, cfg.eps_low, cfg.eps_high)
    c = cfg.dual_clip_c
    obj = jnp.where(a < 0, jnp.maximum(obj, c * a), obj)
    aux["clipped_dual"] = ((a < 0) & (ratio > c)).astype(jnp.float32)
    return -obj, aux


def gspo_loss(logp, old_logp, adv, mask, cfg, segments=None):
    """GSPO (Zheng et al. 2025): clip the length-normalised sequence ratio, not token ratios."""
    length = jnp.maximum(segment_sum(mask, segments), 1.0)  # [B, T] its sequence's length
    log_s = segment_sum(mask * (logp - old_logp), segments) / length  # [B, T]
    # Value s for every token, gradient s * grad(logp_t): see the module docstring.
    s_t = sg(jnp.exp(log_s)) * jnp.exp(logp - sg(logp))  # [B, T]
    obj, aux = _ppo_objective(s_t, _per_token(adv), cfg.gspo_eps_low, cfg.gspo_eps_high)
    return -obj, aux


def cispo_loss(logp, old_logp, adv, mask, cfg, segments=None):
    """CISPO (MiniMax-M1): REINFORCE with a clipped, detached IS weight, so clipped tokens still
    get a gradient (PPO would zero it)."""
    ratio = jnp.exp(logp - old_logp)  # [B, T]
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    weight = sg(jnp.clip(ratio, lo, hi))
    aux = {
        "ratio": ratio,
        "clipped_low": (ratio < lo).astype(jnp.float32),
        "clipped_high": (ratio > hi).astype(jnp.float32),
    }
    return -weight * _per_token(adv) * logp, aux


POLICY_LOSSES = {
    "ppo_clip": ppo_clip_loss,
    "dual_clip": dual_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}


def trust_region_keep(logp, old_logp, adv, cfg):
    """f32 [B, T] 0 where the DPPO trust region drops a token from the policy term, else 1 (see
    the module docstring); a constant (no gradient)."""
    if cfg.trust_region == "none":
        return jnp.ones_like(logp)
    if cfg.trust_region == "tv":
        d = jnp.exp(logp) - jnp.exp(old_logp)  # [B, T] change of the token's probability
    elif cfg.trust_region in ("log", "abs_log"):
        d = logp - old_logp
    else:
        raise ValueError(
            f"unknown trust_region {cfg.trust_region!r}; valid: {', '.join(TRUST_REGIONS)}"
        )
    d = sg(d)
    if cfg.trust_region == "abs_log":  # two-sided: the advantage's sign plays no part
        out = (d > cfg.trust_region_high) | (d < -cfg.trust_region_low)
    else:
        out = jnp.where(_per_token(adv) > 0, d > cfg.trust_region_high, d < -cfg.trust_region_low)
    return 1.0 - out.astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# Aggregation: per-token values -> this micro-batch's contribution to the full-batch scalar.


def aggregate(
    per_token, mask, mode, *, global_tokens, global_seqs, max_new_tokens=0, segments=None
):
    """Contribution of these rows to the full-batch aggregate; sums over row splits are exact.

    token_mean:           sum(x) / global_tokens          (DAPO: every token weighs the same)
    seq_mean_token_mean:  sum_i mean_t(x_i) / global_seqs (GRPO paper, GSPO)
    seq_mean_token_sum:   sum(x) / global_seqs
    drgrpo_constant:      sum(x) / (global_seqs * max_new_tokens)   (Dr. GRPO: no length bias)
    Sums run over positions where mask > 0; a sequence's length is its mask sum (at least 1), over
    its segment of the row (`segments`, None: the whole row).
    """
    x = jnp.where(mask > 0, per_token, 0.0)  # [B, T]
    total = jnp.sum(x)
    if mode == "token_mean":
        return total / jnp.maximum(global_tokens, 1)
    if mode == "seq_mean_token_mean":
        length = jnp.maximum(segment_sum(mask, segments), 1.0)  # [B, T] its sequence's length
        return jnp.sum(x / length) / jnp.maximum(global_seqs, 1)
    if mode == "seq_mean_token_sum":
        return total / jnp.maximum(global_seqs, 1)
    if mode == "drgrpo_constant":
        if max_new_tokens <= 0:
            raise ValueError(f"drgrpo_constant needs max_new_tokens > 0, got {max_new_tokens}")
        return total / (jnp.maximum(global_seqs, 1) * max_new_tokens)
    raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")


def grpo_loss(
    logp,
    old_logp,
    sampler_logp,
    ref_logp,
    adv,
    mask,
    cfg: LossConfig,
    *,
    global_tokens,
    global_seqs,
    entropy=None,
    full_logp=None,
    segments=None,
):
    """This micro-batch's contribution to the GRPO loss, and summable metrics.

    Args:
      logp, old_logp: f32[B, T] current and rollout-time learner log-probs of the sampled tokens.
      sampler_logp: f32[B, T] sampler log-probs, or None (then is_correction must be "none").
      ref_logp: f32[B, T] reference log-probs, or None when kl_coef == 0 or kl_in == "reward".
        If given anyway, the KL is logged but only enters the loss when kl_in == "loss".
      adv: f32[B] sequence advantages (one sequence per row), or f32[B, T] each position's
        sequence advantage (packed rows).
      mask: f32[B, T] 1 on completion tokens that count.
      cfg: LossConfig (static under jit).
      global_tokens, global_seqs: valid tokens / sequences of the whole optimizer step.
      entropy: optional f32[B, T] per-token policy entropy (required if entropy_coef > 0).
      full_logp: optional f32[B, T] current policy log-probs under the tempered full softmax, the
        distribution the KL to the reference compares (`rl.logprobs`); None: logp (no top-k/p).
      segments: optional int[B, T] sequence id of each position within its row (packed rows);
        None: one sequence per row.

    Returns:
      loss = agg(w * policy, mask*keep*trust) + kl_coef * agg(kl, mask) - entropy_coef * agg(H, mask),
      metrics: dict of contributions (sum them over micro-batches); token-level metrics are
        token means (sum / global_tokens) whatever the aggregation, *_seq_frac fractions of
        global_seqs (sequences with a token the rule dropped: mis_* the IS rule's, trust_* the
        trust region's, logged when it is on). metrics["maxima"] holds MAXIMA (the sampler's
        only with sampler_logp), to be reduced with max.
    """
    cfg.validate()
    mask = mask.astype(jnp.float32)
    valid = mask > 0
    clean = lambda x: jnp.where(valid, x, 0.0)  # pad garbage (even -inf) never reaches an exp
    agg = functools.partial(
        aggregate,
        mode=cfg.aggregation,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        max_new_tokens=cfg.max_new_tokens,
        segments=segments,
    )
    token_mean = lambda x: jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(global_tokens, 1)

    logp = clean(logp)
    old_logp = sg(clean(old_logp))
    per_token, aux = POLICY_LOSSES[cfg.policy_loss](logp, old_logp, adv, mask, cfg, segments)

    if sampler_logp is None:
        if cfg.is_correction != "none":
            raise ValueError(f"is_correction={cfg.is_correction!r} needs sampler_logp")
        weight = keep = jnp.ones_like(mask)
        mismatch = None
    else:
        sampler_logp = sg(clean(sampler_logp))
        weight, keep = behaviour_weights(old_logp, sampler_logp, mask, cfg, segments)
        # old_logp, not logp: same parameters as the sampler, so this is pure numerical mismatch.
        mismatch = mismatch_metrics(old_logp, sampler_logp, mask)

    # Sequences with a token the rule dropped, as a fraction of the step's sequences.
    seq_frac = lambda drop: count_sequences(mask * drop, segments) / jnp.maximum(global_seqs, 1)
    policy_keep = keep
    trust = None
    if cfg.trust_region != "none":
        trust = trust_region_keep(logp, old_logp, adv, cfg)
        policy_keep = keep * trust
    policy = agg(weight * per_token, mask * policy_keep)
    loss = policy
    metrics = {
        "policy_loss": policy,
        "clip_frac_low": token_mean(aux["clipped_low"]),
        "clip_frac_high": token_mean(aux["clipped_high"]),
        "ratio_mean": token_mean(aux["ratio"]),
        "is_weight_mean": token_mean(weight),
        "mis_masked_frac": token_mean(1.0 - keep),
        "mis_masked_seq_frac": seq_frac(1.0 - keep),
    }
    if trust is not None:
        metrics["trust_masked_frac"] = token_mean(1.0 - trust)
        metrics["trust_masked_seq_frac"] = seq_frac(1.0 - trust)
    if "clipped_dual" in aux:
        metrics["clip_frac_dual"] = token_mean(aux["clipped_dual"])
    if mismatch is not None:
        metrics["mismatch_abs_logp"] = mismatch["abs_logp_sum"] / jnp.maximum(global_tokens, 1)
        metrics["mismatch_kl"] = mismatch["kl_sum"] / jnp.maximum(global_tokens, 1)

    kl_in_loss = cfg.kl_in == "loss" and cfg.kl_coef > 0
    if ref_logp is not None:
        # In reward mode the penalty applied is k1, so that is what gets logged.
        estimator = cfg.kl_estimator if cfg.kl_in == "loss" else "k1"
        pi = logp if full_logp is None else clean(full_logp)
        kl = kl_penalty(pi, sg(clean(ref_logp)), estimator, cfg.kl_clamp)  # [B, T]
        metrics["kl"] = token_mean(kl)
        if kl_in_loss:
            loss = loss + cfg.kl_coef * agg(kl, mask)
    elif kl_in_loss:
        raise ValueError(f"kl_coef={cfg.kl_coef} with kl_in='loss' needs ref_logp")

    if entropy is not None:
        entropy = clean(entropy)
        metrics["entropy"] = token_mean(entropy)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * agg(entropy, mask)
    elif cfg.entropy_coef > 0:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} needs per-token entropy")

    metrics["loss"] = loss
    # Padding is zeroed, and ratios and weights are positive, so 0 is a neutral fill for max.
    metrics["maxima"] = {
        "ratio_max": jnp.max(clean(aux["ratio"])),
        "is_weight_max": jnp.max(clean(weight)),
    }
    if mismatch is not None:
        metrics["maxima"]["mismatch_abs_logp_max"] = mismatch["abs_logp_max"]
    return loss, jax.tree.map(sg, metrics)


def combine_metrics(acc, new):
    """Reduces two micro-batches' metrics: sum everything except `maxima`, which takes the max."""
    summed = jax.tree.map(
        jnp.add,
        {k: v for k, v in acc.items() if k != "maxima"},
        {k: v for k, v in new.items() if k != "maxima"},
    )
    summed["maxima"] = jax.tree.map(jnp.maximum, acc["maxima"], new["maxima"])
    return summed
