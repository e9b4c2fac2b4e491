"""Test setup: 8 fake CPU devices, and a persistent compilation cache for the training
subprocesses that tests start.

The device count must be set before JAX initialises its backends, hence at import time here.
"""

import contextlib
import os
import sys

import jax
from jax._src import lru_cache as _lru_cache

# XLA:CPU code at LLVM -O0 by default: most tests run tiny shapes for milliseconds, so compiling is
# what they pay for, and -O0 compiles much faster (tests/rl/test_learner.py, cold cache: 101 s ->
# 62 s). jax_disable_most_optimizations sets the backend's -O0 (and skips LLVM's expensive passes)
# per compile, so a test whose time goes to running many steps can compile at XLA's default level
# instead (marked `optimized`, below: tests/launch/test_long_episodes.py's 4k-token step, cold
# cache: 91 s -> 40 s of CPU). HLO passes (fusion, buffer assignment) are the same at either
# level, so HLO and memory checks see the same programs. The environment variable carries it to
# subprocesses (training runs); an XLA_FLAGS that sets the level itself is left to decide.
_OPTIMIZE = "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
# XLA:CPU's elemental emitters instead of its fusion emitters (MLIR): they compile about twice as
# fast (tests/rl/test_learner.py, cold cache: 99 -> 47 s of CPU; the tiny learner step 2.7 ->
# 1.0 s). Collectives and buffer sizes are unchanged, but scatters are expanded into while loops
# (tests/launch/test_bench_mesh.py, which reads loop structure, runs its bench with the default);
# numerics differ in instruction choice only, which the tests' tolerances (references in numpy,
# dense attention) allow, and runs compared bitwise are compiled alike. CPU-only: accelerators'
# compiles, and users' runs, never see it. Carried to subprocesses with XLA_FLAGS.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false"
    ).strip()
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "false" if _OPTIMIZE else "true")
jax.config.update(
    "jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "true"
)
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
# One cache directory per pytest-xdist worker (and "main" without xdist), under the user's
# JAX_COMPILATION_CACHE_DIR or ~/.cache/jax_grpo_tests: a process reads only entries that it, the
# tests before it in the same worker, or the subprocesses those tests started wrote. With one
# directory for both workers, a worker twice segfaulted in XLA:CPU's deserialize_executable
# (jax._src.compilation_cache.get_executable_and_time) on an entry written by the other worker or
# its training subprocesses (CI at e49b647 and at 8b3434d; cause not found: JAX's zlib framing
# rejects a torn file before XLA sees it). The base travels to the workers in TESTS_JAX_CACHE_BASE,
# since the controller process sets JAX_COMPILATION_CACHE_DIR below before it starts them.
_BASE = os.environ.setdefault(
    "TESTS_JAX_CACHE_BASE",
    os.environ.get(
        "JAX_COMPILATION_CACHE_DIR",
        os.path.join(os.path.expanduser("~"), ".cache", "jax_grpo_tests"),
    ),
)
_CACHE = os.path.join(_BASE, os.environ.get("PYTEST_XDIST_WORKER", "main"))
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE  # inherited by subprocesses
# Every compile of a training subprocess is cached (and of the test processes with
# TESTS_PROCESS_CACHE=1, below): at -O0 most take under JAX's default 1 s threshold, so each run
# recompiled what the runs before it had compiled (the kill -9 test of
# tests/launch/test_train.py, empty cache: 102 s -> 80 s).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _atomic_put(self, key: str, value: bytes) -> None:
    """jax's LRUCache.put (no size limit), the entry written under a temporary name and renamed:
    JAX writes it in place, and with TESTS_PROCESS_CACHE=1 a test process shares its directory
    with the training subprocesses its tests start (a reader of a torn entry gets a zlib error
    and recompiles, but a whole file is the simpler contract). Multi-process runs' processes,
    which compile the same programs at the same moment, each get their own cache directory
    (`process_cache`)."""
    path = self.path / f"{key}-cache"
    if path.exists():
        return
    tmp = self.path / f".{key}.{os.getpid()}.tmp"
    tmp.write_bytes(value)
    os.replace(tmp, path)


def process_cache(index: int) -> str:
    """The compilation cache directory of process `index` of a multi-process test run."""
    return os.path.join(_CACHE, f"process{index}")


jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# The test processes themselves (pytest's workers) keep no persistent cache unless
# TESTS_PROCESS_CACHE=1; the training subprocesses they start keep theirs (the environment
# above). Long-lived workers segfaulted inside XLA:CPU's loading or serialisation of an
# executable (jax 0.10.2, jax._src.compilation_cache): twice in `deserialize_executable`
# (get_executable_and_time; CI at e49b647 and 8b3434d, both workers then sharing one directory),
# and, with a directory per worker and an empty cache, once in `executable.serialize()`
# (put_executable_and_time; test_advantages, in a local run of .ci/run) and once in CI at 0f4db92
# (test_refresh; the stack cut off in CI's log). No training subprocess was seen to
# crash there. Within one process jit's own caches serve repeated shapes (module-level sampler
# steps, Learners sharing their jits): from empty caches the fast tier took 5:41 without the
# workers' cache and 5:37 with it, back to back at 0f4db92; rerun on the caches it left, 4:59
# with TESTS_PROCESS_CACHE=1 (without, a rerun compiles what the first run did).
if os.environ.get("TESTS_PROCESS_CACHE") == "1":
    _lru_cache.LRUCache.put = _atomic_put
else:
    jax.config.update("jax_enable_compilation_cache", False)


# The fast tier's longest files (wall seconds on 2 workers, `--durations`), which start first
# among the fast tests, longest first: alphabetically the sampler's files came last, and the two
# workers ended apart by a whole long file. A file missing here only runs later; keep the list short.
LONG_FIRST = (
    "tests/sampling/test_preemption.py", "tests/sampling/test_paged_attention.py",
    "tests/rl/test_repo_images.py", "tests/rl/test_repo_pytest_versions.py",
    "tests/sampling/test_distribution.py",
    "tests/sampling/test_shard_pools.py", "tests/models/test_hf.py", "tests/rl/test_sandbox.py",
    "tests/rl/test_learner.py", "tests/launch/test_bad_inputs.py",
    "tests/sampling/test_engine_scale.py", "tests/rl/test_repo_grading.py",
    "tests/sampling/test_engine.py", "tests/models/test_attention_kernels.py",
)  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """Tests marked slow (whole training runs, the real configs' lowerings) run first, then the
    fast tier's LONG_FIRST files. Under pytest-xdist's `--dist loadfile` (README, .ci/run) a worker
    then takes each long file early and the many short files fill in around them, instead of one
    worker ending alone on a long file."""
    rank = {path: i for i, path in enumerate(LONG_FIRST)}

    def key(item):
        fast = item.get_closest_marker("slow") is None
        return fast, rank.get(item.nodeid.split("::")[0], len(rank)) if fast else 0

    items.sort(key=key)  # stable: the rest keep their order


# Shared test helpers, imported by test modules as `from tests.conftest import ...` (below the
# device setup above, which must run before anything touches a JAX backend).
import json  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from models.config import ModelConfig  # noqa: E402
from models.sharding import init_params, make_mesh  # noqa: E402
from sampling.engine import EngineConfig  # noqa: E402


@contextlib.contextmanager
def xla_optimized():
    """Compiles at XLA's default optimization level within the block, in this process and in the
    subprocesses it starts (see the top of this file); restores the -O0 default after it."""
    flag = jax.config.read("jax_disable_most_optimizations")
    env = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"]
    # The flag is not part of jit's cache keys: without clearing, a program compiled at one
    # level serves calls at the other, in this process (an eager jnp.std of the advantages,
    # compiled optimized by test_long_resume, gave tests/launch/test_partial_resume.py's
    # in-process run another last bit than its -O0 subprocess).
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "false"
    try:
        yield
    finally:
        jax.clear_caches()
        jax.config.update("jax_disable_most_optimizations", flag)
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = env


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "optimized: compiled at XLA's default level, not -O0 (tests/conftest.py): "
        "tests whose time goes to running many steps, not to compiling",
    )
    config.addinivalue_line(
        "markers",
        "repo_sandbox: runs the `repo` environment's sandboxes; skipped, with the library's "
        "reason, where they cannot run here (tests/conftest.py repo_sandbox_refusal)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test marked repo_sandbox (`isolation=` the one it runs in, else `sandbox_isolation()`)
    is skipped, before its fixtures, where this host keeps the `repo` environment's sandbox from
    running (`repo_sandbox_refusal`); the skip mark reports the test's own location."""
    if (mark := item.get_closest_marker("repo_sandbox")) is not None:
        if why := repo_sandbox_refusal(mark.kwargs.get("isolation") or sandbox_isolation()):
            item.add_marker(pytest.mark.skip(reason=f"the repo environment cannot run here: {why}"))


@pytest.fixture(autouse=True, scope="module")
def _optimized_module(request):
    """A module marked `optimized` (pytestmark) compiles optimized, its module fixtures too."""
    marks = getattr(request.module, "pytestmark", [])
    marks = marks if isinstance(marks, list) else [marks]
    optimized = any(m.name == "optimized" for m in marks)
    with xla_optimized() if optimized else contextlib.nullcontext():
        yield


@pytest.fixture(autouse=True)
def _optimized_test(request):
    """A test marked `optimized` compiles optimized (mark its module for its module fixtures)."""
    optimized = request.node.get_closest_marker("optimized") is not None
    with xla_optimized() if optimized else contextlib.nullcontext():
        yield


@pytest.fixture(autouse=True)
def _no_wandb_service_left():
    """A test that runs W&B in this process (test_hub's README commands) leaves W&B's service
    running and its address in WANDB_SERVICE, which every training subprocess a later test of
    this worker starts inherits: they then all share this process's wandb-core, and a run killed
    there (test_workdir_faults' kill -9) keeps its run id held until this worker exits. Each
    test ends with the service stopped and the variable gone."""
    yield
    if os.environ.pop("WANDB_SERVICE", None) is not None and "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")  # tiny HF checkpoints + references

# The engine tests' tiny model and engine shapes, shared so that their compiles are shared. Every
# parameter dimension divides the (data=2, fsdp=2, tensor=2) mesh, and K = 2 KV heads split over
# tensor, so on that mesh parameters and KV pages are genuinely sharded.
CFG = ModelConfig(
    family="qwen2", vocab_size=128, d_model=32, d_ff=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, qkv_bias=True,
)  # fmt: skip
ECFG = EngineConfig(
    num_slots=8, page_size=8, num_pages=96, max_prompt_len=24, max_new_tokens=12,
    steps_per_call=4, backend="auto",  # the C++ kernel on CPU (blockwise without a compiler)
)  # fmt: skip


@pytest.fixture(scope="module")
def one_device_mesh():
    return make_mesh({}, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def tiny(one_device_mesh):
    """(graphdef, params) of CFG on one device."""
    return init_params(CFG, one_device_mesh, seed=3)


def random_prompts(lengths, vocab=CFG.vocab_size, seed=0):
    """One prompt of uniform random ids in [1, vocab) per length."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


# The per-step training metrics that two runs of `launch.train` must agree on.
METRIC_KEYS = (
    "loss",
    "policy_loss",
    "kl",
    "entropy",
    "reward_mean",
    "adv_mean",
    "adv_std",
    "grad_norm",
)


def train_metrics(workdir):
    """{step: {key: value}} over METRIC_KEYS of the train-step rows of workdir/metrics.jsonl."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    return {r["step"]: {k: r[k] for k in METRIC_KEYS} for r in rows if "loss" in r}


def train_here(argv, devices: int = 1) -> int:
    """`python -m launch.train *argv` run in this process on `devices` of its 8 fake devices
    (`models.sharding.on_devices`): on one, the run a one-device subprocess makes, program for
    program and bitwise (tests/launch/test_train.py compares them), without the interpreter start,
    the imports and the retracing of every jitted function that a subprocess pays (~8 s of CPU
    for the tiny model; a second run of the same shapes here ~1.5 s). Returns main's exit code.
    A run that a test kills, or that needs its own environment variables at import time, still
    runs in a subprocess. Not bitwise for every model: XLA:CPU's matmuls can round otherwise in
    a process of 8 CPU devices than in one of one (an f32 [256,128]^T @ [256,96] does), and a
    mixture of experts' run shows it from step 2 on (tests/launch/test_partial_resume.py runs
    its MoE runs as subprocesses)."""
    from launch.train import main
    from models.sharding import on_devices

    with on_devices(jax.devices()[:devices]):
        return main([str(a) for a in argv])


import functools  # noqa: E402
import stat  # noqa: E402


@functools.cache
def sandbox_isolation() -> str:
    """The sandbox isolation of every test that is not about isolation itself: "bwrap" where
    bubblewrap works here, else "rlimits". The library's default ("auto") refuses to run without
    bubblewrap; the tests choose the weak mode explicitly on a machine without it, so that they
    still run (.ci/run says so). The isolation tests (tests/rl/test_isolation.py,
    test_repo_isolation.py, test_sandbox.py's "auto" cases) hide or require bubblewrap on purpose."""
    import warnings

    from rl.sandbox import Sandbox

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Sandbox(1, isolation="bwrap").close()
    except RuntimeError:
        return "rlimits"
    return "bwrap"


def site_hidden(isolation: str) -> bool:
    """Whether the `repo` environment's workspace uids cannot reach the trainer's site-packages
    on this host: only as root does the sandbox run them as other uids; without bubblewrap
    (isolation "rlimits": the uid mode) they go through every directory above it, with bubblewrap
    only into the site itself (its bind mount). A Python or virtual environment under a private
    home (/root is 0700: a pyenv Python, a venv in ~) hides it in the uid mode."""
    if os.geteuid() != 0:
        return False
    from rl.envs.repo.sandbox import site_packages

    site = path = site_packages()
    dirs = [site]
    while isolation != "bwrap" and path != os.path.dirname(path):
        path = os.path.dirname(path)
        dirs.append(path)
    others = lambda d, bits: os.stat(d).st_mode & bits == bits
    return not others(site, stat.S_IROTH) or not all(others(d, stat.S_IXOTH) for d in dirs)


@functools.cache
def repo_sandbox_refusal(isolation: str) -> str:
    """Why the `repo` environment's sandbox cannot run on this host in `isolation`, in the
    library's words (`RepoEnv.check_sandbox`, which launch.train runs at start-up: it refuses
    and names the fix, docs/sandbox.md); "" where the host lets it run (`site_hidden`), so that
    there a refusal, a library fault, fails the tests marked `repo_sandbox` instead of skipping
    them (tests/rl/test_repo_env.py checks the probe passes there)."""
    if not site_hidden(isolation):
        return ""
    from ml_collections import ConfigDict

    from rl.envs.repo import RepoEnv

    return RepoEnv.check_sandbox(ConfigDict({"env": {"isolation": isolation}}))
