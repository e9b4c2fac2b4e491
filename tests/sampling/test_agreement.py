"""sampling.agreement across two real processes (jax.distributed on 127.0.0.1, gloo): values
that agree pass (tool answers whose CRC-32 is 2**31 or more included: collectives carry int32),
values that differ raise on every process, naming what differs, instead of leaving the processes
to part ways and hang in different collectives."""

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # two fresh JAX processes

PROGRAM = """
import sys, zlib
from concurrent.futures import Future
import jax
import numpy as np
from rl.dynamic_sampling import check_rewards_agree
from rl.rollout import Group
from sampling.agreement import agreed_done, check_agreed

jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
me = jax.process_index()
answers = [[i] for i in range(8)]
crcs = [zlib.crc32(np.array(a, np.int64).tobytes()) for a in answers]
assert min(crcs) < 2**31 <= max(crcs), crcs  # both halves of the range
futures = [Future() for _ in answers]
for f, a in zip(futures, answers):
    f.set_result(a)
pending = Future()  # done on process 0 only: not agreed
if me == 0:
    pending.set_result([1])
assert agreed_done([*futures, pending]) == futures
check_agreed(np.arange(5, dtype=np.float32), "values", "the same values")  # agree: passes
group = Group({}, [1], [None, None], [], np.array([1.0, 0.0], np.float32), {})
check_rewards_agree([group])  # agree: passes
group.masked = np.array([False, me == 1])  # an infrastructure error seen on one process only
try:
    check_rewards_agree([group])
except RuntimeError as e:
    print("RAISED", e, flush=True)
"""


def test_values_that_differ_between_processes_raise_on_every_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", JAX_PLATFORMS="cpu",
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, "-c", PROGRAM, f"127.0.0.1:{port}", str(i)], cwd=ROOT,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]  # fmt: skip
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        last = out.splitlines()[-1]  # after gloo's own lines
        assert last.startswith(f"RAISED rewards differ between processes (process {i} of 2)"), out
        assert last.endswith("infrastructure errors (masked episodes) seen everywhere"), out
