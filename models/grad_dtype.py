"""The dtype of the weights' gradients, set around a trace (`optim.grad_reduce_dtype`).

A context variable, not an argument, because it reaches every matmul of the model: the dense
layers (models/transformer.py) and the experts (models/moe.py) read it where they cast a weight to
the compute dtype, and compute that weight's gradient, and so its sum across devices, in this dtype.
Its own module so that both read it without importing each other.
"""

import contextlib
import contextvars

import jax.numpy as jnp

# Set by `weight_grads_in()`: the dtype of the weights' gradients (None: the compute dtype).
_GRAD_DTYPE = contextvars.ContextVar("weight_grad_dtype", default=None)


@contextlib.contextmanager
def weight_grads_in(dtype):
    """Models traced within the block compute their weights' gradients, and so sum them across
    devices, in `dtype` (see models/transformer.py's docstring); None: in the compute dtype."""
    token = _GRAD_DTYPE.set(None if dtype is None else jnp.dtype(dtype))
    try:
        yield
    finally:
        _GRAD_DTYPE.reset(token)


def weight_grad_dtype(dtype):
    """The weights' gradient dtype where `weight_grads_in` makes it differ from the compute dtype
    `dtype`, else None."""
    g = _GRAD_DTYPE.get()
    return None if g is None or g == jnp.dtype(dtype) else g
