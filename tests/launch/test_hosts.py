"""Each host runs only its own episodes (issue 35): 2 processes x 4 CPU devices (jax.distributed
on 127.0.0.1, gloo) against 1 process x 8, on the mesh data=2 x fsdp=2 x tensor=2 (4 batch
shards, 2 on each process).

- The CPU tool demo (configs/calc_tool.py) with partial rollouts, its calculator behind random
  0-60 ms delays on the two processes (unseeded: tests/launch/jittered_tools.py) and instant on
  the one: each process reads only its shards' records and calls the tool for its own episodes
  (the two counts add up to the one process's), and the runs train alike within 1e-5; one of
  the two processes killed (kill -9) and both restarted, the jittered run's parameters are
  bitwise those of the instant tool's straight run on two processes.
- The same demo without partial rollouts (the synchronous multi-turn loop): alike within 1e-5.
- A tool whose answers hold the process index and a random digit trains 3 steps on the two
  processes: nothing requires the hosts to agree, and each process's groups hold exactly the
  observations its own tool produced, in the rows of the batch that process holds.
- The traffic of a decode call (`models.processes`): in the compiled `steps.generate`, the
  collectives whose replica groups span both processes, and the collectives of the loop around
  it (`peers.agree`, and any `multihost_utils` call): the same at 8 and at 32 slots, and none
  carries a token or a log-prob.
"""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from launch.build import load_run
from models.sharding import flatten, on_devices
from tests.conftest import METRIC_KEYS, ROOT, process_cache, sandbox_isolation, train_here
from tests.launch.host_tools import record, steps

pytestmark = pytest.mark.slow  # multi-process training runs

# On CPU a multi-process run decodes from the training layout (launch.build.check_hosts), and
# its one-process baseline alike.
MESH = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
        "--config.sampling.weights_layout=training"]  # fmt: skip
ARGS = [
    f"--config={ROOT}/configs/calc_tool.py", "--config.num_steps=3",
    "--config.checkpoint_every=2", "--config.eval_every=0", "--config.rl.partial_rollouts=True",
    "--config.rl.is_correction=tis", "--config.data.eval.num=8", *MESH,
    "--config.data.prompts_per_step=8", "--config.rl.extra_groups=4",
    "--config.sampling.num_slots=64", "--config.sampling.num_pages=320",
]  # fmt: skip


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(
    workdir, out, *flags, args=ARGS, module="tests.launch.host_tools", kill_after=None, then=()
):
    """Two processes of 4 CPU devices each running `module` with out, flags and the run's args;
    with kill_after, process 1 is killed (SIGKILL) once that step's checkpoint is committed, and
    process 0 must stop on its own. `then`: more runs (workdir, out, flags, args) of
    tests.launch.host_tools, one after the other in the same two processes (one start and one
    compile for all). Returns process 0's stderr. Each process's output goes to a file
    (OUT.p<i>.log), not a pipe: a pipe read after its peer's could fill and block a process
    that its peer then waits for in a collective."""
    port, procs, logs = _free_port(), [], [f"{out}.p{i}.log" for i in range(2)]
    runs = [(workdir, out, flags, args), *then]
    for i in range(2):
        env = dict(os.environ, JAX_NUM_CPU_DEVICES="4", JAX_PLATFORMS="cpu",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID=str(i), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                   JAX_COMPILATION_CACHE_DIR=process_cache(i))  # fmt: skip
        cmd = [sys.executable, "-m", module]
        for k, (w, o, f, a) in enumerate(runs):
            cmd += ["--then"] * (k > 0) + [str(o), *f, *([f"--workdir={w}"] if w else []), *a]
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))  # fmt: skip
    tail = lambda i: open(logs[i]).read()[-3000:]
    if kill_after is not None:
        while not (workdir / "checkpoints" / str(kill_after)).exists():
            assert procs[1].poll() is None, tail(1)
            time.sleep(0.05)  # polling a directory the run writes; nothing is timed
        procs[1].kill()
        procs[0].wait(timeout=300)
        procs[1].wait()
        assert procs[0].returncode != 0, tail(0)
        return open(logs[0]).read()
    for i, p in enumerate(procs):
        p.wait(timeout=900)
        assert p.returncode == 0, tail(i)
    return open(logs[0]).read()


def _rows(workdir):
    return [json.loads(x) for x in open(workdir / "metrics.jsonl") if '"loss"' in x]


def test_each_host_runs_its_own_episodes_and_they_train_as_one_host(tmp_path):
    """The calculator behind random delays on two processes, one of them killed (kill -9) after
    step 2's checkpoint and both restarted, against the instant calculator on one: per step the
    processes read their own shards' records, call the tool for their own episodes and train
    exactly the sequences the one process trains (ids), and the runs train alike within 1e-5.
    Against the instant calculator's straight run on the same two processes: bitwise equal
    parameters (the delays and the kill change nothing)."""
    one, two, instant = tmp_path / "one", tmp_path / "two", tmp_path / "instant"
    with record(str(tmp_path / "one_out")):
        assert train_here([f"--workdir={one}", *ARGS], devices=8) == 0
    (single,) = steps(tmp_path / "one_out")
    # The killed run: a short heartbeat timeout, so process 0 stops seconds after the kill (the
    # default 30 s is waiting, not testing); the restart's is long (a paused machine is no death).
    short = [*ARGS, "--config.heartbeat_timeout_s=15"]
    _pair(two, tmp_path / "two_out", "--jitter", "60", args=short, kill_after=2)
    # The restart, then in the same two processes the instant tool's straight run (compared
    # below: bitwise; one start and one compile of two processes fewer).
    err = _pair(
        two,
        tmp_path / "two_out",
        "--jitter",
        "60",
        args=[*ARGS, "--config.heartbeat_timeout_s=300"],
        then=[(instant, tmp_path / "instant_out", (), ARGS)],
    )
    assert "resumed from step 2" in err, err[-3000:]
    p0, p1 = steps(tmp_path / "two_out")
    assert sorted(single) == sorted(p0) == sorted(p1) == [1, 2, 3]
    for s in (1, 2, 3):  # step 3 by the restarted processes
        a, b, want = p0[s], p1[s], single[s]
        # Data: process 0 read shards 0 and 1 of the 4, process 1 shards 2 and 3: together the
        # one process's records, shard for shard.
        assert {i for i, _ in a["read"]} <= {0, 1} and {i for i, _ in b["read"]} <= {2, 3}, s
        assert sorted(a["read"] + b["read"]) == sorted(want["read"]), s
        # Tools: each process called the tool for its own episodes; together the one's calls.
        assert a["tool_calls"] + b["tool_calls"] == want["tool_calls"], s
        # Decisions: the same sequences trained at each step, to the id, whatever the delays.
        assert sorted(a["trained"] + b["trained"]) == want["trained"], s
    assert all(any(p[s]["read"] for s in p) for p in (p0, p1))  # each read records of its own
    calls = [sum(p[s]["tool_calls"] for s in p) for p in (p0, p1)]
    assert all(0.25 <= n / sum(calls) <= 0.75 for n in calls), calls  # about half each
    rows_one, rows_two = _rows(one), _rows(two)
    for a, b in zip(rows_one, rows_two):  # the metrics of the processes' calls, per step
        both = b["rollout/tool_calls_per_process_max"] + b["rollout/tool_calls_per_process_min"]
        assert both == a["rollout/tool_calls_per_process_max"], (a["step"], both)
    # Training: the same, within 1e-5 (the tools' delays and the process split change nothing).
    assert [r["step"] for r in rows_one] == [r["step"] for r in rows_two] == [1, 2, 3]
    keys = [k for k in METRIC_KEYS if k in rows_one[0]] + ["rollout/carried_episodes"]
    for a, b in zip(rows_one, rows_two):
        np.testing.assert_allclose([b[k] for k in keys], [a[k] for k in keys], atol=1e-5,
                                   rtol=1e-5, err_msg=f"step {a['step']}")  # fmt: skip
    assert rows_one[0]["rollout/carried_episodes"] > 0  # step 1 carried episodes into step 2
    pa, pb = (flatten(load_run(str(w))[0].state.params) for w in (one, two))
    for name in pa:
        np.testing.assert_allclose(np.asarray(pb[name]), np.asarray(pa[name]), atol=1e-5,
                                   err_msg=name)  # fmt: skip
    # 2 x 4, instant tool, straight (run after the restart, above)
    assert steps(tmp_path / "instant_out") == [p0, p1]  # reads, tool calls, trained ids
    pi = flatten(load_run(str(instant))[0].state.params)
    for name in pa:
        np.testing.assert_array_equal(np.asarray(pb[name]), np.asarray(pi[name]), err_msg=name)


# The calculator demo without partial rollouts (the synchronous multi-turn loop), 2 steps: it
# carries nothing across steps, so a third would repeat the second's checks.
SYNC = [
    a for a in ARGS if not any(k in a for k in ("partial_rollouts", "is_correction", "num_steps"))
]
SYNC += ["--config.num_steps=2"]


@pytest.fixture(scope="module")
def sync_pair(tmp_path_factory):
    """One start of two processes for two synchronous runs, one after the other: the instant
    calculator's (`two`), then the calculator whose answers differ between the hosts (`host`,
    --host_tool), which reuses the first run's compiled programs."""
    top = tmp_path_factory.mktemp("sync")
    host = (top / "host", top / "host_out", ("--host_tool",), SYNC)
    _pair(top / "two", top / "two_out", args=SYNC, then=[host])
    return top


def test_tools_may_differ_between_hosts(sync_pair):
    """Each process appends its index and a random digit to the calculator's answers: a
    synchronous multi-turn run trains 2 steps with no agreement error, and each process's groups
    hold exactly its own tool's observations in the learner rows it holds (checked in the run:
    host_tools._check)."""
    p0, p1 = steps(sync_pair / "host_out")
    assert sorted(p0) == sorted(p1) == [1, 2]
    # 8 groups a step on 4 shards: each process checked its 2 shards' 4 groups every step, and
    # observations of its own tool in them
    assert all(p[s]["groups"] == 4 and p[s]["checked"] > 0 for p in (p0, p1) for s in p)
    assert [r["step"] for r in _rows(sync_pair / "host")] == [1, 2]


def test_a_synchronous_multi_turn_run_trains_as_one_host(sync_pair, tmp_path):
    """The calculator demo without partial rollouts, 2 steps: two processes train the sequences
    the one process trains (ids, per step) and alike within 1e-5."""
    one, two = tmp_path / "one", sync_pair / "two"
    with record(str(tmp_path / "one_out")):
        assert train_here([f"--workdir={one}", *SYNC], devices=8) == 0
    (single,), (p0, p1) = steps(tmp_path / "one_out"), steps(sync_pair / "two_out")
    for s in (1, 2):
        assert sorted(p0[s]["trained"] + p1[s]["trained"]) == single[s]["trained"], s
        assert p0[s]["tool_calls"] + p1[s]["tool_calls"] == single[s]["tool_calls"] > 0, s
    rows_one, rows_two = _rows(one), _rows(two)
    assert [r["step"] for r in rows_one] == [r["step"] for r in rows_two] == [1, 2]
    keys = [k for k in METRIC_KEYS if k in rows_one[0]]
    for a, b in zip(rows_one, rows_two):
        np.testing.assert_allclose([b[k] for k in keys], [a[k] for k in keys], atol=1e-5,
                                   rtol=1e-5, err_msg=f"step {a['step']}")  # fmt: skip
    pa, pb = (flatten(load_run(str(w))[0].state.params) for w in (one, two))
    for name in pa:
        np.testing.assert_allclose(np.asarray(pb[name]), np.asarray(pa[name]), atol=1e-5,
                                   err_msg=name)  # fmt: skip


@pytest.mark.repo_sandbox
def test_repo_episodes_run_their_sandboxes_on_their_own_host(tmp_path):
    """The `repo` environment's scripted policy (8 tasks x 2 episodes, tests/rl/repo_scripted.py):
    on two processes each runs the sandboxes of its own episodes, and the two counts add up to
    the one process's."""
    from launch.make_repo_tasks import make_tasks
    from tests.launch.host_repo import rollout

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in make_tasks(str(tmp_path / "t"), 8, 1)))
    with on_devices(jax.devices()):
        one = rollout(str(tmp_path / "one"), str(tasks), sandbox_isolation())
    _pair(None, tmp_path / "two", str(tasks), sandbox_isolation(), args=[],
          module="tests.launch.host_repo")  # fmt: skip
    two = [json.loads((tmp_path / "two" / f"process{i}.json").read_text()) for i in (0, 1)]
    runs = [p["sandbox_runs"] for p in two]
    assert sum(runs) == one["sandbox_runs"] > 0 and [p["episodes"] for p in two] == [8, 8]
    assert all(0.25 <= n / sum(runs) <= 0.75 for n in runs), runs  # about half each
    for p in two:  # the run's own metric: each process's count, gathered
        assert p["per_process"]["rollout/sandbox_runs_per_process_max"] == max(runs)
        assert p["per_process"]["rollout/sandbox_runs_per_process_min"] == min(runs)


TRAFFIC = """
import dataclasses, json, sys
import jax
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
import numpy as np
from jax.experimental import multihost_utils
from launch.bench import hlo
from models.sharding import init_params, make_mesh
from models import processes as peers
from sampling import steps
from sampling.distribution import SamplingParams
from models.config import ModelConfig
from sampling.engine import Engine, EngineConfig
from sampling.episodes import generate_all

CFG = ModelConfig(family="qwen2", vocab_size=128, d_model=32, d_ff=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, qkv_bias=True)  # tests.conftest's (not imported:
                  # it would give this process 8 devices)
rng = np.random.default_rng(jax.process_index())

mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
graphdef, params = init_params(CFG, mesh, seed=0)
calls = {"multihost": 0, "sizes": set()}
for name in ("process_allgather", "broadcast_one_to_all", "sync_global_devices"):
    fn = getattr(multihost_utils, name)
    def counted(*a, _fn=fn, **k):
        calls["multihost"] += 1
        calls["sizes"].add(int(np.size(a[0])) if a and not isinstance(a[0], str) else 0)
        return _fn(*a, **k)
    setattr(multihost_utils, name, counted)
owner = lambda d: mesh.devices.flat[d].process_index
out = {}
for slots in (8, 32):
    # Decoded from the training layout (CPU: launch.build.check_hosts); the default "tensor"
    # layout's program is lowered and compiled below, not run.
    ecfg = EngineConfig(num_slots=slots, page_size=8, num_pages=16 * slots, max_prompt_len=16,
                        max_new_tokens=12, steps_per_call=4, weights_layout="training")
    engine = Engine(CFG, graphdef, ecfg, SamplingParams(1.0), mesh=mesh)
    dispatch, decoded = engine.dispatch, [0]
    calls["sizes"] = set()
    def counting(*a, **k):
        decoded[0] += 1
        return dispatch(*a, **k)
    engine.dispatch = counting
    g, per = 2, slots // 4 // 2  # G = 2, every slot of every shard busy
    shards = [i for i in engine.local_shards for _ in range(per)]
    prompts = [rng.integers(1, 128, 3 + j % 5).tolist() for j in range(len(shards))]
    before, multi = peers.CALLS[0], calls["multihost"]
    _, res = generate_all(engine, params, engine.init_state(), prompts, g, shards=shards,
                                 request_ids=[1000 * jax.process_index() + j for j in range(len(shards))])
    state = engine.init_state()
    spanning = {}
    for layout in ("tensor", "training"):
        e = Engine(CFG, graphdef, dataclasses.replace(ecfg, weights_layout=layout),
                   SamplingParams(1.0), mesh=mesh)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
        compiled = steps.generate.lower(e.graphdef, e.abstract_decode_params(abstract), state,
                                        e.sampling, 4, (), e.backend, jax.random.key(0),
                                        e.layout, e.cascade_group(), False).compile()
        spanning[layout] = [[c.kind, c.shapes] for c in hlo.collectives(compiled.as_text())
                            if c.spans(owner)]
    out[slots] = {"decode_calls": decoded[0], "agree": peers.CALLS[0] - before,
                  "multihost": calls["multihost"] - multi, "sizes": sorted(calls["sizes"]),
                  "spanning": spanning,
                  "finished": sum(len(r) for r in res)}
print("RESULT " + json.dumps(out))
"""


def test_a_decode_call_moves_no_token_between_hosts(tmp_path):
    """At 8 and 32 slots: every round of the loop makes one `peers.agree` (each decode call's,
    and the last round's, which finds everything done) and no other multihost call; the
    compiled decode call's collectives that span both processes are the same (the loop's stop
    flag) and carry no per-slot array."""
    port, procs = _free_port(), []
    for i in range(2):
        env = dict(os.environ, JAX_NUM_CPU_DEVICES="4", JAX_PLATFORMS="cpu",
                   JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                   JAX_COMPILATION_CACHE_DIR=process_cache(i))  # fmt: skip
        with open(tmp_path / f"p{i}.log", "w") as log:  # a file, not a pipe: _pair says why
            procs.append(subprocess.Popen(
                [sys.executable, "-c", TRAFFIC, f"127.0.0.1:{port}", str(i)], cwd=ROOT, env=env,
                stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
    results = []
    for i, p in enumerate(procs):
        p.wait(timeout=600)
        out = (tmp_path / f"p{i}.log").read_text()
        assert p.returncode == 0, out[-3000:]
        results.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
    for res in results:
        small, big = res["8"], res["32"]
        for r in (small, big):
            assert r["decode_calls"] > 0 and r["finished"] > 0
            assert r["agree"] == r["decode_calls"] + 1, r  # one per round: no more per slot
            assert r["multihost"] == r["agree"], r  # peers.agree is the only multihost call
            for layout, spans in r["spanning"].items():  # no array of the slots: no token,
                assert spans, layout  # at least the loop's stop flag
                for kind, shapes in spans:  # no log-prob (in either decode layout)
                    assert shapes and all(len(d) == 0 for _, d in shapes), (layout, kind, shapes)
        assert small["spanning"] == big["spanning"], (small, big)
        # what each process sends per agreement: the same few dozen int32 at 8 and 32 slots
        assert small["sizes"] == big["sizes"] and max(small["sizes"]) <= 64, (small, big)
    print(
        {
            k: (v["decode_calls"], v["agree"], v["sizes"], v["spanning"])
            for k, v in results[0].items()
        }
    )
