"""CPU tests of cupaged.sparse: the float64 reference against independent oracles, the
NumPy path of the public ops, the policies, and bad input. GPU tests: test_sparse_gpu.py."""
import numpy as np
import pytest

from cupaged import sparse
from cupaged.reference import attention as ra
from cupaged.reference import sparse as ref


def _qkv(rng, q_len, kv_len, hq=4, hk=2, d=64, dtype=np.float32):
    q = rng.standard_normal((q_len, hq, d)).astype(dtype)
    k = rng.standard_normal((kv_len, hk, d)).astype(dtype)
    v = rng.standard_normal((kv_len, hk, d)).astype(dtype)
    return q, k, v


# ----------------------------------------------------------------------------- estimate
def _seed_style_scores(q, k, last_q):
    """Vertical and slash scores by explicit loops over rows, keys and diagonals."""
    q_len, hq, d = q.shape
    kv_len, hk = k.shape[:2]
    n = min(last_q, q_len)
    vert, slash = np.zeros((hq, kv_len)), np.zeros((hq, kv_len))
    for h in range(hq):
        kh = k[:, h // (hq // hk)].astype(np.float64)
        for i in range(n):
            p = kv_len - n + i
            s = kh[:p + 1] @ q[q_len - n + i, h].astype(np.float64) / np.sqrt(d)
            e = np.exp(s - s.max())
            e /= e.sum()
            vert[h, :p + 1] += e
            for j in range(p + 1):
                slash[h, p - j] += e[j]
    return vert, slash


@pytest.mark.parametrize("q_len,kv_len,last_q", [(70, 70, 64), (20, 90, 64), (100, 100, 7)])
def test_estimate_scores_match_loops(rng, q_len, kv_len, last_q):
    q, k, _ = _qkv(rng, q_len, kv_len)
    vert, slash = ref.estimate_scores(q, k, last_q=last_q)
    want_v, want_s = _seed_style_scores(q, k, last_q)
    np.testing.assert_allclose(vert, want_v, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(slash, want_s, rtol=1e-10, atol=1e-12)


def test_estimate_top_k_forced_and_sorted(rng):
    q, k, _ = _qkv(rng, 150, 150)
    v_idx, s_idx = sparse.estimate_vertical_slash(q, k, vertical_size=20, slash_size=30,
                                                  num_sink_tokens=5, num_recent_diags=8)
    assert v_idx.dtype == s_idx.dtype == np.int32
    assert v_idx.shape == (4, 20) and s_idx.shape == (4, 30)
    vert, slash = ref.estimate_scores(q, k)
    for h in range(4):
        assert (np.diff(v_idx[h]) > 0).all() and (np.diff(s_idx[h]) > 0).all()
        assert set(range(5)) <= set(v_idx[h]) and set(range(8)) <= set(s_idx[h])
        rest_v = np.setdiff1d(np.arange(150), v_idx[h])
        assert vert[h, v_idx[h][v_idx[h] >= 5]].min() >= vert[h, rest_v].max()
        rest_s = np.setdiff1d(np.arange(150), s_idx[h])
        assert slash[h, s_idx[h][s_idx[h] >= 8]].min() >= slash[h, rest_s].max()


def test_pattern_sizes_adaptive_budget():
    assert ref.pattern_sizes(1000, 5, 7, 30, 100, 0.3) == (60, 240)
    assert ref.pattern_sizes(100, 5, 7, 30, 100, 0.3) == (31, 100)   # floors, capped at kv_len
    assert ref.pattern_sizes(50, 80, 7, 30, 100, None) == (50, 7)


def test_estimate_gqa_equals_repeated_heads(rng):
    q, k, _ = _qkv(rng, 90, 90, hq=4, hk=1)
    a = sparse.estimate_vertical_slash(q, k, vertical_size=10, slash_size=12, num_sink_tokens=2,
                                       num_recent_diags=3)
    b = sparse.estimate_vertical_slash(q, np.repeat(k, 4, axis=1), vertical_size=10, slash_size=12,
                                       num_sink_tokens=2, num_recent_diags=3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_paged_estimate_equals_dense(rng):
    q, k, _ = _qkv(rng, 40, 100, d=64)
    bs, nb = 16, 12
    table = rng.permutation(nb).astype(np.int32)[:7]
    cache = rng.standard_normal((nb, bs, 2, 64)).astype(np.float32)
    for i, blk in enumerate(table):
        n = min(bs, 100 - i * bs)
        cache[blk, :n] = k[i * bs:i * bs + n]
    opts = dict(vertical_size=9, slash_size=11, num_sink_tokens=2, num_recent_diags=4)
    want = sparse.estimate_vertical_slash(q, k, **opts)
    for layout, c in (("NHD", cache), ("HND", np.ascontiguousarray(cache.transpose(0, 2, 1, 3)))):
        got = sparse.paged_estimate_vertical_slash(q, c, table, 100, layout=layout, **opts)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------- index
def _minference_walk(v_row, s_desc, end, block):
    """MInference's interleaved walk (block_m == block_n), valid when the last merged range
    reaches ``end``: slashes descending, verticals ascending."""
    blocks, cols = [], []
    s = [d for d in s_desc if d < end]
    rs = max(end - s[0], block) - block
    re, si, vi = rs + block, 1, 0
    while True:
        if vi < len(v_row) and v_row[vi] < re:
            if v_row[vi] < rs:
                cols.append(v_row[vi])
            vi += 1
            continue
        if si == len(s):
            blocks += list(range(rs, re, block))
            return blocks, cols
        hi = max(end - s[si], block)
        si += 1
        if hi > re + block:
            blocks += list(range(rs, re, block))
            rs, re = hi - block, hi
        elif hi > re:
            re += block


def test_index_matches_minference_walk(rng):
    seq = 700
    for _ in range(5):
        v_row = np.sort(rng.choice(seq, 40, replace=False)).astype(np.int32)
        s_row = np.union1d(np.arange(20), rng.choice(seq, 30, replace=False)).astype(np.int32)
        bc, bo, cc, ci = ref.vertical_slash_index([seq], v_row[None, None], s_row[None, None], seq)
        for m in range(-(-seq // 64)):
            blocks, cols = _minference_walk(list(v_row), list(s_row[::-1]), 64 * m + 64, 64)
            assert list(bo[0, 0, m, :bc[0, 0, m]]) == blocks
            assert list(ci[0, 0, m, :cc[0, 0, m]]) == [c for c in cols if c < seq]


@pytest.mark.parametrize("block_m,block_n", [(64, 64), (64, 32), (128, 64), (32, 48)])
def test_index_blocks_cover_slashes_and_columns_cover_verticals(rng, block_m, block_n):
    q_len, kv_len = 300, 420
    v_row = rng.choice(kv_len, 50, replace=False).astype(np.int32)
    s_row = rng.choice(kv_len, 40, replace=False).astype(np.int32)
    bc, bo, cc, ci = ref.vertical_slash_index([q_len], v_row[None, None], s_row[None, None], q_len,
                                              block_m, block_n, kv_seqlens=[kv_len])
    for m in range(-(-q_len // block_m)):
        end = kv_len - q_len + m * block_m + block_m
        limit = min(end, kv_len)
        starts = bo[0, 0, m, :bc[0, 0, m]].astype(np.int64)
        assert (np.diff(starts) >= block_n).all()                      # ascending, disjoint
        covered = np.zeros(end + 2 * max(block_m, block_n), bool)
        for st in starts:
            covered[st:st + block_n] = True
        raw = np.zeros_like(covered)
        for d in s_row[s_row < limit]:
            hi = max(end - d, block_m)
            raw[hi - block_m:hi] = True
        assert (covered >= raw).all()                                  # every slash range
        # blocks hold nothing but slash ranges rounded up to block_n
        extra = np.flatnonzero(covered & ~raw)
        assert all(raw[max(0, e - block_n + 1):e].any() for e in extra)
        cols = ci[0, 0, m, :cc[0, 0, m]]
        want = sorted(int(x) for x in v_row if x < limit and not covered[x])
        assert list(cols) == want


def test_index_padding_and_unsorted_input(rng):
    v = rng.permutation(200).astype(np.int32)[:30]
    s = rng.permutation(200).astype(np.int32)[:30]
    a = sparse.vertical_slash_index(np.array([200], np.int32), v[None, None], s[None, None], 200)
    padded_v = np.concatenate([v[::-1], [ref.PAD] * 5]).astype(np.int32)
    padded_s = np.concatenate([[ref.PAD, 250], s]).astype(np.int32)
    b = sparse.vertical_slash_index(np.array([200], np.int32), padded_v[None, None],
                                    padded_s[None, None], 200)
    for x, y in zip(a[::2], b[::2]):
        np.testing.assert_array_equal(x, y)
    for (x, cx), (y, cy) in zip(((a[1], a[0]), (a[3], a[2])), ((b[1], b[0]), (b[3], b[2]))):
        for m in range(x.shape[2]):
            np.testing.assert_array_equal(x[0, 0, m, :cx[0, 0, m]], y[0, 0, m, :cy[0, 0, m]])


def test_pad_indices():
    rows = [np.array([[1, 2, 3]], np.int32), np.array([[4]], np.int32)]
    out = sparse.pad_indices(rows)
    assert out.shape == (2, 1, 3) and out.dtype == np.int32
    assert out[1, 0].tolist() == [4, sparse.PAD, sparse.PAD]
    with pytest.raises(ValueError, match="rows"):
        sparse.pad_indices([])


# ----------------------------------------------------------------------------- attention
def test_mask_from_index_is_pattern_and_causal(rng):
    q_len, kv_len = 130, 200
    v_row = np.array([0, 3, 100, 150, 199], np.int32)
    s_row = np.array([0, 1, 90], np.int32)
    bc, bo, cc, ci = ref.vertical_slash_index([q_len], v_row[None, None], s_row[None, None], q_len,
                                              kv_seqlens=[kv_len])
    mask = ref.vertical_slash_mask(bc[0], bo[0], cc[0], ci[0], q_len, kv_len)[0]
    want = np.zeros((q_len, kv_len), bool)
    for m in range(3):
        rows = slice(64 * m, min(q_len, 64 * m + 64))
        for st in bo[0, 0, m, :bc[0, 0, m]]:
            want[rows, st:st + 64] = True
        want[rows, ci[0, 0, m, :cc[0, 0, m]]] = True
    want &= ra.visible_keys(q_len, kv_len)
    np.testing.assert_array_equal(mask, want)
    assert mask[:, 3].all()                 # a vertical column every row sees


@pytest.mark.parametrize("q_len,kv_len", [(150, 150), (70, 200)])
def test_full_pattern_equals_dense(rng, q_len, kv_len):
    q, k, v = _qkv(rng, q_len, kv_len)
    s_all = np.tile(np.arange(kv_len, dtype=np.int32), (4, 1))
    sinks = rng.standard_normal(4).astype(np.float32)
    out, lse = sparse.vertical_slash_attention(q, k, v, s_all[:, :1].copy(), s_all, sinks=sinks,
                                               return_lse=True)
    want, want_lse = ra.attend(q, k, v, causal=True, sinks=sinks)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
    v_all = s_all.copy()   # every vertical column, no slash but the main diagonal
    out2 = sparse.vertical_slash_attention(q, k, v, v_all, s_all[:, :1].copy(), sinks=sinks)
    np.testing.assert_allclose(out2, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opts", [dict(window_left=17), dict(window_left=0),
                                  dict(logits_soft_cap=1.5, sm_scale=0.5),
                                  dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32)),
                                  dict(sm_scale=-0.2),
                                  dict(window_left=30, logits_soft_cap=2.0,
                                       alibi_slopes=np.array([0.5, 0.1, 0.0, 1.0], np.float32))])
@pytest.mark.parametrize("q_len,kv_len", [(150, 150), (70, 200)])
def test_full_pattern_with_score_options_equals_dense(rng, opts, q_len, kv_len):
    """Window, soft-cap, ALiBi and the scale apply inside the pattern as in dense attention."""
    q, k, v = _qkv(rng, q_len, kv_len)
    s_all = np.tile(np.arange(kv_len, dtype=np.int32), (4, 1))
    sinks = rng.standard_normal(4).astype(np.float32)
    out, lse = sparse.vertical_slash_attention(q, k, v, s_all[:, :1].copy(), s_all, sinks=sinks,
                                               return_lse=True, **opts)
    want, want_lse = ra.attend(q, k, v, causal=True, sinks=sinks, **opts)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
    indptr = np.arange(-(-q_len // 64) + 1, dtype=np.int32) * -(-kv_len // 64)
    indices = np.tile(np.arange(-(-kv_len // 64), dtype=np.int32), -(-q_len // 64))
    bsr_out = sparse.block_sparse_attention(q, k, v, indptr, indices, 64, 64, sinks=sinks, **opts)
    np.testing.assert_allclose(bsr_out, want, rtol=1e-5, atol=1e-6)


def test_window_on_top_of_the_pattern(rng):
    """A window hides pattern keys left of p - w; the pattern still hides keys inside it."""
    q, k, v = _qkv(rng, 140, 140)
    v_idx = np.sort(rng.choice(140, (4, 10), replace=False), axis=1).astype(np.int32)
    s_idx = np.sort(rng.choice(140, (4, 6), replace=False), axis=1).astype(np.int32)
    out = sparse.vertical_slash_attention(q, k, v, v_idx, s_idx, window_left=40)
    window = ra.visible_keys(140, 140, causal=True, window_left=40)
    for h in range(4):
        bc, bo, cc, ci = ref.vertical_slash_index([140], v_idx[None, h:h + 1], s_idx[None, h:h + 1], 140)
        mask = ref.vertical_slash_mask(bc[0], bo[0], cc[0], ci[0], 140, 140)[0] & window
        want, _ = ra.attend_masked(q[:, h:h + 1], k[:, h // 2:h // 2 + 1], v[:, h // 2:h // 2 + 1], mask)
        np.testing.assert_allclose(out[:, h], want[:, 0], rtol=1e-5, atol=1e-6)


def test_backend_is_checked_by_name(rng):
    """NumPy inputs run the reference whatever the backend, but a name not in the choices
    is refused before anything runs."""
    q, k, v = _qkv(rng, 70, 70)
    v_idx = np.sort(rng.choice(70, (4, 5), replace=False), axis=1).astype(np.int32)
    s_idx = np.sort(rng.choice(70, (4, 3), replace=False), axis=1).astype(np.int32)
    want = sparse.vertical_slash_attention(q, k, v, v_idx, s_idx)
    np.testing.assert_array_equal(sparse.vertical_slash_attention(q, k, v, v_idx, s_idx,
                                                                  backend="mma"), want)
    with pytest.raises(ValueError, match=r"backend: expected one of .*got 'sm90'"):
        sparse.vertical_slash_attention(q, k, v, v_idx, s_idx, backend="sm90")


def test_wgmma_kernels_fit_one_cta_an_sm():
    """The sm_90a attention kernels' shared memory stays within an H100/H200 SM's 227 KB
    for every head size, and each (dtype, head size, kind, score path) is a spec."""
    from cupaged.core.arrays import HEAD_DIMS
    from cupaged.sparse import launch
    assert all(launch.ws_smem(d, kind) <= 232448 for d in HEAD_DIMS for kind in launch.WS_KERNELS)
    specs = [s for s in launch.kernel_specializations() if s.stem == "sparse_sm90"]
    assert all(s.hopper for s in specs)
    kinds = len(HEAD_DIMS) + len(launch.WS_TMA_HEAD_DIMS)   # cp.async, and TMA where it fits
    assert len(specs) == 2 * kinds * 2 * 2


def test_pattern_attention_is_masked_dense(rng):
    q, k, v = _qkv(rng, 140, 140)
    v_idx = np.sort(rng.choice(140, (4, 10)), axis=1).astype(np.int32)
    s_idx = np.sort(rng.choice(140, (4, 6)), axis=1).astype(np.int32)
    out = sparse.vertical_slash_attention(q, k, v, v_idx, s_idx, dense_threshold=None)
    for h in range(4):
        bc, bo, cc, ci = ref.vertical_slash_index([140], v_idx[None, h:h + 1], s_idx[None, h:h + 1], 140)
        mask = ref.vertical_slash_mask(bc[0], bo[0], cc[0], ci[0], 140, 140)[0]
        want, _ = ra.attend_masked(q[:, h:h + 1], k[:, h // 2:h // 2 + 1], v[:, h // 2:h // 2 + 1], mask)
        np.testing.assert_allclose(out[:, h], want[:, 0], rtol=1e-5, atol=1e-6)


def test_batched_and_paged_equal_per_sequence(rng):
    q_lens, kv_lens = [50, 0, 80], [90, 10, 80]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q, k, v = _qkv(rng, cu_q[-1], cu_k[-1])
    v_rows = [np.sort(rng.choice(n, (4, 5))).astype(np.int32) for n in kv_lens]
    s_rows = [np.sort(rng.choice(n, (4, 3 + b))).astype(np.int32) for b, n in enumerate(kv_lens)]
    v_idx, s_idx = sparse.pad_indices(v_rows), sparse.pad_indices(s_rows)
    out = sparse.vertical_slash_attention(q, k, v, v_idx, s_idx, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    bs, nb = 16, 20
    tables = np.full((3, 8), -1, np.int32)
    perm = rng.permutation(nb)
    k_cache = rng.standard_normal((nb, bs, 2, 64)).astype(np.float32)
    v_cache = rng.standard_normal((nb, bs, 2, 64)).astype(np.float32)
    used = 0
    for b in range(3):
        for i in range(-(-kv_lens[b] // bs)):
            blk, n = perm[used], min(bs, kv_lens[b] - i * bs)
            tables[b, i], used = blk, used + 1
            k_cache[blk, :n] = k[cu_k[b] + i * bs:cu_k[b] + i * bs + n]
            v_cache[blk, :n] = v[cu_k[b] + i * bs:cu_k[b] + i * bs + n]
    paged = sparse.paged_vertical_slash_attention(q, k_cache, v_cache, v_idx, s_idx, cu_q, tables,
                                                  np.array(kv_lens, np.int32))
    for b in range(3):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if q_lens[b]:
            one = sparse.vertical_slash_attention(q[rows], k[keys], v[keys], v_rows[b], s_rows[b])
            np.testing.assert_array_equal(out[rows], one)
            np.testing.assert_array_equal(paged[rows], one)


def _random_bsr(rng, rows, cols, per_row):
    indptr, indices = [0], []
    for _ in range(rows):
        indices += sorted(rng.choice(cols, min(per_row, cols), replace=False).tolist())
        indptr.append(len(indices))
    return np.array(indptr, np.int32), np.array(indices, np.int32)


@pytest.mark.parametrize("causal", [True, False])
def test_bsr_is_masked_dense(rng, causal):
    q, k, v = _qkv(rng, 100, 130)
    indptr, indices = _random_bsr(rng, 4, 5, 2)
    out, lse = sparse.block_sparse_attention(q, k, v, indptr, indices, 32, 32, causal=causal,
                                             return_lse=True)
    mask = np.zeros((100, 130), bool)
    for r in range(4):
        for c in indices[indptr[r]:indptr[r + 1]]:
            mask[32 * r:32 * r + 32, 32 * c:32 * c + 32] = True
    if causal:
        mask &= ra.visible_keys(100, 130)
    want, want_lse = ra.attend_masked(q, k, v, mask)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
    full_ptr = (np.arange(5) * 5).astype(np.int32)
    full = sparse.block_sparse_attention(q, k, v, full_ptr, np.tile(np.arange(5, dtype=np.int32), 4),
                                         32, 32, causal=causal)
    np.testing.assert_allclose(full, ra.attend(q, k, v, causal=causal)[0], rtol=1e-5, atol=1e-6)


def test_out_buffer_and_bf16(rng):
    from cupaged.core.arrays import bfloat16
    q, k, v = (x.astype(bfloat16) for x in _qkv(rng, 64, 64))
    idx = np.tile(np.arange(64, dtype=np.int32), (4, 1))
    out = np.full(q.shape, np.nan, bfloat16)
    got = sparse.vertical_slash_attention(q, k, v, idx, idx, out=out)
    assert got is out and np.isfinite(out.astype(np.float32)).all()


# ----------------------------------------------------------------------------- policies
def test_policy_interface_defaults():
    pol = sparse.SparsePolicy()
    assert not pol.supports_prefill and not pol.supports_decode
    assert pol.select_blocks([3, 1, 2]) == [3, 1, 2]
    with pytest.raises(NotImplementedError):
        pol.estimate_pattern(None, None)
    with pytest.raises(NotImplementedError):
        pol.sparse_prefill_attention(None, None, None)
    pol.reset()


def test_minference_policy(rng):
    pol = sparse.MInferencePolicy()
    assert (pol.vertical_size, pol.slash_size, pol.adaptive_budget, pol.num_sink_tokens,
            pol.num_recent_diags) == (1000, 6096, 0.3, 30, 100)
    assert pol.supports_prefill and not pol.supports_decode and "0.3" in repr(pol)
    q, k, v = _qkv(rng, 400, 400)
    v_idx, s_idx = pol.estimate_pattern(q, k, 0)
    assert v_idx.shape == (4, 31) and s_idx.shape == (4, 101)          # max(sinks+1, 24), ...
    out = pol.sparse_prefill_attention(q, k, v, 0)
    np.testing.assert_array_equal(out, sparse.vertical_slash_attention(q, k, v, v_idx, s_idx))
    with pytest.raises(ValueError, match="adaptive_budget"):
        sparse.MInferencePolicy(adaptive_budget=2.0)


def test_minference_policy_paged_chunk(rng):
    pol = sparse.MInferencePolicy(vertical_size=8, slash_size=20, adaptive_budget=None,
                                  num_sink_tokens=2, num_recent_diags=5)
    q, k, v = _qkv(rng, 40, 100)
    table = np.arange(7, dtype=np.int32)[::-1].copy()
    kc, vc = np.zeros((7, 16, 2, 64), np.float32), np.zeros((7, 16, 2, 64), np.float32)
    for i in range(7):
        n = min(16, 100 - 16 * i)
        kc[table[i], :n], vc[table[i], :n] = k[16 * i:16 * i + n], v[16 * i:16 * i + n]
    got = pol.paged_prefill_attention(q, kc, vc, table, 100)
    v_idx, s_idx = pol.estimate_pattern(q, k)
    np.testing.assert_array_equal(got, sparse.vertical_slash_attention(q, k, v, v_idx, s_idx))


def _quest_setup(rng, lens, bs=8, hk=2, hq=4, d=64, layout="NHD"):
    nb = sum(-(-n // bs) for n in lens) + 3
    perm = rng.permutation(nb)
    tables = np.full((len(lens), max(-(-n // bs) for n in lens)), -1, np.int32)
    used = 0
    for b, n in enumerate(lens):
        for i in range(-(-n // bs)):
            tables[b, i], used = perm[used], used + 1
    k = rng.standard_normal((nb, bs, hk, d)).astype(np.float32)
    v = rng.standard_normal((nb, bs, hk, d)).astype(np.float32)
    if layout == "HND":
        k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v))
    q = rng.standard_normal((len(lens), hq, d)).astype(np.float32)
    return q, k, v, tables, np.array(lens, np.int32)


def test_quest_bounds_and_upper_bound(rng):
    q, k, _, tables, lens = _quest_setup(rng, [30, 17])
    pol = sparse.QuestPolicy(2)
    with pytest.raises(ValueError, match="reads as NHD .* and as HND"):
        pol.update_bounds(k, tables, lens)  # [nb, 8, 2, d]: 8 kv heads or a block of 8
    pol.update_bounds(k, tables, lens, layout="NHD")
    assert pol.supports_decode and not pol.supports_prefill
    blk, n = tables[1, 2], 17 - 16           # a partial last page: only its first key counts
    np.testing.assert_array_equal(pol.k_min[blk], k[blk, :n].min(axis=0))
    np.testing.assert_array_equal(pol.k_max[blk], k[blk, :n].max(axis=0))
    scores = pol.page_scores(q, tables, lens)
    for b in range(2):
        pages = -(-lens[b] // 8)
        assert np.isposinf(scores[b, :, pages - 1]).all() and np.isneginf(scores[b, :, pages:]).all()
        for h in range(2):
            for p in range(pages - 1):
                keys = k[tables[b, p], :, h]
                true_max = (q[b, 2 * h:2 * h + 2] @ keys.T).max()
                assert scores[b, h, p] >= true_max - 1e-4


@pytest.mark.parametrize("bounds", ["bfloat16", "fp8_e4m3"])
def test_quest_policy_narrow_bounds_still_bound(rng, bounds):
    """bfloat16 and e4m3 bounds are rounded outward: the scores still bound every key's,
    by no more than the float32 bounds' scores plus the rounding."""
    q, k, _, tables, lens = _quest_setup(rng, [30, 17])
    k[..., 0] *= 1000.0                       # past e4m3's range: unknown, scored as infinite
    wide, narrow = sparse.QuestPolicy(2), sparse.QuestPolicy(2, bounds_dtype=bounds)
    for pol in (wide, narrow):
        pol.update_bounds(k, tables, lens, layout="NHD")
    assert narrow.k_min.dtype == sparse.quest.BOUND_NAMES[bounds]
    exact, scores = wide.page_scores(q, tables, lens), narrow.page_scores(q, tables, lens)
    for b in range(2):
        for h in range(2):
            for p in range(-(-lens[b] // 8)):
                keys = k[tables[b, p], :min(8, lens[b] - 8 * p), h]
                assert scores[b, h, p] >= (q[b, 2 * h:2 * h + 2] @ keys.T).max() - 1e-3
    assert (scores >= exact - 1e-3).all()
    if bounds == "fp8_e4m3":
        assert np.isposinf(scores).sum() > np.isposinf(exact).sum()
    with pytest.raises(ValueError, match="bounds_dtype"):
        sparse.QuestPolicy(2, bounds_dtype="fp8_e5m2")


def test_quest_select_keeps_last_page_in_order(rng):
    q, k, _, tables, lens = _quest_setup(rng, [60, 20])
    pol = sparse.QuestPolicy(3)
    pol.update_bounds(k, tables, lens, layout="NHD")
    pos, counts = pol.select_pages(q, tables, lens)
    assert counts.tolist() == [3, 3]
    for b, pages in enumerate((8, 3)):
        for h in range(2):
            row = pos[b, h, :counts[b]]
            assert (np.diff(row) > 0).all() and row[-1] == pages - 1
    ctx = sparse.PolicyContext(query=q[0], seq_len=60)
    chosen = pol.select_blocks(list(tables[0, :8]), ctx)
    assert set(chosen) == set(tables[0, np.unique(pos[0, :, :3])])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_quest_decode_reads_selected_pages(rng, layout):
    """Each kv head reads exactly its own pages, in every layout."""
    pytest.importorskip("cupaged.decode.api")
    q, k, v, tables, lens = _quest_setup(rng, [60, 20, 5], layout=layout)
    pol = sparse.QuestPolicy(2)
    pol.update_bounds(k, tables, lens, layout=layout)
    out = pol.decode(q, k, v, tables, lens, layout=layout)
    pos, counts = pol.select_pages(q, tables, lens)
    kn, vn = (x.transpose(0, 2, 1, 3) if layout == "HND" else x for x in (k, v))
    for b in range(3):
        for h in range(4):
            kvh = h // 2
            pages = [int(p) for p in pos[b, kvh, :counts[b]]]
            keys = [(tables[b, p], o) for p in pages for o in range(8) if p * 8 + o < lens[b]]
            kk = np.stack([kn[blk, o, kvh] for blk, o in keys])
            vv = np.stack([vn[blk, o, kvh] for blk, o in keys])
            s = kk @ q[b, h] / 8.0
            w = np.exp(s - s.max())
            np.testing.assert_allclose(out[b, h], w @ vv / w.sum(), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- bad input
def test_bad_estimate_arguments(rng):
    q, k, _ = _qkv(rng, 10, 10)
    ok = dict(vertical_size=4, slash_size=4)
    with pytest.raises(ValueError, match="last_q"):
        sparse.estimate_vertical_slash(q, k, last_q=65, **ok)
    with pytest.raises(ValueError, match="vertical_size"):
        sparse.estimate_vertical_slash(q, k, vertical_size=0, slash_size=4)
    with pytest.raises(ValueError, match="adaptive_budget"):
        sparse.estimate_vertical_slash(q, k, adaptive_budget=0.0, **ok)
    with pytest.raises(ValueError, match="q_len"):
        sparse.estimate_vertical_slash(q, k[:5], **ok)
    with pytest.raises(TypeError, match="k"):
        sparse.estimate_vertical_slash(q, k.astype(np.float16), **ok)
    with pytest.raises(ValueError, match="num_kv_heads"):
        sparse.estimate_vertical_slash(q, np.ascontiguousarray(np.repeat(k, 2, axis=1)[:, :3]), **ok)
    with pytest.raises(ValueError, match="block_table"):
        sparse.paged_estimate_vertical_slash(q, np.zeros((2, 4, 2, 64), np.float32),
                                             np.array([0, 5], np.int32), 8, layout="NHD", **ok)
    with pytest.raises(ValueError, match="k_cache: shape .* reads as NHD .* and as HND"):
        sparse.paged_estimate_vertical_slash(q, np.zeros((2, 4, 2, 64), np.float32),
                                             np.array([0, 1], np.int32), 8, **ok)


def test_bad_index_arguments():
    lens = np.array([100], np.int32)
    v = np.zeros((1, 2, 3), np.int32)
    with pytest.raises(ValueError, match="s_idx"):
        sparse.vertical_slash_index(lens, v, np.zeros((1, 3, 3), np.int32), 100)
    with pytest.raises(ValueError, match="v_idx"):
        sparse.vertical_slash_index(lens, v - 1, v, 100)
    with pytest.raises(TypeError, match="v_idx"):
        sparse.vertical_slash_index(lens, v.astype(np.int64), v, 100)
    with pytest.raises(ValueError, match="context_size"):
        sparse.vertical_slash_index(lens, v, v, 99)
    with pytest.raises(ValueError, match="block_n"):
        sparse.vertical_slash_index(lens, v, v, 100, 64, 0)
    with pytest.raises(ValueError, match="kv_seqlens"):
        sparse.vertical_slash_index(lens, v, v, 100, kv_seqlens=np.array([50], np.int32))
    with pytest.raises(ValueError, match="max_kv_len: expected >= the longest kv_seqlens"):
        sparse.vertical_slash_index(lens, v, v, 100, kv_seqlens=np.array([300], np.int32),
                                    max_kv_len=299)
    with pytest.raises(ValueError, match="max_kv_len: expected None without kv_seqlens"):
        sparse.vertical_slash_index(lens, v, v, 100, max_kv_len=100)
    with pytest.raises(TypeError, match="max_kv_len"):
        sparse.vertical_slash_index(lens, v, v, 100, kv_seqlens=lens, max_kv_len=1.5)


def test_index_widths_follow_the_host_bound(rng):
    """The lists are as wide as the key bound needs (context_size without kv_seqlens, else
    max_kv_len or the longest kv_seqlens), whatever the lengths; the lists agree."""
    q_lens = np.array([70, 5], np.int32)
    v_idx = rng.integers(0, 70, (2, 2, 6)).astype(np.int32)
    s_idx = rng.integers(0, 70, (2, 2, 40)).astype(np.int32)
    short = sparse.vertical_slash_index(q_lens, v_idx, s_idx, 70, 64, 16)
    wide = sparse.vertical_slash_index(q_lens, v_idx, s_idx, 1000, 64, 16)
    bounded = sparse.vertical_slash_index(q_lens, v_idx, s_idx, 1000, 64, 16, kv_seqlens=q_lens,
                                          max_kv_len=5000)
    w = lambda n: ref.index_widths(6, 40, n, 64, 16)[0]
    assert short[1].shape[-1] == w(70) < wide[1].shape[-1] == w(1000) < bounded[1].shape[-1] == w(5000)
    for a, b in ((short, wide), (wide, bounded)):
        np.testing.assert_array_equal(a[0], b[0][:, :, :a[0].shape[2]])
        np.testing.assert_array_equal(a[2], b[2][:, :, :a[2].shape[2]])
        m = a[0].shape[2]
        np.testing.assert_array_equal(a[1], b[1][:, :, :m, :a[1].shape[3]])
        assert not b[1][:, :, :m, a[1].shape[3]:].any()


def test_bad_attention_arguments(rng):
    q, k, v = _qkv(rng, 20, 20)
    idx = np.zeros((4, 3), np.int32)
    with pytest.raises(ValueError, match="v_idx"):
        sparse.vertical_slash_attention(q, k, v, idx[:3], idx)
    with pytest.raises(ValueError, match="q_len"):
        sparse.vertical_slash_attention(q, k[:10], v[:10], idx, idx)
    with pytest.raises(ValueError, match="cu_seqlens"):
        sparse.vertical_slash_attention(q, k, v, idx, idx, cu_seqlens_q=np.array([0, 20], np.int32))
    with pytest.raises(ValueError, match="v"):
        sparse.vertical_slash_attention(q, k, v[:, :1], idx, idx)
    with pytest.raises(ValueError, match="sinks"):
        sparse.vertical_slash_attention(q, k, v, idx, idx, sinks=np.zeros(3, np.float32))
    for kw, error, match in [
            (dict(window_left=-3), ValueError, r"window_left: expected an int >= -1 \(-1: no window\), got -3"),
            (dict(logits_soft_cap=-0.5), ValueError, r"logits_soft_cap: expected a finite float >= 0 \(0: off\), got -0.5"),
            (dict(alibi_slopes=np.zeros(3, np.float32)), ValueError, r"alibi_slopes: expected shape \[4\], got \(3,\)"),
            (dict(alibi_slopes=np.zeros(4, np.float64)), TypeError, "alibi_slopes: expected dtype float32")]:
        with pytest.raises(error, match=match):
            sparse.vertical_slash_attention(q, k, v, idx, idx, **kw)
        with pytest.raises(error, match=match):
            sparse.paged_vertical_slash_attention(
                q, np.zeros((3, 8, 2, 64), np.float32), np.zeros((3, 8, 2, 64), np.float32),
                idx[None], idx[None], np.array([0, 20], np.int32), np.zeros((1, 3), np.int32),
                np.array([20], np.int32), **kw)
    with pytest.raises(ValueError, match="out"):
        sparse.vertical_slash_attention(q, k, v, idx, idx, out=np.zeros((20, 4, 32), np.float32))
    with pytest.raises(ValueError, match="seq_lens"):
        sparse.paged_vertical_slash_attention(q, np.zeros((2, 8, 2, 64), np.float32),
                                              np.zeros((2, 8, 2, 64), np.float32), idx[None], idx[None],
                                              np.array([0, 20], np.int32), np.zeros((1, 2), np.int32),
                                              np.array([20], np.int32))


def test_bad_bsr_arguments(rng):
    q, k, v = _qkv(rng, 64, 64)
    with pytest.raises(ValueError, match="indptr"):
        sparse.block_sparse_attention(q, k, v, np.array([0, 1, 1], np.int32), np.array([0], np.int32), 64, 64)
    with pytest.raises(ValueError, match="indices"):
        sparse.block_sparse_attention(q, k, v, np.array([0, 1], np.int32), np.array([1], np.int32), 64, 64)
    with pytest.raises(ValueError, match="increasing"):
        sparse.block_sparse_attention(q, k, v, np.array([0, 2], np.int32), np.array([1, 0], np.int32), 64, 32)
    with pytest.raises(ValueError, match="last entry"):
        sparse.block_sparse_attention(q, k, v, np.array([0, 2], np.int32), np.array([0], np.int32), 64, 32)
    with pytest.raises(ValueError, match="block_m"):
        sparse.block_sparse_attention(q, k, v, np.array([0, 1], np.int32), np.array([0], np.int32), 0, 32)


def test_bad_policy_arguments(rng):
    with pytest.raises(ValueError, match="top_k_pages"):
        sparse.QuestPolicy(0)
    q, k, _, tables, lens = _quest_setup(rng, [20])
    with pytest.raises(ValueError, match="update_bounds"):
        sparse.QuestPolicy(2).page_scores(q, tables, lens)
    with pytest.raises(ValueError, match="block_tables"):
        sparse.QuestPolicy(2).update_bounds(k, tables + 100, lens, layout="NHD")


# ----------------------------------------------------------------------------- dense fallback
def test_dense_heads_count_kept_and_causal_blocks():
    """q_len = kv_len = 256, 64 x 64 blocks: 1 + 2 + 3 + 4 = 10 causal blocks. Head 0 keeps
    the diagonal blocks (4, one per query block); head 1 also two columns in block 3 (one
    more block); head 2 keeps them all."""
    bc = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 2, 3, 4]])
    cc = np.array([[0, 0, 0, 0], [0, 0, 0, 2], [0, 0, 0, 0]])
    got = ref.dense_heads(bc, cc, 256, 256, 64, 64, 0.45)
    assert got.tolist() == [False, True, True]              # 4, 5, 10 of 10 blocks
    assert ref.dense_heads(bc, cc, 256, 256, 64, 64, 0.4).tolist() == [False, True, True]
    assert ref.dense_heads(bc, cc, 256, 256, 64, 64, 0.5).tolist() == [False, False, True]
    assert not ref.dense_heads(bc, cc, 256, 256, 64, 64, None).any()
    assert not ref.dense_heads(bc, cc, 256, 256, 64, 64, 1.0).any()  # "more than"


def test_fallback_heads_are_dense_the_others_their_pattern(rng):
    """Heads whose pattern keeps more than the threshold get full causal attention (with the
    options); the others their pattern, as with no threshold."""
    q, k, v = _qkv(rng, 700, 901)
    v_idx = np.tile(np.array([0, 1, 2], np.int32), (4, 1))
    s_idx = np.tile(np.arange(20, dtype=np.int32), (4, 1))  # a band: few blocks
    s_idx[1] = np.arange(0, 901, 40)[:20]                   # spread: most blocks
    s_idx[3] = np.arange(0, 901, 45)[:20]
    bc, _, cc, _ = ref.vertical_slash_index([700], v_idx[None], s_idx[None], 700, kv_seqlens=[901])
    dense = ref.dense_heads(bc[0], cc[0], 700, 901, 64, 64, sparse.DENSE_THRESHOLD)
    assert dense.tolist() == [False, True, False, True]
    sinks = rng.standard_normal(4).astype(np.float32)
    out, lse = sparse.vertical_slash_attention(q, k, v, v_idx, s_idx, sinks=sinks, window_left=90,
                                               return_lse=True)
    exact = sparse.vertical_slash_attention(q, k, v, v_idx, s_idx, sinks=sinks, window_left=90,
                                            dense_threshold=None)
    full, full_lse = ra.attend(q, k, v, causal=True, sinks=sinks, window_left=90)
    for h in range(4):
        want = full[:, h] if dense[h] else exact[:, h]
        np.testing.assert_allclose(out[:, h], want, rtol=1e-5, atol=1e-6)
        if dense[h]:
            np.testing.assert_allclose(lse[:, h], full_lse[:, h], rtol=1e-5, atol=1e-6)


def test_dense_threshold_is_checked(rng):
    q, k, v = _qkv(rng, 20, 20)
    idx = np.zeros((4, 2), np.int32)
    for bad in (1.5, -0.1, "half", True):
        with pytest.raises(ValueError, match="dense_threshold"):
            sparse.vertical_slash_attention(q, k, v, idx, idx, dense_threshold=bad)
