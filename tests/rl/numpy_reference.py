"""Independent float64 numpy reference for rl.advantages and rl.losses, used only by the tests.

Written on purpose in a different style from the jnp code: python loops over groups, sequences
and tokens, per-case branches instead of min/clip algebra, sequence ratios as products of token
ratios. It computes the FULL-batch loss directly (global means over this batch), never
contributions, so the tests check both the formulas and the contribution bookkeeping.
"""

import math

import numpy as np


def advantages(rewards, group_size, mode, eps):
    r = [float(x) for x in rewards]
    n = len(r)
    mean_all = sum(r) / n
    batch_std = math.sqrt(sum((x - mean_all) ** 2 for x in r) / max(n - 1, 1))
    out = [0.0] * n
    zero_groups = 0
    for g in range(n // group_size):
        grp = r[g * group_size : (g + 1) * group_size]
        if all(x == grp[0] for x in grp):
            zero_groups += 1
            continue
        m = sum(grp) / group_size
        std = math.sqrt(sum((x - m) ** 2 for x in grp) / max(group_size - 1, 1))
        for j, x in enumerate(grp):
            if mode == "group_std":
                out[g * group_size + j] = (x - m) / (std + eps)
            elif mode == "group_mean":
                out[g * group_size + j] = x - m
            elif mode == "batch_std":
                out[g * group_size + j] = (x - m) / (batch_std + eps)
            else:
                raise ValueError(mode)
    return np.array(out), zero_groups


def masked_advantages(rewards, group_size, mode, eps, keep, penalty=None):
    """`advantages` over the kept samples only: each group (and the batch std) as if drawn
    without the dropped ones; dropped samples get 0."""
    r = [float(x) for x in rewards]
    kept_all = [x for x, k in zip(r, keep) if k]
    m_all = sum(kept_all) / max(len(kept_all), 1)
    batch_std = math.sqrt(sum((x - m_all) ** 2 for x in kept_all) / max(len(kept_all) - 1, 1))
    out = [0.0] * len(r)
    for g in range(len(r) // group_size):
        idx = [i for i in range(g * group_size, (g + 1) * group_size) if keep[i]]
        vals = [r[i] for i in idx]
        if idx and penalty is not None:
            pm = sum(float(penalty[i]) for i in idx) / len(idx)
            for i in idx:
                out[i] -= float(penalty[i]) - pm
        if len(vals) < 2 or all(x == vals[0] for x in vals):
            continue
        m = sum(vals) / len(vals)
        std = math.sqrt(sum((x - m) ** 2 for x in vals) / (len(vals) - 1))
        for i, x in zip(idx, vals):
            scale = {"group_std": std + eps, "group_mean": 1.0, "batch_std": batch_std + eps}
            out[i] += (x - m) / scale[mode]
    return np.array(out)


def kl(lp, ref, estimator, clamp):
    """One token. KL(pi || ref) estimators written via q = ref / pi, log q clamped to +-clamp."""
    log_q = min(max(ref - lp, -clamp), clamp)
    if estimator == "k1":
        return -log_q
    if estimator == "k2":
        return 0.5 * log_q**2
    q = math.exp(log_q)
    return q - math.log(q) - 1.0


def _clipped_objective(ratio, a, low, high):
    """min(r A, clip(r) A) by cases on the sign of A; returns (objective, clipped_low, high)."""
    if a >= 0:
        return a * min(ratio, 1.0 + high), False, a > 0 and ratio > 1.0 + high
    return a * max(ratio, 1.0 - low), ratio < 1.0 - low, False


def policy_tokens(name, lp, olp, a, cfg):
    """Per-token (loss, ratio, clipped_low, clipped_high, clipped_dual) for ONE sequence's valid
    tokens (1-d arrays lp, olp)."""
    rows = []
    if name == "gspo":
        s = math.exp(sum(x - y for x, y in zip(lp, olp)) / max(len(lp), 1))
        for _ in lp:
            obj, lo, hi = _clipped_objective(s, a, cfg.gspo_eps_low, cfg.gspo_eps_high)
            rows.append((-obj, s, lo, hi, False))
        return rows
    for x, y in zip(lp, olp):
        r = math.exp(x - y)
        if name == "ppo_clip":
            obj, lo, hi = _clipped_objective(r, a, cfg.eps_low, cfg.eps_high)
            rows.append((-obj, r, lo, hi, False))
        elif name == "dual_clip":
            obj, lo, hi = _clipped_objective(r, a, cfg.eps_low, cfg.eps_high)
            dual = a < 0 and r > cfg.dual_clip_c
            if a < 0:
                obj = a * min(max(r, 1.0 - cfg.eps_low), cfg.dual_clip_c)
            rows.append((-obj, r, lo, hi, dual))
        elif name == "cispo":
            w = r
            if r < 1.0 - cfg.eps_low:
                w = 1.0 - cfg.eps_low
            if r > 1.0 + cfg.eps_high:
                w = 1.0 + cfg.eps_high
            rows.append((-w * a * x, r, r < 1.0 - cfg.eps_low, r > 1.0 + cfg.eps_high, False))
        else:
            raise ValueError(name)
    return rows


def is_weights(olp, slp, cfg):
    """(weight, keep) lists for ONE sequence's valid tokens."""
    n = len(olp)
    if cfg.is_correction == "none":
        return [1.0] * n, [True] * n
    token_ratios = [math.exp(o - s) for o, s in zip(olp, slp)]
    if cfg.is_level == "sequence":
        seq_ratio = float(np.prod(token_ratios))
        ratios = [seq_ratio] * n
    elif cfg.is_level == "geometric":  # the n-th root of the product
        seq_ratio = float(np.prod(token_ratios)) ** (1.0 / max(n, 1))
        ratios = [seq_ratio] * n
    else:
        ratios = token_ratios
    if cfg.is_correction == "tis":
        return [min(r, cfg.is_cap) for r in ratios], [True] * n
    inside = [cfg.mis_low <= r <= cfg.mis_high for r in ratios]
    if cfg.is_correction == "icepop":
        return [r if k else 0.0 for r, k in zip(ratios, inside)], inside
    return [1.0] * n, inside


def trust_keep(lp, olp, a, cfg):
    """Per token of ONE sequence: False where DPPO's trust region drops it. The probability (tv)
    or log-probability (log) moved beyond the region in the direction the advantage pushes;
    abs_log: the log-probability moved out of [-low, high], either way, whatever the advantage."""
    out = []
    for x, y in zip(lp, olp):
        if cfg.trust_region == "none":
            out.append(True)
            continue
        if cfg.trust_region == "abs_log":
            out.append(-cfg.trust_region_low <= x - y <= cfg.trust_region_high)
            continue
        moved = math.exp(x) - math.exp(y) if cfg.trust_region == "tv" else x - y
        if a > 0:
            out.append(not moved > cfg.trust_region_high)
        else:
            out.append(not moved < -cfg.trust_region_low)
    return out


def aggregate_full(values, keeps, mode, max_new_tokens):
    """Full-batch aggregate of per-sequence token lists; `keeps` selects tokens that count.
    Token normaliser = all valid tokens, sequence normaliser = all sequences."""
    n_tokens = sum(len(v) for v in values)
    n_seqs = len(values)
    seq_sums = [sum(x for x, k in zip(v, kp) if k) for v, kp in zip(values, keeps)]
    if mode == "token_mean":
        return sum(seq_sums) / n_tokens
    if mode == "seq_mean_token_mean":
        kept = [max(sum(kp), 1) for kp in keeps]
        return sum(s / n for s, n in zip(seq_sums, kept)) / n_seqs
    if mode == "seq_mean_token_sum":
        return sum(seq_sums) / n_seqs
    if mode == "drgrpo_constant":
        return sum(seq_sums) / (n_seqs * max_new_tokens)
    raise ValueError(mode)


def grpo_loss(logp, old_logp, sampler_logp, ref_logp, adv, mask, cfg, entropy=None):
    """Full-batch loss and metrics (same keys as rl.losses.grpo_loss, maxima flattened in); one
    sequence per row (`grpo_loss_seqs` takes the sequences themselves)."""
    mask = np.asarray(mask, np.float64)
    seqs = []
    for i in range(mask.shape[0]):
        idx = np.nonzero(mask[i] > 0)[0]
        pick = lambda x, i=i, idx=idx: None if x is None else np.asarray(x, np.float64)[i, idx]
        seqs.append(
            dict(
                logp=pick(logp),
                old_logp=pick(old_logp),
                sampler_logp=pick(sampler_logp),
                ref_logp=pick(ref_logp),
                entropy=pick(entropy),
                adv=float(adv[i]),
            )
        )
    return grpo_loss_seqs(seqs, cfg)


def grpo_loss_seqs(seqs, cfg):
    """Full-batch loss and metrics of a list of sequences, each a dict of its valid tokens' 1-d
    float64 arrays logp, old_logp, sampler_logp, ref_logp, entropy (the last three may be None)
    and its advantage adv."""
    sampler_logp = seqs[0]["sampler_logp"]
    ref_logp = seqs[0]["ref_logp"]
    entropy = seqs[0]["entropy"]
    per_seq = {k: [] for k in ("loss", "w", "keep", "ratio", "lo", "hi", "dual", "kl", "ent")}
    per_seq["trust"] = []
    abs_d, mis_kl, max_d = 0.0, 0.0, 0.0
    for sq in seqs:
        lp, olp = sq["logp"], sq["old_logp"]
        rows = policy_tokens(cfg.policy_loss, lp, olp, sq["adv"], cfg)
        if sampler_logp is None:
            w, keep = [1.0] * len(lp), [True] * len(lp)
        else:
            slp = sq["sampler_logp"]
            w, keep = is_weights(olp, slp, cfg)
            for o, s in zip(olp, slp):
                abs_d += abs(o - s)
                mis_kl += math.exp(o - s) - (o - s) - 1.0
                max_d = max(max_d, abs(o - s))
        trust = trust_keep(lp, olp, sq["adv"], cfg)
        per_seq["loss"].append([wt * row[0] for wt, row in zip(w, rows)])
        per_seq["w"].append(w)
        per_seq["keep"].append(keep)
        per_seq["trust"].append(trust)
        for j, key in enumerate(("ratio", "lo", "hi", "dual"), start=1):
            per_seq[key].append([float(row[j]) for row in rows])
        if ref_logp is not None:
            est = cfg.kl_estimator if cfg.kl_in == "loss" else "k1"
            per_seq["kl"].append([kl(a, b, est, cfg.kl_clamp) for a, b in zip(lp, sq["ref_logp"])])
        if entropy is not None:
            per_seq["ent"].append(list(sq["entropy"]))

    n_tok = sum(len(v) for v in per_seq["w"])
    all_keep = [[True] * len(v) for v in per_seq["w"]]
    agg = lambda v, k: aggregate_full(v, k, cfg.aggregation, cfg.max_new_tokens)
    tok_mean = lambda v: sum(sum(x) for x in v) / n_tok
    both = [[k and t for k, t in zip(kp, tp)] for kp, tp in zip(per_seq["keep"], per_seq["trust"])]
    policy = agg(per_seq["loss"], both)
    loss = policy
    dropped = lambda keeps: [[float(not k) for k in kp] for kp in keeps]
    seq_frac = lambda keeps: sum(not all(kp) for kp in keeps) / len(seqs)
    out = {
        "policy_loss": policy,
        "clip_frac_low": tok_mean(per_seq["lo"]),
        "clip_frac_high": tok_mean(per_seq["hi"]),
        "ratio_mean": tok_mean(per_seq["ratio"]),
        "is_weight_mean": tok_mean(per_seq["w"]),
        "mis_masked_frac": tok_mean(dropped(per_seq["keep"])),
        "mis_masked_seq_frac": seq_frac(per_seq["keep"]),
        "ratio_max": max(max(v, default=0.0) for v in per_seq["ratio"]),
        "is_weight_max": max(max(v, default=0.0) for v in per_seq["w"]),
    }
    if cfg.trust_region != "none":
        out["trust_masked_frac"] = tok_mean(dropped(per_seq["trust"]))
        out["trust_masked_seq_frac"] = seq_frac(per_seq["trust"])
    if cfg.policy_loss == "dual_clip":
        out["clip_frac_dual"] = tok_mean(per_seq["dual"])
    if sampler_logp is not None:
        out["mismatch_abs_logp"] = abs_d / n_tok
        out["mismatch_kl"] = mis_kl / n_tok
        out["mismatch_abs_logp_max"] = max_d
    if ref_logp is not None:
        out["kl"] = tok_mean(per_seq["kl"])
        if cfg.kl_in == "loss" and cfg.kl_coef > 0:
            loss += cfg.kl_coef * agg(per_seq["kl"], all_keep)
    if entropy is not None:
        out["entropy"] = tok_mean(per_seq["ent"])
        loss -= cfg.entropy_coef * agg(per_seq["ent"], all_keep)
    out["loss"] = loss
    return out
