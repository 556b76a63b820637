"""CPU tests of cupaged.reference.bsr (batched block-sparse-row attention) and of the
pattern checks in cupaged.sparse.index: a loop oracle written from the docstring, the dense
and single-sequence references, per-kv-head against per-query-head patterns, paged against
ragged in every layout, empty patterns, and bad patterns."""
import math

import numpy as np
import pytest

from cupaged.core.layouts import LAYOUTS, cache_shapes
from cupaged.reference import attention as ra
from cupaged.reference import bsr
from cupaged.reference import sparse as rs
from cupaged.reference.cache import write_kv_cache
from cupaged.sparse.index import check_bsr_batch


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _batch(rng, q_lens, kv_lens, hq, hk, d, dtype=np.float64):
    q = rng.standard_normal((sum(q_lens), hq, d)).astype(dtype)
    k = rng.standard_normal((sum(kv_lens), hk, d)).astype(dtype)
    v = rng.standard_normal((sum(kv_lens), hk, d)).astype(dtype)
    return q, k, v, _cu(q_lens), _cu(kv_lens)


def _pattern(rng, q_lens, kv_lens, bm, bn, heads, density):
    """Random pattern; CSR rows in (sequence, pattern head, block row) order."""
    indptr, indices = [0], []
    for q_len, kv_len in zip(q_lens, kv_lens):
        cols = -(-kv_len // bn)
        for _ in range(heads * -(-q_len // bm)):
            keep = np.flatnonzero(rng.random(cols) < density)
            indices += keep.tolist()
            indptr.append(len(indices))
    return np.array(indptr, np.int32), np.array(indices, np.int32)


def _full(q_lens, kv_lens, bm, bn, heads):
    return _pattern(np.random.default_rng(0), q_lens, kv_lens, bm, bn, heads, 2.0)


def _oracle(q, k, v, cu_q, cu_k, indptr, indices, bm, bn, heads, causal=True, sm_scale=None,
            window_left=-1, alibi_slopes=None, sinks=None, logits_soft_cap=0.0):
    """Row-by-row loops straight from the module docstring."""
    hq, d = q.shape[1:]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    out, lse = np.zeros(q.shape), np.full(q.shape[:2], -np.inf)
    t = 0
    for b in range(len(cu_q) - 1):
        q_len, kv_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        rows = -(-q_len // bm)
        kept = []
        for _ in range(heads):
            kept.append([set(indices[indptr[t + r]:indptr[t + r + 1]].tolist()) for r in range(rows)])
            t += rows
        for h in range(hq):
            hk = h // (hq // k.shape[1])
            for i in range(q_len):
                p = kv_len - q_len + i
                blocks = kept[h // (hq // heads)][i // bm]
                s, vs = [], []
                for j in range(kv_len):
                    hidden = (causal and j > p) or (window_left >= 0 and j < p - window_left)
                    if j // bn not in blocks or hidden:
                        continue
                    x = scale * float(q[cu_q[b] + i, h] @ k[cu_k[b] + j, hk])
                    if logits_soft_cap > 0:
                        x = logits_soft_cap * math.tanh(x / logits_soft_cap)
                    if alibi_slopes is not None:
                        x += float(alibi_slopes[h]) * (j - p)
                    s.append(x)
                    vs.append(v[cu_k[b] + j, hk])
                terms = s + ([float(sinks[h])] if sinks is not None else [])
                if not terms:
                    continue
                m = max(terms)
                denom = sum(math.exp(x - m) for x in terms)
                acc = sum((math.exp(x - m) * vv for x, vv in zip(s, vs)), np.zeros(d))
                out[cu_q[b] + i, h], lse[cu_q[b] + i, h] = acc / denom, m + math.log(denom)
    return out, lse


def _close(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-9, atol=1e-11)


Q_LENS, KV_LENS = [7, 0, 13, 1, 5], [19, 3, 13, 9, 0]
HQ, HK, D = 4, 2, 12


def _features(rng):
    return {
        "plain": {},
        "not causal": dict(causal=False),
        "sm_scale": dict(sm_scale=0.3),
        "window": dict(window_left=4),
        "alibi": dict(alibi_slopes=rng.uniform(0.05, 0.5, HQ)),
        "sinks": dict(sinks=rng.standard_normal(HQ)),
        "soft cap": dict(logits_soft_cap=1.5, sm_scale=2.0),
        "all": dict(causal=True, sm_scale=0.7, window_left=6, alibi_slopes=rng.uniform(0.05, 0.5, HQ),
                    sinks=rng.standard_normal(HQ), logits_soft_cap=2.0),
    }


FEATURES = list(_features(np.random.default_rng(0)))


# ----------------------------------------------------------------------------- definition
def test_row_offsets():
    np.testing.assert_array_equal(bsr.bsr_row_offsets([7, 0, 13, 1], 4, 3), [0, 6, 6, 18, 21])
    assert bsr.bsr_row_offsets([5], 4, 2).dtype == np.int32


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("heads", [HQ, HK, 1])
def test_matches_loop_oracle(rng, feature, heads):
    options = _features(rng)[feature]
    q, k, v, cu_q, cu_k = _batch(rng, Q_LENS, KV_LENS, HQ, HK, D)
    indptr, indices = _pattern(rng, Q_LENS, KV_LENS, 3, 5, heads, 0.5)
    check_bsr_batch(indptr, indices, Q_LENS, KV_LENS, 3, 5, heads, HQ, HK, np)
    got = bsr.varlen_block_sparse_attention(q, k, v, cu_q, cu_k, indptr, indices, 3, 5,
                                            pattern_heads=heads, **options)
    _close(got, _oracle(q, k, v, cu_q, cu_k, indptr, indices, 3, 5, heads, **options))


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("bm,bn", [(1, 1), (4, 3), (16, 64)])
def test_all_blocks_kept_is_dense(rng, feature, bm, bn):
    options = _features(rng)[feature]
    q, k, v, cu_q, cu_k = _batch(rng, Q_LENS, KV_LENS, HQ, HK, D)
    indptr, indices = _full(Q_LENS, KV_LENS, bm, bn, HK)
    out, lse = bsr.varlen_block_sparse_attention(q, k, v, cu_q, cu_k, indptr, indices, bm, bn,
                                                 pattern_heads=HK, **options)
    want, want_lse = ra.varlen_prefill(q, k, v, cu_q, cu_k, return_lse=True, **options)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_shared_pattern_is_single_sequence_bsr(rng, causal):
    q, k, v, cu_q, cu_k = _batch(rng, Q_LENS, KV_LENS, HQ, HK, D)
    indptr, indices = _pattern(rng, Q_LENS, KV_LENS, 4, 3, 1, 0.4)
    sinks = rng.standard_normal(HQ)
    out, lse = bsr.varlen_block_sparse_attention(q, k, v, cu_q, cu_k, indptr, indices, 4, 3,
                                                 pattern_heads=1, causal=causal, sinks=sinks)
    offsets = bsr.bsr_row_offsets(np.diff(cu_q), 4, 1)
    for b in range(len(Q_LENS)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start:
            continue
        ptr = indptr[offsets[b]:offsets[b + 1] + 1]
        one = rs.block_sparse_attention(q[rows], k[keys], v[keys], ptr - ptr[0],
                                        indices[ptr[0]:ptr[-1]], 4, 3, causal=causal, sinks=sinks)
        np.testing.assert_array_equal(out[rows], one[0])
        np.testing.assert_array_equal(lse[rows], one[1])


def _repeat_heads(indptr, indices, q_lens, bm, heads, group):
    """A per-kv-head pattern as the per-query-head pattern it stands for."""
    offsets = bsr.bsr_row_offsets(q_lens, bm, heads)
    lengths, rows_out = np.diff(indptr), []
    for b, q_len in enumerate(q_lens):
        rows = -(-q_len // bm)
        for g in range(heads):
            first = offsets[b] + g * rows
            rows_out += [range(first, first + rows)] * group
    order = [t for r in rows_out for t in r]
    new_ptr = _cu(lengths[order]) if order else np.zeros(1, np.int32)
    new_idx = [indices[indptr[t]:indptr[t + 1]] for t in order]
    return new_ptr, np.concatenate(new_idx + [np.zeros(0, np.int32)]).astype(np.int32)


def test_kv_head_pattern_is_repeated_query_head_pattern(rng):
    q, k, v, cu_q, cu_k = _batch(rng, Q_LENS, KV_LENS, 6, 2, D)
    indptr, indices = _pattern(rng, Q_LENS, KV_LENS, 2, 4, 2, 0.5)
    wide_ptr, wide_idx = _repeat_heads(indptr, indices, Q_LENS, 2, 2, 3)
    check_bsr_batch(wide_ptr, wide_idx, Q_LENS, KV_LENS, 2, 4, 6, 6, 2, np)
    opts = dict(window_left=5, logits_soft_cap=3.0, alibi_slopes=rng.uniform(0.1, 0.3, 6))
    per_kv = bsr.varlen_block_sparse_attention(q, k, v, cu_q, cu_k, indptr, indices, 2, 4,
                                               pattern_heads=2, **opts)
    per_q = bsr.varlen_block_sparse_attention(q, k, v, cu_q, cu_k, wide_ptr, wide_idx, 2, 4,
                                              pattern_heads=6, **opts)
    np.testing.assert_array_equal(per_kv[0], per_q[0])
    np.testing.assert_array_equal(per_kv[1], per_q[1])


# ----------------------------------------------------------------------------- paged
def _to_paged(rng, k, v, kv_lens, layout, page, spare=2):
    """Write ragged K/V into scattered pages; returns ``(k_cache, v_cache, tables)``."""
    need = [-(-n // page) for n in kv_lens]
    num_blocks = sum(need) + spare
    ks, vs = cache_shapes(layout, num_blocks, page, k.shape[1], k.shape[2], k.dtype)
    k_cache = rng.standard_normal(ks).astype(k.dtype)
    v_cache = rng.standard_normal(vs).astype(v.dtype)
    ids = rng.permutation(num_blocks)
    tables = np.full((len(kv_lens), max(need) + 1), -1, np.int32)
    slots, start = [], 0
    for b, (n, m) in enumerate(zip(kv_lens, need)):
        tables[b, :m] = ids[start:start + m]
        start += m
        t = np.arange(n)
        slots.append(tables[b, t // page].astype(np.int64) * page + t % page)
    write_kv_cache(k, v, k_cache, v_cache, np.concatenate(slots), layout)
    return k_cache, v_cache, tables


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page", [1, 16, 128])
def test_paged_is_ragged(rng, layout, page):
    kv_lens = [19, 3, 140, 9, 0]
    q_lens = [7, 0, 13, 1, 0]
    q, k, v, cu_q, cu_k = _batch(rng, q_lens, kv_lens, HQ, HK, 16, np.float32)
    indptr, indices = _pattern(rng, q_lens, kv_lens, 4, 8, HQ, 0.4)
    k_cache, v_cache, tables = _to_paged(rng, k, v, kv_lens, layout, page)
    opts = dict(sinks=rng.standard_normal(HQ).astype(np.float32), window_left=30)
    ragged = bsr.varlen_block_sparse_attention(q, k, v, cu_q, cu_k, indptr, indices, 4, 8,
                                               pattern_heads=HQ, **opts)
    paged = bsr.paged_block_sparse_attention(q, k_cache, v_cache, cu_q, tables,
                                             np.array(kv_lens, np.int32), indptr, indices, 4, 8,
                                             pattern_heads=HQ, layout=layout, **opts)
    np.testing.assert_array_equal(paged[0], ragged[0])
    np.testing.assert_array_equal(paged[1], ragged[1])


def test_paged_all_kept_is_dense_paged_prefill(rng):
    kv_lens, q_lens = [21, 40], [21, 6]
    q, k, v, cu_q, _ = _batch(rng, q_lens, kv_lens, HQ, HK, 16, np.float32)
    k_cache, v_cache, tables = _to_paged(rng, k, v, kv_lens, "HND", 16)
    indptr, indices = _full(q_lens, kv_lens, 8, 16, 1)
    lens = np.array(kv_lens, np.int32)
    out, lse = bsr.paged_block_sparse_attention(q, k_cache, v_cache, cu_q, tables, lens, indptr,
                                                indices, 8, 16, pattern_heads=1, layout="HND")
    want, want_lse = ra.paged_prefill(q.astype(np.float64), k_cache, v_cache, cu_q, tables, lens,
                                      layout="HND", return_lse=True)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_fp8_and_long_queries(rng, layout):
    """fp8 caches read back as in paged_prefill; q_len > kv_len leaves leading rows empty."""
    kv_lens, q_lens = [21, 5], [9, 8]
    q, k, v, cu_q, _ = _batch(rng, q_lens, kv_lens, HQ, HK, 16, np.float32)
    page, need = 16, [2, 1]
    ks, vs = cache_shapes(layout, 5, page, HK, 16, np.uint8)
    k8, v8 = np.zeros(ks, np.uint8), np.zeros(vs, np.uint8)
    tables = np.array([[3, 0], [4, -1]], np.int32)
    slots = np.concatenate([tables[b, np.arange(n) // page].astype(np.int64) * page
                            + np.arange(n) % page for b, n in enumerate(kv_lens)])
    fp8 = dict(kv_dtype="fp8_e4m3", k_scale=np.float32(0.5), v_scale=np.full(HK, 0.25, np.float32))
    write_kv_cache(k, v, k8, v8, slots, layout, **fp8)
    indptr, indices = _full(q_lens, kv_lens, 4, 4, HK)
    lens = np.array(kv_lens, np.int32)
    out, lse = bsr.paged_block_sparse_attention(q, k8, v8, cu_q, tables, lens, indptr, indices,
                                                4, 4, pattern_heads=HK, layout=layout, **fp8)
    want, want_lse = ra.paged_prefill(q.astype(np.float64), k8, v8, cu_q, tables, lens,
                                      layout=layout, return_lse=True, **fp8)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    assert (out[9:12] == 0).all() and np.isneginf(lse[9:12]).all()


# ----------------------------------------------------------------------------- empty rows
@pytest.mark.parametrize("with_sinks", [False, True])
def test_no_kept_block_gives_zeros(rng, with_sinks):
    q, k, v, cu_q, cu_k = _batch(rng, Q_LENS, KV_LENS, HQ, HK, D)
    rows = bsr.bsr_row_offsets(Q_LENS, 4, HK)[-1]
    sinks = rng.standard_normal(HQ) if with_sinks else None
    out, lse = bsr.varlen_block_sparse_attention(q, k, v, cu_q, cu_k, np.zeros(rows + 1, np.int32),
                                                 np.zeros(0, np.int32), 4, 4, pattern_heads=HK,
                                                 sinks=sinks)
    assert (out == 0).all()
    empty = -np.inf if sinks is None else sinks
    np.testing.assert_array_equal(lse, np.broadcast_to(empty, lse.shape))


def test_empty_rows_among_kept_ones(rng):
    """A row block with no kept block is zeros; other rows are unaffected (causal blocks
    past the diagonal keep no key either)."""
    q, k, v, cu_q, cu_k = _batch(rng, [8], [8], 2, 1, D)
    indptr = np.array([0, 0, 1, 2, 2], np.int32)   # head 0: rows {}, {1}; head 1: rows {1}, {}
    indices = np.array([1, 1], np.int32)
    out, lse = bsr.varlen_block_sparse_attention(q, k, v, cu_q, cu_k, indptr, indices, 4, 4,
                                                 pattern_heads=2)
    # block row 0: head 0 keeps nothing, head 1 only keys after every query of the row
    assert (out[:4] == 0).all() and np.isneginf(lse[:4]).all()
    assert (out[4:, 1] == 0).all() and np.isneginf(lse[4:, 1]).all()
    want = ra.attend_masked(q[4:, :1], k[4:], v[4:], ra.visible_keys(4, 4))
    np.testing.assert_allclose(out[4:, :1], want[0], rtol=1e-12)


# ----------------------------------------------------------------------------- bad patterns
def _good():
    q_lens, kv_lens = np.array([5, 0, 3]), np.array([9, 2, 3])
    indptr, indices = _full(q_lens, kv_lens, 4, 4, 2)            # rows: 2 + 0 + 1 per head
    return indptr, indices, q_lens, kv_lens


def test_good_pattern_passes():
    indptr, indices, q_lens, kv_lens = _good()
    offsets = check_bsr_batch(indptr, indices, q_lens, kv_lens, 4, 4, 2, 4, 2, np)
    np.testing.assert_array_equal(offsets, [0, 4, 4, 6])


@pytest.mark.parametrize("edit,error,match", [
    (lambda p, i: (p.astype(np.int64), i), TypeError, "indptr: expected dtype int32"),
    (lambda p, i: (p, i.astype(np.int64)), TypeError, "indices: expected dtype int32"),
    (lambda p, i: (p[:-1], i), ValueError, r"indptr: expected shape \[7\]"),
    (lambda p, i: (p + 1, i), ValueError, r"indptr: expected indptr\[0\] == 0"),
    (lambda p, i: (np.array([0, 3, 2, 5, 8, 11, 11], np.int32), i), ValueError,
     "indptr: expected non-decreasing"),
    (lambda p, i: (p, i[:-1]), ValueError, "indptr: expected last entry 13"),
    (lambda p, i: (p, np.where(np.arange(len(i)) == 4, 3, i).astype(np.int32)), ValueError,
     r"indices: expected entries in \[0, 3\), got 3 at index 4 \(sequence 0, pattern head 0, "
     r"block row 1\)"),
    (lambda p, i: (p, np.where(np.arange(len(i)) == 13, 1, i).astype(np.int32)), ValueError,
     r"indices: expected entries in \[0, 1\).*sequence 2, pattern head 1, block row 0"),
    (lambda p, i: (p, -i), ValueError, "indices: expected entries in"),
    (lambda p, i: (p, np.where(np.arange(len(i)) == 1, 0, i).astype(np.int32)), ValueError,
     "indices: expected strictly increasing block ids within each row, got 0 then 0"),
    (lambda p, i: (p, i[::-1].copy()), ValueError, "indices: expected"),
])
def test_bad_pattern_raises_naming_it(edit, error, match):
    indptr, indices, q_lens, kv_lens = _good()
    indptr, indices = edit(indptr, indices)
    with pytest.raises(error, match=match):
        check_bsr_batch(indptr, indices, q_lens, kv_lens, 4, 4, 2, 4, 2, np)


@pytest.mark.parametrize("args,error,match", [
    (dict(pattern_heads=3), ValueError, r"pattern_heads: expected \[1, 2, 4\].*got 3"),
    (dict(pattern_heads=0), ValueError, "pattern_heads"),
    (dict(pattern_heads=2.0), TypeError, "pattern_heads: expected an int"),
    (dict(block_m=0), ValueError, "block_m"),
    (dict(block_n="4"), TypeError, "block_n"),
])
def test_bad_sizes_raise_naming_them(args, error, match):
    indptr, indices, q_lens, kv_lens = _good()
    kw = dict(block_m=4, block_n=4, pattern_heads=2) | args
    with pytest.raises(error, match=match):
        check_bsr_batch(indptr, indices, q_lens, kv_lens, kw["block_m"], kw["block_n"],
                        kw["pattern_heads"], 4, 2, np)
