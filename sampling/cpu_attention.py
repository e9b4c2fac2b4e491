"""The "cpu_kernel" paged attention backend: a small C++ kernel (sampling/kernels/
paged_attention_cpu.cc) called through the XLA FFI, compiled on first use.

Why a C++ kernel on CPU: decode attention is a few multiply-adds per cached byte, and XLA:CPU has
no way to run it without first copying each sequence's pages into a dense block (a gather), then
running tiny batched matmuls and a softmax as separate passes; that costs several times the
attention math (see `sampling.paged_attention`'s blockwise backend, the portable fallback). The
kernel reads the pages in place, one sequence at a time, on XLA's CPU thread pool.

Build: the first call compiles the kernel with the system C++ compiler (`$CXX`, else c++, g++ or
clang++) against the XLA FFI headers that ship with jaxlib, into a cache directory
(`$JAX_GRPO_KERNEL_CACHE`, default ~/.cache/jax-grpo/kernels) keyed by the source, the flags,
the jaxlib version and the CPU's instruction-set flags, so later processes just load it.
`-march=native` targets the CPU it runs on: keying on its flags, not its model name, keeps a home
directory shared by machines with different CPUs from loading a build for another instruction set
(SIGILL). Compiling and linking are separate steps so that -ffast-math (needed to vectorise the
f32 sums and exp) never links GCC's crtfastmath, which would flush denormals to zero in the whole
process. If there is no compiler or the build fails, `available()` is False, a warning
says why once, and "auto" falls back to the blockwise backend: results are the same to rounding.

Limits: f32 caches only; the kernel is opaque to GSPMD, so the engine uses it only when its
state is not spread over several devices (`sampling.paged_attention.resolve_backend`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = os.path.join(os.path.dirname(__file__), "kernels", "paged_attention_cpu.cc")
TARGET = "jax_grpo_paged_attention_cpu"
COMPILE_FLAGS = ["-O3", "-ffast-math", "-march=native", "-std=c++17", "-fPIC"]
CPUINFO = "/proc/cpuinfo"  # read for the instruction-set flags that key the build cache


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    """The CPU's instruction-set extensions: the `flags` line of /proc/cpuinfo on Linux (x86;
    `Features` on Arm), else platform.processor(). Two machines may share a model name yet not
    the extensions (a VM hides some), and only the extensions decide where a -march=native
    build runs."""
    try:
        with open(CPUINFO) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return " ".join(sorted(value.split()))
    except OSError:
        pass
    return platform.processor()


def _library_path(cxx: str) -> str:
    """Where the build for this source, these flags, jaxlib, CPU and compiler is cached."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = [source, " ".join(COMPILE_FLAGS).encode(), jax.__version__.encode()]
    key += [platform.machine().encode(), _cpu_flags().encode(), cxx.encode()]
    digest = hashlib.sha256(b"\0".join(key)).hexdigest()[:16]
    cache = os.environ.get("JAX_GRPO_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jax-grpo", "kernels"
    )
    return os.path.join(cache, f"paged_attention_cpu-{digest}.so")


def _build(cxx: str) -> str:
    """Path of the compiled shared library, building it if the cache lacks it."""
    lib = _library_path(cxx)
    cache = os.path.dirname(lib)
    if os.path.exists(lib):
        return lib
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        obj, out = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.so")
        include = ["-I", jax.ffi.include_dir()]
        _run([cxx, *COMPILE_FLAGS, *include, "-c", SOURCE, "-o", obj])
        # libmvec holds glibc's vectorised expf; elsewhere the compiler does not call it.
        libs = ["-lmvec"] if platform.system() == "Linux" else []
        _run([cxx, "-shared", obj, "-o", out, *libs])
        os.replace(out, lib)  # atomic: concurrent processes never load a half-written file
    return lib


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr.strip()[-2000:]}")


@functools.cache
def available() -> bool:
    """Builds (once per machine), loads and registers the kernel; False with a warning if not."""
    cxx = _compiler()
    try:
        if cxx is None:
            raise RuntimeError("no C++ compiler found (set $CXX)")
        handle = ctypes.cdll.LoadLibrary(_build(cxx))
        jax.ffi.register_ffi_target(
            TARGET, jax.ffi.pycapsule(handle.PagedAttentionCpu), platform="cpu"
        )
    except Exception as e:  # noqa: BLE001 - any build or load failure means "use the fallback"
        warnings.warn(
            f"paged attention: the C++ CPU kernel is unavailable, using the blockwise JAX "
            f"backend instead ({e})",
            stacklevel=2,
        )
        return False
    return True


def paged_attention_cpu(q, k_pages, v_pages, lengths, page_indices, layer=None):
    """q [B,N,H] -> [B,N,H] over one layer's pages [K,P,page_size,H] or, with `layer`, the
    stacked pool [L,K,P,page_size,H] read in place. Requires `available()` and f32 pages."""
    if not available():
        raise RuntimeError("backend 'cpu_kernel': the C++ kernel did not build (see the warning)")
    if k_pages.dtype != jnp.float32:
        raise ValueError(f"cpu_kernel needs a float32 KV cache, got {k_pages.dtype}")
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        lengths.astype(jnp.int32),
        page_indices.astype(jnp.int32),
        layer=np.int64(layer),
    )
    return out.astype(q.dtype)
