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
from cupaged.prefill import plan as plan_
from cupaged.core.arrays import HEAD_DIMS, bfloat16
from cupaged.core.checks import check_block_elements
from cupaged.core.layouts import LAYOUTS, cache_shapes, k_as_nhd, layout_strides, v_as_nhd
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


def paged(rng, k, v, cu_k, layout, block_size, spare=3, num_blocks=None, fill=None):
    """Lay ragged k/v into a paged cache with shuffled blocks; returns caches, tables, lens.

    Unused cache entries hold random values (never read), or ``fill``; tables are -1 padded.
    """
    lens = np.diff(cu_k).astype(np.int32)
    need = -(-lens // block_size)
    total = int(need.sum()) + spare if num_blocks is None else num_blocks
    ks, vs = cache_shapes(layout, total, block_size, k.shape[1], k.shape[2], k.dtype)
    if fill is None:
        k_cache, v_cache = _rand(rng, ks, k.dtype), _rand(rng, vs, k.dtype)
    else:
        k_cache, v_cache = np.full(ks, fill, k.dtype), np.full(vs, fill, k.dtype)
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
TILES = [plan_.default_tile(128), plan_.default_tile(256), plan_.TileShape(8, 2, 64, 2, False, 1),
         plan_.SIMT_TILE]


def _covered_rows(items, q_lens, group, block_m):
    seen = {}
    for b, h, r0, _ in items:
        for r in range(r0, min(r0 + block_m, q_lens[b] * group)):
            seen[(b, h, r)] = seen.get((b, h, r), 0) + 1
    return seen


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("heads, sections", [(2, None), (5, 2), (3, 1)])
@pytest.mark.parametrize("group, causal, window", [(1, True, -1), (4, True, 50), (8, False, -1), (3, False, 7)])
def test_work_list_covers_every_row_once_longest_first(rng, group, causal, window, tile, heads,
                                                        sections):
    q_lens = rng.integers(0, 300, 6)
    kv_lens = q_lens + rng.integers(0, 200, 6)
    kv_lens[0] = 0
    items = plan_.work_list(q_lens, kv_lens, group=group, num_kv_heads=heads, tile=tile,
                            causal=causal, window_left=window, section_heads=sections)
    assert items.dtype == np.int32 and items.shape[1] == 4
    seen = _covered_rows(items, q_lens, group, tile.block_m)
    want = {(b, h, r) for b in range(6) for h in range(heads) for r in range(q_lens[b] * group)}
    assert set(seen) == want and set(seen.values()) <= {1}
    per_head, hs = len(items) // heads, sections or heads
    for h0 in range(0, heads, hs):  # sections of hs heads in order, each longest first
        part = items[per_head * h0:per_head * min(h0 + hs, heads)]
        assert set(part[:, 1]) == set(range(h0, min(h0 + hs, heads)))
        cost = []
        for b, _, r0, _ in part:
            lo, hi = _tile_keys(q_lens[b], kv_lens[b], group, r0, causal, window, tile.block_m)
            bn = tile.block_n
            cost.append(max(0, -(-hi // bn) - lo // bn) if hi > lo else 0)
        assert (np.diff(cost) <= 0).all()


@pytest.mark.parametrize("tokens, d, itemsize, heads, l2, want", [
    (16384, 128, 2, 32, 50 << 20, 3), (16384, 128, 1, 32, 50 << 20, 6),
    (100, 64, 2, 8, 50 << 20, 8), (1 << 22, 256, 2, 8, 50 << 20, 1), (0, 128, 2, 4, 1, 1)])
def test_section_heads_fill_a_share_of_the_l2(tokens, d, itemsize, heads, l2, want):
    assert plan_.section_heads(tokens, d, itemsize, heads, l2) == want


def _tile_keys(q_len, kv_len, group, row0, causal, window, block_m):
    """Keys [lo, hi) some row of the tile starting at packed row0 sees (kernel's formula)."""
    last = min(row0 + block_m, q_len * group) - 1
    p0, p1 = kv_len - q_len + row0 // group, kv_len - q_len + last // group
    lo = max(0, p0 - window) if window >= 0 else 0
    hi = min(kv_len, p1 + 1) if causal else kv_len
    return lo, hi


def _warp_keys(q_len, kv_len, group, row0, first, last, causal, window):
    """WarpKeys (j_lo, j_hi, hi_min, lo_max) for valid tile rows [first, last]."""
    pos = lambda r: kv_len - q_len + (row0 + r) // group  # noqa: E731
    lo = lambda p: max(0, p - window) if window >= 0 else 0  # noqa: E731
    hi = lambda p: min(kv_len, p + 1) if causal else kv_len  # noqa: E731
    return lo(pos(first)), hi(pos(last)), hi(pos(first)), lo(pos(last))


@pytest.mark.parametrize("tile", TILES[:3] + [plan_.TileShape(4, 2, 32, 2, False, 2)])
def test_kernel_tile_logic_emulated(rng, tile):
    """Mirror prefill_mma's key-tile range, warp skipping and mask choice in Python: every
    visible (row, key) pair lies in a tile its warp computes, and a tile the warp leaves
    unmasked hides no key from any valid row of the warp."""
    block_m, block_n, rows_per_warp = tile.block_m, tile.block_n, 16 * tile.m_tiles
    for _ in range(30):
        group = int(rng.choice([1, 2, 5, 8]))
        q_len, kv_len = int(rng.integers(1, 90)), int(rng.integers(0, 300))
        causal, window = bool(rng.integers(2)), int(rng.choice([-1, 0, 3, 40]))
        vis = ref.visible_keys(q_len, kv_len, causal=causal, window_left=window)
        for row0 in range(0, q_len * group, block_m):
            rows = min(block_m, q_len * group - row0)
            lo, hi = _tile_keys(q_len, kv_len, group, row0, causal, window, block_m)
            tiles = range(lo // block_n, (hi - 1) // block_n + 1) if hi > lo else range(0)
            for first in range(0, min(rows, block_m), rows_per_warp):
                last = min(first + rows_per_warp, rows) - 1
                j_lo, j_hi, hi_min, lo_max = _warp_keys(q_len, kv_len, group, row0, first, last,
                                                        causal, window)
                done = np.zeros(kv_len, bool)
                for n in tiles:
                    j0 = n * block_n
                    if not (j0 < j_hi and j0 + block_n > j_lo):
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
    """The kernel's address formula with layout_strides() hits the element the layout defines."""
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
    s = layout_strides(layout, bs, hk, d, np.dtype(dtype).itemsize)
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
    from cupaged.prefill.launch import kernel_specializations
    for d in HEAD_DIMS:
        for vt in (False, True):
            tile = plan_.default_tile(d, vt)
            smem = plan_.smem_bytes(np.float16, d, vt, tile)
            assert smem <= 163 * 1024  # one CTA fits an sm_80 SM
            assert tile.ctas * (smem + 1024) <= 228 * 1024  # its CTAs per SM fit an sm_90 SM
            assert plan_.smem_bytes(np.float32, d, vt, plan_.launch_tile(np.float32, d)) == 0
    for d in plan_.FP8_HEAD_DIMS:  # fp8 caches add one tile's staging (one CTA an SM at d128)
        for vt in (False, True):
            tile = plan_.default_tile(d, vt)
            staged = plan_.smem_bytes(np.float16, d, vt, tile, "fp8_e4m3")
            assert staged - plan_.smem_bytes(np.float16, d, vt, tile) == 2 * tile.block_n * d
            assert staged <= 163 * 1024
            assert (plan_.wgmma_smem_bytes(d, plan_.wgmma_tile(d, "fp8_e5m2", vt), "fp8_e5m2")
                    <= 227 * 1024)
    exprs = {s.expr for s in kernel_specializations() if s.stem == "prefill"}
    fp8 = 2 * 2 * len(plan_.FP8_HEAD_DIMS) * 2  # q dtypes x formats x head dims x V layouts
    assert len(exprs) == 2 * len(HEAD_DIMS) * 2 + len(HEAD_DIMS) + fp8
    assert ("cupaged::prefill_mma_kernel<__nv_bfloat16, __nv_bfloat16, 128, false, "
            "cupaged::TileShape<4, 2, 64, 2, false, 2>>") in exprs
    assert ("cupaged::prefill_mma_kernel<__half, cupaged::fp8_e5m2, 64, true, "
            "cupaged::TileShape<4, 2, 128, 2, false, 2>>") in exprs
    hopper = {s.expr for s in kernel_specializations() if s.stem == "prefill_sm90"}
    # (16-bit, each fp8 format) x q dtypes x head dims x score paths
    tma = 3 * 2 * len(plan_.TMA_HEAD_DIMS) * 2
    assert len(hopper) == 2 * len(plan_.WGMMA_HEAD_DIMS) * 4 + 2 * fp8 + tma
    assert "cupaged::prefill_simt_kernel<256>" in exprs


def test_check_block_elements():
    from cupaged.core.layouts import CacheGeometry
    check_block_elements(CacheGeometry(10, 1 << 14, 8, 128))
    with pytest.raises(ValueError, match="k_cache"):
        check_block_elements(CacheGeometry(10, 1 << 18, 64, 256))


# ----------------------------------------------------------------------------- CPU: bad input
def _varlen_args(rng):
    q, k, v, cu_q, cu_k = ragged(rng, [3, 4], [5, 4], 4, 2, 64, np.float16)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def _paged_args(rng):
    q, k, v, cu_q, cu_k = ragged(rng, [3, 4], [5, 4], 4, 2, 64, np.float16)
    kc, vc, bt, sl = paged(rng, k, v, cu_k, "NHD", 4)
    return dict(q=q, k_cache=kc, v_cache=vc, cu_seqlens_q=cu_q, block_tables=bt, seq_lens=sl,
                layout="NHD")


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
    ("cu_seqlens_q", lambda a: a.update(cu_seqlens_q=np.array([0, 3, 8], np.int32)), ValueError),
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
    pre = cupaged.PagedPrefiller(4, 2, 64, 4, dtype="float16", layout="NHD")
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
    with pytest.raises(ValueError, match="planner"):
        pre.plan(a["cu_seqlens_q"], a["block_tables"], a["seq_lens"], planner="gpu")
    pre.plan(a["cu_seqlens_q"], a["block_tables"], a["seq_lens"], planner="device")
    with pytest.raises(ValueError, match="q: expected at least 7 rows"):
        pre.run(a["q"][:-1], a["k_cache"], a["v_cache"])
    with pytest.raises(ValueError, match="max_batch"):
        cupaged.PagedPrefiller(4, 2, 64, 4, layout="NHD", max_batch=0)


def test_prefiller_device_planner_of_host_arrays_is_the_reference(rng):
    """planner="device" on NumPy metadata: the same result, q may carry padding rows."""
    a = _paged_args(rng)
    pre = cupaged.PagedPrefiller(4, 2, 64, 4, dtype="float16", layout="NHD", max_batch=8,
                                 max_blocks_per_seq=16)
    want = pre.plan(a["cu_seqlens_q"], a["block_tables"], a["seq_lens"]).run(
        a["q"], a["k_cache"], a["v_cache"])
    q = np.concatenate([a["q"], _rand(rng, (3,) + a["q"].shape[1:], np.float16)])
    got = pre.plan(a["cu_seqlens_q"], a["block_tables"], a["seq_lens"], planner="device").run(
        q, a["k_cache"], a["v_cache"])
    np.testing.assert_array_equal(got[:len(want)], want)
    assert (got[len(want):] == 0).all()


# ----------------------------------------------------------------------------- GPU
def _dev(cp, x):
    return cp.asarray(x) if isinstance(x, np.ndarray) else x


def _poisoned(cp, shape, dtype):
    return cp.asarray(np.full(shape, np.nan, dtype))


def gpu_varlen(cp, rng, q_lens, kv_lens, hq, hk, d, dtype, q_scale=1.0, backend="auto", **opts):
    """Kernel vs reference on one random ragged batch (outputs poisoned first)."""
    q, k, v, cu_q, cu_k = ragged(rng, q_lens, kv_lens, hq, hk, d, dtype)
    q = (q.astype(np.float32) * q_scale).astype(dtype)
    out = _poisoned(cp, q.shape, dtype)
    dev_opts = {name: _dev(cp, x) for name, x in opts.items()}
    got, lse = cupaged.varlen_prefill(*(_dev(cp, a) for a in (q, k, v, cu_q, cu_k)), out=out,
                                      return_lse=True, backend=backend, **dev_opts)
    want, want_lse = ref.varlen_prefill(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    assert got is out
    assert_close(got.get(), want, dtype)
    assert_lse(lse.get(), want_lse)


def gpu_paged(cp, rng, q_lens, kv_lens, hq, hk, d, dtype, layout, block_size, op="paged_prefill",
              backend="auto", q_scale=1.0, fill=None, **opts):
    q, k, v, cu_q, cu_k = ragged(rng, q_lens, kv_lens, hq, hk, d, dtype)
    q = (q.astype(np.float32) * q_scale).astype(dtype)
    kc, vc, bt, sl = paged(rng, k, v, cu_k, layout, block_size, fill=fill)
    out = _poisoned(cp, q.shape, dtype)
    dev_opts = {name: _dev(cp, x) for name, x in opts.items()}
    got, lse = getattr(cupaged, op)(*(_dev(cp, a) for a in (q, kc, vc, cu_q, bt, sl)),
                                    layout=layout, out=out, return_lse=True, backend=backend,
                                    **dev_opts)
    want, want_lse = ref.varlen_prefill(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    assert_close(got.get(), want, dtype)
    assert_lse(lse.get(), want_lse)


Q_LENS, KV_LENS = [1, 37, 130, 0, 20], [1, 50, 300, 7, 9]  # incl. q_len 0 and q_len > kv_len


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_varlen_dtypes_and_head_dims(cp, rng, dtype, head_dim):
    gpu_varlen(cp, rng, Q_LENS, KV_LENS, 4, 2, head_dim, dtype)


FEATURES = {
    "non_causal": dict(causal=False),
    "window": dict(window_left=37),
    "window_0": dict(window_left=0, causal=False),
    "alibi": dict(alibi_slopes="slopes"),
    "sinks": dict(sinks="sinks"),
    "soft_cap": dict(logits_soft_cap=3.0, q_scale=4.0),
    "sharp_scores": dict(q_scale=6.0),
    "sm_scale": dict(sm_scale=0.3),
    "negative_scale": dict(sm_scale=-0.2),
    "zero_scale": dict(sm_scale=0.0, sinks="sinks"),
    "alibi_soft_cap": dict(alibi_slopes="slopes", logits_soft_cap=5.0, q_scale=3.0, causal=False),
    "all": dict(window_left=70, alibi_slopes="slopes", sinks="sinks", logits_soft_cap=20.0),
}


def _feature_opts(rng, name, hq):
    opts = dict(FEATURES[name])
    if opts.get("alibi_slopes") == "slopes":
        opts["alibi_slopes"] = (2.0 ** -np.arange(1, hq + 1)).astype(np.float32)
    if opts.get("sinks") == "sinks":
        opts["sinks"] = _rand(rng, hq, np.float32, 2.0)
    return opts


def _bench_tiles():
    from cupaged.bench.prefill import VARIANTS
    return [(d, t) for d, tiles in VARIANTS.items() for t in tiles[1:]]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, tile", _bench_tiles())
def test_gpu_benchmark_tiles(cp, rng, head_dim, tile):
    """Every non-default tile the benchmark times, against the reference (GQA, window, LSE)."""
    from cupaged.prefill import launch as prefill
    from cupaged.core.checks import check_options
    q, k, v, cu_q, cu_k = ragged(rng, Q_LENS + [300], KV_LENS + [333], 8, 2, head_dim, bfloat16)
    opts = check_options(np, 8, head_dim, window_left=150)
    work = prefill.host_work(np.diff(cu_q), np.diff(cu_k), q.dtype, 8, 2, head_dim, False, True, opts, tile)
    out, lse = _poisoned(cp, q.shape, bfloat16), cp.full(q.shape[:2], np.nan, np.float32)
    prefill._launch(*(cp.asarray(a) for a in (q, k, v)), out, lse, cp.asarray(work), cp.asarray(cu_q),
                    cp.asarray(cu_k), None, 1, layout_strides("ragged", 1, 2, head_dim, q.itemsize),
                    opts, True, False, 2, tile=tile)
    want, want_lse = ref.varlen_prefill(q, k, v, cu_q, cu_k, window_left=150, return_lse=True)
    assert_close(out.get(), want, bfloat16)
    assert_lse(lse.get(), want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("dtype, head_dim, heads", [(bfloat16, 128, (8, 2)), (np.float16, 80, (4, 4)),
                                                    (np.float16, 256, (4, 1)), (np.float32, 64, (8, 2))])
def test_gpu_varlen_features(cp, rng, feature, dtype, head_dim, heads):
    gpu_varlen(cp, rng, Q_LENS, KV_LENS, *heads, head_dim, dtype, **_feature_opts(rng, feature, heads[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 6])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_paged_layouts(cp, rng, dtype, layout, block_size):
    gpu_paged(cp, rng, Q_LENS, KV_LENS, 8, 2, 64, dtype, layout, block_size)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, head_dim", [(bfloat16, 128), (np.float16, 112), (np.float16, 256)])
def test_gpu_paged_features(cp, rng, dtype, head_dim, layout):
    gpu_paged(cp, rng, [5, 70, 1], [300, 70, 33], 8, 2, head_dim, dtype, layout, 16,
              **_feature_opts(rng, "all", 8))


@pytest.mark.gpu
def test_gpu_random_long_varlen(cp, rng):
    lens = rng.integers(1, 5001, 4)
    lens[0] = 5000
    gpu_varlen(cp, rng, lens, lens + rng.integers(0, 300, 4), 2, 1, 64, bfloat16)


@pytest.mark.gpu
def test_gpu_chunked_prefill_equals_one_shot(cp, rng):
    q, k, v, cu_q, cu_k = ragged(rng, [700], [700], 8, 2, 128, bfloat16)
    kc, vc, bt, _ = paged(rng, k, v, cu_k, "NHD", 16)
    whole = cupaged.varlen_prefill(*(cp.asarray(a) for a in (q, k, v, cu_q, cu_k))).get()
    assert_close(whole, ref.varlen_prefill(q, k, v, cu_q, cu_k), bfloat16)
    kc, vc, bt = cp.asarray(kc), cp.asarray(vc), cp.asarray(bt)
    for a, b in [(0, 256), (256, 601), (601, 700)]:
        part = cupaged.paged_prefill(cp.asarray(q[a:b]), kc, vc, cp.asarray(np.array([0, b - a], np.int32)),
                                     bt, cp.asarray(np.array([b], np.int32)), layout="NHD")
        assert_close(part.get(), whole[a:b], bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_mixed_batch_equals_decode_and_prefill(cp, rng, layout):
    q_lens, kv_lens = np.array([1, 90, 1, 1, 33]), np.array([700, 90, 1, 129, 200])
    q, k, v, cu_q, cu_k = ragged(rng, q_lens, kv_lens, 8, 2, 128, np.float16)
    kc, vc, bt, sl = paged(rng, k, v, cu_k, layout, 16)
    got = cupaged.paged_attention(*(cp.asarray(a) for a in (q, kc, vc, cu_q, bt, sl)), layout=layout).get()
    dec, pre = q_lens == 1, q_lens > 1
    want_dec = ref.paged_decode(q[cu_q[:-1][dec]], kc, vc, bt[dec], sl[dec], layout=layout)
    assert_close(got[cu_q[:-1][dec]], want_dec, np.float16)
    cu_pre = np.concatenate([[0], np.cumsum(q_lens[pre])]).astype(np.int32)
    rows = np.concatenate([np.arange(cu_q[i], cu_q[i + 1]) for i in np.flatnonzero(pre)])
    want_pre = ref.paged_prefill(q[rows], kc, vc, cu_pre, bt[pre], sl[pre], layout=layout)
    assert_close(got[rows], want_pre, np.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bfloat16, np.float32])
def test_gpu_empty_sequences(cp, rng, dtype):
    """Seed 004's cu_seq_lens_k [0, 0, 1, 8]: a kv-empty sequence, and a q-empty one."""
    q, k, v, _, _ = ragged(rng, [2, 1, 3], [0, 1, 7], 4, 2, 64, dtype)
    cu_q, cu_k = np.array([0, 2, 2, 3, 6], np.int32), np.array([0, 0, 1, 1, 8], np.int32)
    sinks = _rand(rng, 4, np.float32)
    for s in (None, sinks):
        got, lse = cupaged.varlen_prefill(*(cp.asarray(a) for a in (q, k, v, cu_q, cu_k)),
                                          sinks=_dev(cp, s), return_lse=True)
        want, want_lse = ref.varlen_prefill(q, k, v, cu_q, cu_k, sinks=s, return_lse=True)
        assert (np.asarray(got[:2].get(), np.float32) == 0).all()
        assert_close(got.get(), want, dtype)
        assert_lse(lse.get(), want_lse)


@pytest.mark.gpu
def test_gpu_prefiller_plan_run_reuse(cp, rng):
    pre = cupaged.PagedPrefiller(8, 2, 128, 16, dtype=bfloat16, layout="HND", window_left=200)
    for q_lens, kv_lens in [([1, 300, 1, 17], [1000, 300, 5, 40]), ([64, 1, 2], [64, 2048, 2])]:
        q, k, v, cu_q, cu_k = ragged(rng, q_lens, kv_lens, 8, 2, 128, bfloat16)
        kc, vc, bt, sl = paged(rng, k, v, cu_k, "HND", 16)
        pre.plan(cp.asarray(cu_q), cp.asarray(bt), cp.asarray(sl))
        want = ref.varlen_prefill(q, k, v, cu_q, cu_k, window_left=200)
        for layer in range(2):  # the plan serves every layer; a second layer gets new data
            got = pre.run(cp.asarray(q), cp.asarray(kc), cp.asarray(vc)).get()
            assert_close(got, want, bfloat16)
            q = _rand(rng, q.shape, bfloat16)
            want = ref.paged_prefill(q, kc, vc, cu_q, bt, sl, window_left=200, layout="HND")


GRAPH_Q_LENS = ([1, 300, 17, 64], [250, 1, 131])  # equal token and item counts, batch 4 then 3
GRAPH_KV_LENS = ([1000, 300, 40, 64], [250, 2048, 700])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "mma"])
@pytest.mark.parametrize("planner", ["device arrays", "host arrays, device planner", "host plan"])
@pytest.mark.parametrize("layout", ["NHD", "vllm"])
def test_gpu_prefiller_graph_replays_after_replan(cp, rng, layout, planner, backend):
    """plan, run, capture run in a CUDA graph, plan again with other lengths, a smaller batch
    and narrower tables, replay: the reference of the new plan (padding rows of a device
    plan zero); then a plain run and a second capture of the new plan."""
    hq, hk, d, bs = 8, 2, 128, 16
    q_lens, kv_lens = np.concatenate(GRAPH_Q_LENS), np.concatenate(GRAPH_KV_LENS)
    q_all, k, v, cu_all, cu_k = ragged(rng, q_lens, kv_lens, hq, hk, d, bfloat16)
    kc, vc, bt, sl = paged(rng, k, v, cu_k, layout, bs)
    kc_dev, vc_dev = cp.asarray(kc), cp.asarray(vc)
    device_plan = planner != "host plan"
    rows = int(cu_all[4]) + (37 if device_plan else 0)  # a device plan takes spare rows
    steps = []
    for seqs in (slice(0, 4), slice(4, 7)):
        cu = (cu_all[seqs.start:seqs.stop + 1] - cu_all[seqs.start]).astype(np.int32)
        # the first plan's tables as wide as any (the buffers' capacity), the second's narrower
        width = bt.shape[1] if seqs.start == 0 else int((-(-sl[seqs] // bs)).max())
        tables = bt[seqs][:, :width].copy()
        q = q_all[cu_all[seqs.start]:cu_all[seqs.stop]]
        q = np.concatenate([q, _rand(rng, (rows - len(q), hq, d), bfloat16)])
        want, want_lse = ref.paged_prefill(q, kc, vc, cu, tables, sl[seqs], layout=layout,
                                           return_lse=True)
        meta = (cu, tables, sl[seqs].copy())
        steps.append((tuple(cp.asarray(a) for a in meta) if planner == "device arrays" else meta,
                      q, want, want_lse))
    assert steps[1][2].shape[0] == rows
    pre = cupaged.PagedPrefiller(hq, hk, d, bs, dtype=bfloat16, layout=layout, backend=backend)
    kwargs = dict(planner="device") if planner == "host arrays, device planner" else {}
    q_buf = cp.empty((rows, hq, d), bfloat16)
    out = cp.empty((rows, hq, d), bfloat16)
    lse = cp.empty((rows, hq), np.float32)
    stream = cp.cuda.Stream(non_blocking=True)

    def check(q, want, want_lse):
        stream.synchronize()
        assert_close(out.get(), want, bfloat16)
        assert_lse(lse.get(), want_lse)

    cp.cuda.Device().synchronize()
    with stream:
        meta, q, want, want_lse = steps[0]
        pre.plan(*meta, **kwargs)
        q_buf.set(q)
        pre.run(q_buf, kc_dev, vc_dev, out=out, lse=lse)  # sets the run up outside the capture
        out.fill(np.nan)
        lse.fill(np.nan)
        stream.begin_capture()
        pre.run(q_buf, kc_dev, vc_dev, out=out, lse=lse)
        graph = stream.end_capture()
        graph.launch()
        check(q, want, want_lse)
        buffers = [pre._buffers[name].data.ptr for name in ("meta", "work")]
        for _ in range(2):
            meta, q, want, want_lse = steps[1]
            pre.plan(*meta, **kwargs)
            assert [pre._buffers[name].data.ptr for name in ("meta", "work")] == buffers
            q_buf.set(q)
            out.fill(np.nan)
            lse.fill(np.nan)
            graph.launch()
            check(q, want, want_lse)
            out.fill(np.nan)
            lse.fill(np.nan)
            pre.run(q_buf, kc_dev, vc_dev, out=out, lse=lse)
            check(q, want, want_lse)
            out.fill(np.nan)
            stream.begin_capture()
            pre.run(q_buf, kc_dev, vc_dev, out=out, lse=lse)
            graph = stream.end_capture()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "vllm"])
@pytest.mark.bigmem
def test_gpu_cache_beyond_2_pow_31_elements(cp, rng, layout):
    """Blocks at the top of a cache of more than 2^31 elements (64-bit offsets)."""
    bs, hk, d, used = 16, 2, 128, 40
    nb = (1 << 31) // (bs * hk * d) + used
    q, k, v, cu_q, cu_k = ragged(rng, [100, 1], [600, 30], 4, hk, d, np.float16)
    small_k, small_v, bt, sl = paged(rng, k, v, cu_k, layout, bs, num_blocks=used)
    ks, vs = cache_shapes(layout, nb, bs, hk, d, np.float16)
    kc, vc = cp.empty(ks, np.float16), cp.empty(vs, np.float16)
    kc[nb - used:], vc[nb - used:] = cp.asarray(small_k), cp.asarray(small_v)
    bt_top = np.where(bt >= 0, bt + nb - used, -1).astype(np.int32)
    got = cupaged.paged_prefill(*(cp.asarray(a) for a in (q,)), kc, vc, cp.asarray(cu_q),
                                cp.asarray(bt_top), cp.asarray(sl), layout=layout)
    assert_close(got.get(), ref.varlen_prefill(q, k, v, cu_q, cu_k), np.float16)
    del kc, vc
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.gpu
def test_gpu_torch_tensors_in_and_out(rng):
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = ragged(rng, [40, 3], [90, 3], 4, 2, 64, np.float16)
    t = [torch.from_numpy(a).cuda() for a in (q, k, v, cu_q, cu_k)]
    got = cupaged.varlen_prefill(*t, window_left=20)
    assert isinstance(got, torch.Tensor) and got.is_cuda
    assert_close(got.cpu().numpy(), ref.varlen_prefill(q, k, v, cu_q, cu_k, window_left=20), np.float16)


# ----------------------------------------------------------------------------- wgmma backend
def test_wgmma_backend_resolution(monkeypatch):
    from cupaged.core.checks import check_options
    opts = check_options(np, 4, 128)
    ok = plan_.wgmma_unsupported(bfloat16, 128, "NHD", opts)
    assert ok is None
    for layout in ("ragged", "NHD", "HND", "vllm"):
        assert plan_.resolve_backend("auto", ok, "90", layout) == "wgmma"
    assert plan_.resolve_backend("mma", ok, "90") == "mma"
    assert plan_.resolve_backend("wgmma", ok, "90", "HND") == "wgmma"
    assert plan_.resolve_backend("wgmma", ok, None) == "wgmma"
    with pytest.raises(ValueError, match="sm_80"):
        plan_.resolve_backend("wgmma", ok, "80")
    with pytest.raises(ValueError, match="backend"):
        plan_.resolve_backend("WGMMA", ok, "90")
    monkeypatch.setattr(plan_, "WGMMA_AUTO", ("ragged", "NHD"))
    assert plan_.resolve_backend("auto", ok, "90", "HND") == "mma"
    assert plan_.resolve_backend("auto", ok, "80") == "mma"
    assert plan_.resolve_backend("auto", "float32 (fp16/bf16 only)", "90") == "mma"
    # every head size, layout and score option runs on wgmma; float32 does not
    for d in HEAD_DIMS:
        for layout in ("ragged",) + LAYOUTS:
            for o in (opts, opts._replace(logits_soft_cap=2.0), opts._replace(sm_scale=-1.0),
                      opts._replace(sm_scale=0.0), opts._replace(alibi_slopes=np.ones(4, np.float32))):
                assert plan_.wgmma_unsupported(np.float16, d, layout, o) is None
    assert "float32" in plan_.wgmma_unsupported(np.float32, 128, "NHD", opts)


def test_general_scores_flag():
    from cupaged.core.checks import check_options
    opts = check_options(np, 4, 128)
    assert not plan_.general_scores(opts)
    assert plan_.general_scores(opts._replace(logits_soft_cap=2.0))
    assert plan_.general_scores(opts._replace(alibi_slopes=np.ones(4, np.float32)))
    assert plan_.general_scores(opts._replace(sm_scale=0.0))
    assert plan_.general_scores(opts._replace(sm_scale=-0.1))


def test_wgmma_tile_shares_work_list_and_fits():
    from cupaged.prefill.launch import kernel_specializations
    for d in plan_.WGMMA_HEAD_DIMS:
        for vt in (False, True):  # PagedPrefiller's one work list
            tile = plan_.wgmma_tile(d, None, vt)
            assert tile.block_m == plan_.default_tile(d, vt).block_m
            assert plan_.wgmma_smem_bytes(d, tile) <= 227 * 1024
    for t in WGMMA_OTHER_TILES:  # the benchmark's tiles, at the head sizes it times them
        for d in (64, 128):
            assert plan_.wgmma_smem_bytes(d, t) <= 227 * 1024
    hopper = {s.expr for s in kernel_specializations() if s.hopper}
    def expr(t, kv, d, vt, g):
        tile = plan_.wgmma_tile(d, kv, vt == "true")
        if kv is None and vt == "false" and d != 256:
            assert tile.ws and tile.threads == plan_.WS_THREADS
            return (f"cupaged::prefill_ws_kernel<{t}, {t}, {d}, {tile.block_n}, {tile.stages}, {g}, "
                    f"{plan_.ws_producer_regs(d)}>")
        assert not tile.ws and tile.threads == 256
        return (f"cupaged::prefill_wgmma_kernel<{t}, {kv or t}, {d}, {tile.block_n}, {tile.stages}, "
                f"{vt}, {g}>")
    want = {expr(t, kv, d, vt, g)
            for t in ("__half", "__nv_bfloat16")
            for kv in (None, "cupaged::fp8_e4m3", "cupaged::fp8_e5m2")
            for d in (HEAD_DIMS if kv is None else plan_.FP8_HEAD_DIMS)
            for vt in ("false", "true") for g in ("false", "true")}
    tma = plan_.tma_tile(128)
    want |= {f"cupaged::prefill_ws_tma_kernel<{t}, {t}, {d}, {tma.block_n}, {tma.stages}, {g}, "
             f"{plan_.ws_producer_regs(d)}, 0>"
             for t in ("__half", "__nv_bfloat16") for d in plan_.TMA_HEAD_DIMS for g in ("false", "true")}
    fp8 = plan_.tma_tile(128, kv="fp8_e4m3")  # opt-in, compiled for the gate
    want |= {f"cupaged::prefill_ws_tma_kernel<{t}, cupaged::{kv}, {d}, {fp8.block_n}, {fp8.stages}, "
             f"{g}, {plan_.ws_producer_regs(d)}, {plan_.FP8_TMA_SLOTS}>"
             for t in ("__half", "__nv_bfloat16") for kv in ("fp8_e4m3", "fp8_e5m2")
             for d in plan_.TMA_HEAD_DIMS for g in ("false", "true")}
    assert hopper == want


@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="fast"), "backend"),
    (dict(backend="wgmma", dtype=np.float32), "float32"),
])
def test_wgmma_backend_rejects_unsupported_calls(rng, kwargs, match):
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", np.float16)
    for op, args in ((cupaged.varlen_prefill, _varlen_args(rng)),
                     (cupaged.paged_prefill, _paged_args(rng))):
        args = {n: a.astype(dtype) if getattr(a, "dtype", None) == np.float16 else a
                for n, a in args.items()}
        with pytest.raises(ValueError, match=match):
            op(**args, **kwargs)


def test_wgmma_backend_numpy_path_is_the_reference(rng):
    q, k, v, cu_q, cu_k = ragged(rng, [5, 9], [7, 9], 4, 2, 64, np.float16)
    slopes = _rand(rng, 4, np.float32, 0.1)
    want = ref.varlen_prefill(q, k, v, cu_q, cu_k, window_left=3, alibi_slopes=slopes,
                              logits_soft_cap=2.0)
    got = cupaged.varlen_prefill(q, k, v, cu_q, cu_k, window_left=3, backend="wgmma",
                                 alibi_slopes=slopes, logits_soft_cap=2.0)
    np.testing.assert_array_equal(got, want)
    for d, layout in ((80, "NHD"), (256, "vllm"), (96, "HND")):
        cupaged.PagedPrefiller(4, 2, d, 4, backend="wgmma", layout=layout, logits_soft_cap=1.0)
    with pytest.raises(ValueError, match="backend"):
        cupaged.PagedPrefiller(4, 2, 64, 4, dtype="float32", layout="NHD", backend="wgmma")
    with pytest.raises(ValueError, match="backend"):
        cupaged.PagedPrefiller(4, 2, 64, 4, backend="mmaa", layout="NHD")


@pytest.fixture
def hopper(cp):
    """Skips unless the device is sm_90 (the wgmma kernel's only target)."""
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma kernel needs an sm_90 device")


def _wgmma_other_tiles():
    from cupaged.bench.prefill import WGMMA_VARIANTS
    return WGMMA_VARIANTS  # both stage counts the benchmark times


WGMMA_OTHER_TILES = _wgmma_other_tiles()
WGMMA_FEATURES = ["plain"] + sorted(FEATURES)


@pytest.mark.gpu
@pytest.mark.parametrize("feature", WGMMA_FEATURES)
@pytest.mark.parametrize("head_dim", plan_.WGMMA_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_gpu_wgmma_varlen(cp, hopper, rng, dtype, head_dim, feature):
    """Every score option (plain and general paths) at every head size, GQA 4."""
    opts = {} if feature == "plain" else _feature_opts(rng, feature, 8)
    gpu_varlen(cp, rng, Q_LENS + [257, 64, 65], KV_LENS + [390, 64, 1000], 8, 2, head_dim, dtype,
               backend="wgmma", **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("feature", ["plain", "all"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 1), (32, 8)])
@pytest.mark.parametrize("head_dim", [96, 128, 256])
def test_gpu_wgmma_gqa_packing(cp, hopper, rng, head_dim, heads, feature):
    opts = {} if feature == "plain" else _feature_opts(rng, feature, heads[0])
    gpu_varlen(cp, rng, Q_LENS + [63], KV_LENS + [200], *heads, head_dim, bfloat16,
               backend="wgmma", **opts)


WGMMA_PAGED_OPTIONS = {np.dtype(np.float16): "window_sinks", bfloat16: "all"}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [16, 6])
@pytest.mark.parametrize("head_dim", plan_.WGMMA_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_gpu_wgmma_paged(cp, hopper, rng, dtype, head_dim, block_size, layout):
    """Every layout (vllm: V^T tiles, 16-byte chunks at page 16, element copies at page 6)
    and head size; fp16 with a window and sinks, bf16 with every option."""
    if WGMMA_PAGED_OPTIONS[np.dtype(dtype)] == "all":
        opts = _feature_opts(rng, "all", 8)
    else:
        opts = dict(window_left=150, sinks=_rand(rng, 8, np.float32, 2.0))
    gpu_paged(cp, rng, [5, 70, 1, 200, 0], [300, 70, 33, 513, 9], 8, 2, head_dim, dtype, layout,
              block_size, backend="wgmma", **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [1, 8, 64, 128])
@pytest.mark.parametrize("head_dim", [96, 128])
def test_gpu_wgmma_page_sizes(cp, hopper, rng, head_dim, block_size, layout):
    """Page sizes 1 (every key its own page), 8, 64 and 128; odd lengths and an empty row."""
    gpu_paged(cp, rng, [1, 63, 64, 65, 0, 300], [1, 63, 130, 65, 40, 1000], 8, 2, head_dim,
              bfloat16, layout, block_size, backend="wgmma", sinks=_rand(rng, 8, np.float32))


def gpu_tile_varlen(cp, q, k, v, cu_q, cu_k, tile, fo):
    """One ragged batch through the wgmma kernel of ``tile`` (a host work list; score
    options ``fo``, ``causal`` among them, default True) against the reference."""
    from cupaged.prefill import launch as prefill
    from cupaged.core.checks import check_options
    hq, hk, head_dim, dtype = q.shape[1], k.shape[1], q.shape[2], q.dtype
    fo = dict(fo)
    causal = fo.pop("causal", True)
    opts = check_options(np, hq, head_dim, **fo)
    work = prefill.host_work(np.diff(cu_q), np.diff(cu_k), dtype, hq, hk, head_dim, False, causal, opts, tile)
    out, lse = _poisoned(cp, q.shape, dtype), cp.full(q.shape[:2], np.nan, np.float32)
    dopts = opts._replace(sinks=_dev(cp, opts.sinks), alibi_slopes=_dev(cp, opts.alibi_slopes))
    prefill._launch(*(cp.asarray(a) for a in (q, k, v)), out, lse, cp.asarray(work), cp.asarray(cu_q),
                    cp.asarray(cu_k), None, 1, layout_strides("ragged", 1, hk, head_dim, q.itemsize),
                    dopts, causal, False, hk, tile=tile, backend="wgmma")
    want, want_lse = ref.varlen_prefill(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, **fo)
    assert_close(out.get(), want, dtype)
    assert_lse(lse.get(), want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", WGMMA_OTHER_TILES)
@pytest.mark.parametrize("feature", ["plain", "non_causal", "window", "sinks", "all"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_gpu_wgmma_other_tiles(cp, hopper, rng, dtype, head_dim, feature, tile):
    """The wgmma tiles the benchmark times beside the default, against the reference."""
    q_lens, kv_lens = Q_LENS + [300], KV_LENS + [533]
    fo = {} if feature == "plain" else _feature_opts(rng, feature, 8)
    gpu_tile_varlen(cp, *ragged(rng, q_lens, kv_lens, 8, 2, head_dim, dtype), tile, fo)


# the TMA-fed warp-specialised kernel: odd lengths around the 128-key tiles, empty rows,
# q_len > kv_len and one sequence longer than 4096 keys
TMA_Q_LENS, TMA_KV_LENS = [1, 63, 64, 65, 0, 1000, 5, 4097], [1, 63, 64, 65, 9, 1000, 0, 4097]


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", plan_.TMA_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_gpu_tma_varlen(cp, hopper, rng, dtype, head_dim, causal, heads, stages):
    """K/V tiles by TMA (plan.tma_tile) against the float64 reference, GQA 4 and none."""
    gpu_tile_varlen(cp, *ragged(rng, TMA_Q_LENS, TMA_KV_LENS, *heads, head_dim, dtype),
                    plan_.tma_tile(head_dim, stages), dict(causal=causal))


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("head_dim", plan_.TMA_HEAD_DIMS)
def test_gpu_tma_features(cp, hopper, rng, head_dim, feature, stages):
    """Every score option (plain and general paths) through the TMA producer."""
    q, k, v, cu_q, cu_k = ragged(rng, Q_LENS + [300], KV_LENS + [533], 8, 2, head_dim, bfloat16)
    fo = _feature_opts(rng, feature, 8)
    q = (q.astype(np.float32) * fo.pop("q_scale", 1.0)).astype(bfloat16)
    gpu_tile_varlen(cp, q, k, v, cu_q, cu_k, plan_.tma_tile(head_dim, stages), fo)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", plan_.TMA_HEAD_DIMS)
def test_gpu_tma_keys_past_kv_len_are_masked(cp, hopper, rng, head_dim, causal):
    """A sequence's last key tile runs past its kv_len into the next sequence's rows (made
    large here) or into rows past the last sequence (inf and NaN here, as an engine's
    preallocated buffer may hold): none of them may reach an output, through the TMA tiles
    and through the public call's default."""
    q_lens, kv_lens = [70, 3, 130], [70, 200, 130]
    q, k, v, cu_q, cu_k = ragged(rng, q_lens, kv_lens, 4, 2, head_dim, np.float16)
    k[70:], v[70:] = k[70:] * 4, v[70:] * 4  # sequence 0's tile reads these rows
    tail = np.full((150,) + k.shape[1:], np.nan, k.dtype)
    tail[::3] = np.inf
    k, v = np.concatenate([k, tail]), np.concatenate([v, -tail])
    for stages in (2, 3):
        gpu_tile_varlen(cp, q, k, v, cu_q, cu_k, plan_.tma_tile(head_dim, stages),
                        dict(causal=causal))
    got = cupaged.varlen_prefill(*(cp.asarray(a) for a in (q, k, v, cu_q, cu_k)), causal=causal)
    assert_close(got.get(), ref.varlen_prefill(q, k, v, cu_q, cu_k, causal=causal), np.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_size", [8, 16, 128, 256])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("head_dim", plan_.TMA_HEAD_DIMS)
def test_gpu_tma_paged(cp, hopper, rng, head_dim, layout, block_size, causal):
    """NHD and HND caches through the default (the TMA producer: a box per cache block's
    part of a tile), block sizes below, at and above the 128-key tile, odd lengths, a
    sequence over several tiles, an empty row; the cache's unwritten slots hold NaN, which
    no output may see."""
    strides = layout_strides(layout, block_size, 2, head_dim, 2)
    assert plan_.wgmma_tile(head_dim, geometry=plan_.TmaGeometry(
        strides, block_size=block_size, num_blocks=100)).tma
    gpu_paged(cp, rng, [1, 63, 64, 65, 0, 300], [1, 63, 130, 65, 40, 1000], 8, 2, head_dim,
              bfloat16, layout, block_size, fill=np.nan, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("feature", ["plain", "all"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", plan_.WGMMA_HEAD_DIMS)
def test_gpu_wgmma_long_sequences_match_mma(cp, hopper, rng, head_dim, causal, feature):
    """Many K/V tiles (lengths to 4097): wgmma vs the reference on a few rows and vs the
    mma.sync kernel on all."""
    lens = np.array([4097, 1, 777, 1500])
    q, k, v, cu_q, cu_k = (cp.asarray(a) for a in ragged(rng, lens, lens + 64, 8, 2, head_dim, bfloat16))
    fo = {} if feature == "plain" else _feature_opts(rng, feature, 8)
    dev = {n: _dev(cp, x) for n, x in fo.items()}
    out = _poisoned(cp, q.shape, bfloat16)
    got, lse = cupaged.varlen_prefill(q, k, v, cu_q, cu_k, causal=causal, out=out, return_lse=True,
                                      backend="wgmma", **dev)
    want, want_lse = cupaged.varlen_prefill(q, k, v, cu_q, cu_k, causal=causal, return_lse=True,
                                            backend="mma", **dev)
    assert_close(got.get(), want.get(), bfloat16)
    np.testing.assert_allclose(lse.get(), want_lse.get(), rtol=1e-3, atol=1e-3)
    rows = slice(4097 - 40, 4097)  # the last rows of sequence 0 against the float64 reference
    kh, vh = k[:4161].get(), v[:4161].get()
    ref_out, _ = ref.varlen_prefill(q[rows].get(), kh, vh, np.array([0, 40], np.int32),
                                    np.array([0, 4161], np.int32), causal=causal, return_lse=True, **fo)
    assert_close(got[rows].get(), ref_out, bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_wgmma_prefiller_and_auto(cp, hopper, rng, layout):
    """PagedPrefiller on wgmma (host and device plans) with ALiBi and a soft-cap; "auto"
    takes wgmma for them (every layout but HND) and gives the same result."""
    q, k, v, cu_q, cu_k = ragged(rng, [1, 37, 130], [50, 37, 300], 8, 2, 128, bfloat16)
    kc, vc, bt, sl = paged(rng, k, v, cu_k, layout, 16)
    dq, dkc, dvc = (cp.asarray(a) for a in (q, kc, vc))
    slopes = (2.0 ** -np.arange(1, 9)).astype(np.float32)
    want = ref.varlen_prefill(q, k, v, cu_q, cu_k, alibi_slopes=slopes, logits_soft_cap=10.0)
    for backend in ("wgmma", "auto"):
        pre = cupaged.PagedPrefiller(8, 2, 128, 16, dtype=bfloat16, backend=backend, layout=layout,
                                     logits_soft_cap=10.0)
        for meta in ((cu_q, bt, sl), tuple(cp.asarray(a) for a in (cu_q, bt, sl))):
            pre.plan(*meta)
            out = _poisoned(cp, q.shape, bfloat16)
            got = pre.run(dq, dkc, dvc, alibi_slopes=cp.asarray(slopes), out=out)
            assert_close(got.get(), want, bfloat16)


@pytest.mark.gpu
def test_gpu_wgmma_rejected_off_hopper(cp, rng):
    if cp.cuda.Device().compute_capability == "90":
        pytest.skip("an sm_90 device runs the wgmma kernel")
    args = {n: cp.asarray(a) for n, a in _varlen_args(rng).items()}
    with pytest.raises(ValueError, match="sm_"):
        cupaged.varlen_prefill(**args, backend="wgmma")
