"""The device plans of kernels_cu/plan.cu against their host specifications.

decode_plan_kernel must write exactly the descriptors and piece info of
``decode_plan.equal_share_plan``; prefill_plan_kernel the items of
``prefill_plan.work_list`` (as a set: items of one cost may come in any order), each
section of kv heads longest first, the rest of its capacity padded with sequence -1.
"""
import numpy as np
import pytest

import cupaged
from cupaged.decode import plan as dp
from cupaged.prefill import launch as prefill, plan as pp
from cupaged.core.arrays import bfloat16


def device_bf16(cp, shape):
    """Random bfloat16 drawn on the device (float32 normals cut to their top 16 bits): the
    caches the plan tests launch over hold up to 10^9 elements, whose host draws and
    conversion took most of their time; the plans do not depend on the values."""
    x = cp.random.standard_normal(shape, dtype=np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(bfloat16)


def tables_for(rng, lens, bs, append=0, spare=5):
    need = -(-(np.asarray(lens, np.int64) + append) // bs)
    width = int(need.max(initial=0)) + 2
    ids = rng.permutation(int(need.sum()) + spare).astype(np.int32)
    tables = np.full((len(lens), width), -1, np.int32)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[start:start + n]
        start += n
    return tables, int(need.sum()) + spare


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pages", "staged"])
@pytest.mark.parametrize("lens, append, window", [
    ([2048], False, -1), ([70001], True, -1), ([5, 0, 4097, 63, 1], False, 100),
    (list(range(0, 6000, 37)), True, -1), ([8192] * 64, False, -1), ([1, 1, 1], True, 0)],
    ids=["b1", "b1-long-append", "b5-window", "b163-append", "b64", "b3-window0"])
def test_decode_plan_matches_host(rng, cp, backend, lens, append, window):
    if backend == "pages" and int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("cp.async.bulk needs sm_90")
    hq, hk, d, bs = 32, 8, 128, 16
    lens = np.asarray(lens, np.int32)
    tables, nb = tables_for(rng, lens, bs, int(append))
    dec = cupaged.PagedDecoder(hq, hk, d, bs, dtype=bfloat16, window_left=window,
                               max_batch=len(lens) + 3, backend=backend, layout="NHD")
    dec.plan(cp.asarray(tables), cp.asarray(lens), append=append)
    kc, vc = (device_bf16(cp, (nb, bs, hk, d)) for _ in range(2))
    q = cp.asarray(rng.standard_normal((len(lens), hq, d), np.float32).astype(bfloat16))
    new = {}
    if append:
        new = {n: cp.asarray(rng.standard_normal((len(lens), hk, d), np.float32)
                             .astype(bfloat16)) for n in ("k_new", "v_new")}
    dec.run(q, kc, vc, **new)
    cp.cuda.Device().synchronize()
    lp = dec._step.device.launch
    lay = dp.DeviceIndex(dec.max_batch, lp.columns)
    desc, info, _ = dp.equal_share_plan(lp, lens, append, window, dec.merge)
    index = dec._index.get()
    got = index[:lay.info].reshape(-1, dp.DESC_INTS)
    np.testing.assert_array_equal(got[:len(desc)], desc)
    np.testing.assert_array_equal(index[lay.info:lay.info + 2 * len(lens)], info.ravel())
    np.testing.assert_array_equal(index[lay.lens:lay.lens + len(lens)], lens)
    cupaged.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("q_lens, kv_extra, causal, window", [
    ([8192, 8192], 0, True, -1), ([1, 63, 64, 65, 1000, 0, 4097], 7, True, 300),
    ([1] * 40 + [2000], 3000, True, -1), ([513, 77], 0, False, -1)],
    ids=["b2", "odd", "mixed", "noncausal"])
def test_prefill_work_matches_host(rng, cp, paged, q_lens, kv_extra, causal, window):
    q_lens = np.asarray(q_lens, np.int32)
    kv_lens = q_lens + kv_extra
    hq, hk, d, bs = 32, 8, 128, 16
    tile = pp.launch_tile(bfloat16, d)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pad = 5  # padding rows past cu_q[-1]
    q = cp.zeros((int(cu_q[-1]) + pad, hq, d), bfloat16)
    out = cp.full(q.shape, np.nan, bfloat16)
    opts = cupaged.core.checks.check_options(cp, hq, d, window_left=window)
    if paged:
        tables, nb = tables_for(rng, kv_lens, bs)
        work, heads = prefill._device_work(q, out, None, cp.asarray(cu_q), cp.asarray(kv_lens.astype(np.int32)),
                                    cp.asarray(tables), bs, nb, 0, hk, tile, causal, opts)
    else:
        cu_k = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
        work, heads = prefill._device_work(q, out, None, cp.asarray(cu_q), cp.asarray(cu_k), None, 1,
                                    0, int(cu_k[-1]), hk, tile, causal, opts)
    got = work.get()
    want = pp.work_list(q_lens, kv_lens, group=hq // hk, num_kv_heads=hk, tile=tile,
                        causal=causal, window_left=window, section_heads=heads)
    n = len(want)
    assert got.shape[0] == prefill.work_capacity(q.shape[0], len(q_lens), hq // hk, hk,
                                                 tile.block_m)
    assert (got[n:, 0] == -1).all()
    as_set = lambda w: sorted(map(tuple, w.tolist()))
    assert as_set(got[:n]) == as_set(want)
    per_head = n // hk
    for h0 in range(0, hk, heads):  # each section: its heads' items, longest first
        hs = min(heads, hk - h0)
        part = got[per_head * h0:per_head * (h0 + hs)]
        assert as_set(part) == as_set(want[per_head * h0:per_head * (h0 + hs)])
        assert (part[:, 1] == np.tile(np.arange(h0, h0 + hs), per_head)).all()
        cost = pp.item_tiles(part[::hs, 0], part[::hs, 2].astype(np.int64), q_lens, kv_lens,
                             group=hq // hk, tile=tile, causal=causal, window_left=window)
        assert (np.diff(cost) <= 0).all()
    assert not cp.isnan(out[int(cu_q[-1]):].astype(cp.float32)).any()  # padding zeroed
    assert float(cp.abs(out[int(cu_q[-1]):].astype(cp.float32)).max()) == 0.0
    cupaged.check_errors()
