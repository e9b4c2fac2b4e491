"""A training run that records, per process, what it did with its own episodes, for
tests/launch/test_hosts.py: `python -m tests.launch.host_tools OUT [--jitter MS] [--host_tool]
[launch.train flags] [--then OUT ...]` (one process of a multi-process run, its runs one after the
other, or `record(...)` in the test process).

- `--jitter MS`: the calculator answers after a random 0..MS ms (unseeded,
  tests/launch/jittered_tools.py).
- `--host_tool`: the calculator's answer ends with this process's index and a random digit
  (unseeded): the processes' tools answer differently, as real tools do (timings, temp paths).
  Every rollout then checks, on this process, that each of its groups' observations is one its
  own tool produced, and that the learner rows this process holds are its groups' ids.

After each step's rollout it appends a line to OUT/process<i>.jsonl (a killed run keeps the
lines of its finished steps): the step, the records this process read from the data since the
last line (`rl.data.PromptStream`: [batch shard, position] each), its tool calls in the step,
the sequences its groups trained ([prompt, ids] each) and the groups it checked. Imports nothing
of tests.conftest (a subprocess keeps its own devices).
"""

import collections
import contextlib
import json
import os
import random
import sys
import threading

import jax
import numpy as np

from rl.data import PromptStream
from rl.envs.calculator import CalculatorEnv
from rl.multiturn import EpisodeSampler
from rl.rollout import Rollouts
from tests.launch.jittered_tools import jittered


@contextlib.contextmanager
def record(out: str, host_tool: bool = False):
    """Within the block, each rollout's reads, tool calls and trained sequences are recorded (and
    with host_tool the processes' answers differ and are checked)."""
    read, produced, calls, lock = [], set(), [0], threading.Lock()
    per_episode = collections.Counter()  # id(episode) -> its answered calls, until scored
    take, step, rollout = PromptStream.take_shards, CalculatorEnv.step, Rollouts.__call__
    score = EpisodeSampler.score
    rng = random.SystemRandom()
    os.makedirs(out, exist_ok=True)

    def take_shards(self, counts, mine):
        at, own_records = self.position, []
        for i, (n, own) in enumerate(zip(counts, mine)):
            own_records.extend([i, q] for q in range(at, at + n) if own)
            at += n
        records = take(self, counts, mine)  # per shard: its records if this process's, or None
        got = [len(r) if r is not None else None for r in records]
        assert got == [n if own else None for n, own in zip(counts, mine)], (got, counts, mine)
        read.extend(own_records)
        return records

    def tool(self, episode, turn):  # on a worker thread
        ids = step(self, episode, turn)
        with lock:
            per_episode[id(episode)] += ids is not None
        if host_tool and ids is not None:
            mark = self.tokenizer.encode(f"{jax.process_index()}{rng.randrange(10)}")
            ids = list(ids) + list(mark)
            produced.add(tuple(ids))
        return ids

    def scored(self, key):  # a group's calls count in the step its group ends in (logical
        episodes, future = score(self, key)  # time), not when a jittered call returns
        with lock:
            calls[0] += sum(per_episode.pop(id(ep), 0) for ep in episodes)
        return episodes, future

    def recorded_rollout(self, step_index, *args, **kwargs):
        r = rollout(self, step_index, *args, **kwargs)
        line = {"step": step_index + 1, "read": list(read), "tool_calls": calls[0],
                "trained": sorted([grp.record["prompt"], c.tokens] for grp in r.groups
                                  for c in grp.completions),
                "groups": len(r.groups), "checked": _check(r, produced) if host_tool else 0}  # fmt: skip
        read.clear()
        calls[0] = 0
        # (the process index only now: jax.distributed starts inside launch.train's main)
        with open(os.path.join(out, f"process{jax.process_index()}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
        return r

    PromptStream.take_shards, CalculatorEnv.step = take_shards, tool
    Rollouts.__call__, EpisodeSampler.score = recorded_rollout, scored
    try:
        yield
    finally:
        PromptStream.take_shards, CalculatorEnv.step, Rollouts.__call__ = take, step, rollout
        EpisodeSampler.score = score


def steps(out) -> list[dict]:
    """{step: the last line of each process for it} per process, from OUT/process<i>.jsonl."""
    out_steps = []
    for i in range(2):
        path = os.path.join(out, f"process{i}.jsonl")
        if not os.path.exists(path):
            break
        lines = {}
        for x in open(path):
            line = json.loads(x)
            lines[line["step"]] = line
        out_steps.append(lines)
    return out_steps


def _check(rollout, produced) -> int:
    """Each observation of this process's groups is one its own tool produced, and the rows this
    process holds of the batch are its groups' ids (the others' rows are not here to read).
    Returns the number of observations checked."""
    rows = {}
    for shard in rollout.batch.tokens.addressable_shards:
        lo = shard.index[0].start or 0
        for r, row in enumerate(np.asarray(shard.data)):
            rows[lo + r] = row
    i, lay, checked = 0, rollout.layout, 0
    for grp in rollout.groups:
        for c in grp.completions:
            obs = np.asarray(c.observation or [False] * c.length, bool)
            runs = np.flatnonzero(np.diff(np.concatenate([[0], obs.astype(int), [0]])))
            for a, z in zip(runs[::2], runs[1::2]):
                assert tuple(c.tokens[a:z]) in produced, "an observation another host produced"
                checked += 1
            want = grp.prompt + c.tokens
            row, col = lay.row[i], lay.start[i]
            assert rows[row][col : col + len(want)].tolist() == want, "a row not its group's"
            assert lay.length[i] == len(want)
            i += 1
    return checked


if __name__ == "__main__":
    from tests.launch.train_runs import run, segments

    # Several runs, one after the other in this process (`OUT ... --then OUT ...`:
    # tests/launch/train_runs.py), each recorded to its own OUT.
    code = 0
    for i, args in enumerate(segments(sys.argv[1:])):
        out, args = args[0], args[1:]
        ms = 0.0
        if args and args[0] == "--jitter":
            ms, args = float(args[1]), args[2:]
        host = bool(args) and args[0] == "--host_tool"
        args = args[1:] if host else args
        with record(out, host), jittered(ms) if ms else contextlib.nullcontext():
            code = run(args, first=i == 0)
        if code:
            break
    sys.exit(code)
