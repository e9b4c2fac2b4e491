"""A training run that records, per process, what it did with its own episodes, for
tests/launch/test_hosts.py: `python -m tests.launch.host_tools OUT [--jitter MS] [--host_tool]
[launch.train flags]` (one process of a multi-process run, or `record(...)` in the test process).

- `--jitter MS`: the calculator answers after a random 0..MS ms (unseeded,
  tests/launch/jittered_tools.py).
- `--host_tool`: the calculator's answer ends with this process's index and a random digit
  (unseeded): the processes' tools answer differently, as real tools do (timings, temp paths).
  Every rollout then checks, on this process, that each of its groups' observations is one its
  own tool produced, and that the learner rows this process holds are its groups' ids.

At exit it writes OUT/process<i>.json: the records this process read from the data
(`rl.data.PromptStream`: [batch shard, position] each), its tool calls and sandbox runs, and the
number of groups it checked. Imports nothing of tests.conftest (a subprocess keeps its own devices).
"""

import contextlib
import json
import os
import random
import sys

import jax
import numpy as np

from rl import sandbox
from rl.data import PromptStream
from rl.envs.calculator import CalculatorEnv
from rl.rollout import Rollouts
from tests.launch.jittered_tools import jittered


@contextlib.contextmanager
def record(out: str, host_tool: bool = False):
    """Within the block, reads of the data, tool calls and (with host_tool) the processes'
    own answers are recorded; OUT/process<i>.json written at the end."""
    read, produced, checked, calls = [], set(), [0], [0]
    take, step, rollout = PromptStream.take_shards, CalculatorEnv.step, Rollouts.__call__
    rng = random.SystemRandom()

    def take_shards(self, counts, mine):
        at = self.position
        for i, (n, own) in enumerate(zip(counts, mine)):
            read.extend([i, q] for q in range(at, at + n) if own)
            at += n
        return take(self, counts, mine)

    def tool(self, episode, turn):
        ids = step(self, episode, turn)
        calls[0] += ids is not None
        if host_tool and ids is not None:
            mark = self.tokenizer.encode(f"{jax.process_index()}{rng.randrange(10)}")
            ids = list(ids) + list(mark)
            produced.add(tuple(ids))
        return ids

    def checked_rollout(self, *args, **kwargs):
        r = rollout(self, *args, **kwargs)
        if host_tool:
            checked[0] += _check(r, produced)
        return r

    PromptStream.take_shards, CalculatorEnv.step = take_shards, tool
    Rollouts.__call__ = checked_rollout
    runs = sandbox.RUNS[0]
    try:
        yield
    finally:
        PromptStream.take_shards, CalculatorEnv.step, Rollouts.__call__ = take, step, rollout
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"process{jax.process_index()}.json"), "w") as f:
            json.dump({"read": read, "tool_calls": calls[0], "checked": checked[0],
                       "sandbox_runs": sandbox.RUNS[0] - runs}, f)  # fmt: skip


def _check(rollout, produced) -> int:
    """Each observation of this process's groups is one its own tool produced, and the rows this
    process holds of the batch are its groups' ids (the others' rows are not here to read)."""
    rows = {}
    for shard in rollout.batch.tokens.addressable_shards:
        lo = shard.index[0].start or 0
        for r, row in enumerate(np.asarray(shard.data)):
            rows[lo + r] = row
    i = 0
    for grp in rollout.groups:
        for c in grp.completions:
            obs = np.asarray(c.observation or [False] * c.length, bool)
            runs = np.flatnonzero(np.diff(np.concatenate([[0], obs.astype(int), [0]])))
            for a, z in zip(runs[::2], runs[1::2]):
                assert tuple(c.tokens[a:z]) in produced, "an observation another host produced"
            row, col, lay = rollout.layout.row[i], rollout.layout.start[i], rollout.layout
            want = grp.prompt + c.tokens
            assert rows[row][col : col + len(want)].tolist() == want, "a row not its group's"
            assert lay.length[i] == len(want)
            i += 1
    return len(rollout.groups)


if __name__ == "__main__":
    from launch.train import main

    args = sys.argv[1:]
    out, args = args[0], args[1:]
    ms = 0.0
    if args and args[0] == "--jitter":
        ms, args = float(args[1]), args[2:]
    host = bool(args) and args[0] == "--host_tool"
    args = args[1:] if host else args
    with record(out, host), jittered(ms) if ms else contextlib.nullcontext():
        code = main(args)
    sys.exit(code)
