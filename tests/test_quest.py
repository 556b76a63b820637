"""Tests of cupaged.sparse.quest and quest_decode: the float64 reference against loop
oracles (CPU), then the kernels against the reference on fresh random inputs (GPU, marked
``gpu``): every layout, fp16/bf16, page sizes 16 and others, partial last pages, sequences
shorter than top-k pages, empty sequences, ties, bad device entries, graph replay."""
import numpy as np
import pytest

import cupaged
from cupaged import sparse
from cupaged.core.arrays import bfloat16
from cupaged.core.layouts import LAYOUTS, k_as_nhd, v_as_nhd
from cupaged.sparse import quest
from test_decode import from_nhd, make_case

TOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 3e-3, np.dtype(bfloat16): 2e-2}


E4M3 = quest.E4M3
BOUNDS = [np.float32, bfloat16, E4M3]
BOUND_IDS = ["f32", "bf16", "e4m3"]


def _fresh_bounds(nb, hk, d, xp=np, fill=np.nan, dtype=np.float32):
    """Two bound arrays filled with ``fill`` (e4m3 on the device: its uint8 codes)."""
    if np.dtype(dtype) == E4M3:
        a = np.full((nb, hk, d), fill, np.float32).astype(E4M3)
        return tuple(a.copy() if xp is np else xp.asarray(a.view(np.uint8)) for _ in range(2))
    return xp.full((nb, hk, d), fill, dtype), xp.full((nb, hk, d), fill, dtype)


def _dev(cp, bounds):
    """Host bounds on the device (e4m3 as uint8 codes)."""
    return cp.asarray(bounds.view(np.uint8) if bounds.dtype == E4M3 else bounds)


def _codes(bounds):
    """Bounds (host or device) as host bits to compare exactly: e4m3 codes, else float32."""
    a = bounds.get() if hasattr(bounds, "get") else bounds
    return a.view(np.uint8) if a.dtype in quest.E4M3_DTYPES else a.astype(np.float32)


def _e4m3_outward(x, up):
    """Oracle: the nearest e4m3 value at or above (up) / below ``x``, NaN past +-448."""
    grid = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid)])                 # ascending, -448 .. 448
    if up:
        i = np.searchsorted(grid, x, side="left")
        return np.where(i < len(grid), grid[np.minimum(i, len(grid) - 1)], np.nan)
    i = np.searchsorted(grid, x, side="right") - 1
    return np.where(i >= 0, grid[np.maximum(i, 0)], np.nan)


def _loop_bounds(k_nhd, tables, lens, bs):
    """{block: (min, max)} by explicit loops over the sequences' pages and tokens."""
    out = {}
    for b, n in enumerate(lens):
        for i in range(-(-int(n) // bs)):
            keys = np.stack([k_nhd[tables[b, i], t] for t in range(min(bs, n - i * bs))])
            out[int(tables[b, i])] = (keys.min(axis=0), keys.max(axis=0))
    return out


def _loop_scores(q, k_min, k_max, tables, lens, bs):
    batch, hq, d = q.shape
    hk = k_min.shape[1]
    g = hq // hk
    scores = np.full((batch, hk, tables.shape[1]), -np.inf)
    for b in range(batch):
        used = -(-int(lens[b]) // bs)
        for h in range(hk):
            for p in range(used):
                blk = tables[b, p]
                best = -np.inf
                for qh in range(h * g, (h + 1) * g):
                    s = sum(max(q[b, qh, e] * k_min[blk, h, e], q[b, qh, e] * k_max[blk, h, e])
                            for e in range(d))
                    best = max(best, s)
                scores[b, h, p] = np.inf if p == used - 1 else best
    return scores


def _pages_of(tables, lens, bt, hk, bs, tpp):
    """Page positions per (sequence, kv head) named by a view table (checked consistent)."""
    batch = bt.shape[0]
    out = {}
    for b in range(batch):
        where = {int(blk): i for i, blk in enumerate(bt[b]) if blk >= 0}
        for h in range(hk):
            row, n = tables[b * hk + h], int(lens[b * hk + h])
            count = -(-n // bs)
            ids = row[:count * tpp].astype(np.int64).reshape(count, tpp)
            assert (ids % hk == h).all(), "a table entry of another kv head"
            if tpp == 1:
                blocks = ids[:, 0] // hk
            else:
                tok = ids // hk
                assert (tok % bs == np.arange(tpp)[None]).all(), "tokens out of order"
                blocks = tok[:, 0] // bs
            out[b, h] = [where[int(x)] for x in blocks]
            assert (row[count * tpp:] == -1).all(), "entries past the count not -1"
    return out


def check_selection(tables, sel_lens, scores, bt, lens, k, hk, bs, tpp, tol=0.0, first=0):
    """A view table and lengths keep, per (sequence, kv head), the last page, then the
    ``first`` first pages, then a top-k of ``scores`` (up to ``tol`` near-ties), in position
    order; the lengths count the keys."""
    pages = _pages_of(tables, sel_lens, bt, hk, bs, tpp)
    for (b, h), kept in pages.items():
        n = -(-int(lens[b]) // bs)
        count = min(n, k)
        want_len = (count - 1) * bs + int(lens[b]) - (n - 1) * bs if count else 0
        assert int(sel_lens[b * hk + h]) == want_len
        assert len(kept) == count and (np.diff(kept) > 0).all()
        if not count:
            continue
        forced = [n - 1] + list(range(min(first, n - 1)))
        assert set(forced[:count]) <= set(kept), "last or first pages not kept"
        rest = np.setdiff1d(np.arange(n), kept + forced)
        chosen = [p for p in kept if p not in forced]
        if len(rest) and chosen:
            row = scores[b, h]
            gap = tol * max(1.0, np.abs(row[:n - 1]).max())
            assert row[chosen].min() >= row[rest].max() - gap, f"({b}, {h}): not a top-k"
    return pages


def _oracle(case, layout, pages, bs, sm_scale, sinks=None):
    """float64 attention of each query head over its kv head's ``pages``."""
    q, lens = case["q"].astype(np.float64), case["seq_lens"]
    k = k_as_nhd(case["k_cache"], layout).astype(np.float64)
    v = v_as_nhd(case["v_cache"], layout).astype(np.float64)
    batch, hq, d = q.shape
    hk = k.shape[2]
    out, lse = np.zeros((batch, hq, d)), np.full((batch, hq), -np.inf)
    for b in range(batch):
        for qh in range(hq):
            h = qh // (hq // hk)
            keys = [(case["block_tables"][b, p], t) for p in pages[b, h] for t in range(bs)
                    if p * bs + t < lens[b]]
            sink = -np.inf if sinks is None else float(sinks[qh])
            if not keys:
                lse[b, qh] = sink
                continue
            kk = np.stack([k[blk, t, h] for blk, t in keys])
            vv = np.stack([v[blk, t, h] for blk, t in keys])
            s = kk @ q[b, qh] * sm_scale
            m = max(s.max(), sink)
            w = np.exp(s - m)
            den = w.sum() + np.exp(sink - m)
            out[b, qh] = w @ vv / den
            lse[b, qh] = m + np.log(den)
    return out, lse


# ----------------------------------------------------------------------------- reference
@pytest.mark.parametrize("bounds", BOUNDS, ids=BOUND_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_bounds_match_loops(rng, layout, bounds):
    bs, hk, d = 8, 2, 64
    case = make_case(rng, lens=[30, 17, 0, 8, 1], hk=hk, d=d, bs=bs, layout=layout,
                     dtype=np.float32)
    if bounds is E4M3:  # keys past e4m3's range (unknown bounds), and below its subnormals
        case["k_cache"][..., 0] *= 1000.0
        case["k_cache"][..., 1] *= 1e-4
    tables, lens = case["block_tables"], case["seq_lens"]
    nb = k_as_nhd(case["k_cache"], layout).shape[0]
    k_min, k_max = _fresh_bounds(nb, hk, d, dtype=bounds)
    quest.update_page_bounds(case["k_cache"], tables, lens, k_min, k_max, layout=layout)
    want = _loop_bounds(k_as_nhd(case["k_cache"], layout), tables, lens, bs)
    for blk, (lo, hi) in want.items():
        got_lo, got_hi = k_min[blk].astype(np.float64), k_max[blk].astype(np.float64)
        if bounds is np.float32:
            np.testing.assert_array_equal(got_lo, lo)
            np.testing.assert_array_equal(got_hi, hi)
            continue
        if bounds is E4M3:
            np.testing.assert_array_equal(got_lo, _e4m3_outward(lo, up=False))
            np.testing.assert_array_equal(got_hi, _e4m3_outward(hi, up=True))
            continue
        # outward: the nearest bfloat16 at or below the min, at or above the max
        assert (got_lo <= lo).all() and (got_hi >= hi).all()
        up = np.nextafter(k_min[blk], np.asarray(np.inf, bounds)).astype(np.float64)
        down = np.nextafter(k_max[blk], np.asarray(-np.inf, bounds)).astype(np.float64)
        assert (up > lo).all() and (down < hi).all()
    if bounds is E4M3:  # past the range: the NaN code, unknown
        touched = list(want)
        assert np.isnan(k_min[touched].astype(np.float32)).any()
        assert np.isnan(k_max[touched].astype(np.float32)).any()
    untouched = np.setdiff1d(np.arange(nb), list(want))
    assert np.isnan(k_min[untouched]).all() and np.isnan(k_max[untouched]).all()
    # last pages only: those pages recomputed, the others left as they were
    full_min = k_min.copy()
    k_min[:], k_max[:] = 7.0, 7.0
    quest.update_page_bounds(case["k_cache"], tables, lens, k_min, k_max, layout=layout,
                             last_page_only=True)
    last = {int(tables[b, -(-n // bs) - 1]) for b, n in enumerate(lens) if n}
    for blk in range(nb):
        if blk in last:
            np.testing.assert_array_equal(k_min[blk], full_min[blk])
        else:
            assert (k_min[blk] == 7.0).all()


def test_reference_scores_match_loops_and_bound_every_key(rng):
    bs, hk, hq, d = 8, 2, 6, 64
    case = make_case(rng, lens=[40, 9, 0, 16], hq=hq, hk=hk, d=d, bs=bs, dtype=np.float32)
    tables, lens, q = case["block_tables"], case["seq_lens"], case["q"]
    nb = case["k_cache"].shape[0]
    k_min, k_max = _fresh_bounds(nb, hk, d)
    quest.update_page_bounds(case["k_cache"], tables, lens, k_min, k_max, layout="NHD")
    q[0, 0, :5] = 0.0  # zero query dims add nothing
    got = quest.page_scores(q, k_min, k_max, tables, lens, bs)
    assert got.dtype == np.float32 and got.shape == (4, hk, tables.shape[1])
    want = _loop_scores(q.astype(np.float64), k_min, k_max, tables, lens, bs)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for b in range(4):
        for h in range(hk):
            for p in range(-(-int(lens[b]) // bs)):
                for t in range(min(bs, lens[b] - p * bs)):
                    key = case["k_cache"][tables[b, p], t, h]
                    assert got[b, h, p] >= (q[b, h * 3:h * 3 + 3] @ key).max() - 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_select_keeps_top_k_and_last_page(rng, layout):
    bs, hk, d, k = 16, 2, 64, 3
    case = make_case(rng, lens=[200, 20, 0, 33, 48], hk=hk, d=d, bs=bs, layout=layout,
                     dtype=np.float32)
    tables, lens = case["block_tables"], case["seq_lens"]
    k_min, k_max = _fresh_bounds(k_as_nhd(case["k_cache"], layout).shape[0], hk, d)
    quest.update_page_bounds(case["k_cache"], tables, lens, k_min, k_max, layout=layout)
    tpp = quest.tokens_per_page(layout, hk, bs)
    sel = quest.select_pages(case["q"], k_min, k_max, tables, lens, bs, k, tokens_per_page=tpp)
    assert sel.tables.shape == (5 * hk, k * tpp) and sel.lens.shape == (5 * hk,)
    pages = check_selection(sel.tables, sel.lens, sel.scores, tables, lens, k, hk, bs, tpp)
    for (b, h), kept in pages.items():
        assert list(sel.positions[b, h, :len(kept)]) == kept
        assert (sel.positions[b, h, len(kept):] == -1).all()


@pytest.mark.parametrize("first", [1, 2, 9])
def test_reference_keeps_first_pages(rng, first):
    bs, hk, d, k = 8, 2, 64, 4
    case = make_case(rng, lens=[200, 20, 9, 0], hk=hk, d=d, bs=bs, dtype=np.float32)
    tables, lens = case["block_tables"], case["seq_lens"]
    k_min, k_max = _fresh_bounds(case["k_cache"].shape[0], hk, d)
    quest.update_page_bounds(case["k_cache"], tables, lens, k_min, k_max, layout="NHD")
    sel = quest.select_pages(case["q"], k_min, k_max, tables, lens, bs, k, first_pages=first)
    check_selection(sel.tables, sel.lens, sel.scores, tables, lens, k, hk, bs, 1, first=first)
    assert sel.positions[0, 0].tolist()[:min(first, k - 1)] == list(range(min(first, k - 1)))


def test_reference_ties_go_to_earlier_pages(rng):
    bs, hk, d, k = 4, 1, 64, 5
    case = make_case(rng, lens=[60], hk=hk, hq=2, d=d, bs=bs, dtype=np.float32)
    kc, tables = case["k_cache"], case["block_tables"]
    kc[tables[0, :15]] = kc[tables[0, 0]]  # every page holds the same keys: equal scores
    k_min, k_max = _fresh_bounds(kc.shape[0], hk, d)
    quest.update_page_bounds(kc, tables, case["seq_lens"], k_min, k_max, layout="NHD")
    sel = quest.select_pages(case["q"], k_min, k_max, tables, case["seq_lens"], bs, k)
    assert sel.positions[0, 0].tolist() == [0, 1, 2, 3, 14]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_decode_reads_each_heads_pages(rng, layout, with_sinks):
    bs, hk, hq, d, k = 8, 2, 4, 64, 3
    case = make_case(rng, lens=[60, 20, 5, 0], hk=hk, hq=hq, d=d, bs=bs, layout=layout,
                     dtype=np.float32)
    tables, lens = case["block_tables"], case["seq_lens"]
    k_min, k_max = _fresh_bounds(k_as_nhd(case["k_cache"], layout).shape[0], hk, d)
    quest.update_page_bounds(case["k_cache"], tables, lens, k_min, k_max, layout=layout)
    sinks = rng.standard_normal(hq).astype(np.float32) if with_sinks else None
    out, lse = sparse.quest_decode(case["q"], case["k_cache"], case["v_cache"], k_min, k_max,
                                   tables, lens, k, layout=layout, sm_scale=0.2, sinks=sinks,
                                   return_lse=True)
    sel = quest.select_pages(case["q"], k_min, k_max, tables, lens, bs, k)
    pages = {(b, h): [p for p in sel.positions[b, h] if p >= 0] for b in range(4)
             for h in range(hk)}
    want, want_lse = _oracle(case, layout, pages, bs, 0.2, sinks)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert (out[3] == 0).all()


def test_decoder_numpy_matches_function(rng):
    bs, hk, hq, d = 8, 2, 4, 64
    case = make_case(rng, lens=[60, 21], hk=hk, hq=hq, d=d, bs=bs, layout="HND",
                     dtype=np.float32)
    tables, lens = case["block_tables"], case["seq_lens"]
    k_min, k_max = _fresh_bounds(case["k_cache"].shape[0], hk, d)
    dec = sparse.QuestDecoder(hq, hk, d, bs, 2, dtype=np.float32, layout="HND", max_batch=4)
    dec.plan(tables, lens)
    dec.update_bounds(case["k_cache"], k_min, k_max, last_page_only=False)
    got = dec.run(case["q"], case["k_cache"], case["v_cache"], k_min, k_max)
    want = sparse.quest_decode(case["q"], case["k_cache"], case["v_cache"], k_min, k_max,
                               tables, lens, 2, layout="HND")
    np.testing.assert_array_equal(got, want)


def test_decode_view_is_a_view_and_refuses_strided_blocks(rng):
    k = np.zeros((5, 16, 4, 64), np.float16)
    kv, vv, layout, bs = quest.decode_view(k, k, "NHD")
    assert kv.shape == (5 * 16 * 4, 1, 1, 64) and bs == 1 and np.shares_memory(kv, k)
    kv, _, _, bs = quest.decode_view(k.transpose(0, 2, 1, 3).copy(), k, "HND")
    assert kv.shape == (5 * 4, 1, 16, 64) and bs == 16
    both = np.zeros((5, 2, 16, 4, 64), np.float16)
    with pytest.raises(ValueError, match="k_cache: expected dense blocks one after the other"):
        quest.decode_view(both[:, 0], both[:, 1], "NHD")


def test_bad_quest_arguments(rng):
    case = make_case(rng, lens=[20], hk=2, hq=4, d=64, bs=8, dtype=np.float32)
    tables, lens, q = case["block_tables"], case["seq_lens"], case["q"]
    nb = case["k_cache"].shape[0]
    k_min, k_max = _fresh_bounds(nb, 2, 64, fill=0.0)
    with pytest.raises(ValueError, match="top_k: expected an int >= 1"):
        quest.select_pages(q, k_min, k_max, tables, lens, 8, 0)
    with pytest.raises(TypeError, match="k_min: expected dtype float32"):
        quest.page_scores(q, k_min.astype(np.float64), k_max, tables, lens, 8)
    with pytest.raises(ValueError, match="k_min: expected 3 dimensions"):
        quest.page_scores(q, k_min[0], k_max, tables, lens, 8)
    with pytest.raises(ValueError, match="k_max: expected shape"):
        quest.page_scores(q, k_min, k_max[:, :1], tables, lens, 8)
    with pytest.raises(ValueError, match="k_min: num_kv_heads"):
        quest.page_scores(q[:, :3], k_min, k_max, tables, lens, 8)
    with pytest.raises(ValueError, match="k_min: expected shape"):
        quest.update_page_bounds(case["k_cache"], tables, lens, k_min[1:], k_max,
                                 layout="NHD")
    with pytest.raises(ValueError, match="k_cache head_dim: head size 32 is not supported"):
        quest.update_page_bounds(case["k_cache"][..., :32].copy(), tables, lens, k_min[..., :32],
                                 k_max[..., :32], layout="NHD")
    with pytest.raises(ValueError, match="block_tables: expected entries in"):
        quest.update_page_bounds(case["k_cache"], tables + nb, lens, k_min, k_max,
                                 layout="NHD")
    with pytest.raises(ValueError, match="sinks: expected shape"):
        sparse.quest_decode(q, case["k_cache"], case["v_cache"], k_min, k_max, tables, lens, 2,
                            layout="NHD", sinks=np.zeros(3, np.float32))
    dec = sparse.QuestDecoder(4, 2, 64, 8, 2, dtype=np.float32, max_batch=1)
    with pytest.raises(ValueError, match="expected a plan"):
        dec.run(q, case["k_cache"], case["v_cache"], k_min, k_max)
    with pytest.raises(ValueError, match="max_batch=1"):
        dec.plan(np.concatenate([tables, tables]), np.concatenate([lens, lens]))
    with pytest.raises(ValueError, match="top_k_pages"):
        sparse.QuestDecoder(4, 2, 64, 8, 0)


# ----------------------------------------------------------------------------- GPU
GPU_CASES = [  # layout, dtype, block size, hq, hk, d, lens, top_k
    ("NHD", np.float16, 16, 8, 2, 128, [300, 40, 129, 0, 16], 4),
    ("HND", bfloat16, 16, 32, 8, 128, [1000, 17, 1, 0, 4000], 8),
    ("vllm", np.float16, 16, 8, 2, 64, [513, 200, 0, 33], 5),
    ("NHD", bfloat16, 8, 4, 1, 128, [700, 9, 64], 6),
    ("HND", np.float16, 32, 16, 4, 256, [2000, 31, 32, 33], 3),
    ("NHD", bfloat16, 24, 12, 3, 80, [600, 25, 0], 64),
    ("vllm", bfloat16, 32, 4, 4, 128, [1500, 100, 1], 10),
    # groups of 8 (d 64: two pages a warp), 12 (two passes of 8) and 6 at d 256 (two of 4)
    ("NHD", np.float16, 16, 16, 2, 64, [900, 77, 0, 16], 7),
    ("HND", bfloat16, 16, 24, 2, 112, [1200, 33], 9),
    ("vllm", bfloat16, 16, 6, 1, 256, [700, 5], 4),
]


def _gpu_setup(cp, rng, layout, dtype, bs, hq, hk, d, lens):
    case = make_case(rng, lens=lens, hq=hq, hk=hk, d=d, bs=bs, layout=layout, dtype=dtype)
    dev = {n: (cp.asarray(a) if isinstance(a, np.ndarray) else a) for n, a in case.items()}
    nb = k_as_nhd(case["k_cache"], layout).shape[0]
    return case, dev, nb


@pytest.mark.gpu
@pytest.mark.parametrize("bounds", BOUNDS, ids=BOUND_IDS)
@pytest.mark.parametrize("layout,dtype,bs,hq,hk,d,lens,k", GPU_CASES)
def test_gpu_bounds_match_reference(cp, rng, layout, dtype, bs, hq, hk, d, lens, k, bounds):
    case, dev, nb = _gpu_setup(cp, rng, layout, dtype, bs, hq, hk, d, lens)
    if bounds is E4M3:  # some keys past e4m3's range: unknown (NaN) bounds, both signs
        kc = case["k_cache"]
        kc[kc.shape[0] // 2:] = (kc[kc.shape[0] // 2:].astype(np.float32) * 300).astype(dtype)
        dev["k_cache"] = cp.asarray(kc)
    want_min, want_max = _fresh_bounds(nb, hk, d, dtype=bounds)
    got_min, got_max = _fresh_bounds(nb, hk, d, cp, dtype=bounds)
    args = (case["block_tables"], case["seq_lens"])
    quest.update_page_bounds(case["k_cache"], *args, want_min, want_max, layout=layout)
    quest.update_page_bounds(dev["k_cache"], dev["block_tables"], dev["seq_lens"], got_min,
                             got_max, layout=layout)
    # exact (NaN where no page was computed; bf16 and e4m3 rounded outward on both sides;
    # e4m3 bit for bit, its NaN codes' signs included)
    np.testing.assert_array_equal(_codes(got_min), _codes(want_min))
    np.testing.assert_array_equal(_codes(got_max), _codes(want_max))
    five = np.full((), 5.0, np.float32).astype(bounds)
    for a, b in ((got_min, want_min), (got_max, want_max)):
        a.fill(five.view(np.uint8) if bounds is E4M3 else five)
        b[...] = five
    quest.update_page_bounds(case["k_cache"], *args, want_min, want_max, layout=layout,
                             last_page_only=True)
    quest.update_page_bounds(dev["k_cache"], dev["block_tables"], dev["seq_lens"], got_min,
                             got_max, layout=layout, last_page_only=True)
    np.testing.assert_array_equal(_codes(got_min), _codes(want_min))
    np.testing.assert_array_equal(_codes(got_max), _codes(want_max))
    cupaged.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("first,bounds", [(0, np.float32), (2, np.float32), (0, bfloat16),
                                          (0, E4M3)],
                         ids=["f32", "f32-first2", "bf16", "e4m3"])
@pytest.mark.parametrize("layout,dtype,bs,hq,hk,d,lens,k", GPU_CASES)
def test_gpu_select_matches_reference(cp, rng, layout, dtype, bs, hq, hk, d, lens, k, first,
                                      bounds):
    case, dev, nb = _gpu_setup(cp, rng, layout, dtype, bs, hq, hk, d, lens)
    k_min, k_max = _fresh_bounds(nb, hk, d, dtype=bounds)
    tables, seq_lens = case["block_tables"], case["seq_lens"]
    quest.update_page_bounds(case["k_cache"], tables, seq_lens, k_min, k_max, layout=layout)
    tpp = quest.tokens_per_page(layout, hk, bs)
    want = quest.select_pages(case["q"], k_min, k_max, tables, seq_lens, bs, k,
                              first_pages=first, tokens_per_page=tpp)
    width = tables.shape[1]
    kk = min(k, width)
    out = quest.Selection(cp.full((len(lens), hk, kk), -7, np.int32),
                          cp.full((len(lens) * hk, kk * tpp), -7, np.int32),
                          cp.full(len(lens) * hk, -7, np.int32),
                          cp.full((len(lens), hk, width), np.nan, np.float32))
    got = quest.select_pages(dev["q"], _dev(cp, k_min), _dev(cp, k_max),
                             dev["block_tables"], dev["seq_lens"], bs, k, first_pages=first,
                             tokens_per_page=tpp, out=out)
    scores = got.scores.get()
    finite = np.isfinite(want.scores)
    np.testing.assert_array_equal(scores[~finite], want.scores[~finite])
    np.testing.assert_allclose(scores[finite], want.scores[finite], rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got.lens.get(), want.lens)
    pages = check_selection(got.tables.get(), got.lens.get(), want.scores, tables, seq_lens,
                            kk, hk, bs, tpp, tol=1e-5, first=first)
    pos = got.positions.get()
    for (b, h), kept in pages.items():
        assert pos[b, h].tolist() == kept + [-1] * (kk - len(kept))
    cupaged.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("bounds", BOUNDS, ids=BOUND_IDS)
@pytest.mark.parametrize("hq,hk,d", [(8, 2, 128), (24, 2, 64), (12, 2, 256)])
def test_gpu_scores_with_infinite_bounds_and_zero_queries(cp, rng, hq, hk, d, bounds):
    """Infinite bounds against zero, positive and negative query dims, as the reference
    takes them: a zero dim adds nothing whatever its bounds, +inf - inf makes the page
    -inf, an infinite product alone makes it +/-inf (the kernel's two-FMA sums give NaN on
    some of these and must fall back to the term-by-term sum). e4m3 has no infinity: its
    unknown bound (NaN) stands in for each, and reads as +inf for a max, -inf for a min."""
    lens = [16 * 40 + 3, 16 * 9]
    case, dev, nb = _gpu_setup(cp, rng, "HND", bfloat16, 16, hq, hk, d, lens)
    tables, seq_lens = case["block_tables"], case["seq_lens"]
    k_min, k_max = _fresh_bounds(nb, hk, d, dtype=bounds)
    quest.update_page_bounds(case["k_cache"], tables, seq_lens, k_min, k_max, layout="HND")
    q = case["q"].astype(np.float32)
    q[:, :, 3] = 0.0                     # a zero dim in every query
    q[:, :, 5] = np.abs(q[:, :, 5]) + 1  # positive
    q[:, :, 6] = -np.abs(q[:, :, 6]) - 1  # negative
    q = q.astype(case["q"].dtype)
    blk = tables[0]
    k_min[blk[0], :, 3], k_max[blk[0], :, 3] = -np.inf, np.inf   # zero dim: adds nothing
    k_max[blk[1], :, 5] = np.inf                                   # +inf
    k_min[blk[2], :, 6] = -np.inf                                  # +inf (negative q)
    k_max[blk[3], :, 5] = np.inf                                   # +inf and -inf: -inf
    k_min[blk[3], :, 6] = k_max[blk[3], :, 6] = np.inf
    k_max[blk[4], :, 5] = k_min[blk[4], :, 5] = -np.inf            # -inf
    k_min[blk[5], 0, 3] = np.inf                                   # zero dim, one head only
    k_min[blk[6], :, 5] = -np.inf                                  # unused side (q > 0)
    want = quest.page_scores(q, k_min, k_max, tables, seq_lens, 16)  # e4m3: the infs are NaN
    got = quest.page_scores(cp.asarray(q), _dev(cp, k_min), _dev(cp, k_max),
                            dev["block_tables"], dev["seq_lens"], 16).get()
    finite = np.isfinite(want)
    assert not finite[0, :, 3].any() and not finite[0, :, 1].any() and finite[0, :, 0].all()
    np.testing.assert_array_equal(got[~finite], want[~finite])
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-4)
    cupaged.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("in_smem", [True, False], ids=["smem", "global"])
def test_gpu_select_many_pages_and_ties(cp, rng, monkeypatch, in_smem):
    """Thousands of pages, top-64: the select on long rows, and ties resolved to the
    earlier pages exactly as the reference does; with the keys in registers and shared
    memory (the bisection) and the kept positions staged there, and (as for rows and
    budgets too long for that) with the keys read from global memory (the radix select)."""
    if not in_smem:
        monkeypatch.setattr(quest, "SELECT_CACHED_PAGES", 0)
        monkeypatch.setattr(quest, "SELECT_STAGED_PAGES", 0)
        monkeypatch.setattr(quest, "_SELECTS", quest.CallCache())  # launches set up afresh
    bs, hk, hq, d = 16, 2, 8, 128
    lens = [16 * 8192 - 5, 3000, 16 * 64 + 5, 16 * 64]  # 8192 pages: 16 keys a select thread
    case, dev, nb = _gpu_setup(cp, rng, "HND", bfloat16, bs, hq, hk, d, lens)
    tables, seq_lens = case["block_tables"], case["seq_lens"]
    kc = case["k_cache"]
    kc[tables[1, :150]] = kc[tables[1, 0]]   # 150 pages of equal scores in sequence 1
    dev["k_cache"] = cp.asarray(kc)
    k_min, k_max = _fresh_bounds(nb, hk, d)
    quest.update_page_bounds(kc, tables, seq_lens, k_min, k_max, layout="HND")
    want = quest.select_pages(case["q"], k_min, k_max, tables, seq_lens, bs, 64)
    got = quest.select_pages(dev["q"], cp.asarray(k_min), cp.asarray(k_max),
                             dev["block_tables"], dev["seq_lens"], bs, 64)
    check_selection(got.tables.get(), got.lens.get(), want.scores, tables, seq_lens, 64, hk,
                    bs, 1, tol=1e-5)
    np.testing.assert_array_equal(got.positions.get()[1], want.positions[1])


def _run_decode_case(cp, rng, layout, dtype, bs, hq, hk, d, lens, k, with_sinks):
    case, dev, nb = _gpu_setup(cp, rng, layout, dtype, bs, hq, hk, d, lens)
    k_min, k_max = _fresh_bounds(nb, hk, d, cp)
    quest.update_page_bounds(dev["k_cache"], dev["block_tables"], dev["seq_lens"], k_min,
                             k_max, layout=layout)
    sinks = rng.standard_normal(hq).astype(np.float32) if with_sinks else None
    out = cp.full(case["q"].shape, np.nan, dtype)
    got, lse = sparse.quest_decode(dev["q"], dev["k_cache"], dev["v_cache"], k_min, k_max,
                                   dev["block_tables"], dev["seq_lens"], k, layout=layout,
                                   sinks=None if sinks is None else cp.asarray(sinks), out=out,
                                   return_lse=True)
    tpp = quest.tokens_per_page(layout, hk, bs)
    sel = quest.select_pages(dev["q"], k_min, k_max, dev["block_tables"], dev["seq_lens"], bs,
                             k, tokens_per_page=tpp)
    pages = _pages_of(sel.tables.get(), sel.lens.get(), case["block_tables"], hk, bs, tpp)
    want, want_lse = _oracle(case, layout, pages, bs, d ** -0.5, sinks)
    return got.get(), lse.get(), want, want_lse


def _assert_close(got, lse, want, want_lse, dtype):
    got = got.astype(np.float64)
    assert np.isfinite(got).all(), "non-finite output (unwritten?)"
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err < TOL[np.dtype(dtype)], f"relative error {err:.3g}"
    np.testing.assert_allclose(lse, want_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("layout,dtype,bs,hq,hk,d,lens,k", GPU_CASES)
def test_gpu_decode_matches_oracle(cp, rng, layout, dtype, bs, hq, hk, d, lens, k, with_sinks):
    got, lse, want, want_lse = _run_decode_case(cp, rng, layout, dtype, bs, hq, hk, d, lens, k,
                                                with_sinks)
    _assert_close(got, lse, want, want_lse, dtype)
    cupaged.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("layout,dtype,bs,hq,hk,d,lens,k", [GPU_CASES[i] for i in (0, 1, 2, 9)])
def test_gpu_decoder_steps_over_layers_match_oracle(cp, rng, layout, dtype, bs, hq, hk, d,
                                                     lens, k):
    """One decoder over two layers' caches, two runs each (the second a hot run: launches
    set up by the first), in each output form; then a plan of fewer, shorter sequences and
    the same again. Every run is compared with the oracle over the pages it selected."""
    case, dev, nb = _gpu_setup(cp, rng, layout, dtype, bs, hq, hk, d, lens)
    layers = []
    for i in range(2):
        k_c = case["k_cache"] if i == 0 else rng.standard_normal(case["k_cache"].shape)
        v_c = case["v_cache"] if i == 0 else rng.standard_normal(case["v_cache"].shape)
        k_c, v_c = k_c.astype(dtype), v_c.astype(dtype)
        layers.append((k_c, v_c, cp.asarray(k_c), cp.asarray(v_c), *_fresh_bounds(nb, hk, d, cp)))
    sinks_h = rng.standard_normal(hq).astype(np.float32)
    dec = sparse.QuestDecoder(hq, hk, d, bs, k, dtype=dtype, layout=layout,
                              max_batch=len(lens))
    tpp = quest.tokens_per_page(layout, hk, bs)
    tables = case["block_tables"]
    # the second step: fewer sequences, each no longer than before (its table row holds them)
    for step_lens in (np.array(lens, np.int32), np.array(lens[:-1], np.int32) // 2):
        batch = len(step_lens)
        step_tables = np.ascontiguousarray(tables[:batch])
        dec.plan(cp.asarray(step_tables), cp.asarray(step_lens))
        q_h = rng.standard_normal((batch, hq, d)).astype(dtype)
        q = cp.asarray(q_h)
        for form in ("out", "out+lse+sinks", "return_lse"):
            for k_h, v_h, kc, vc, k_min, k_max in layers * 2:
                dec.update_bounds(kc, k_min, k_max, last_page_only=False)
                out = cp.full(q.shape, np.nan, dtype)
                lse = cp.full(q.shape[:2], np.nan, np.float32)
                sinks = cp.asarray(sinks_h) if form == "out+lse+sinks" else None
                if form == "return_lse":
                    out, lse = dec.run(q, kc, vc, k_min, k_max, return_lse=True)
                else:
                    dec.run(q, kc, vc, k_min, k_max, out=out, sinks=sinks,
                            lse=lse if sinks is not None else None)
                sel = dec.selection
                want_min, want_max = _fresh_bounds(nb, hk, d)
                quest.update_page_bounds(k_h, step_tables, step_lens, want_min, want_max,
                                         layout=layout)
                scores = quest.page_scores(q_h, want_min, want_max, step_tables, step_lens, bs)
                pages = check_selection(sel.tables.get(), sel.lens.get(), scores, step_tables,
                                        step_lens, k, hk, bs, tpp, tol=1e-5)
                one = {"q": q_h, "k_cache": k_h, "v_cache": v_h, "seq_lens": step_lens,
                       "block_tables": step_tables}
                want, want_lse = _oracle(one, layout, pages, bs, d ** -0.5,
                                         sinks_h if sinks is not None else None)
                got = out.get()
                if form == "out":
                    assert np.isfinite(got.astype(np.float64)).all()
                    err = np.linalg.norm(got.astype(np.float64) - want) / max(
                        np.linalg.norm(want), 1e-30)
                    assert err < TOL[np.dtype(dtype)], f"relative error {err:.3g}"
                else:
                    _assert_close(got, lse.get(), want, want_lse, dtype)
    cupaged.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_decoder_graph_replay_follows_new_keys_and_lengths(cp, rng, layout):
    """Capture a whole step (last-page bounds update, select, decode, sinks); then append a
    key to every sequence, plan the new lengths (same tables), replay, and compare."""
    bs, hk, hq, d, k = 16, 2, 8, 128, 4
    lens1 = np.array([300, 17, 0, 160], np.int32)
    lens2 = lens1 + 1
    case, dev, nb = _gpu_setup(cp, rng, layout, bfloat16, bs, hq, hk, d, lens2 + bs)
    kc, vc = cp.asarray(case["k_cache"]), cp.asarray(case["v_cache"])
    tables = cp.asarray(case["block_tables"])
    sinks_h = rng.standard_normal(hq).astype(np.float32)
    sinks = cp.asarray(sinks_h)
    k_min, k_max = _fresh_bounds(nb, hk, d, cp)
    dec = sparse.QuestDecoder(hq, hk, d, bs, k, dtype=bfloat16, layout=layout, max_batch=4)
    q = cp.asarray(case["q"])
    out = cp.empty(q.shape, bfloat16)
    lse = cp.empty(q.shape[:2], np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with stream:
        dec.plan(tables, cp.asarray(lens1))
        dec.update_bounds(kc, k_min, k_max, last_page_only=False)
        dec.run(q, kc, vc, k_min, k_max, sinks=sinks, out=out, lse=lse)  # set up outside
        stream.synchronize()
        stream.begin_capture()
        dec.update_bounds(kc, k_min, k_max)
        dec.run(q, kc, vc, k_min, k_max, sinks=sinks, out=out, lse=lse)
        graph = stream.end_capture()
        # a new key at position lens1 of each sequence, new queries, the new lengths
        new_q = rng.standard_normal(case["q"].shape).astype(bfloat16)
        q[...] = cp.asarray(new_q)
        case["q"] = new_q
        kn = np.array(k_as_nhd(case["k_cache"], layout))
        for b, n in enumerate(lens1):
            kn[case["block_tables"][b, n // bs], n % bs] = 3.0 * rng.standard_normal((hk, d))
        case["k_cache"] = from_nhd(kn, np.array(v_as_nhd(case["v_cache"], layout)), layout)[0]
        kc[...] = cp.asarray(case["k_cache"])
        dec.plan(tables, cp.asarray(lens2))
        out.fill(np.nan)
        lse.fill(np.nan)
        graph.launch()
        stream.synchronize()
    case["seq_lens"] = lens2
    want_min, want_max = _fresh_bounds(nb, hk, d)
    quest.update_page_bounds(case["k_cache"], case["block_tables"], lens2, want_min, want_max,
                             layout=layout)
    used = np.unique([case["block_tables"][b, p] for b, n in enumerate(lens2)
                      for p in range(-(-n // bs))])
    np.testing.assert_array_equal(k_min.get()[used], want_min[used])
    sel = dec.selection
    tpp = quest.tokens_per_page(layout, hk, bs)
    scores = quest.page_scores(case["q"], want_min, want_max, case["block_tables"], lens2, bs)
    pages = check_selection(sel.tables.get(), sel.lens.get(), scores, case["block_tables"],
                            lens2, k, hk, bs, tpp, tol=1e-5)
    want, want_lse = _oracle(case, layout, pages, bs, d ** -0.5, sinks_h)
    _assert_close(out.get(), lse.get(), want, want_lse, bfloat16)


@pytest.mark.gpu
def test_gpu_torch_tensors_match_cupy(cp, rng):
    """QuestDecoder (plan, update_bounds, run) and quest_decode take torch tensors zero-copy
    and give torch tensors back, equal to the same calls on CuPy arrays."""
    torch = pytest.importorskip("torch")
    bs, hk, hq, d, k = 16, 2, 8, 128, 4
    lens = [300, 17, 0, 160]
    case, dev, nb = _gpu_setup(cp, rng, "HND", bfloat16, bs, hq, hk, d, lens)
    t = {n: torch.from_dlpack(a) for n, a in dev.items() if hasattr(a, "__cuda_array_interface__")}
    results = []
    for kind, arr in (("cupy", dev), ("torch", t)):
        k_min, k_max = _fresh_bounds(nb, hk, d, cp)
        if kind == "torch":
            k_min, k_max = torch.from_dlpack(k_min), torch.from_dlpack(k_max)
        dec = sparse.QuestDecoder(hq, hk, d, bs, k, dtype=bfloat16, layout="HND", max_batch=4)
        dec.plan(arr["block_tables"], arr["seq_lens"])
        dec.update_bounds(arr["k_cache"], k_min, k_max, last_page_only=False)
        out, lse = dec.run(arr["q"], arr["k_cache"], arr["v_cache"], k_min, k_max,
                           return_lse=True)
        once = sparse.quest_decode(arr["q"], arr["k_cache"], arr["v_cache"], k_min, k_max,
                                   arr["block_tables"], arr["seq_lens"], k, layout="HND")
        if kind == "torch":
            assert all(isinstance(x, torch.Tensor) and x.is_cuda for x in (out, lse, once))
            results.append([x.float().cpu().numpy() for x in (out, lse, once)])
        else:
            results.append([x.astype(cp.float32).get() for x in (out, lse, once)])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(results[0][0]).all() and (results[0][0] != 0).any()
    cupaged.check_errors()


@pytest.mark.gpu
def test_gpu_quest_calls_do_not_sync(cp, rng):
    from test_no_sync import assert_no_sync_cupy
    bs, hk, hq, d = 16, 8, 32, 128
    case, dev, nb = _gpu_setup(cp, rng, "NHD", bfloat16, bs, hq, hk, d, [3000, 17, 0, 900])
    k_min, k_max = _fresh_bounds(nb, hk, d, cp, fill=0.0)
    args = (dev["block_tables"], dev["seq_lens"])
    dec = sparse.QuestDecoder(hq, hk, d, bs, 16, dtype=bfloat16, layout="NHD", max_batch=4)
    out = cp.empty(case["q"].shape, bfloat16)
    for call in (
            lambda: quest.update_page_bounds(dev["k_cache"], *args, k_min, k_max, layout="NHD"),
            lambda: sparse.quest_decode(dev["q"], dev["k_cache"], dev["v_cache"], k_min, k_max,
                                        *args, 16, layout="NHD"),
            lambda: dec.plan(*args).run(dev["q"], dev["k_cache"], dev["v_cache"], k_min, k_max,
                                        out=out)):
        assert_no_sync_cupy(cp, call)
    cupaged.check_errors()


@pytest.mark.gpu
def test_gpu_bad_device_entries_are_reported(cp, rng):
    bs, hk, hq, d = 16, 2, 4, 64
    case, dev, nb = _gpu_setup(cp, rng, "HND", np.float16, bs, hq, hk, d, [100, 50, 70])
    tables, lens = case["block_tables"].copy(), case["seq_lens"].copy()
    k_min, k_max = _fresh_bounds(nb, hk, d, cp, fill=0.0)
    quest.update_page_bounds(dev["k_cache"], dev["block_tables"], dev["seq_lens"], k_min,
                             k_max, layout="HND")
    cupaged.check_errors()
    tables[1, 2] = nb + 5
    bad_tables = cp.asarray(tables)
    out = sparse.quest_decode(dev["q"], dev["k_cache"], dev["v_cache"], k_min, k_max,
                              bad_tables, dev["seq_lens"], 3, layout="HND").get()
    assert (out[1] == 0).all() and np.isfinite(out).all() and (out[0] != 0).any()
    with pytest.raises(ValueError, match=r"block_tables: expected entries in \[0, "):
        cupaged.check_errors()
    lens[2] = tables.shape[1] * bs + 1
    out = sparse.quest_decode(dev["q"], dev["k_cache"], dev["v_cache"], k_min, k_max,
                              dev["block_tables"], cp.asarray(lens), 3, layout="HND").get()
    assert (out[2] == 0).all()
    with pytest.raises(ValueError, match="seq_lens: sequence 2"):
        cupaged.check_errors()
    quest.update_page_bounds(dev["k_cache"], bad_tables, dev["seq_lens"], k_min, k_max,
                             layout="HND")
    with pytest.raises(ValueError, match="block_tables"):
        cupaged.check_errors()


# ----------------------------------------------------------------------------- retrieval
def _retrieval_case(rng, batch, seq_len, hq, hk, d, bs, hits, dtype):
    """Noise keys (std 0.25) with ``hits`` keys per (sequence, kv head) aligned with the
    sum of its group's queries, about 8 nats above the noise: the pages Quest must find."""
    case = make_case(rng, lens=[seq_len] * batch, hq=hq, hk=hk, d=d, bs=bs, dtype=np.float32)
    k = np.nan_to_num(case["k_cache"]) * 0.25
    q = case["q"]
    g = hq // hk
    planted = {}
    for b in range(batch):
        for h in range(hk):
            u = q[b, h * g:(h + 1) * g].sum(axis=0)
            u /= np.linalg.norm(u)
            for j in rng.choice(seq_len - bs, hits, replace=False):   # not in the last page
                k[case["block_tables"][b, j // bs], j % bs, h] = 16.0 * u
                planted.setdefault((b, h), set()).add(int(j // bs))
    case.update(k_cache=k.astype(dtype), q=q.astype(dtype),
                v_cache=np.nan_to_num(case["v_cache"]).astype(dtype))
    return case, planted


def _check_retrieval(case, planted, pages, out, bs):
    """Every planted page selected, and the output within the bound of dense attention:
    ``|quest - dense| <= 2 m max|v|``, ``m`` dense's softmax mass on the keys not read."""
    for key, want in planted.items():
        assert want <= set(pages[key]), f"{key}: planted pages {want} not all selected"
    q, kc, vc = (case[n].astype(np.float64) for n in ("q", "k_cache", "v_cache"))
    hq, hk, d = q.shape[1], kc.shape[2], q.shape[2]
    for b in range(q.shape[0]):
        n = int(case["seq_lens"][b])
        blocks = case["block_tables"][b, np.arange(n) // bs]
        keys, vals = kc[blocks, np.arange(n) % bs], vc[blocks, np.arange(n) % bs]
        for qh in range(hq):
            h = qh // (hq // hk)
            s = keys[:, h] @ q[b, qh] * d ** -0.5
            w = np.exp(s - s.max())
            w /= w.sum()
            read = np.isin(np.arange(n) // bs, pages[b, h])
            dropped = w[~read].sum()
            dense = w @ vals[:, h]
            bound = 2 * dropped * np.abs(vals[:, h]).max() + 2e-2 * np.abs(dense).max()
            assert np.abs(out[b, qh].astype(np.float64) - dense).max() <= bound


@pytest.mark.parametrize("bounds", BOUNDS, ids=BOUND_IDS)
def test_reference_retrieval_finds_planted_keys(rng, bounds):
    bs, hk, hq, d, k = 16, 2, 8, 64, 8
    case, planted = _retrieval_case(rng, 2, 1024, hq, hk, d, bs, 3, np.float32)
    k_min, k_max = _fresh_bounds(case["k_cache"].shape[0], hk, d, dtype=bounds)
    tables, lens = case["block_tables"], case["seq_lens"]
    quest.update_page_bounds(case["k_cache"], tables, lens, k_min, k_max, layout="NHD")
    out = sparse.quest_decode(case["q"], case["k_cache"], case["v_cache"], k_min, k_max,
                              tables, lens, k, layout="NHD")
    sel = quest.select_pages(case["q"], k_min, k_max, tables, lens, bs, k)
    pages = {(b, h): [p for p in sel.positions[b, h] if p >= 0] for b in range(2)
             for h in range(hk)}
    _check_retrieval(case, planted, pages, out, bs)


@pytest.mark.gpu
@pytest.mark.parametrize("bounds", BOUNDS, ids=BOUND_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_retrieval_finds_planted_keys(cp, rng, layout, bounds):
    bs, hk, hq, d, k = 16, 8, 32, 128, 64
    case, planted = _retrieval_case(rng, 2, 32768, hq, hk, d, bs, 4, bfloat16)
    kc, vc = from_nhd(case["k_cache"], case["v_cache"], layout)
    tables, lens = cp.asarray(case["block_tables"]), cp.asarray(case["seq_lens"])
    kd, vd, q = cp.asarray(kc), cp.asarray(vc), cp.asarray(case["q"])
    k_min, k_max = _fresh_bounds(kc.shape[0], hk, d, cp, dtype=bounds)
    dec = sparse.QuestDecoder(hq, hk, d, bs, k, dtype=bfloat16, layout=layout, max_batch=2)
    dec.plan(tables, lens).update_bounds(kd, k_min, k_max, last_page_only=False)
    out = dec.run(q, kd, vd, k_min, k_max).get()
    tpp = quest.tokens_per_page(layout, hk, bs)
    pages = _pages_of(dec.selection.tables.get(), dec.selection.lens.get(),
                      case["block_tables"], hk, bs, tpp)
    _check_retrieval(case, planted, pages, out, bs)
    cupaged.check_errors()
