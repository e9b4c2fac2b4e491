"""One rollout of the `repo` environment's scripted policy (tests/rl/repo_scripted.py) on the mesh
data=2 x fsdp=2 x tensor=2, for tests/launch/test_hosts.py: `python -m tests.launch.host_repo
OUT TASKS ISOLATION` in each process of a multi-process run, or `rollout(...)` in the test
process on its 8 devices. Writes OUT/process<i>.json: the sandbox runs this process started
(`rl.sandbox.RUNS`) and its episodes. Imports nothing of tests.conftest."""

import json
import os
import sys

import jax

MESH = [
    "--config.mesh.data=2",
    "--config.mesh.fsdp=2",
    "--config.mesh.tensor=2",
    "--config.sampling.weights_layout=training",
]  # on CPU: launch.build.check_hosts


def rollout(out: str, tasks: str, isolation: str) -> dict:
    from launch.build import build
    from launch.cli import parse_args
    from tests.rl import repo_scripted

    config = parse_args(repo_scripted.args(tasks, isolation, prompts=8) + MESH, {})[0]
    run = build(config)
    r, runs = repo_scripted.rollout(run, config, batch_size=8)
    result = {"sandbox_runs": runs,
              "episodes": sum(len(g.episodes) for g in r.groups),
              "per_process": {k: v for k, v in r.stats.items() if "per_process" in k}}  # fmt: skip
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"process{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)
    return result


if __name__ == "__main__":
    from launch.distributed import init_distributed

    class _Env:  # init_distributed reads the coordinator from the environment variables
        distributed, heartbeat_timeout_s = False, 60

    init_distributed(_Env)
    rollout(*sys.argv[1:4])
