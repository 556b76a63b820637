"""paged_attention's split of mixed batches (docs/prefill.md, "Mixed batches"): decode rows
on the split-KV decode launch through a row map, the other rows on the prefill launch.

CPU: the host twin of the split (``prefill.plan.decode_rows``, the work list without decode
rows, the split capacity bound) and the flag's checks.
GPU (``gpu`` marker): mixed batches against the float64 reference (outputs and LSE poisoned
first, so an unwritten element fails), every layout, page sizes 1 / 16 / 128, odd lengths,
empty rows, GQA / MQA, every score feature, head sizes and dtypes, fp8 caches, strict mode,
bad device indices, padding rows, PagedPrefiller (host and device plans).
"""
import numpy as np
import pytest

import cupaged
from cupaged.core import errors
from cupaged.core.arrays import HEAD_DIMS, bfloat16
from cupaged.core.layouts import LAYOUTS
from cupaged.prefill import launch as launch_
from cupaged.prefill import plan as plan_
from cupaged.reference import attention as ref
from test_prefill import FEATURES, _feature_opts, _rand, assert_close, paged, ragged

# decode rows (q_len 1) at the odd lengths, prefill chunks, an empty row (q_len 0), a decode
# row without keys, a chunk longer than its keys
ODD_Q = [1, 1, 1, 1, 1, 1, 0, 200, 1, 65, 1, 3]
ODD_KV = [1, 63, 64, 65, 1000, 4097, 30, 1000, 0, 65, 129, 1]


# ----------------------------------------------------------------------------- CPU
def test_decode_rows_is_the_host_twin_of_the_split():
    cu = np.array([0, 1, 5, 5, 6, 9, 10], np.int32)  # q_lens 1, 4, 0, 1, 3, 1
    q_lens, rows = plan_.decode_rows(cu)
    np.testing.assert_array_equal(q_lens, [0, 4, 0, 0, 3, 0])
    np.testing.assert_array_equal(rows, [0, -1, -1, 5, -1, 9])
    assert rows.dtype == np.int32


@pytest.mark.parametrize("group", [1, 4, 32])
def test_split_work_list_holds_only_prefill_rows_and_fits_the_capacity(rng, group):
    q_lens = np.array([1, 1, 37, 1, 0, 300, 1, 2])
    kv_lens = q_lens + rng.integers(0, 500, len(q_lens))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    split_lens, rows = plan_.decode_rows(cu)
    tile = plan_.default_tile(128)
    items = plan_.work_list(split_lens, kv_lens, group=group, num_kv_heads=2, tile=tile,
                            causal=True, window_left=-1)
    assert set(items[:, 0]) == {2, 5, 7}
    assert (rows[q_lens == 1] == cu[:-1][q_lens == 1]).all() and (rows[q_lens != 1] == -1).all()
    cap = launch_.work_capacity(int(cu[-1]), len(q_lens), group, 2, tile.block_m, split=True)
    assert len(items) <= cap <= launch_.work_capacity(int(cu[-1]), len(q_lens), group, 2,
                                                      tile.block_m)


def test_split_decode_flag_is_checked(rng):
    q, k, v, cu_q, cu_k = ragged(rng, [1, 3], [5, 3], 4, 2, 64, np.float32)
    kc, vc, bt, sl = paged(rng, k, v, cu_k, "NHD", 4)
    with pytest.raises(TypeError, match="split_decode"):
        cupaged.paged_attention(q, kc, vc, cu_q, bt, sl, layout="NHD", split_decode=1)
    with pytest.raises(TypeError, match="split_decode"):
        cupaged.PagedPrefiller(4, 2, 64, 4, dtype=np.float32, split_decode="yes")
    a = cupaged.paged_attention(q, kc, vc, cu_q, bt, sl, layout="NHD")
    b = cupaged.paged_attention(q, kc, vc, cu_q, bt, sl, layout="NHD", split_decode=False)
    np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- GPU
def _dev(cp, x):
    return cp.asarray(x) if isinstance(x, np.ndarray) else x


def check_mixed(cp, rng, q_lens, kv_lens, *, hq=8, hk=2, d=128, dtype=bfloat16, layout="NHD",
                block_size=16, extra_rows=0, split_decode=True, validate=None, **opts):
    """paged_attention on the device (out and LSE poisoned) against the float64 reference;
    ``extra_rows`` padding rows past the last prefix must come out as zeros."""
    q_scale = opts.pop("q_scale", 1.0)
    q, k, v, cu_q, cu_k = ragged(rng, q_lens, kv_lens, hq, hk, d, dtype)
    q = (q.astype(np.float32) * q_scale).astype(dtype)
    if extra_rows:
        q = np.concatenate([q, _rand(rng, (extra_rows, hq, d), dtype)])
    kc, vc, bt, sl = paged(rng, k, v, cu_k, layout, block_size)
    want, want_lse = ref.paged_prefill(q, kc, vc, cu_q, bt, sl, layout=layout, return_lse=True,
                                       **opts)
    out = cp.asarray(np.full(q.shape, np.nan, dtype))
    got, lse = cupaged.paged_attention(
        *(cp.asarray(a) for a in (q, kc, vc, cu_q, bt, sl)), layout=layout, out=out,
        return_lse=True, split_decode=split_decode, validate=validate,
        **{n: _dev(cp, a) for n, a in opts.items()})
    cp.cuda.Device().synchronize()
    errors.check_errors()
    assert got is out
    got = got.get()
    assert_close(got, want, dtype)
    lse = lse.get()
    assert not np.isnan(lse).any(), "unwritten LSE"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-3, atol=1e-3)
    one = np.flatnonzero(np.asarray(q_lens) == 1)
    if len(one):  # the decode rows on their own, so that prefill rows cannot hide their error
        rows = cu_q[one]
        assert_close(got[rows], want[rows], dtype)
    if extra_rows:
        assert (np.asarray(got[cu_q[-1]:], np.float32) == 0).all()
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_mixed_odd_lengths_layouts_pages(cp, rng, layout, block_size):
    check_mixed(cp, rng, ODD_Q, ODD_KV, layout=layout, block_size=block_size, extra_rows=5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (32, 8), (32, 1), (12, 4)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_mixed_gqa(cp, rng, layout, heads):
    check_mixed(cp, rng, [1, 300, 1, 1, 64], [4097, 300, 65, 1, 1000], hq=heads[0], hk=heads[1],
                layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_mixed_features(cp, rng, layout, feature):
    opts = _feature_opts(rng, feature, 8)
    check_mixed(cp, rng, [1, 130, 1, 1, 20, 1], [1000, 300, 65, 1, 20, 4097], layout=layout,
                **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32])
def test_gpu_mixed_dtypes_and_head_dims(cp, rng, dtype, head_dim):
    check_mixed(cp, rng, [1, 37, 1, 0, 1], [1000, 50, 64, 7, 0], hq=4, hk=2, d=head_dim,
                dtype=dtype, layout="HND" if head_dim == 64 else "NHD")


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens, kv_lens", [
    ([1] * 70, list(range(1, 71))),          # decode rows only (more than the plan's CTAs)
    ([5, 300, 2], [5, 1000, 2]),             # prefill rows only
    ([0, 0, 1], [3, 0, 9]),                  # one decode row after empty ones
    ([1], [8192]),                           # one long decode row
])
def test_gpu_mixed_one_kind_only(cp, rng, q_lens, kv_lens):
    check_mixed(cp, rng, q_lens, kv_lens, extra_rows=3)


@pytest.mark.gpu
def test_gpu_mixed_split_equals_unsplit_and_strict(cp, rng):
    for kwargs in (dict(split_decode=False), dict(validate=True), dict(split_decode=True)):
        check_mixed(cp, rng, ODD_Q, ODD_KV, hq=32, hk=8, sinks=_rand(rng, 32, np.float32),
                    window_left=700, **kwargs)


@pytest.mark.gpu
def test_gpu_mixed_63_decode_rows_and_a_chunk(cp, rng):
    """Issue 20's shape, scaled down in context: 63 decode rows and one chunk."""
    check_mixed(cp, rng, [1] * 63 + [512], [2048] * 63 + [1024], hq=32, hk=8)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", ["float", "tensor", "heads"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_mixed_fp8(cp, rng, layout, scale):
    from test_prefill_fp8 import check_gpu, fp8_paged
    case, fp8 = fp8_paged(rng, [1, 90, 1, 1, 33, 1], [700, 90, 1, 129, 200, 4097], layout=layout,
                          scale=scale, fmt="fp8_e4m3" if scale != "tensor" else "fp8_e5m2")
    check_gpu(cp, case, fp8, layout, op="paged_attention")
    # host scales: only a float (a NumPy array is refused: a launch cannot take its address)
    check_gpu(cp, case, fp8, layout, op="paged_attention", device_scales=scale != "float",
              sinks=_rand(rng, 8, np.float32), window_left=100)


@pytest.mark.gpu
def test_gpu_mixed_bad_block_id_zeroes_its_row_only(cp, rng):
    q, k, v, cu_q, cu_k = ragged(rng, [1, 40, 1, 1], [300, 40, 200, 64], 8, 2, 128, bfloat16)
    kc, vc, bt, sl = paged(rng, k, v, cu_k, "NHD", 16)
    want = ref.paged_prefill(q, kc, vc, cu_q, bt, sl, layout="NHD")
    bt[2, 3] = kc.shape[0] + 5  # decode row 2 (q row 41) reads a block past the cache
    out = cp.asarray(np.full(q.shape, np.nan, bfloat16))
    got = cupaged.paged_attention(*(cp.asarray(a) for a in (q, kc, vc, cu_q, bt, sl)),
                                  layout="NHD", out=out).get()
    with pytest.raises(errors.DeviceIndexError, match="block_tables"):
        cupaged.check_errors()
    bad = int(cu_q[2])
    assert (np.asarray(got[bad], np.float32) == 0).all()
    keep = np.arange(len(q)) != bad
    assert_close(got[keep], want[keep], bfloat16)


@pytest.mark.gpu
def test_gpu_mixed_bad_prefix_sums_zero_every_row(cp, rng):
    q, k, v, cu_q, cu_k = ragged(rng, [1, 40, 1], [300, 40, 200], 8, 2, 128, bfloat16)
    kc, vc, bt, sl = paged(rng, k, v, cu_k, "NHD", 16)
    cu_q[2] = 0  # decreasing
    out = cp.asarray(np.full(q.shape, np.nan, bfloat16))
    got = cupaged.paged_attention(*(cp.asarray(a) for a in (q, kc, vc, cu_q, bt, sl)),
                                  layout="NHD", out=out).get()
    with pytest.raises(errors.DeviceIndexError, match="cu_seqlens_q"):
        cupaged.check_errors()
    assert (np.asarray(got, np.float32) == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("planner", ["device arrays", "host arrays, device planner", "host plan"])
@pytest.mark.parametrize("split", [True, False])
def test_gpu_prefiller_mixed(cp, rng, planner, split):
    hq, hk, d, bs = 8, 2, 128, 16
    pre = cupaged.PagedPrefiller(hq, hk, d, bs, dtype=bfloat16, layout="vllm",
                                 window_left=300, split_decode=split)
    for q_lens, kv_lens in [(ODD_Q, ODD_KV), ([1, 1, 64], [2048, 5, 64]), ([7], [7])]:
        q, k, v, cu_q, cu_k = ragged(rng, q_lens, kv_lens, hq, hk, d, bfloat16)
        kc, vc, bt, sl = paged(rng, k, v, cu_k, "vllm", bs)
        meta = (cu_q, bt, sl)
        if planner == "device arrays":
            meta = tuple(cp.asarray(a) for a in meta)
        pre.plan(*meta, **(dict(planner="device") if planner.endswith("planner") else {}))
        want, want_lse = ref.paged_prefill(q, kc, vc, cu_q, bt, sl, layout="vllm",
                                           window_left=300, return_lse=True)
        for _ in range(2):
            out = cp.asarray(np.full(q.shape, np.nan, bfloat16))
            lse = cp.asarray(np.full(q.shape[:2], np.nan, np.float32))
            pre.run(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), out=out, lse=lse)
            assert_close(out.get(), want, bfloat16)
            got_lse = lse.get()
            fin = np.isfinite(want_lse)
            assert not np.isnan(got_lse).any()
            np.testing.assert_allclose(got_lse[fin], want_lse[fin], rtol=1e-3, atol=1e-3)
