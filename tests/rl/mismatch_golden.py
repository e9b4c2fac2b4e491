"""The pre-change outputs of `rl.losses.grpo_loss` with is_correction none / tis / mis, kept so
that the mismatch rules added later (issue 53: geometric level, icepop, trust region, the new
metrics) are shown to leave those configurations bitwise unchanged.

`python -m tests.rl.mismatch_golden` writes tests/fixtures/mismatch_golden.npz under the tests'
XLA settings (tests/conftest.py: -O0, elemental emitters, which round differently from the
defaults); it was run once at fdf8c92 (before the rules existed), and tests/rl/test_mismatch.py recomputes the same
quantities with today's code and compares them bit for bit: the loss, the gradient with respect
to logp, and every metric that existed then, eager and under jit, on a packed batch (several
sequences per row, padding with garbage in it).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np

import tests.conftest  # noqa: F401  (the tests' XLA settings, with which the file was made)
from rl.losses import LossConfig, grpo_loss

PATH = os.path.join(os.path.dirname(__file__), "..", "fixtures", "mismatch_golden.npz")

# (policy_loss, aggregation, is_correction, is_level): every correction and level of before, each
# with a different policy loss and aggregation, so every per-sequence path is taken.
CASES = [
    ("ppo_clip", "token_mean", "none", "token"),
    ("ppo_clip", "seq_mean_token_mean", "tis", "token"),
    ("dual_clip", "token_mean", "tis", "sequence"),
    ("cispo", "seq_mean_token_sum", "mis", "token"),
    ("gspo", "seq_mean_token_mean", "mis", "sequence"),
    ("ppo_clip", "drgrpo_constant", "mis", "token"),
]
JIT_CASES = (1, 4)  # also compared under jax.jit


def config(case) -> LossConfig:
    policy, aggregation, corr, level = case
    return LossConfig(
        policy_loss=policy,
        aggregation=aggregation,
        is_correction=corr,
        is_level=level,
        max_new_tokens=12,
        kl_coef=0.04,
        entropy_coef=0.01,
        mis_low=0.6,
        mis_high=1.6,
        gspo_eps_low=0.05,
        gspo_eps_high=0.05,
    )


def packed_batch(seed=3):
    """4 rows of 12 positions, 2-3 sequences per row and padding; garbage where mask is 0."""
    rng = np.random.default_rng(seed)
    segments = np.array(
        [
            [1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 0],
            [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0],
            [1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3],
            [1, 1, 1, 1, 1, 1, 1, 2, 2, 0, 0, 0],
        ],
        np.int32,
    )
    mask = (segments > 0).astype(np.float32)
    mask[0, 4] = mask[1, 0] = mask[2, 8] = 0.0  # prompt-like positions inside sequences
    shape = segments.shape
    logp = -rng.exponential(1.5, shape)
    old = logp - rng.normal(0.0, 0.3, shape)
    sampler = old - rng.normal(0.0, 0.5, shape)
    ref_logp = logp + rng.normal(0.0, 0.4, shape)
    entropy = rng.uniform(0.0, 3.0, shape)
    seq_adv = {(r, s): rng.normal() for r in range(shape[0]) for s in range(1, 4)}
    adv = np.array([[seq_adv.get((r, s), 0.0) for s in row] for r, row in enumerate(segments)])
    pad = mask == 0
    for array, junk in [(logp, -np.inf), (old, 1e4), (sampler, np.nan), (ref_logp, np.inf)]:
        array[pad] = junk
    entropy[pad] = np.nan
    f32 = lambda x: np.asarray(x, np.float32)
    return dict(
        logp=f32(logp),
        old_logp=f32(old),
        sampler_logp=f32(sampler),
        ref_logp=f32(ref_logp),
        adv=f32(adv),
        mask=mask,
        entropy=f32(entropy),
        segments=segments,
    )


def outputs(cfg: LossConfig, batch: dict, jit: bool = False) -> dict:
    """loss, d loss / d logp and every metric (maxima flattened in), as numpy float32."""
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    counts = dict(global_tokens=jnp.sum(b["mask"]), global_seqs=jnp.float32(10.0))

    def f(logp):
        return grpo_loss(
            logp,
            b["old_logp"],
            b["sampler_logp"],
            b["ref_logp"],
            b["adv"],
            b["mask"],
            cfg,
            entropy=b["entropy"],
            segments=b["segments"],
            **counts,
        )

    fn = jax.value_and_grad(f, has_aux=True)
    (loss, metrics), grad = (jax.jit(fn) if jit else fn)(b["logp"])
    metrics = jax.device_get(metrics)
    out = {k: v for k, v in metrics.items() if k != "maxima"}
    out.update(metrics["maxima"])
    out.update(loss=loss, grad=grad)
    return {k: np.asarray(v) for k, v in out.items()}


def all_outputs() -> dict:
    batch = packed_batch()
    flat = {}
    for i, case in enumerate(CASES):
        for jit in (False, True) if i in JIT_CASES else (False,):
            for k, v in outputs(config(case), batch, jit).items():
                flat[f"{i}/{'jit' if jit else 'eager'}/{k}"] = v
    return flat


if __name__ == "__main__":
    np.savez(PATH, **all_outputs())
    print(f"wrote {os.path.normpath(PATH)}")
