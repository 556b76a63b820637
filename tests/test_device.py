"""Device memory the library keeps between calls (core.device): per-stream scratch and the
error word live on their own allocations, so that a caller's allocator set for a while (a
CUDA graph's private pool, as the demo's DecodeGraphs uses) cannot free them."""
import gc

import numpy as np
import pytest

from cupaged.core import device


@pytest.mark.gpu
@pytest.mark.parametrize("zero", [False, True])
def test_scratch_made_under_a_private_pool_outlives_it(cp, zero):
    pool = cp.cuda.MemoryPool()
    name = f"test_device.{zero}"
    with cp.cuda.using_allocator(pool.malloc):
        buf = device.scratch(name, 1 << 16, np.int32, zero=zero)
    assert pool.used_bytes() == 0  # nothing of it came from the pool
    if zero:
        assert int(cp.count_nonzero(buf)) == 0
    buf.fill(7)
    del pool
    gc.collect()
    others = [cp.full(1 << 16, -1, np.int32) for _ in range(8)]  # would reuse freed memory
    cp.cuda.Device().synchronize()
    assert device.scratch(name, 1 << 16, np.int32) is buf
    assert int((buf == 7).sum()) == buf.size
    del others


@pytest.mark.gpu
def test_owned_array_shape_dtype_and_zeros(cp):
    a = device.owned_array(1001, np.float32, zero=True)
    assert a.shape == (1001,) and a.dtype == np.float32
    assert float(cp.abs(a).max()) == 0.0
    assert device.owned_array(0, np.int64).shape == (0,)


@pytest.mark.gpu
def test_rope_frequencies_first_made_under_a_private_pool_outlive_it(cp):
    """The RoPE frequency table is cached per process: made first inside a transient pool
    (as the demo's DecodeGraphs warm-up runs), it must not point into that pool once it
    goes."""
    import cupaged
    from cupaged.reference import rope as rref
    rng = np.random.default_rng(5)
    base = 7919.0  # a key no other test makes, so this call makes the table
    q = rng.standard_normal((9, 3, 64)).astype(np.float32)
    k = rng.standard_normal((9, 1, 64)).astype(np.float32)
    pos = rng.integers(0, 4000, 9).astype(np.int32)
    want = rref.apply_rope(pos, q, k, base=base)
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        cupaged.apply_rope(cp.asarray(pos), cp.asarray(q), cp.asarray(k), base=base)
    del pool
    gc.collect()
    others = [cp.full(1 << 16, np.nan, np.float64) for _ in range(8)]  # would reuse freed memory
    got = cupaged.apply_rope(cp.asarray(pos), cp.asarray(q), cp.asarray(k), base=base)
    for g, w in zip(got, want):
        np.testing.assert_allclose(cp.asnumpy(g), w, rtol=1e-5, atol=1e-5)
    del others
