"""Test setup: 8 fake CPU devices and a shared persistent compilation cache.

The device count must be set before JAX initialises its backends, hence at import time here.
"""

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
_CACHE = os.environ.get(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jax_grpo_tests")
)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE  # inherited by subprocesses
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
