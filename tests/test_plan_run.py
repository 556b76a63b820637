"""The wrapper convention shared by PagedDecoder and PagedPrefiller (CPU, NumPy backend):
``plan()`` returns the wrapper, plans own copies of the caller's host arrays, and ``run``
takes the same keywords (``out``, ``lse``, ``return_lse``)."""
import numpy as np
import pytest

import cupaged

HQ, HK, D, BS, NB = 4, 2, 64, 4, 12


def _caches(rng):
    shape = (NB, BS, HK, D)
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


def _tables():
    return np.array([[3, 7, 1], [0, 5, 9]], np.int32), np.array([9, 6], np.int32)


def test_decoder_plan_returns_self_and_owns_its_arrays(rng):
    kc, vc = _caches(rng)
    bt, sl = _tables()
    q = rng.standard_normal((2, HQ, D)).astype(np.float32)
    dec = cupaged.PagedDecoder(HQ, HK, D, BS, dtype=np.float32, xp=np, layout="NHD")
    assert dec.plan(bt, sl) is dec
    want = cupaged.paged_decode(q, kc, vc, bt.copy(), sl.copy(), layout="NHD")
    bt[:] = 11
    sl[:] = 1
    np.testing.assert_allclose(dec.run(q, kc, vc), want)


def test_prefiller_plan_returns_self_and_owns_its_arrays(rng):
    kc, vc = _caches(rng)
    bt, sl = _tables()
    cu = np.array([0, 3, 5], np.int32)
    q = rng.standard_normal((5, HQ, D)).astype(np.float32)
    pre = cupaged.PagedPrefiller(HQ, HK, D, BS, dtype=np.float32, layout="NHD")
    assert pre.plan(cu, bt, sl) is pre
    want = cupaged.paged_prefill(q, kc, vc, cu.copy(), bt.copy(), sl.copy(), layout="NHD")
    bt[:] = 11
    sl[:] = 1
    cu[:] = 0
    np.testing.assert_allclose(pre.run(q, kc, vc), want)


@pytest.mark.parametrize("wrapper", ["decoder", "prefiller"])
def test_run_writes_the_lse_buffer(rng, wrapper):
    kc, vc = _caches(rng)
    bt, sl = _tables()
    if wrapper == "decoder":
        q = rng.standard_normal((2, HQ, D)).astype(np.float32)
        w = cupaged.PagedDecoder(HQ, HK, D, BS, dtype=np.float32, xp=np, layout="NHD").plan(bt, sl)
    else:
        q = rng.standard_normal((5, HQ, D)).astype(np.float32)
        w = cupaged.PagedPrefiller(HQ, HK, D, BS, dtype=np.float32, layout="NHD").plan(
            np.array([0, 3, 5], np.int32), bt, sl)
    out, want_lse = w.run(q, kc, vc, return_lse=True)
    lse = np.full(q.shape[:2], np.nan, np.float32)
    got = w.run(q, kc, vc, lse=lse)
    np.testing.assert_allclose(got, out)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    got, got_lse = w.run(q, kc, vc, lse=lse, return_lse=True)
    assert got_lse is lse
    with pytest.raises(TypeError):
        w.run(q, kc, vc, None)  # everything past the caches is a keyword
