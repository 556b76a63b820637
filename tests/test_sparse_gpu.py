"""GPU tests of cupaged.sparse: every kernel against the float64 reference on fresh random
inputs, outputs poisoned with NaN first. Skipped without a CUDA device."""
import numpy as np
import pytest

from cupaged import sparse
from cupaged.core.arrays import bfloat16
from cupaged.reference import attention as ra
from cupaged.reference import sparse as ref
from cupaged.sparse import index, tiles
from test_sparse_tiles import check_lists

pytestmark = pytest.mark.gpu
TOL = {np.dtype(np.float16): 2e-3, np.dtype(bfloat16): 1e-2}


# the attention kernels on the GPU: the mma.sync one and the sm_90 wgmma one ("auto" is one
# of the two: sparse.launch.use_wgmma)
BACKENDS = ["mma", "wgmma"]


def needs_backend(cp, backend):
    """Skip a wgmma case off sm_90 (the op refuses it there)."""
    if backend == "wgmma" and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma kernels need sm_90")


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _host(cp, x):
    return cp.asnumpy(x)


def _check_close(got, want, dtype, what="out"):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), f"{what}: non-finite values (unwritten?)"
    err = _rel_err(got, want)
    assert err < TOL[np.dtype(dtype)], f"{what}: relative error {err:.3g}"


def _check_top_k(got, scores, forced):
    """``got`` is a valid top-k of ``scores`` up to near-ties, with ``forced`` included."""
    for h in range(scores.shape[0]):
        row = got[h]
        assert (np.diff(row) > 0).all(), "not strictly ascending"
        assert set(range(min(forced, scores.shape[1]))) <= set(row.tolist())
        rest = np.setdiff1d(np.arange(scores.shape[1]), row)
        kept = scores[h, row[row >= forced]]
        if len(rest) and len(kept):
            tol = 1e-4 * scores[h].max() + 1e-6
            assert kept.min() >= scores[h, rest].max() - tol, f"head {h}: not a top-k"


# ----------------------------------------------------------------------------- estimate
@pytest.mark.parametrize("dtype,d,hq,hk,q_len,kv_len,last_q", [
    (np.float16, 128, 4, 2, 300, 300, 64),
    (bfloat16, 128, 8, 2, 200, 1500, 64),
    (np.float16, 64, 2, 2, 40, 5000, 64),
    (bfloat16, 64, 4, 1, 100, 100, 13),
    (np.float16, 80, 2, 1, 129, 129, 64),
    (np.float16, 96, 2, 2, 77, 300, 64),
    (bfloat16, 112, 2, 1, 65, 65, 64),
    (np.float16, 256, 2, 1, 150, 700, 64),
])
def test_estimate_matches_reference(cp, rng, dtype, d, hq, hk, q_len, kv_len, last_q):
    q, k = _rand(rng, (q_len, hq, d), dtype), _rand(rng, (kv_len, hk, d), dtype)
    opts = dict(vertical_size=max(kv_len // 7, 3), slash_size=max(kv_len // 5, 3), last_q=last_q,
                num_sink_tokens=4, num_recent_diags=9)
    v_idx, s_idx = sparse.estimate_vertical_slash(cp.asarray(q), cp.asarray(k), **opts)
    assert v_idx.dtype == s_idx.dtype == np.int32
    want_v, want_s = sparse.estimate_vertical_slash(q, k, **opts)
    assert v_idx.shape == want_v.shape and s_idx.shape == want_s.shape
    vert, slash = ref.estimate_scores(q, k, last_q=last_q)
    _check_top_k(_host(cp, v_idx), vert, 4)
    _check_top_k(_host(cp, s_idx), slash, 9)


@pytest.mark.parametrize("width,k", [(1, 1), (300, 7), (300, 300), (5000, 1000), (131072, 6096)])
def test_top_k_kernel_equals_stable_argsort(cp, rng, width, k):
    """The estimate's top k (radix select): forced +inf entries, ties (to the earlier
    position), -0 and +0 as one value, NaN as -inf, against the reference's stable sort."""
    from cupaged.sparse import estimate
    scores = rng.standard_normal((4, width)).astype(np.float32)
    scores[:, :3] = np.inf
    scores[1, 5::3] = 0.25                     # many ties
    scores[2, ::2] = -0.0
    scores[2, 1::2] = 0.0
    scores[3, 1::5] = np.nan
    out = estimate.top_sorted(cp.asarray(scores), k)
    want = ref._top_sorted(np.where(np.isnan(scores), -np.inf, scores), k)
    np.testing.assert_array_equal(cp.asnumpy(out), want)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_estimate_matches_reference(cp, rng, layout):
    bs, nb, kv_len, q_len = 16, 70, 1000, 200
    q = _rand(rng, (q_len, 4, 128), np.float16)
    cache = _rand(rng, (nb, bs, 2, 128), np.float16)
    table = rng.permutation(nb)[:-(-kv_len // bs)].astype(np.int32)
    k = cache[table].reshape(-1, 2, 128)[:kv_len]
    if layout == "HND":
        cache = np.ascontiguousarray(cache.transpose(0, 2, 1, 3))
    opts = dict(vertical_size=50, slash_size=80, num_sink_tokens=3, num_recent_diags=10)
    v_idx, s_idx = sparse.paged_estimate_vertical_slash(cp.asarray(q), cp.asarray(cache),
                                                        cp.asarray(table), kv_len, layout=layout, **opts)
    vert, slash = ref.estimate_scores(q, k)
    _check_top_k(_host(cp, v_idx), vert, 3)
    _check_top_k(_host(cp, s_idx), slash, 10)


# ----------------------------------------------------------------------------- index
@pytest.mark.parametrize("block_m,block_n", [(64, 64), (128, 64), (64, 32), (100, 48)])
def test_index_kernel_equals_reference(cp, rng, block_m, block_n):
    q_lens = np.array([300, 0, 1, 700], np.int32)
    kv_lens = np.array([300, 50, 64, 1200], np.int32)
    rows_v, rows_s = [], []
    for n in kv_lens:
        rows_v.append(rng.integers(0, n, (3, 40)).astype(np.int32))        # unsorted, duplicates
        rows_s.append(np.concatenate([rng.integers(0, n, (3, 30)),
                                      np.tile(np.arange(5), (3, 1))], axis=1).astype(np.int32))
    v_idx, s_idx = sparse.pad_indices(rows_v), sparse.pad_indices(rows_s)
    s_idx[3, :, 0] = 1300                                               # past kv_len: ignored
    want = sparse.vertical_slash_index(q_lens, v_idx, s_idx, 700, block_m, block_n, kv_seqlens=kv_lens)
    got = sparse.vertical_slash_index(cp.asarray(q_lens), cp.asarray(v_idx), cp.asarray(s_idx), 700,
                                      block_m, block_n, kv_seqlens=cp.asarray(kv_lens))
    for name, g, w in zip(("block_count", "block_offset", "column_count", "column_index"), got, want):
        np.testing.assert_array_equal(_host(cp, g), w, err_msg=name)


def test_index_with_host_bounds_reads_nothing_back_and_reports_bad_lengths(cp, rng):
    """With the key bound on the host (max_kv_len) the conversion equals NumPy's without a
    host read; a length past its bound is reported to the error word, its sequence listed
    empty, the others unchanged."""
    from test_no_sync import assert_no_sync_cupy
    import cupaged
    q_lens = np.array([300, 1, 700], np.int32)
    kv_lens = np.array([333, 64, 1200], np.int32)
    v_idx = sparse.pad_indices([rng.integers(0, n, (2, 30)).astype(np.int32) for n in kv_lens])
    s_idx = sparse.pad_indices([rng.integers(0, n, (2, 50)).astype(np.int32) for n in kv_lens])
    want = sparse.vertical_slash_index(q_lens, v_idx, s_idx, 700, kv_seqlens=kv_lens,
                                       max_kv_len=1500)
    args = [cp.asarray(x) for x in (q_lens, v_idx, s_idx, kv_lens)]
    got = []
    assert_no_sync_cupy(cp, lambda: got.append(sparse.vertical_slash_index(
        *args[:3], 700, kv_seqlens=args[3], max_kv_len=1500)))
    for name, g, w in zip(("block_count", "block_offset", "column_count", "column_index"),
                          got[0], want):
        np.testing.assert_array_equal(_host(cp, g), w, err_msg=name)
    cupaged.check_errors()
    bad = args[3].copy()
    bad[1] = 1501                                                  # past max_kv_len
    got = sparse.vertical_slash_index(*args[:3], 700, kv_seqlens=bad, max_kv_len=1500)
    with pytest.raises(ValueError, match="kv_seqlens"):
        cupaged.check_errors()
    assert not _host(cp, got[0])[1].any() and not _host(cp, got[2])[1].any()
    np.testing.assert_array_equal(_host(cp, got[0])[[0, 2]], want[0][[0, 2]])
    seq = args[0].copy()
    seq[2] = 701                                                   # past context_size
    sparse.vertical_slash_index(seq, *args[1:3], 700, kv_seqlens=args[3], max_kv_len=1500)
    with pytest.raises(ValueError, match="seqlens"):
        cupaged.check_errors()


def _schedule(cp, q_lens, kv_lens, hq):
    """``bsr_prepare``'s schedule of a packed batch (q/k of zeros): ``(meta, cta_bound,
    cu_q)`` on the device."""
    from cupaged.sparse import launch
    cu_q = cp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    cu_k = cp.asarray(np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32))
    q = cp.zeros((int(np.sum(q_lens)), hq, 64), np.float16)
    k = cp.zeros((int(np.sum(kv_lens)), 1, 64), np.float16)
    meta, cta_bound, _ = launch.schedule(q, cp.empty_like(q), None, cu_q, launch.dense_kv(k, k, cu_k),
                                         None, int(k.shape[0]), launch.CTA_ROWS)
    return meta, cta_bound, cu_q


def _batch_rows(rng, kv_lens, heads, nv=40, ns=30, band=70):
    rows_v, rows_s = [], []
    for n in kv_lens:
        rows_v.append(rng.integers(0, n + 2, (heads, nv)).astype(np.int32))   # duplicates, padding
        rows_s.append(np.concatenate([rng.integers(0, n, (heads, ns)),
                                      np.tile(np.arange(band), (heads, 1))], axis=1).astype(np.int32))
    return sparse.pad_indices(rows_v), sparse.pad_indices(rows_s)


@pytest.mark.parametrize("block_m,tile_n", [(64, 64), (128, 64), (64, 32)])
def test_device_tile_lists_cover_the_pattern(cp, rng, block_m, tile_n):
    """vs_prepare + vs_plan_kernel: every 64-row half of every CTA holds its pattern's keys
    once, in a slot of list_bound tiles."""
    q_lens = np.array([300, 0, 1, 700, 129], np.int32)
    kv_lens = np.array([300, 50, 64, 1200, 640], np.int32)
    v_idx, s_idx = _batch_rows(rng, kv_lens, 3)
    meta, cta_bound, _ = _schedule(cp, q_lens, kv_lens, 3)
    max_kv = int(kv_lens.sum())
    prep = index.prepare(cp.asarray(v_idx), cp.asarray(s_idx), meta[1:], block_m, q_lens=meta[3:],
                         len_stride=4)
    (lists,) = tiles.vs_lists(prep, None, meta, len(q_lens), cta_bound, max_kv, 64, tile_n)
    assert lists.cap == tiles.list_bound(max_kv, v_idx.shape[2], s_idx.shape[2], block_m, tile_n)
    counts = _host(cp, lists.counts)
    t_all = _host(cp, lists.tiles)[:3 * cta_bound * lists.cap].reshape(3 * cta_bound, lists.cap, 2)
    cols, vcount, m = _host(cp, lists.cols), _host(cp, prep.v_count), _host(cp, meta)
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        assert m[4 * b + 1] == kv_len and m[4 * b + 3] == q_len
        bc, bo, cc, ci = ref.vertical_slash_index([q_len], v_idx[b:b + 1], s_idx[b:b + 1],
                                                  max(q_len, 1), block_m, 64, kv_seqlens=[kv_len])
        masks = ref.vertical_slash_mask(bc[0], bo[0], cc[0], ci[0], q_len, kv_len, block_m, 64)
        for h in range(3):
            def list_of(c, b=b, h=h):
                item = h * cta_bound + m[4 * b + 2] + c
                return t_all[item, :counts[item]], cols[b, h, :vcount[b, h]]
            check_lists(list_of, -(-int(q_len) // 128), masks[h], int(q_len), int(kv_len), tile_n)


@pytest.mark.parametrize("block_m,block_n", [(64, 64), (128, 32), (192, 100)])
def test_device_dense_decision_equals_reference(cp, rng, block_m, block_n):
    """vs_prepare's dense flags are reference.sparse.dense_heads', bit for bit, on bands
    (sparse) and spread slashes (dense) in odd lengths."""
    q_lens = np.array([333, 0, 1, 517, 129], np.int32)
    kv_lens = np.array([400, 17, 64, 517, 900], np.int32)
    v_idx, s_idx = _batch_rows(rng, kv_lens, 4, nv=30, ns=0, band=25)
    for b, n in enumerate(kv_lens):                   # heads 1 and 3 spread: most blocks
        for h in (1, 3):
            s_idx[b, h, :25] = np.arange(25) * (n // 25 + 1)
    meta, _, _ = _schedule(cp, q_lens, kv_lens, 4)
    prep = index.prepare(cp.asarray(v_idx), cp.asarray(s_idx), meta[1:], block_m, q_lens=meta[3:],
                         len_stride=4, block_n=block_n, dense_threshold=sparse.DENSE_THRESHOLD)
    got = _host(cp, prep.dense).astype(bool)
    want = np.zeros_like(got)
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        bc, _, cc, _ = ref.vertical_slash_index([q_len], v_idx[b:b + 1], s_idx[b:b + 1],
                                                max(q_len, 1), block_m, block_n, kv_seqlens=[kv_len])
        want[b] = ref.dense_heads(bc[0], cc[0], int(q_len), int(kv_len), block_m, block_n,
                                  sparse.DENSE_THRESHOLD)
    np.testing.assert_array_equal(got, want)
    assert want.any() and not want.all()


# ----------------------------------------------------------------------------- attention
def _random_pattern(rng, hq, kv_len, nv, ns, recent=8):
    v_idx = np.sort(np.stack([rng.choice(kv_len, nv, replace=False) for _ in range(hq)]), axis=1)
    s_idx = np.stack([np.union1d(np.arange(recent), rng.choice(kv_len, ns, replace=False))[:ns]
                      for _ in range(hq)])
    return v_idx.astype(np.int32), np.sort(s_idx, axis=1).astype(np.int32)


def _vs_gpu(cp, q, k, v, v_idx, s_idx, **kw):
    needs_backend(cp, kw.get("backend", "auto"))
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    got, lse = sparse.vertical_slash_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v),
                                               cp.asarray(v_idx), cp.asarray(s_idx), out=out,
                                               return_lse=True, **kw)
    assert got is out
    return _host(cp, got), _host(cp, lse)


@pytest.mark.parametrize("dtype,d,hq,hk,q_len,kv_len,sinks", [
    (np.float16, 64, 4, 2, 333, 333, False),
    (bfloat16, 64, 2, 1, 200, 450, True),
    (np.float16, 80, 2, 2, 130, 130, False),
    (bfloat16, 96, 3, 1, 250, 300, True),
    (np.float16, 112, 2, 1, 64, 64, True),
    (np.float16, 128, 8, 2, 500, 777, True),
    (bfloat16, 128, 4, 4, 321, 321, False),
    (bfloat16, 256, 2, 1, 190, 260, True),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_vertical_slash_matches_reference(cp, rng, dtype, d, hq, hk, q_len, kv_len, sinks, backend):
    q, k, v = (_rand(rng, s, dtype) for s in ((q_len, hq, d), (kv_len, hk, d), (kv_len, hk, d)))
    v_idx, s_idx = _random_pattern(rng, hq, kv_len, 20, 12)
    sk = rng.standard_normal(hq).astype(np.float32) if sinks else None
    got, lse = _vs_gpu(cp, q, k, v, v_idx, s_idx, sinks=None if sk is None else cp.asarray(sk),
                       backend=backend)
    want, want_lse = sparse.vertical_slash_attention(q.astype(np.float32), k.astype(np.float32),
                                                     v.astype(np.float32), v_idx, s_idx, sinks=sk,
                                                     return_lse=True)
    _check_close(got, want, dtype)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_full_pattern_equals_dense(cp, rng, dtype):
    q_len, kv_len = 260, 400
    q, k, v = (_rand(rng, s, dtype) for s in ((q_len, 4, 128), (kv_len, 2, 128), (kv_len, 2, 128)))
    s_all = np.tile(np.arange(kv_len, dtype=np.int32), (4, 1))
    got, lse = _vs_gpu(cp, q, k, v, s_all[:, :2].copy(), s_all)
    want, want_lse = ra.attend(q, k, v, causal=True)
    _check_close(got, want, dtype)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype,d,hq,hk,q_len,kv_len", [
    (np.float16, 64, 4, 2, 333, 333),
    (bfloat16, 128, 8, 2, 300, 700),
    (bfloat16, 256, 2, 1, 200, 200),
])
def test_full_pattern_equals_dense_prefill(cp, rng, dtype, d, hq, hk, q_len, kv_len):
    """The sparse kernel on a full pattern and the dense prefill kernel share their tile core
    (attn_tile.cuh): same rows, LSE included."""
    import cupaged
    q, k, v = (_rand(rng, s, dtype) for s in ((q_len, hq, d), (kv_len, hk, d), (kv_len, hk, d)))
    s_all = np.tile(np.arange(kv_len, dtype=np.int32), (hq, 1))
    sk = rng.standard_normal(hq).astype(np.float32)
    got, lse = _vs_gpu(cp, q, k, v, s_all[:, :1].copy(), s_all, sinks=cp.asarray(sk))
    cu_q, cu_k = (cp.asarray(np.array([0, n], np.int32)) for n in (q_len, kv_len))
    want, want_lse = cupaged.varlen_prefill(cp.asarray(q), cp.asarray(k), cp.asarray(v), cu_q, cu_k,
                                            causal=True, sinks=cp.asarray(sk), return_lse=True)
    want = _host(cp, want).astype(np.float64)
    assert np.isfinite(got).all() and _rel_err(got, want) < 2 * TOL[np.dtype(dtype)]  # two roundings
    np.testing.assert_allclose(lse, _host(cp, want_lse), rtol=1e-3, atol=1e-3)


def test_band_pattern_and_scales(cp, rng):
    """A band of recent diagonals plus sinks (shared tiles, edge tiles, one column tile), with a
    positive, a negative and a zero scale."""
    q_len = kv_len = 1500
    q = _rand(rng, (q_len, 4, 128), bfloat16)
    k, v = (_rand(rng, (kv_len, 2, 128), bfloat16) for _ in range(2))
    v_idx = np.tile(np.array([0, 1, 2, 3, 700], np.int32), (4, 1))
    s_idx = np.tile(np.concatenate([np.arange(300), [555, 1000]]).astype(np.int32), (4, 1))
    for scale in (0.05, -0.07, 0.0):
        got, lse = _vs_gpu(cp, q, k, v, v_idx, s_idx, sm_scale=scale)
        want, want_lse = sparse.vertical_slash_attention(
            q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), v_idx, s_idx,
            sm_scale=scale, return_lse=True)
        _check_close(got, want, bfloat16)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-3, atol=1e-3)


def test_block_sizes_and_empty_rows(cp, rng):
    """block_m 128 / block_n 32; and a head with an empty pattern (zeros, LSE -inf or sink)."""
    q, k, v = (_rand(rng, (300, 2, 64), np.float16) for _ in range(3))
    v_idx, s_idx = _random_pattern(rng, 2, 300, 15, 10)
    for bm, bn in ((128, 32), (64, 100)):
        got, _ = _vs_gpu(cp, q, k, v, v_idx, s_idx, block_m=bm, block_n=bn)
        want = sparse.vertical_slash_attention(q, k, v, v_idx, s_idx, block_m=bm, block_n=bn)
        _check_close(got, want, np.float16)
    pad = np.full((2, 3), sparse.PAD, np.int32)
    sk = np.array([0.5, -1.0], np.float32)
    got, lse = _vs_gpu(cp, q, k, v, pad, pad, sinks=cp.asarray(sk))
    assert (got == 0).all() and np.allclose(lse, np.broadcast_to(sk, lse.shape))
    got, lse = _vs_gpu(cp, q, k, v, pad, pad)
    assert (got == 0).all() and np.isneginf(lse).all()


def test_batched_equals_per_sequence(cp, rng):
    q_lens, kv_lens = [100, 0, 64, 257], [300, 40, 64, 257]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = _rand(rng, (cu_q[-1], 4, 128), bfloat16)
    k, v = (_rand(rng, (cu_k[-1], 2, 128), bfloat16) for _ in range(2))
    pats = [_random_pattern(rng, 4, n, min(n, 17), min(n, 9 + b)) for b, n in enumerate(kv_lens)]
    v_idx = sparse.pad_indices([p[0] for p in pats])
    s_idx = sparse.pad_indices([p[1] for p in pats])
    dev = [cp.asarray(x) for x in (q, k, v, v_idx, s_idx, cu_q, cu_k)]
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    sparse.vertical_slash_attention(*dev[:5], cu_seqlens_q=dev[5], cu_seqlens_k=dev[6], out=out)
    out = _host(cp, out)
    for b in range(4):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if q_lens[b]:
            one, _ = _vs_gpu(cp, q[rows], k[keys], v[keys], *pats[b])
            np.testing.assert_array_equal(out[rows], one)


def _paged(rng, k, v, cu_k, bs, num_blocks, layout, cp, top=False):
    """Scatter packed keys/values into a fresh cache; blocks at the top when ``top``."""
    b = len(cu_k) - 1
    lens = np.diff(cu_k)
    need = [-(-int(n) // bs) for n in lens]
    hk, d = k.shape[1:]
    ids = (num_blocks - 1 - rng.permutation(sum(need))) if top else rng.permutation(num_blocks)[:sum(need)]
    tables = np.full((b, max(need) + 2), -1, np.int32)
    shape = (num_blocks, bs, hk, d) if layout == "NHD" else (num_blocks, hk, bs, d)
    kc, vc = cp.zeros(shape, k.dtype), cp.zeros(shape, k.dtype)
    used = 0
    for s in range(b):
        for i in range(need[s]):
            blk, n, r0 = int(ids[used]), min(bs, int(lens[s]) - i * bs), cu_k[s] + i * bs
            tables[s, i], used = blk, used + 1
            for cache, src in ((kc, k), (vc, v)):
                rows = cp.asarray(src[r0:r0 + n])
                if layout == "NHD":
                    cache[blk, :n] = rows
                else:
                    cache[blk, :, :n] = rows.transpose(1, 0, 2)
    return kc, vc, tables


@pytest.mark.bigmem
@pytest.mark.parametrize("layout,big,bs", [("NHD", False, 16), ("HND", False, 16), ("NHD", True, 16),
                                           ("HND", False, 24)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_equals_dense(cp, rng, layout, big, bs, backend):
    needs_backend(cp, backend)
    q_lens, kv_lens = [70, 128, 1], [500, 128, 33]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = _rand(rng, (cu_q[-1], 8, 128), np.float16)
    k, v = (_rand(rng, (cu_k[-1], 2, 128), np.float16) for _ in range(2))
    num_blocks = (2 ** 31) // (bs * 2 * 128) + 64 if big else 80      # > 2^31 elements when big
    kc, vc, tables = _paged(rng, k, v, cu_k, bs, num_blocks, layout, cp, top=big)
    pats = [_random_pattern(rng, 8, n, min(n, 20), min(n, 12)) for n in kv_lens]
    v_idx = sparse.pad_indices([p[0] for p in pats])
    s_idx = sparse.pad_indices([p[1] for p in pats])
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    sparse.paged_vertical_slash_attention(cp.asarray(q), kc, vc, cp.asarray(v_idx), cp.asarray(s_idx),
                                          cp.asarray(cu_q), cp.asarray(tables),
                                          cp.asarray(np.array(kv_lens, np.int32)), layout=layout, out=out,
                                          backend=backend)
    dense = cp.full(q.shape, np.nan, dtype=q.dtype)
    sparse.vertical_slash_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(v_idx),
                                    cp.asarray(s_idx), cu_seqlens_q=cp.asarray(cu_q),
                                    cu_seqlens_k=cp.asarray(cu_k), out=dense, backend=backend)
    np.testing.assert_array_equal(_host(cp, out), _host(cp, dense))
    del kc, vc


def test_long_sequence_rows_match_reference(cp, rng):
    """8K tokens with the seed's adaptive budget: many block and column tiles per row."""
    n, hq, hk, d = 8192, 2, 1, 128
    q, k, v = (_rand(rng, s, bfloat16) for s in ((n, hq, d), (n, hk, d), (n, hk, d)))
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    v_idx, s_idx = sparse.estimate_vertical_slash(dq, dk, vertical_size=1, slash_size=1,
                                                  adaptive_budget=0.05)
    got = _host(cp, sparse.vertical_slash_attention(dq, dk, dv, v_idx, s_idx, dense_threshold=None))
    bc, bo, cc, ci = (_host(cp, x) for x in sparse.vertical_slash_index(
        cp.asarray(np.array([n], np.int32)), v_idx[None], s_idx[None], n))
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    for row in (0, 63, 64, 4095, 5000, n - 1):
        for h in range(hq):
            m = row // 64
            keys = set(int(c) for c in ci[0, h, m, :cc[0, h, m]])
            for st in bo[0, h, m, :bc[0, h, m]]:
                keys |= set(range(int(st), int(st) + 64))
            keys = np.array(sorted(j for j in keys if j <= row))
            s = k64[keys, 0] @ q[row, h].astype(np.float64) / np.sqrt(d)
            w = np.exp(s - s.max())
            want = w @ v64[keys, 0] / w.sum()
            assert _rel_err(got[row, h], want) < 1e-2, (row, h)


# ----------------------------------------------------------------------------- no host read
def _fallback_batch(rng, dtype=bfloat16, hq=6, hk=2, d=128):
    """A packed batch of odd lengths (one empty sequence, 7 padding rows) whose heads 1, 4, ...
    spread their slashes (dense fallback) while the others keep a band and a few columns, and
    the last head of sequence 2 has an empty pattern."""
    q_lens, kv_lens = [733, 0, 1029, 65], [900, 17, 1029, 1000]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = _rand(rng, (cu_q[-1] + 7, hq, d), dtype)
    k, v = (_rand(rng, (cu_k[-1], hk, d), dtype) for _ in range(2))
    rows_v, rows_s = [], []
    for n in kv_lens:
        vr = np.sort(rng.integers(0, n, (hq, 9)), axis=1).astype(np.int32)
        sr = np.tile(np.arange(24, dtype=np.int32), (hq, 1))
        sr[1::3] = np.arange(24) * (n // 24 + 1)
        rows_v.append(vr)
        rows_s.append(sr)
    v_idx, s_idx = sparse.pad_indices(rows_v), sparse.pad_indices(rows_s)
    v_idx[2, hq - 1], s_idx[2, hq - 1] = sparse.PAD, sparse.PAD
    return q, k, v, v_idx, s_idx, cu_q, cu_k


def _fallback_run(cp, q, k, v, v_idx, s_idx, cu_q, cu_k, sinks, **kw):
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    got, lse = sparse.vertical_slash_attention(
        *(cp.asarray(x) for x in (q, k, v, v_idx, s_idx)), cu_seqlens_q=cp.asarray(cu_q),
        cu_seqlens_k=cp.asarray(cu_k), sinks=cp.asarray(sinks), out=out, return_lse=True,
        validate=False, **kw)
    return _host(cp, got), _host(cp, lse)


def test_dense_fallback_for_some_heads_matches_reference(cp, rng):
    """Fallback heads (full causal attention) beside pattern heads, an empty sequence, an
    empty pattern and padding rows, against the float64 reference."""
    q, k, v, v_idx, s_idx, cu_q, cu_k = _fallback_batch(rng)
    sinks = rng.standard_normal(q.shape[1]).astype(np.float32)
    got, lse = _fallback_run(cp, q, k, v, v_idx, s_idx, cu_q, cu_k, sinks)
    n = cu_q[-1]
    f32 = [x.astype(np.float32) for x in (q[:n], k, v)]
    want, want_lse = sparse.vertical_slash_attention(*f32, v_idx, s_idx, cu_seqlens_q=cu_q,
                                                     cu_seqlens_k=cu_k, sinks=sinks, return_lse=True)
    _check_close(got[:n], want, bfloat16)
    np.testing.assert_allclose(lse[:n], want_lse, rtol=1e-3, atol=1e-3)
    assert (got[n:] == 0).all() and np.isneginf(lse[n:]).all()            # padding rows
    rows = slice(cu_q[2], cu_q[3])
    assert (got[rows, 5] == 0).all() and np.allclose(lse[rows, 5], sinks[5])  # empty pattern
    dense = []
    for b in range(4):                                 # the reference's decision is mixed
        ql, kl = int(cu_q[b + 1] - cu_q[b]), int(cu_k[b + 1] - cu_k[b])
        bc, _, cc, _ = ref.vertical_slash_index([ql], v_idx[b:b + 1], s_idx[b:b + 1], max(ql, 1),
                                                kv_seqlens=[kl])
        dense.append(ref.dense_heads(bc[0], cc[0], ql, kl, 64, 64, sparse.DENSE_THRESHOLD))
    dense = np.array(dense)
    assert dense[[0, 2, 3]][:, [1, 4]].all() and not dense[[0, 2, 3]][:, [0, 2, 3]].any()


def test_head_groups_of_a_small_budget_give_the_same_result(cp, rng, monkeypatch):
    """A list budget of one head's slots: a list launch and an attention launch per head, the
    buffers reused; the result equals the one-group run bit for bit."""
    q, k, v, v_idx, s_idx, cu_q, cu_k = _fallback_batch(rng, np.float16, hq=4, hk=1, d=64)
    sinks = np.zeros(4, np.float32)
    one, one_lse = _fallback_run(cp, q, k, v, v_idx, s_idx, cu_q, cu_k, sinks)
    from cupaged.sparse import launch
    calls = []
    real = tiles.vs_lists

    def counted(*a, **kw):
        for g in real(*a, **kw):
            calls.append(g.heads)
            yield g
    monkeypatch.setattr(tiles, "vs_lists", counted)
    monkeypatch.setattr(tiles, "LIST_BUDGET", 1)
    got, lse = _fallback_run(cp, q, k, v, v_idx, s_idx, cu_q, cu_k, sinks)
    assert calls == [1, 1, 1, 1] and launch.CTA_ROWS == 128
    np.testing.assert_array_equal(got, one)
    np.testing.assert_array_equal(lse, one_lse)


@pytest.mark.parametrize("which", ["v_idx", "s_idx"])
def test_negative_device_index_goes_to_the_error_word(cp, rng, which):
    """A negative index is found on the device (no host read): its (sequence, head) comes out
    as zeros, the others as the reference, and check_errors names the argument; strict mode
    raises on the host first."""
    import cupaged
    cupaged.check_errors()
    q, k, v, v_idx, s_idx, cu_q, cu_k = _fallback_batch(rng)
    sinks = np.zeros(q.shape[1], np.float32)
    bad_v, bad_s = v_idx.copy(), s_idx.copy()
    (bad_v if which == "v_idx" else bad_s)[2, 3, 1] = -5
    got, _ = _fallback_run(cp, q, k, v, bad_v, bad_s, cu_q, cu_k, sinks)
    with pytest.raises(cupaged.DeviceIndexError, match=which):
        cupaged.check_errors()
    n = cu_q[-1]
    want, _ = sparse.vertical_slash_attention(*(x.astype(np.float32) for x in (q[:n], k, v)), v_idx,
                                              s_idx, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=sinks,
                                              return_lse=True)
    rows = slice(cu_q[2], cu_q[3])
    assert (got[rows, 3] == 0).all()
    want[rows, 3] = 0
    _check_close(got[:n], want, bfloat16)
    with pytest.raises(ValueError, match=which):
        sparse.vertical_slash_attention(*(cp.asarray(x) for x in (q[:n], k, v, bad_v, bad_s)),
                                        cu_seqlens_q=cp.asarray(cu_q), cu_seqlens_k=cp.asarray(cu_k),
                                        validate=True)


# ----------------------------------------------------------------------------- BSR
@pytest.mark.parametrize("dtype,d,block_m,block_n,causal", [
    (np.float16, 128, 64, 64, True),
    (bfloat16, 128, 128, 32, False),
    (np.float16, 64, 64, 96, True),
    (bfloat16, 256, 128, 128, True),
    (np.float16, 80, 64, 16, False),
])
def test_bsr_matches_reference(cp, rng, dtype, d, block_m, block_n, causal):
    q_len, kv_len = 300, 420
    q, k, v = (_rand(rng, s, dtype) for s in ((q_len, 4, d), (kv_len, 2, d), (kv_len, 2, d)))
    rows, cols = -(-q_len // block_m), -(-kv_len // block_n)
    indptr, indices = [0], []
    for _ in range(rows):
        indices += sorted(rng.choice(cols, rng.integers(0, cols + 1), replace=False).tolist())
        indptr.append(len(indices))
    indptr, indices = np.array(indptr, np.int32), np.array(indices, np.int32)
    sk = rng.standard_normal(4).astype(np.float32)
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    got, lse = sparse.block_sparse_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v),
                                             cp.asarray(indptr), cp.asarray(indices), block_m, block_n,
                                             causal=causal, sinks=cp.asarray(sk), out=out, return_lse=True)
    want, want_lse = sparse.block_sparse_attention(q, k, v, indptr, indices, block_m, block_n,
                                                   causal=causal, sinks=sk, return_lse=True)
    _check_close(_host(cp, got), want, dtype)
    np.testing.assert_allclose(_host(cp, lse), want_lse, rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------- policies
def test_minference_policy_gpu(cp, rng):
    pol = sparse.MInferencePolicy()
    q, k, v = (_rand(rng, (1000, 4, 64), np.float16) for _ in range(3))
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    got = _host(cp, pol.sparse_prefill_attention(dq, dk, dv, 0))
    v_idx, s_idx = (_host(cp, x) for x in pol.estimate_pattern(dq, dk, 0))
    want = sparse.vertical_slash_attention(q, k, v, v_idx, s_idx)
    _check_close(got, want, np.float16)


def test_quest_gpu_equals_numpy(cp, rng):
    pytest.importorskip("cupaged.decode.api")
    bs, lens = 16, np.array([300, 40, 129], np.int32)
    nb = 40
    k_cache, v_cache = (_rand(rng, (nb, 2, bs, 128), np.float16) for _ in range(2))
    tables = np.full((3, 20), -1, np.int32)
    perm, used = rng.permutation(nb), 0
    for b, n in enumerate(lens):
        for i in range(-(-int(n) // bs)):
            tables[b, i], used = perm[used], used + 1
    q = _rand(rng, (3, 8, 128), np.float16)
    want_pol, got_pol = sparse.QuestPolicy(4), sparse.QuestPolicy(4)
    want_pol.update_bounds(k_cache, tables, lens, layout="HND")
    want = want_pol.decode(q, k_cache, v_cache, tables, lens, layout="HND")
    dev = [cp.asarray(x) for x in (q, k_cache, v_cache, tables, lens)]
    got_pol.update_bounds(dev[1], dev[3], dev[4], layout="HND")
    got = got_pol.decode(*dev, layout="HND")
    _check_close(_host(cp, got), want, np.float16)


# ----------------------------------------------------------------------------- score options
def score_options(rng, hq, feature):
    """NumPy options of one test case: ``feature`` in window, window0, alibi, soft_cap,
    negative_scale, all (window + ALiBi + soft-cap + sinks)."""
    opts = {}
    if feature in ("window", "all"):
        opts["window_left"] = 45
    if feature == "window0":
        opts["window_left"] = 0                      # the diagonal key alone
    if feature in ("alibi", "all"):
        opts["alibi_slopes"] = (2.0 ** -np.linspace(1, 8, hq)).astype(np.float32)
    if feature in ("soft_cap", "all"):
        opts.update(logits_soft_cap=2.5, sm_scale=0.4)   # scores large enough to saturate
    if feature == "negative_scale":
        opts["sm_scale"] = -0.09
    if feature == "all":
        opts["sinks"] = rng.standard_normal(hq).astype(np.float32)
    return opts


def on_device(cp, opts):
    return {k: cp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in opts.items()}


FEATURES = ["window", "window0", "alibi", "soft_cap", "negative_scale", "all"]


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype,d,hq,hk,q_len,kv_len", [
    (np.float16, 64, 4, 2, 333, 333),
    (bfloat16, 80, 2, 1, 200, 450),
    (np.float16, 96, 3, 1, 130, 131),
    (bfloat16, 112, 2, 2, 257, 300),
    (np.float16, 128, 8, 2, 500, 777),
    (bfloat16, 256, 2, 1, 190, 260),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_vertical_slash_score_options_match_reference(cp, rng, feature, dtype, d, hq, hk, q_len,
                                                      kv_len, backend):
    """window_left, ALiBi, soft-cap and a negative scale, alone and together, against the
    float64 reference (poisoned outputs, odd sizes, GQA), on both kernels."""
    q, k, v = (_rand(rng, s, dtype) for s in ((q_len, hq, d), (kv_len, hk, d), (kv_len, hk, d)))
    v_idx, s_idx = _random_pattern(rng, hq, kv_len, 20, 12)
    opts = score_options(rng, hq, feature)
    got, lse = _vs_gpu(cp, q, k, v, v_idx, s_idx, backend=backend, **on_device(cp, opts))
    want, want_lse = sparse.vertical_slash_attention(
        *(x.astype(np.float32) for x in (q, k, v)), v_idx, s_idx, return_lse=True, **opts)
    _check_close(got, want, dtype)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_vertical_slash_score_options(cp, rng, layout, backend):
    """The paged op with every option equals the packed op bit for bit on one kernel (its
    cp.async tiles against the packed op's TMA ones on wgmma), and the reference."""
    needs_backend(cp, backend)
    q_lens, kv_lens = [70, 128, 1], [500, 128, 33]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = _rand(rng, (cu_q[-1], 8, 128), bfloat16)
    k, v = (_rand(rng, (cu_k[-1], 2, 128), bfloat16) for _ in range(2))
    kc, vc, tables = _paged(rng, k, v, cu_k, 16, 80, layout, cp)
    pats = [_random_pattern(rng, 8, n, min(n, 20), min(n, 12)) for n in kv_lens]
    v_idx = sparse.pad_indices([p[0] for p in pats])
    s_idx = sparse.pad_indices([p[1] for p in pats])
    opts = score_options(rng, 8, "all")
    dev = on_device(cp, opts)
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    sparse.paged_vertical_slash_attention(cp.asarray(q), kc, vc, cp.asarray(v_idx), cp.asarray(s_idx),
                                          cp.asarray(cu_q), cp.asarray(tables),
                                          cp.asarray(np.array(kv_lens, np.int32)), layout=layout,
                                          out=out, backend=backend, **dev)
    dense = cp.full(q.shape, np.nan, dtype=q.dtype)
    sparse.vertical_slash_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(v_idx),
                                    cp.asarray(s_idx), cu_seqlens_q=cp.asarray(cu_q),
                                    cu_seqlens_k=cp.asarray(cu_k), out=dense, backend=backend, **dev)
    np.testing.assert_array_equal(_host(cp, out), _host(cp, dense))
    want = sparse.vertical_slash_attention(*(x.astype(np.float32) for x in (q, k, v)), v_idx, s_idx,
                                           cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **opts)
    _check_close(_host(cp, out), want, bfloat16)


def test_full_pattern_with_options_equals_dense_prefill(cp, rng):
    """Every key kept: the sparse kernel's general path is varlen_prefill's result."""
    import cupaged
    q_len, kv_len, hq, hk, d = 300, 420, 4, 2, 128
    q, k, v = (_rand(rng, s, np.float16) for s in ((q_len, hq, d), (kv_len, hk, d), (kv_len, hk, d)))
    v_idx = np.tile(np.arange(kv_len, dtype=np.int32), (hq, 1))
    s_idx = np.tile(np.arange(kv_len, dtype=np.int32), (hq, 1))
    opts = on_device(cp, score_options(rng, hq, "all"))
    got, _ = _vs_gpu(cp, q, k, v, v_idx, s_idx, **opts)
    cu_q, cu_k = (cp.asarray(np.array([0, n], np.int32)) for n in (q_len, kv_len))
    dense = cupaged.varlen_prefill(cp.asarray(q), cp.asarray(k), cp.asarray(v), cu_q, cu_k, **opts)
    _check_close(got, _host(cp, dense).astype(np.float64), np.float16)
