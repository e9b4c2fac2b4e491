"""Ordering by data: `after(tree, ref)` makes tree computed only once ref is.

XLA's schedulers decide when an instruction runs from its operands alone. A buffer made from
constants (zeros that a loop accumulates into, a gathered weight that depends on parameters
only) may run at the start of the program and stay live across everything before its use:
XLA:CPU made every layer's at the start (`models.transformer.remat`, `models.flash`,
`rl.logprobs`). Reading it through a value computed just before its use puts it there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def after(tree, ref):
    """tree, computed only once ref (an array of rows, [B,...]) is. An `optimization_barrier`
    orders TPU and GPU schedules; XLA:CPU drops barriers before it schedules, so there each float
    leaf is also read through ref: the leaf as is, or NaN if ref[:, 0, ..., 0] holds a NaN (the
    same bits otherwise; on a mesh, an all-reduce of one scalar). So on CPU a NaN in one row's
    activations makes every row NaN, not just its own (the loss is NaN either way, and the step
    is skipped). Lowered for another platform, only the barrier. Reverse mode only where it is
    used inside custom VJPs (`models.transformer.remat`: jax.jvp of a remat model raises)."""
    tree, ref = jax.lax.optimization_barrier((tree, jax.lax.stop_gradient(ref)))

    def read_through(tree, ref):
        nan = jnp.isnan(jnp.sum(ref[(slice(None),) + (0,) * (ref.ndim - 1)]))
        tie = lambda a: jnp.where(nan, jnp.nan, a) if jnp.issubdtype(a.dtype, jnp.floating) else a
        return jax.tree.map(tie, tree)

    return jax.lax.platform_dependent(tree, ref, cpu=read_through, default=lambda tree, _: tree)
