"""The learner's optimizer: AdamW after global-norm clipping, written so that its update can be
done in place on any backend.

`make_optimizer` is optax's `chain(clip_by_global_norm, adamw)`, with the same state tree (so
checkpoints and resumes are unaffected) and the same f32 results, two pieces replaced:

- `clip_by_global_norm` multiplies every gradient by one scalar, min(1, max_norm / norm).
  optax's computes (g / norm) * max_norm per element: XLA's fusion does not repeat a division in
  each of its readers (AdamW's two moment updates), so the clipped gradients were made as a second
  full set of gradient shards (3.1 GiB a device at 7B on fsdp=8, the learner step's peak).
- `scale_by_adam` makes the new moments, selects them with the step's `finite` flag (a step with
  a non-finite loss or gradient keeps the old ones, `rl.learner`), and only then computes the
  update direction from them, behind an optimization barrier. Without it XLA fuses the moment
  updates into the parameter update as well, which then reads the old moments after the new ones
  were written over them in place: XLA:CPU keeps a copy of both moments of every weight for that
  (7.1 GiB a device at 7B). With it each weight's update reads and writes each buffer once, in
  place: the step's only full set of temporaries is the gradient shards. (Measured in XLA:CPU's
compiles, `launch.bench memory` and tests/rl/test_learner.py; no accelerator was at hand. At a
small scale the barrier changes nothing there; the 7B step needed it.)

The barrier costs one more read of the two moments per step (the optimizer update is a few
passes over the parameters' shards, against a forward and a backward over the batch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def make_optimizer(cfg) -> optax.GradientTransformationExtraArgs:
    """AdamW (decay on matrices only) after global-norm clipping, with the learning-rate schedule
    of `cfg` (an `rl.learner.LearnerConfig`). `update(grads, state, params, finite=flag)`: with
    flag False the moments and their count stay as they were."""
    lr = cfg.learning_rate
    if cfg.decay_steps:
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, lr, cfg.warmup_steps, cfg.warmup_steps + cfg.decay_steps, lr * cfg.end_lr_fraction
        )
    elif cfg.warmup_steps:
        schedule = optax.linear_schedule(0.0, lr, cfg.warmup_steps)
    else:
        schedule = lr
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(decayed, params)
    # optax.adamw's chain, nested as it nests it: the state tree is optax's
    adamw = optax.chain(
        scale_by_adam(cfg.b1, cfg.b2),
        optax.add_decayed_weights(cfg.weight_decay, decay_mask),
        optax.scale_by_learning_rate(schedule),
    )
    clip = clip_by_global_norm(cfg.max_grad_norm) if cfg.max_grad_norm else optax.identity()
    return optax.chain(clip, adamw)


def decayed(path, x) -> bool:
    """Whether weight decay applies to a parameter: matrices (and the experts' stacked ones), not
    norms' scales nor biases (Qwen2's q/k/v biases are [heads, head_dim]: named, not 1-D)."""
    names = [getattr(k, "key", getattr(k, "name", "")) for k in path]
    return x.ndim >= 2 and not any(str(n).endswith("bias") for n in names)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Global-norm clipping as one scalar factor, min(1, max_norm / norm), times each gradient:
    equal to optax's to an f32 rounding (tests/rl/test_learner.py), and exactly the gradients when
    their norm is under max_norm."""

    def update(grads, state, params=None):
        del params
        norm = optax.tree.norm(grads)
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)  # f32 []
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def scale_by_adam(b1: float, b2: float, eps: float = 1e-8) -> optax.GradientTransformationExtraArgs:
    """optax.scale_by_adam (its state, its arithmetic), the new moments selected by `finite` and
    fenced off from the direction computed from them (module docstring)."""
    init = optax.scale_by_adam(b1, b2, eps).init

    def update(grads, state, params=None, *, finite=True, **extra):
        del params, extra
        mu = optax.tree.update_moment(grads, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(grads, state.nu, b2, 2)
        count = optax.safe_increment(state.count)
        keep = lambda new, old: jnp.where(finite, new, old)
        mu, nu, count = jax.tree.map(keep, (mu, nu, count), (state.mu, state.nu, state.count))
        mu, nu = jax.lax.optimization_barrier((mu, nu))
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, count)
        direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return direction, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformationExtraArgs(init, update)
