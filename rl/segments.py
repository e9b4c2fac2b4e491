"""Sequences within learner rows: sums over the positions of each sequence.

A learner row holds one sequence, or several packed ones (`rl.packing`). `segments` int [B,T] gives
each position's sequence within its row: 1, 2, ... in order, 0 for padding; None means one
sequence per row. Losses, metrics and the KL-in-reward penalty reduce per sequence through these
functions, so the packed and the padded layout of the same sequences give the same numbers. The
sums are per row (vmapped over B), so a batch sharded over rows needs no communication.
"""

import jax
import jax.numpy as jnp


def sequence_totals(x, segments):
    """f32 [B, T+1]: per row, the sum of x [B,T] over each segment id 0..T (segments int [B,T]);
    None: the whole row is one sequence, id 1."""
    if segments is None:
        return jnp.pad(jnp.sum(x, axis=1, keepdims=True), ((0, 0), (1, x.shape[1] - 1)))
    n = x.shape[1] + 1
    return jax.vmap(lambda xr, sr: jax.ops.segment_sum(xr, sr, num_segments=n))(x, segments)


def segment_sum(x, segments):
    """[B,T]: at every position, the sum of x over the positions of its sequence."""
    if segments is None:
        return jnp.broadcast_to(jnp.sum(x, axis=1, keepdims=True), x.shape)
    return jnp.take_along_axis(sequence_totals(x, segments), segments, axis=1)


def count_sequences(mask, segments):
    """f32 scalar: sequences (segments with id > 0) with at least one position where mask > 0."""
    lengths = sequence_totals(mask, segments)[:, 1:]  # [B, T]
    return jnp.sum(lengths > 0).astype(jnp.float32)
