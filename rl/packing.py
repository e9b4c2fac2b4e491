"""The learner batch: a rollout's sequences packed into fixed-length rows, with segment ids.

Completion lengths of reasoning and coding rollouts are long-tailed: a few near the budget, most
far shorter. One sequence per row, padded to max_prompt_len + max_new_tokens, spends most of the
learner's FLOPs on padding. Packing several sequences into each row (verl's remove-padding, TRL's
padding-free training) makes the learner's cost follow the real tokens.

- Rows are T = max_prompt_len + max_new_tokens tokens long, so any sequence fits in one row.
  Sequences are placed first-fit decreasing by length (ties in order: deterministic, so a resumed
  run packs exactly as an uninterrupted one).
- Every token carries its sequence's segment id within the row (1, 2, ...; 0 = padding) and its
  position within the sequence. Attention stays within a segment (`models.attention.causal_mask`)
  and the losses reduce per sequence over segments (`rl.segments`), so a packed batch has the
  loss and gradient of the same sequences laid out one per row.
- The number of rows is bucketed to `multiple * s`, s in 1..8, 10, 12, 14, 16, 20, ... (four
  sizes per doubling), capped at the padded layout's row count, so a run compiles the learner
  step for a handful of shapes. `multiple` (batch shards x minibatches x micro-batches) divides
  every bucket, so packing saves rows only when B*G is well above it.
- With several minibatches per rollout, each minibatch's sequences (those the padded layout
  gives it) are packed on their own, so every optimizer step sees the same sequences either way.
- `pack=False` is the padded layout: row i holds sequence i.

Sequences come group-major (sequence i*G+k is completion k of prompt i); `Layout` maps them to
rows and back: `spread` writes per-sequence values (advantages, masks) on a sequence's scored
positions, `gather` reads per-sequence totals (`rl.segments.sequence_totals`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rl import router
from rl.learner import Batch


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each of N sequences sits: row, segment id (1, 2, ...), first column and length."""

    rows: int
    width: int  # T, tokens per row
    row: np.ndarray  # int [N]
    segment: np.ndarray  # int [N]
    start: np.ndarray  # int [N]
    length: np.ndarray  # int [N]

    def spread(self, values) -> np.ndarray:
        """f32 [rows, T-1]: values[i] on the positions that score sequence i's tokens after its
        first (position t scores token t+1), 0 elsewhere."""
        out = np.zeros((self.rows, self.width - 1), np.float32)
        for i, v in enumerate(np.asarray(values, np.float32)):
            out[self.row[i], self.start[i] : self.start[i] + self.length[i] - 1] = v
        return out

    def gather(self, totals) -> np.ndarray:
        """[N] sequence i's entry of per-row, per-segment totals [rows, T+1]."""
        return np.asarray(totals)[self.row, self.segment]

    @property
    def padding_frac(self) -> float:
        return 1.0 - float(self.length.sum()) / (self.rows * self.width)


def bucket_rows(needed: int, multiple: int, cap: int) -> int:
    """The smallest multiple * s >= needed with s in 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20,
    ... (four sizes per doubling, so at most 25% padding rows and a few shapes per octave), at
    most cap rounded up to a multiple of multiple."""
    units, size = -(-needed // multiple), 1
    while size < units:
        size += max(1, (1 << (size.bit_length() - 1)) // 4)  # a quarter of the octave
    return min(size * multiple, -(-cap // multiple) * multiple)


def _first_fit(lengths, width: int):
    """First-fit decreasing: (row, segment, start) of each sequence, and the rows used."""
    n = len(lengths)
    row, segment, start = (np.zeros(n, np.int64) for _ in range(3))
    free = np.zeros(0, np.int64)  # tokens left in each row opened so far
    used = np.zeros(0, np.int64)  # sequences in each row
    for i in sorted(range(n), key=lambda i: -lengths[i]):  # stable: ties keep their order
        fits = np.nonzero(free >= lengths[i])[0]
        if len(fits):
            r = fits[0]
        else:
            r = len(free)
            free, used = np.append(free, width), np.append(used, 0)
        row[i], start[i] = r, width - free[r]
        used[r] += 1
        segment[i] = used[r]
        free[r] -= lengths[i]
    return row, segment, start, len(free)


def place(
    lengths, width: int, pack: bool = True, multiple: int = 1, minibatches: int = 1
) -> Layout:
    """The rows of sequences of the given lengths (all <= width).

    With minibatches M > 1 the learner steps on rows m, m+M, m+2M, ... (`rl.learner`), and the
    padded layout puts sequences m, m+M, ... there. Packing keeps that: the sequences of each
    minibatch are packed on their own into the same number of rows, interleaved, so every
    optimizer step sees the same sequences as with padding (and none is empty). `multiple`
    includes the factor M."""
    lengths = np.asarray(lengths, np.int64)
    n = len(lengths)
    if not pack:
        ones = np.ones(n, np.int64)
        return Layout(n, width, np.arange(n), ones, np.zeros(n, np.int64), lengths)
    if multiple % minibatches or n % minibatches:
        raise ValueError(f"{n} sequences, multiple {multiple}: not divisible by {minibatches}")
    row, segment, start = (np.zeros(n, np.int64) for _ in range(3))
    parts = [np.arange(m, n, minibatches) for m in range(minibatches)]
    placed = [_first_fit(lengths[idx], width) for idx in parts]
    per = bucket_rows(max(p[3] for p in placed), multiple // minibatches, n // minibatches)
    for m, (idx, (r, seg, st, _)) in enumerate(zip(parts, placed)):
        row[idx], segment[idx], start[idx] = r * minibatches + m, seg, st
    return Layout(per * minibatches, width, row, segment, start, lengths)


def build_batch(
    groups,
    width: int,
    pad_id: int,
    min_new_tokens: int = 0,
    pack: bool = True,
    multiple: int = 1,
    minibatches: int = 1,
    rows: int | None = None,
    routes: str | None = None,
) -> tuple[Batch, Layout]:
    """The learner Batch (numpy) of the groups' sequences (prompt + completion), and its Layout;
    with `rows` (>= what they need: a batch shard's rows, the same on every shard) padded to it.

    `loss_mask` covers every completion token the model sampled, never an observation of a
    multi-turn episode (`rl.rollout.Rollouts` applies rl.mask_truncated); advantages are left at
    0 (`Rollouts` spreads them); `stop_masked` marks the first min_new_tokens completion
    positions, where the sampler banned the stop ids (None if 0). The sampler's record of each
    sequence's experts (`Completion.routes`, prompt first; a completion without one is an
    error): with `routes="replay"` (rl.routing_replay="rollout") as `Batch.routes` [rows, T,
    L_moe, k], with "compare" (replay off, for rollout/route_mismatch) as
    `Batch.route_digest` [rows, T, L_moe] (`rl.router.digest`), padding 0 (unscored); None:
    neither.
    """
    if routes not in (None, "replay", "compare"):
        raise ValueError(f"routes={routes!r}: one of None, 'replay', 'compare'")
    seqs = [(grp.prompt, c) for grp in groups for c in grp.completions]
    lengths = [len(p) + c.length for p, c in seqs]
    if max(lengths, default=0) > width:
        raise ValueError(
            f"sequence of {max(lengths)} tokens > max_prompt_len + max_new_tokens = {width}"
        )
    layout = place(lengths, width, pack, multiple, minibatches)
    if rows is not None:
        if rows < layout.rows or rows % minibatches:
            raise ValueError(
                f"rows={rows}: the sequences need {layout.rows}, in a multiple of "
                f"{minibatches} minibatches"
            )
        layout = dataclasses.replace(layout, rows=rows)
    rows = layout.rows
    tokens = np.full((rows, width), pad_id, np.int32)
    positions = np.zeros((rows, width), np.int32)
    segment_ids = np.zeros((rows, width), np.int32)
    loss_mask = np.zeros((rows, width - 1), np.float32)
    sampler_logp = np.zeros((rows, width - 1), np.float32)
    stop_masked = np.zeros((rows, width - 1), bool)
    missing = [i for i, (_, c) in enumerate(seqs) if c.routes is None]
    if routes and missing:
        raise ValueError(f"sequence {missing[0]}: no recorded routes (Completion.routes)")
    record = None
    if routes and seqs:
        first = np.asarray(seqs[0][1].routes)
        record = (
            np.zeros((rows, width, *first.shape[1:]), first.dtype)
            if routes == "replay"
            else np.zeros((rows, width, first.shape[1]), np.uint16)
        )
    for i, (p, c) in enumerate(seqs):
        r, s, n = layout.row[i], layout.start[i], lengths[i]
        tokens[r, s : s + n] = p + c.tokens
        positions[r, s : s + n] = np.arange(n)
        segment_ids[r, s : s + n] = layout.segment[i]
        first = s + len(p) - 1  # position t scores token t + 1: the first completion token
        model = 1.0 if c.observation is None else ~np.asarray(c.observation, bool)
        loss_mask[r, first : s + n - 1] = model
        sampler_logp[r, first : s + n - 1] = c.logprobs
        stop_masked[r, first : first + min(min_new_tokens, c.length)] = True
        if record is not None:
            if len(c.routes) != n:
                raise ValueError(f"sequence {i}: routes for {len(c.routes)} tokens, has {n}")
            record[r, s : s + n] = c.routes if routes == "replay" else router.digest(c.routes, np)
    batch = Batch(
        tokens=tokens,
        positions=positions,
        segment_ids=segment_ids,
        loss_mask=loss_mask,
        advantages=np.zeros((rows, width - 1), np.float32),
        sampler_logp=sampler_logp,
        stop_masked=stop_masked if min_new_tokens else None,
        routes=record if routes == "replay" else None,
        route_digest=record if routes == "compare" else None,
    )
    return batch, layout
