"""The round's queued prefill calls (`sampling.engine.Plan`): their shapes, alone and agreed between
processes (the elementwise maximum of `Plan.shapes`)."""

import numpy as np

from sampling.engine import CHUNK, Plan, Row


def _plan(rows_per_shard, length=5, num_shards=2):
    p = Plan(num_shards, 64)
    p.prefill("admit", [Row(i, [1] * length, 0, [1]) for i, n in enumerate(rows_per_shard)
                        for _ in range(n)])  # fmt: skip
    return p


def _calls(plan, shapes, chunks=2):
    return [c for *_, calls, _ in plan.calls(shapes, chunks) for c in calls]


def test_a_batch_of_more_than_a_chunk_ends_with_a_call_of_its_last_rows():
    # 20 rows on shard 0: a call of 16 rows per shard, then one of 4 (as the prefill was issued
    # before it was queued), not a second call of 16.
    plan = _plan([20, 3])
    assert _calls(plan, plan.shapes(2)) == [(0, CHUNK, 16), (1, 4, 16)]
    plan = _plan([17, 0])
    assert _calls(plan, plan.shapes(2)) == [(0, CHUNK, 16), (1, 1, 16)]
    plan = _plan([5, 3])
    assert _calls(plan, plan.shapes(2)) == [(0, 8, 16)]


def test_the_agreed_calls_hold_every_process_rows():
    # Two processes' plans (shard 0 on one, shard 1 on the other): the elementwise maximum of
    # their shapes makes calls with room for each one's rows, chunk by chunk.
    a, b = _plan([20, 0], length=3), _plan([0, 6], length=40)
    shapes = np.maximum(a.shapes(2), b.shapes(2))
    calls = _calls(a, shapes)
    assert calls == _calls(b, shapes) == [(0, CHUNK, 64), (1, 4, 16)]
    for plan in (a, b):
        for j, part in enumerate(plan.batches["admit"][0].chunks(2)):
            _, n, t = calls[j]
            assert all(len(q) <= n and all(len(r.tokens) <= t for r in q) for q in part)
