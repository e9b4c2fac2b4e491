"""Paged KV writes and decode attention: the reference against a float64 numpy softmax, and the
blockwise CPU backend and the Pallas GPU / TPU kernels (interpreted on CPU) against the reference.

Shapes are tiny because interpret mode runs the kernels op by op. Page assignments are shuffled
so that a kernel reading pages in pool order instead of table order would fail.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from sampling import cpu_attention
from sampling.paged_attention import (
    gather_kv,
    paged_attention,
    paged_attention_blockwise,
    paged_attention_reference,
    resolve_backend,
    write_kv,
)

PAGE_SIZE = 4
PAGES_PER_SEQ = 8
NUM_PAGES = 48
H = 16
GQA = [(2, 2), (8, 2)]  # (N, K): ratios 1 and 4


def _cache(seed, n, k, lengths, dtype=np.float32):
    """Random q, pages and a shuffled page table; lengths list -> numpy arrays."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    q = rng.standard_normal((b, n, H)).astype(dtype)
    k_pages = rng.standard_normal((k, NUM_PAGES, PAGE_SIZE, H)).astype(dtype)
    v_pages = rng.standard_normal((k, NUM_PAGES, PAGE_SIZE, H)).astype(dtype)
    pages = rng.permutation(np.arange(1, NUM_PAGES))[: b * PAGES_PER_SEQ]
    table = pages.reshape(b, PAGES_PER_SEQ).astype(np.int32)
    for i, length in enumerate(lengths):  # pages past the length are unassigned, as in the engine
        table[i, -(-length // PAGE_SIZE) :] = 0
    return q, k_pages, v_pages, np.asarray(lengths, np.int32), table


def _numpy_attention(q, k_pages, v_pages, lengths, table):
    """float64 softmax(q k^T / sqrt(H)) v over each sequence's first `length` tokens."""
    b, n, h = q.shape
    kh = k_pages.shape[0]
    out = np.zeros((b, n, h))
    for i in range(b):
        pos = np.arange(lengths[i])
        pages, slots = table[i, pos // PAGE_SIZE], pos % PAGE_SIZE
        for j in range(n):
            kv_head = j // (n // kh)
            keys = k_pages[kv_head, pages, slots].astype(np.float64)  # [L,H]
            vals = v_pages[kv_head, pages, slots].astype(np.float64)
            s = keys @ q[i, j].astype(np.float64) * h**-0.5
            if len(s):
                p = np.exp(s - s.max())
                out[i, j] = (p / p.sum()) @ vals
    return out


def _lengths(seed):
    """Length 1, an exact page multiple, a full table, one random partial length."""
    rng = np.random.default_rng(seed)
    full = PAGE_SIZE * PAGES_PER_SEQ
    return [1, 2 * PAGE_SIZE, full, int(rng.integers(2, full)) | 1]


@pytest.mark.parametrize("n,k", GQA)
def test_reference_matches_numpy(n, k):
    q, kp, vp, lengths, table = _cache(0, n, k, _lengths(0))
    got = jax.jit(paged_attention_reference)(q, kp, vp, lengths, table)
    np.testing.assert_allclose(got, _numpy_attention(q, kp, vp, lengths, table), atol=1e-5)


def test_length_zero_gives_zeros():
    q, kp, vp, lengths, table = _cache(1, 4, 2, [0, 5])
    got = np.asarray(paged_attention_reference(q, kp, vp, lengths, table))
    assert np.all(got[0] == 0)
    np.testing.assert_allclose(got[1], _numpy_attention(q, kp, vp, lengths, table)[1], atol=1e-5)


def test_dispatch_on_cpu():
    # With a C++ compiler (CI has one) the kernel must build; sharded or bf16 pages never use it.
    kernel = cpu_attention._compiler() is not None
    assert resolve_backend("auto") == ("cpu_kernel" if kernel else "blockwise")
    assert resolve_backend("auto", sharded=True) == "blockwise"
    assert resolve_backend("auto", dtype=jnp.bfloat16) == "blockwise"
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda")
    q, kp, vp, lengths, table = _cache(2, 4, 2, _lengths(2))
    got = jax.jit(paged_attention)(q, kp, vp, lengths, table)
    np.testing.assert_allclose(got, paged_attention_reference(q, kp, vp, lengths, table), atol=1e-5)


@pytest.mark.parametrize(
    "platform,sharded,head_dim,page_size,want",
    [
        ("tpu", False, 128, 32, "pallas_tpu"),
        ("tpu", False, 256, 16, "pallas_tpu"),
        ("tpu", False, 64, 32, "blockwise"),  # Qwen2.5-0.5B, Llama-3.2-1B: Mosaic cannot lower it
        ("tpu", True, 128, 32, "pallas_tpu"),  # on a mesh inside shard_map (sampling.partitioned)
        ("tpu", True, 64, 32, "blockwise"),
        ("tpu", False, None, None, "blockwise"),  # unknown shape: no kernel
        ("gpu", False, 64, 32, "pallas_gpu"),
        ("cuda", False, 128, 16, "pallas_gpu"),
        ("gpu", False, 96, 32, "blockwise"),  # Triton loads power-of-two blocks only
        ("gpu", False, 8, 32, "blockwise"),  # Triton's dot needs >= 16
        ("gpu", False, 64, 8, "blockwise"),
        ("gpu", True, 128, 32, "pallas_gpu"),
        ("cpu", True, 128, 32, "blockwise"),  # fake CPU meshes: the GSPMD path
    ],
)
def test_dispatch_on_accelerators(platform, sharded, head_dim, page_size, want):
    """ "auto" picks a Pallas kernel only where it lowers: a supported page shape, on one device
    or a mesh (tests/sampling/test_tpu_export.py checks the TPU rule against the real
    lowering)."""
    got = resolve_backend("auto", sharded, "bfloat16", head_dim, page_size, platform=platform)
    assert got == want
    # Explicit backends stay as given.
    assert resolve_backend("reference", sharded, platform=platform) == "reference"
    assert resolve_backend("pallas_tpu", sharded, platform="cpu") == "pallas_tpu"


@pytest.mark.parametrize("n,k,h", [(2, 2, 16), (8, 2, 16), (8, 2, 32), (14, 2, 64)])
def test_cpu_kernel_matches_reference(n, k, h):
    """The C++ kernel on a stacked [L,K,P,page_size,H] pool, per layer: head sizes with a
    compile-time path (32, 64) and the generic one (16); GQA ratios 1, 4 and 7. Pages past each
    length hold NaN: the kernel must never read them."""
    if not cpu_attention.available():
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(12)
    layers, b = 3, 5
    kp = rng.standard_normal((layers, k, 1 + b * PAGES_PER_SEQ, PAGE_SIZE, h)).astype(np.float32)
    vp = rng.standard_normal(kp.shape).astype(np.float32)
    q = rng.standard_normal((b, n, h)).astype(np.float32)
    table = rng.permutation(np.arange(1, kp.shape[2])).reshape(b, PAGES_PER_SEQ).astype(np.int32)
    full = PAGE_SIZE * PAGES_PER_SEQ
    lengths = np.array([0, 1, 2 * PAGE_SIZE, full, int(rng.integers(2, full)) | 1], np.int32)
    kp_nan, vp_nan = kp.copy(), vp.copy()
    for i, length in enumerate(lengths):
        unread = table[i, -(-length // PAGE_SIZE) :]
        kp_nan[:, :, unread], vp_nan[:, :, unread] = np.nan, np.nan
        if length % PAGE_SIZE:  # the tail of a partial page
            last = table[i, length // PAGE_SIZE]
            kp_nan[:, :, last, length % PAGE_SIZE :] = np.nan
            vp_nan[:, :, last, length % PAGE_SIZE :] = np.nan
    f = jax.jit(cpu_attention.paged_attention_cpu, static_argnames="layer")
    for layer in range(layers):
        want = paged_attention_reference(q, kp[layer], vp[layer], lengths, table)
        got = np.asarray(f(q, kp_nan, vp_nan, lengths, table, layer=layer))
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert np.all(got[0] == 0)
    got = paged_attention(q, kp_nan[1], vp_nan[1], lengths, table, backend="cpu_kernel")
    np.testing.assert_allclose(
        got, paged_attention_reference(q, kp[1], vp[1], lengths, table), atol=1e-5
    )


def test_cpu_kernel_falls_back_without_compiler(monkeypatch, tmp_path):
    """No compiler: one warning, `available()` False, and "auto" picks the blockwise backend."""
    monkeypatch.setattr(cpu_attention, "_compiler", lambda: None)
    cpu_attention.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
            assert not cpu_attention.available()
        assert resolve_backend("auto") == "blockwise"
    finally:
        monkeypatch.undo()
        cpu_attention.available.cache_clear()
    # A fresh cache directory builds the kernel from scratch (what a new machine does).
    if cpu_attention._compiler() is not None:
        monkeypatch.setenv("JAX_GRPO_KERNEL_CACHE", str(tmp_path))
        lib = cpu_attention._build(cpu_attention._compiler())
        assert os.path.dirname(lib) == str(tmp_path) and os.path.getsize(lib) > 0


def test_cpu_kernel_cache_is_keyed_on_instruction_set(monkeypatch, tmp_path):
    """A -march=native build is cached per set of CPU flags: a home directory shared by two
    CPUs with different extensions keeps one library each (loading the other's would SIGILL)."""
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu_attention, "CPUINFO", str(cpuinfo))
    model = "model name\t: Same CPU @ 2.0GHz\n"
    cpuinfo.write_text(f"processor\t: 0\n{model}flags\t\t: fpu sse2 avx2\n")
    assert cpu_attention._cpu_flags() == "avx2 fpu sse2"
    path = cpu_attention._library_path("c++")
    cpuinfo.write_text(f"processor\t: 0\n{model}flags\t\t: fpu sse2 avx2 avx512f\n")
    assert cpu_attention._library_path("c++") != path
    cpuinfo.write_text(f"processor\t: 0\n{model}flags\t\t: avx2 sse2 fpu\n")  # order only
    assert cpu_attention._library_path("c++") == path
    monkeypatch.setattr(cpu_attention, "CPUINFO", str(tmp_path / "missing"))
    monkeypatch.setattr(cpu_attention.platform, "processor", lambda: "arm")
    assert cpu_attention._cpu_flags() == "arm"


@pytest.mark.parametrize("n,k", GQA)
@pytest.mark.parametrize("pages_per_block", [1, 3, 8])
def test_blockwise_matches_reference(n, k, pages_per_block):
    """Block sizes that divide PAGES_PER_SEQ, that do not (a padded last block), and one block.

    Lengths cover 0, 1, page multiples, a full table and random ones, so blocks end inside a
    page, on a page boundary and past the last valid page; max(lengths) sets the trip count.
    """
    rng = np.random.default_rng(8)
    full = PAGE_SIZE * PAGES_PER_SEQ
    f = jax.jit(paged_attention_blockwise, static_argnames="pages_per_block")
    # At most 5 sequences fit the pool with distinct pages.
    for seed, lengths in enumerate(
        [
            [0, 1, 3 * PAGE_SIZE, full, 2 * PAGE_SIZE + 1],
            [PAGE_SIZE, full - 1, 2, *rng.integers(1, full, 2)],
        ]
    ):
        q, kp, vp, lengths, table = _cache(8 + seed, n, k, lengths)
        got = f(q, kp, vp, lengths, table, pages_per_block=pages_per_block)
        want = paged_attention_reference(q, kp, vp, lengths, table)
        np.testing.assert_allclose(got, want, atol=1e-5)
    q, kp, vp, lengths, table = _cache(8, n, k, [0, 1, 3 * PAGE_SIZE, full, 2 * PAGE_SIZE + 1])
    assert np.all(np.asarray(f(q, kp, vp, lengths, table, pages_per_block=pages_per_block))[0] == 0)
    # Short batches stop early: the blocks past max(lengths) are never read, so their pages may
    # hold anything, here NaN. (Masked slots inside a read block must stay finite: 0 * NaN.)
    short = np.minimum(lengths, 2 * PAGE_SIZE)
    kp_nan, vp_nan = kp.copy(), vp.copy()
    late = table[:, 2:][table[:, 2:] > 0]
    kp_nan[:, late], vp_nan[:, late] = np.nan, np.nan
    got = f(q, kp_nan, vp_nan, short, table, pages_per_block=1)
    want = paged_attention_reference(q, kp, vp, short, table)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_write_kv_then_read_back():
    b, t, kh = 3, 6, 2
    rng = np.random.default_rng(3)
    table = rng.permutation(np.arange(1, NUM_PAGES))[: b * PAGES_PER_SEQ]
    table = table.reshape(b, PAGES_PER_SEQ).astype(np.int32)
    # Row 0: left padding then a prompt; row 1: a prompt crossing a page boundary from an
    # offset (a refill after earlier tokens); row 2: right padding.
    positions = np.array(
        [[-1, -1, 0, 1, 2, 3], [3, 4, 5, 6, 7, 8], [0, 1, 2, -1, -1, -1]], np.int32
    )
    k = rng.standard_normal((b, t, kh, H)).astype(np.float32)
    v = rng.standard_normal((b, t, kh, H)).astype(np.float32)
    zeros = jnp.zeros((kh, NUM_PAGES, PAGE_SIZE, H), jnp.float32)
    kp, vp = jax.jit(write_kv)(zeros, zeros, k, v, table, positions)
    kp, vp = np.asarray(kp), np.asarray(vp)
    expect_k, expect_v = np.zeros_like(kp), np.zeros_like(vp)
    for i in range(b):
        for j in range(t):
            p = positions[i, j]
            if p >= 0:
                page, slot = table[i, p // PAGE_SIZE], p % PAGE_SIZE
                assert np.array_equal(kp[:, page, slot], k[i, j])
                assert np.array_equal(vp[:, page, slot], v[i, j])
                expect_k[:, page, slot], expect_v[:, page, slot] = k[i, j], v[i, j]
    # Nothing else was touched: padding is dropped, the null page included.
    assert np.array_equal(kp, expect_k)
    assert np.array_equal(vp, expect_v)
    # gather_kv sees the same tokens in sequence order.
    dense = np.asarray(gather_kv(jnp.asarray(kp), table))  # [B,S,K,H]
    assert np.array_equal(dense[1, 3:9], k[1])


def test_write_then_attend_matches_numpy():
    """A decode step end to end: write one token per sequence at its length, attend over it."""
    n, kh = 8, 2
    q, kp, vp, lengths, table = _cache(4, n, kh, [3, 7, 12])
    table[:, :4] = np.arange(1, 13).reshape(3, 4)[::-1]  # room to grow, non-contiguous
    kp, vp = jnp.asarray(kp), jnp.asarray(vp)
    rng = np.random.default_rng(5)
    k_new = rng.standard_normal((3, 1, kh, H)).astype(np.float32)
    v_new = rng.standard_normal((3, 1, kh, H)).astype(np.float32)
    kp2, vp2 = write_kv(kp, vp, k_new, v_new, table, lengths[:, None])
    got = paged_attention_reference(q, kp2, vp2, lengths + 1, table)
    want = _numpy_attention(q, np.asarray(kp2), np.asarray(vp2), lengths + 1, table)
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("n,k", GQA)
def test_gpu_kernel_interpret_matches_reference(n, k):
    q, kp, vp, lengths, table = _cache(6, n, k, [0] + _lengths(6))
    got = paged_attention(q, kp, vp, lengths, table, backend="pallas_gpu", interpret=True)
    want = paged_attention_reference(q, kp, vp, lengths, table)
    np.testing.assert_allclose(got, want, atol=1e-5)


def _bf16(x):
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize(  # (8, 1): 8 q heads per kv head, the kernel's other q layout
    "n,k", [pytest.param(*GQA[0], marks=pytest.mark.slow), GQA[1], (8, 1)]
)  # (2, 2), GQA ratio 1, in the full suite only: the fast tier keeps ratios 4 and 8
def test_tpu_kernel_interpret_matches_bf16_reference(n, k):
    q, kp, vp, lengths, table = _cache(7, n, k, [0] + _lengths(7))
    with pltpu.force_tpu_interpret_mode():
        got = paged_attention(q, kp, vp, lengths, table, backend="pallas_tpu")
    want = paged_attention_reference(q, _bf16(kp), _bf16(vp), lengths, table)
    np.testing.assert_allclose(got, want, atol=1e-5)
    # The kernel really does round K and V to bf16: against the f32 cache it is off by far more.
    exact = paged_attention_reference(q, kp, vp, lengths, table)
    assert np.abs(np.asarray(got) - np.asarray(exact)).max() > 1e-4


def test_write_kv_is_two_unique_scatters_and_drops_padding():
    rng = np.random.default_rng(7)
    k_heads, pages, page_size, h = 2, 12, 4, 8
    pool = jnp.asarray(rng.normal(size=(k_heads, pages, page_size, h)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, pages))[:8].reshape(2, 4), jnp.int32)
    k = jnp.asarray(rng.normal(size=(2, 3, k_heads, h)), jnp.float32)
    positions = jnp.asarray([[5, 6, 7], [0, -1, 9]], jnp.int32)
    kp, vp = write_kv(pool, pool, k, 2 * k, table, positions)
    want = np.asarray(pool).copy()
    for b, t in np.argwhere(np.asarray(positions) >= 0):
        p = int(positions[b, t])
        want[:, table[b, p // page_size], p % page_size] = k[b, t]
    np.testing.assert_array_equal(kp, want)  # the padding position wrote nothing
    # One scatter per array, its indices unique (the padding position is dropped, not sent to
    # the null page with the other rows).
    hlo = jax.jit(write_kv).lower(pool, pool, k, 2 * k, table, positions).as_text()
    scatters = [x for x in hlo.splitlines() if "scatter" in x and "=" in x]
    assert len(scatters) == 2 and all("unique_indices = true" in x for x in scatters), scatters


@pytest.mark.parametrize("pages_per_block", [1, 2, 3])
def test_cascade_over_shared_prompts_matches_reference(pages_per_block):
    """group=4 over one layer's pool: block 0 shares 2 pages, block 1 shares
    3 but its first slot was reused by an unrelated sequence (shared_len 0, its own table row,
    so the block's shared pages must come from another row), block 2 shares nothing."""
    rng = np.random.default_rng(11)
    n, k, group = 8, 2, 4
    b = 3 * group
    kp = rng.standard_normal((k, 1 + b * PAGES_PER_SEQ, PAGE_SIZE, H)).astype(np.float32)
    vp = rng.standard_normal(kp.shape).astype(np.float32)
    q = rng.standard_normal((b, n, H)).astype(np.float32)
    pages = iter(rng.permutation(np.arange(1, kp.shape[1])).tolist())
    table = np.array([[next(pages) for _ in range(PAGES_PER_SEQ)] for _ in range(b)], np.int32)
    shared_len = np.zeros(b, np.int32)
    for block, shared in ((0, 2), (1, 3)):
        rows = range(block * group + block, (block + 1) * group)  # row 4 is the reused slot
        table[list(rows), :shared] = table[rows[0], :shared]
        shared_len[list(rows)] = shared * PAGE_SIZE
    full = PAGE_SIZE * PAGES_PER_SEQ
    lengths = np.maximum(rng.integers(1, full + 1, b), shared_len).astype(np.int32)
    lengths[1], lengths[6], lengths[11] = shared_len[1], full, 0  # own part empty; full; idle
    f = jax.jit(paged_attention_blockwise, static_argnames=("pages_per_block", "group"))
    want = paged_attention_reference(q, kp, vp, lengths, table)
    got = f(q, kp, vp, lengths, table, pages_per_block, group, shared_len)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got, _numpy_attention(q, kp, vp, lengths, table), atol=1e-5)
