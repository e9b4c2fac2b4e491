"""The sandbox that runs model-written code: rewards' and environments' programs in fresh, limited
processes. It knows nothing of RL: environments (rl/envs/) use it, learning modules never do.

    process.py    `Sandbox`: one limited interpreter per run (bubblewrap namespaces, rlimits, uid)
    workspace.py  an episode's directory (cwd and HOME of its runs; a leased uid as root)
    sweep.py      what a dead run's sandboxes left behind, removed when a new one starts
    oci.py        container images (OCI layout / docker save) unpacked into a root filesystem

The process sandbox's public names are re-exported here (`from rl.sandbox import Sandbox`);
docs/sandbox.md says what each isolation mode stops.
"""

from rl.sandbox.process import (
    ISOLATIONS,
    RUNS,
    Limits,
    RunResult,
    Sandbox,
    boot_command,
    isolation_of,
    refusal,
    weak_mode,
)
from rl.sandbox.workspace import Workspace

__all__ = [
    "ISOLATIONS",
    "RUNS",
    "Limits",
    "RunResult",
    "Sandbox",
    "Workspace",
    "boot_command",
    "isolation_of",
    "refusal",
    "weak_mode",
]
