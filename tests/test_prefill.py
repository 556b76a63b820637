"""Prefill: varlen_prefill, paged_prefill, paged_attention, PagedPrefiller.

CPU: the NumPy path against the reference and cross-checks (paged vs ragged, plan/run vs
functional), the host plan (work list coverage, the kernel's tile/mask logic emulated, the
stride formulas against the real layouts) and bad input for every argument.
GPU (``gpu`` marker): the kernels against the float64 reference for every dtype, head size,
layout and option, with outputs poisoned before the run.
"""
import numpy as np
import pytest

import cupaged
from cupaged import prefill_plan as plan_
from cupaged._arrays import HEAD_DIMS, bfloat16
from cupaged.layouts import LAYOUTS, cache_shapes, k_as_nhd, v_as_nhd
from cupaged.reference import attention as ref
from cupaged.reference.cache import write_kv_cache

DTYPES = [np.float16, bfloat16, np.float32]
TOL = {np.dtype(np.float16): 2e-3, bfloat16: 1e-2, np.dtype(np.float32): 1e-4}


# ----------------------------------------------------------------------------- builders
def _rand(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def ragged(rng, q_lens, kv_lens, hq, hk, d, dtype):
    """Random packed q, k, v and int32 prefix sums."""
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = _rand(rng, (cu_q[-1], hq, d), dtype)
    k = _rand(rng, (cu_k[-1], hk, d), dtype)
    v = _rand(rng, (cu_k[-1], hk, d), dtype)
    return q, k, v, cu_q, cu_k


def paged(rng, k, v, cu_k, layout, block_size, spare=3, num_blocks=None):
    """Lay ragged k/v into a paged cache with shuffled blocks; returns caches, tables, lens.

    Unused cache entries hold random values (never read); tables are -1 padded.
    """
    lens = np.diff(cu_k).astype(np.int32)
    need = -(-lens // block_size)
    total = int(need.sum()) + spare if num_blocks is None else num_blocks
    ks, vs = cache_shapes(layout, total, block_size, k.shape[1], k.shape[2], k.dtype)
    k_cache, v_cache = _rand(rng, ks, k.dtype), _rand(rng, vs, k.dtype)
    ids = rng.permutation(total)[:need.sum()].astype(np.int32)
    tables = np.full((len(lens), int(need.max(initial=0)) + 1), -1, np.int32)
    slots = []
    for b, start in enumerate(np.cumsum(need) - need):
        tables[b, :need[b]] = ids[start:start + need[b]]
        t = np.arange(lens[b])
        slots.append(tables[b, t // block_size].astype(np.int64) * block_size + t % block_size)
    write_kv_cache(k, v, k_cache, v_cache, np.concatenate(slots + [np.zeros(0, np.int64)]), layout)
    return k_cache, v_cache, tables, lens


def rel_err(out, want):
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-30)


def assert_close(out, want, dtype):
    assert np.isfinite(np.asarray(out, np.float64)).all(), "non-finite output"
    err = rel_err(out, want)
    assert err < TOL[np.dtype(dtype)], f"relative error {err:.3g}"


def assert_lse(lse, want):
    lse, want = np.asarray(lse, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(lse[fin], want[fin], rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------- CPU: NumPy path
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_numpy_paged_equals_ragged(rng, layout, dtype):
    q_lens, kv_lens = np.array([3, 0, 5, 2]), np.array([7, 4, 5, 0])
    q, k, v, cu_q, cu_k = ragged(rng, q_lens, kv_lens, 4, 2, 64, dtype)
    kc, vc, bt, sl = paged(rng, k, v, cu_k, layout, 4)
    opts = dict(window_left=3, sinks=_rand(rng, 4, np.float32), logits_soft_cap=5.0)
    o1, l1 = cupaged.varlen_prefill(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    o2, l2 = cupaged.paged_prefill(q, kc, vc, cu_q, bt, sl, layout=layout, return_lse=True, **opts)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)
    assert (o1[3:3] == 0).all() and np.isfinite(l1).all()


def test_numpy_out_is_written_and_returned(rng):
    q, k, v, cu_q, cu_k = ragged(rng, [4, 2], [6, 2], 2, 1, 80, np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    res = cupaged.varlen_prefill(q, k, v, cu_q, cu_k, out=out, causal=False)
    assert res is out
    np.testing.assert_allclose(out, ref.varlen_prefill(q, k, v, cu_q, cu_k, causal=False))


def test_numpy_chunked_prefill_equals_one_shot(rng):
    """Three chunks through paged_prefill == one varlen_prefill over the whole prompt."""
    q, k, v, cu_q, cu_k = ragged(rng, [10], [10], 4, 2, 64, np.float32)
    kc, vc, bt, _ = paged(rng, k, v, cu_k, "HND", 4)
    whole = cupaged.varlen_prefill(q, k, v, cu_q, cu_k)
    for a, b in [(0, 3), (3, 8), (8, 10)]:
        part = cupaged.paged_prefill(q[a:b], kc, vc, np.array([0, b - a], np.int32), bt,
                                     np.array([b], np.int32), layout="HND")
        np.testing.assert_allclose(part, whole[a:b], rtol=1e-5, atol=1e-6)


def test_numpy_prefiller_matches_functional(rng):
    q, k, v, cu_q, cu_k = ragged(rng, [1, 6, 1], [9, 6, 3], 8, 2, 96, np.float32)
    kc, vc, bt, sl = paged(rng, k, v, cu_k, "vllm", 4)
    pre = cupaged.PagedPrefiller(8, 2, 96, 4, dtype="float32", layout="vllm", window_left=4)
    pre.plan(cu_q, bt, sl)
    slopes = _rand(rng, 8, np.float32, 0.1)
    want = cupaged.paged_attention(q, kc, vc, cu_q, bt, sl, layout="vllm", window_left=4,
                                   alibi_slopes=slopes)
    np.testing.assert_array_equal(pre.run(q, kc, vc, alibi_slopes=slopes), want)


# ----------------------------------------------------------------------------- CPU: host plan
def _covered_rows(items, q_lens, group):
    seen = {}
    for b, h, r0, _ in items:
        for r in range(r0, min(r0 + plan_.BLOCK_M, q_lens[b] * group)):
            seen[(b, h, r)] = seen.get((b, h, r), 0) + 1
    return seen


@pytest.mark.parametrize("group, causal, window", [(1, True, -1), (4, True, 50), (8, False, -1), (3, False, 7)])
def test_work_list_covers_every_row_once_longest_first(rng, group, causal, window):
    q_lens = rng.integers(0, 300, 6)
    kv_lens = q_lens + rng.integers(0, 200, 6)
    kv_lens[0] = 0
    items = plan_.work_list(q_lens, kv_lens, group=group, num_kv_heads=2, head_dim=128,
                            causal=causal, window_left=window)
    assert items.dtype == np.int32 and items.shape[1] == 4
    seen = _covered_rows(items, q_lens, group)
    want = {(b, h, r) for b in range(6) for h in range(2) for r in range(q_lens[b] * group)}
    assert set(seen) == want and set(seen.values()) <= {1}
    cost = []
    for b, _, r0, _ in items:
        lo, hi = _tile_keys(q_lens[b], kv_lens[b], group, r0, causal, window)
        cost.append(max(0, -(-hi // 64) - lo // 64) if hi > lo else 0)
    assert (np.diff(cost) <= 0).all()


def _tile_keys(q_len, kv_len, group, row0, causal, window):
    """Keys [lo, hi) some row of the tile starting at packed row0 sees (kernel's formula)."""
    last = min(row0 + plan_.BLOCK_M, q_len * group) - 1
    p0, p1 = kv_len - q_len + row0 // group, kv_len - q_len + last // group
    lo = max(0, p0 - window) if window >= 0 else 0
    hi = min(kv_len, p1 + 1) if causal else kv_len
    return lo, hi


@pytest.mark.parametrize("block_n", [32, 64])
def test_kernel_tile_logic_emulated(rng, block_n):
    """Mirror prefill_mma's tile range, warp skipping and mask-free test in Python: every
    visible (row, key) pair lies in a computed tile, and mask-free tiles hide nothing."""
    for _ in range(40):
        group = int(rng.choice([1, 2, 5, 8]))
        q_len, kv_len = int(rng.integers(1, 90)), int(rng.integers(0, 300))
        causal, window = bool(rng.integers(2)), int(rng.choice([-1, 0, 3, 40]))
        vis = ref.visible_keys(q_len, kv_len, causal=causal, window_left=window)
        for row0 in range(0, q_len * group, plan_.BLOCK_M):
            rows = min(plan_.BLOCK_M, q_len * group - row0)
            lo, hi = _tile_keys(q_len, kv_len, group, row0, causal, window)
            tiles = range(lo // block_n, (hi - 1) // block_n + 1) if hi > lo else range(0)
            for first in range(0, rows, 16):
                last = min(first + 15, rows - 1)
                pos = lambda r: kv_len - q_len + (row0 + r) // group  # noqa: E731
                lo_w = max(0, pos(first) - window) if window >= 0 else 0
                hi_w = min(kv_len, pos(last) + 1) if causal else kv_len
                hi_min = min(kv_len, pos(first) + 1) if causal else kv_len
                lo_max = max(0, pos(last) - window) if window >= 0 else 0
                done = np.zeros(kv_len, bool)
                for n in tiles:
                    j0 = n * block_n
                    if not (j0 < hi_w and j0 + block_n > lo_w):
                        continue
                    done[j0:j0 + block_n] = True
                    if not (j0 + block_n > hi_min or j0 < lo_max):
                        for r in range(first, last + 1):
                            assert vis[(row0 + r) // group, j0:j0 + block_n].all()
                for r in range(first, last + 1):
                    assert not (vis[(row0 + r) // group] & ~done).any()


@pytest.mark.parametrize("layout", ("ragged",) + LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_kv_strides_locate_elements(rng, layout, dtype):
    """The kernel's address formula with kv_strides() hits the element the layout defines."""
    nb, bs, hk, d = 5, 8, 3, 32
    x = 16 // np.dtype(dtype).itemsize
    if layout == "ragged":
        ks = vs = (nb * bs, hk, d)
    else:
        ks, vs = cache_shapes(layout, nb, bs, hk, d, dtype)
    kc = np.arange(np.prod(ks)).reshape(ks)
    vc = np.arange(np.prod(vs)).reshape(vs) + 7
    as_nhd = (lambda c, _: c) if layout == "ragged" else None
    kn = (as_nhd or k_as_nhd)(kc, layout).reshape(nb * bs, hk, d)
    vn = (as_nhd or v_as_nhd)(vc, layout).reshape(nb * bs, hk, d)
    s = plan_.kv_strides(layout, bs, hk, d, dtype)
    for _ in range(50):
        blk, off, h, e = rng.integers(nb), rng.integers(bs), rng.integers(hk), rng.integers(d)
        if layout == "ragged":
            blk, off = 0, blk * bs + off
        tok = blk * bs + off
        k_at = blk * s.k_block + h * s.k_head + (e // x) * s.k_chunk + e % x + off * s.k_tok
        v_at = blk * s.v_block + h * s.v_head + e * s.v_dim + off * s.v_tok
        assert kc.ravel()[k_at] == kn[tok, h, e]
        assert vc.ravel()[v_at] == vn[tok, h, e]


def test_smem_fits_and_specs_cover_every_head_dim():
    from cupaged.prefill import kernel_specializations
    for d in HEAD_DIMS:
        for vt in (False, True):
            assert plan_.smem_bytes(np.float16, d, vt) <= 227 * 1024
    exprs = {s.expr for s in kernel_specializations()}
    assert len(exprs) == 2 * len(HEAD_DIMS) * 2 + len(HEAD_DIMS)
    assert "cupaged::prefill_kernel<__nv_bfloat16, 128, false>" in exprs


# ----------------------------------------------------------------------------- CPU: bad input
def _varlen_args(rng):
    q, k, v, cu_q, cu_k = ragged(rng, [3, 4], [5, 4], 4, 2, 64, np.float16)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def _paged_args(rng):
    q, k, v, cu_q, cu_k = ragged(rng, [3, 4], [5, 4], 4, 2, 64, np.float16)
    kc, vc, bt, sl = paged(rng, k, v, cu_k, "NHD", 4)
    return dict(q=q, k_cache=kc, v_cache=vc, cu_seqlens_q=cu_q, block_tables=bt, seq_lens=sl)


VARLEN_BAD = [
    ("q", lambda a: a.update(q=a["q"].astype(np.float64)), TypeError),
    ("q", lambda a: a.update(q=a["q"][:, :, :48].copy()), ValueError),
    ("q", lambda a: a.update(q=a["q"][None]), ValueError),
    ("q", lambda a: a.update(q=a["q"][:, ::2]), ValueError),
    ("q", lambda a: a.update(q=None), TypeError),
    ("k", lambda a: a.update(k=a["k"].astype(np.float32)), TypeError),
    ("k", lambda a: a.update(k=np.concatenate([a["k"]] * 2, axis=2)), ValueError),
    ("k", lambda a: a.update(k=a["k"][:, :1].repeat(3, axis=1), v=a["v"][:, :1].repeat(3, axis=1)), ValueError),
    ("v", lambda a: a.update(v=a["v"][:-1]), ValueError),
    ("cu_seqlens_q", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].astype(np.int64)), TypeError),
    ("cu_seqlens_q", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"] + 1), ValueError),
    ("cu_seqlens_q", lambda a: a.update(cu_seqlens_q=np.array([0, 5, 3, 7], np.int32)), ValueError),
    ("cu_seqlens_q", lambda a: a.update(cu_seqlens_q=np.array([0, 3, 6], np.int32)), ValueError),
    ("cu_seqlens_k", lambda a: a.update(cu_seqlens_k=np.array([0, 9], np.int32)), ValueError),
    ("max_seqlen_q", lambda a: a.update(max_seqlen_q=3), ValueError),
    ("max_seqlen_k", lambda a: a.update(max_seqlen_k=2.5), ValueError),
]
OPTION_BAD = [
    ("causal", lambda a: a.update(causal="yes"), TypeError),
    ("return_lse", lambda a: a.update(return_lse=1), TypeError),
    ("sm_scale", lambda a: a.update(sm_scale=float("nan")), ValueError),
    ("window_left", lambda a: a.update(window_left=-2), ValueError),
    ("logits_soft_cap", lambda a: a.update(logits_soft_cap=-1.0), ValueError),
    ("alibi_slopes", lambda a: a.update(alibi_slopes=np.zeros(3, np.float32)), ValueError),
    ("sinks", lambda a: a.update(sinks=np.zeros(4, np.float64)), TypeError),
    ("out", lambda a: a.update(out=np.zeros((7, 4, 32), np.float16)), ValueError),
    ("out", lambda a: a.update(out=np.zeros((7, 4, 64), np.float32)), TypeError),
]
PAGED_BAD = [
    ("layout", lambda a: a.update(layout="NDH"), ValueError),
    ("k_cache", lambda a: a.update(k_cache=None), TypeError),
    ("k_cache", lambda a: a.update(k_cache=a["k_cache"].astype(np.float32),
                                   v_cache=a["v_cache"].astype(np.float32)), TypeError),
    ("k_cache", lambda a: a.update(k_cache=a["k_cache"][..., :32].copy(),
                                   v_cache=a["v_cache"][..., :32].copy()), ValueError),
    ("k_cache", lambda a: a.update(q=a["q"][:, :3].copy()), ValueError),
    ("v_cache", lambda a: a.update(v_cache=a["v_cache"][:-1]), ValueError),
    ("cu_seqlens_q", lambda a: a.update(cu_seqlens_q=np.array([0, 3, 8], np.int32)), ValueError),
    ("block_tables", lambda a: a.update(block_tables=a["block_tables"].astype(np.int64)), TypeError),
    ("block_tables", lambda a: a.update(block_tables=a["block_tables"][:1]), ValueError),
    ("block_tables", lambda a: a["block_tables"].__setitem__((1, 0), 10 ** 6), ValueError),
    ("block_tables", lambda a: a["block_tables"].__setitem__((0, 0), -1), ValueError),
    ("seq_lens", lambda a: a["seq_lens"].__setitem__(0, 100), ValueError),
    ("seq_lens", lambda a: a["seq_lens"].__setitem__(0, -1), ValueError),
    ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].astype(np.int64)), TypeError),
]


@pytest.mark.parametrize("name, mutate, exc", VARLEN_BAD + OPTION_BAD)
def test_varlen_rejects_bad_input(rng, name, mutate, exc):
    args = _varlen_args(rng)
    poisoned = np.full(args["q"].shape, np.nan, np.float16)
    args["out"] = poisoned
    mutate(args)
    with pytest.raises(exc, match=name):
        cupaged.varlen_prefill(**args)
    assert np.isnan(poisoned).all()


@pytest.mark.parametrize("name, mutate, exc", PAGED_BAD + OPTION_BAD)
@pytest.mark.parametrize("op", ["paged_prefill", "paged_attention"])
def test_paged_rejects_bad_input(rng, op, name, mutate, exc):
    args = _paged_args(rng)
    mutate(args)
    with pytest.raises(exc, match=name):
        getattr(cupaged, op)(**args)


@pytest.mark.parametrize("name, kwargs, exc", [
    ("head_dim", dict(head_dim=72), ValueError),
    ("num_kv_heads", dict(num_kv_heads=3), ValueError),
    ("block_size", dict(block_size=0), ValueError),
    ("dtype", dict(dtype="int8"), TypeError),
    ("layout", dict(layout="nhd"), ValueError),
    ("causal", dict(causal=None), TypeError),
    ("window_left", dict(window_left=-5), ValueError),
])
def test_prefiller_rejects_bad_construction(name, kwargs, exc):
    base = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4, dtype="float16")
    with pytest.raises(exc, match=name):
        cupaged.PagedPrefiller(**{**base, **kwargs})


def test_prefiller_rejects_bad_plan_and_run(rng):
    a = _paged_args(rng)
    pre = cupaged.PagedPrefiller(4, 2, 64, 4, dtype="float16")
    with pytest.raises(ValueError, match="plan"):
        pre.run(a["q"], a["k_cache"], a["v_cache"])
    with pytest.raises(ValueError, match="seq_lens"):
        pre.plan(a["cu_seqlens_q"], a["block_tables"], a["seq_lens"] * 10)
    pre.plan(a["cu_seqlens_q"], a["block_tables"], a["seq_lens"])
    with pytest.raises(ValueError, match="q"):
        pre.run(a["q"][:-1], a["k_cache"], a["v_cache"])
    with pytest.raises(TypeError, match="q"):
        pre.run(a["q"].astype(np.float32), a["k_cache"], a["v_cache"])
    kc, vc = a["k_cache"].reshape(-1, 2, 2, 64), a["v_cache"].reshape(-1, 2, 2, 64)
    with pytest.raises(ValueError, match="k_cache"):
        pre.run(a["q"], kc, vc)
    with pytest.raises(ValueError, match="block_tables"):
        pre.run(a["q"], a["k_cache"][:1], a["v_cache"][:1])
    with pytest.raises(TypeError, match="sinks"):
        pre.run(a["q"], a["k_cache"], a["v_cache"], sinks=np.zeros(4))
