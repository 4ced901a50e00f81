"""The Pallas prefix kernels over a paged cache (prefix_kernel.py, `pages=`), in Pallas'
interpreter on CPU: a row's prefix read through its shuffled page table gives the state the
dense kernel gives over the same slots in row buffers, and, through `cached_attention`, the
output of the portable paged path; ragged prefixes (none, mid-page, a page's end, the whole
table), a sliding-window floor, a soft-cap, grouped heads and several queries a row. Pages
no row holds are NaN in the pool: any read of one shows. Which passes take the paged
kernel (`applies`, `attention._prefix_kernel`)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cache as kv
from specjax.backend import Backend
from specjax.models import attention as attn
from specjax.models import prefix_kernel as pk
from tests.test_long_context import _split_case


def _pool(rows, table, num_pages: int, page: int):
    """Row buffers [B, G, S, D] laid into a pool [P, G, page, D] by the table [B, W]; the
    pages no row holds NaN."""
    B, G, S, D = rows.shape
    pool = jnp.full((num_pages, G, page, D), jnp.nan, rows.dtype)
    return pool.at[table].set(rows.reshape(B, G, S // page, page, D).transpose(0, 2, 1, 3, 4))


def _table(B: int, W: int, num_pages: int, seed: int = 0):
    """Each row's W pages, shuffled over the pool (page 0, the null page, never held)."""
    ids = np.random.default_rng(seed).permutation(np.arange(1, num_pages))[:B * W]
    return jnp.asarray(ids.reshape(B, W), jnp.int32)


@pytest.mark.parametrize("platform, page", [("gpu", 4), ("gpu", 128), ("tpu", 16)])
def test_the_paged_kernel_reads_the_slots_the_dense_kernel_reads(platform, page):
    """GPU pages of 4 slots (a loop step gathers 16 of them, past the table's end in the
    last) and of 128 (a step is one page, more than a dense step's slots); TPU pages of 16
    (a program a page). Rows: no prefix, one ending mid-page, one at a page's end, the whole
    table; a window of 9 slots, a soft-cap. (No floor: the next test's tree case.)"""
    rng = np.random.default_rng(1)
    B, T, G, R, D = 4, 3, 2, 2, 16
    W = 5 if page < 128 else 3
    S = W * page
    P = B * W + 3
    qg = jnp.asarray(rng.standard_normal((B, T, G, R, D)), jnp.float32)
    rows = [jnp.asarray(rng.standard_normal((B, G, S, D)), jnp.float32) for _ in range(2)]
    table = _table(B, W, P, seed=2)
    pools = [_pool(r, table, P, page) for r in rows]
    prefix = jnp.array([0, S // 2 + 1, 2 * page, S], jnp.int32)
    floor = jnp.asarray(np.array(prefix)[:, None] - 9 + np.arange(T)[None, :] - 1, jnp.int32)  # a window of 9
    block = pk.BLOCK if platform == "gpu" else pk.TPU_BLOCK
    dense = [jnp.pad(r, ((0, 0), (0, 0), (0, -S % block), (0, 0))) for r in rows]  # whole dense blocks
    want = pk.state(platform, qg, *dense, prefix, floor, 0.3, 3.0, interpret=True)
    got = jax.jit(lambda q, k, v, n, f, t: pk.state(platform, q, k, v, n, f, 0.3, 3.0, interpret=True, pages=t))(
        qg, *pools, prefix, floor, table)
    for name, g, w in zip(("max", "sum", "output"), got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5, err_msg=name)
    assert np.all(np.asarray(got[1])[0] == 0) and np.all(np.asarray(got[2])[0] == 0)  # no prefix: nothing seen


@pytest.mark.parametrize("kind", ["window", "tree"])
def test_cached_attention_over_pages_takes_the_kernel_and_equals_the_portable_path(kind):
    """A pass of 5 queries a row (4 heads over 2 kv heads, head_dim 128, pages of 16) through
    `cached_attention` with kernels: each platform's paged kernel (interpreted) gives the
    portable paged path's output and one softmax's over the written row buffers."""
    cap = 3.0 if kind == "window" else None
    args, want = _split_case(kind, cap, S=64, D=128)
    q, k, v, mask, cache_k, cache_v, prefix, floor, scale, cap = args
    page, P = 16, 12
    table = _table(2, 64 // page, P, seed=3)
    pools = [_pool(c, table, P, page) for c in (cache_k, cache_v)]
    portable = jax.jit(lambda *a: attn.cached_attention(*a, scale, cap, backend=Backend("cpu"), pages=table))(
        q, k, v, mask, *pools, prefix, floor)
    np.testing.assert_allclose(np.asarray(portable), np.asarray(want), atol=2e-5, rtol=0)
    for platform in ("gpu", "tpu"):
        fn = jax.jit(lambda *a: attn.cached_attention(*a, scale, cap, backend=Backend(platform), kernels=True,
                                                      interpret=True, pages=table))
        traced = fn.trace(q, k, v, mask, *pools, prefix, floor)
        assert "specjax_paged_prefix_attention" in str(traced.jaxpr)
        got = traced.lower().compile()(q, k, v, mask, *pools, prefix, floor)
        np.testing.assert_allclose(np.asarray(got), np.asarray(portable), atol=2e-5, rtol=0, err_msg=platform)


def test_the_paged_kernel_applies_to_pages_of_its_platform():
    """A GPU's: head_dim a power of two >= 16, pages a power of two (any table width); a TPU's:
    head_dim a multiple of 128, pages a multiple of 16 slots. Elsewhere, portably, or where it
    does not apply: the portable paged path (no kernel)."""
    assert pk.applies("gpu", 16 * 5, 2, 64, page=16) and pk.applies("gpu", 256 * 3, 2, 64, page=256)
    assert not pk.applies("gpu", 24 * 4, 2, 64, page=24)
    assert pk.applies("tpu", 16 * 5, 2, 128, page=16) and pk.applies("tpu", 32 * 3, 1, 256, page=32)
    assert not pk.applies("tpu", 8 * 4, 2, 128, page=8) and not pk.applies("tpu", 16 * 4, 2, 64, page=16)
    assert not pk.applies("cpu", 16 * 4, 2, 128, page=16)
    table = jnp.zeros((2, 5), jnp.int32)
    pool = (9, 2, 16, 128)  # [P, G, page, D]
    assert attn._prefix_kernel(Backend("tpu"), 2, pool, None, 1.0, None, False, table) is not None
    assert attn._prefix_kernel(Backend("gpu"), 2, pool, None, 1.0, None, False, table) is not None
    for backend in (Backend("cpu"), Backend("tpu", portable=True)):
        assert attn._prefix_kernel(backend, 2, pool, None, 1.0, None, False, table) is None
    assert attn._prefix_kernel(Backend("tpu"), 2, (9, 2, 8, 128), None, 1.0, None, False, table) is None


def test_a_consecutive_paged_write_is_the_scatter():
    """cache.write's consecutive form over pages (a TPU's: a token's entry a
    dynamic_update_slice) writes what the scatter writes, rows crossing a page's end included;
    a row's slots past its table go to the null page 0 (the scatter drops them), nowhere else."""
    rng = np.random.default_rng(4)
    B, T, G, D, page, W, P = 3, 5, 2, 8, 4, 4, 16
    table = _table(B, W, P, seed=5)
    pool = jnp.asarray(rng.standard_normal((P, G, page, D)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((B, T, G, D)), jnp.float32)
    slots = jnp.asarray([[0, 1, 2, 3, 4], [6, 7, 8, 9, 10], [13, 14, 15, 16, 17]], jnp.int32)  # row 2: 2 past W page
    want = kv.write(pool, new, slots, pages=table)
    got = jax.jit(lambda *a: kv.write(*a, consecutive=True, pages=table))(pool, new, slots)
    np.testing.assert_array_equal(np.asarray(got)[1:], np.asarray(want)[1:])
    np.testing.assert_array_equal(np.asarray(got)[0, :, :2], np.asarray(new)[2, 3:].transpose(1, 0, 2))
    np.testing.assert_array_equal(np.asarray(got)[0, :, 2:], np.asarray(pool)[0, :, 2:])


_SHARDED = """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from specjax import sharding
    from specjax import cache as kv
from specjax.backend import Backend
    from specjax.models import attention as attn
    from tests.test_long_context import _split_case
    from tests.test_paged_kernels import _pool, _table
    args, want = _split_case("causal", None, S=64, D=128)
    q, k, v, mask, cache_k, cache_v, prefix, floor, scale, cap = args
    table = _table(2, 4, 12, seed=3)
    pools = [_pool(c, table, 12, 16) for c in (cache_k, cache_v)]
    mesh = sharding.make_mesh(2, 2)
    for platform in ("gpu", "tpu"):
        backend = Backend(platform, mesh)
        fn = jax.jit(lambda *a: attn.cached_attention(*a, scale, cap, backend=backend, kernels=True, interpret=True,
                                                      rules=tuple(sharding.DEFAULT_RULES), pages=table))
        jaxpr = str(fn.trace(q, k, v, mask, *pools, prefix, floor).jaxpr)
        assert "shard_map" in jaxpr and "specjax_paged_prefix_attention" in jaxpr, platform
        got = fn(q, k, v, mask, *pools, prefix, floor)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0, err_msg=platform)
    print("ok")
"""


@pytest.mark.slow
def test_a_sharded_paged_pass_runs_the_kernel_under_shard_map():
    """On a (data 2, model 2) mesh of 4 emulated CPU devices (a subprocess): each device runs
    the paged kernel on its rows' tables and its kv heads of the pools (every page whole on
    each), and the pass equals one softmax over the row buffers."""
    root = Path(__file__).parent.parent
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_SHARDED)], cwd=root, capture_output=True,
                            text=True, timeout=300, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
