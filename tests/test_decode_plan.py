"""Paged-decode planning on the CPU: launch geometry, work pieces and their descriptors, the
packed index, and a mirror of the kernel's tile stream (which stage holds which tile).

The kernels' constants and tile sizes come from decode.plan (emitted into abi.cuh), so the
expectations here are written in its constants, not restated numbers; the GPU tests in
test_decode.py check the kernel itself against the reference on plans like these.
"""
import math

import numpy as np
import pytest

from cupaged.core import abi
from cupaged.decode import checks as dc, launch as decode, plan as dp
from cupaged.core.arrays import FLOAT_DTYPES, HEAD_DIMS
from cupaged.core.layouts import LAYOUTS

D128 = dict(itemsize=2, head_dim=128, layout="NHD", block_size=16)


def launch(hq=32, hk=8, slots=None, **kw):
    return dp.plan_launch(**{**D128, **kw}, num_q_heads=hq, num_kv_heads=hk, slots=slots)


def random_lengths(rng, batch, top=3000):
    lens = rng.integers(0, top, batch).astype(np.int32)
    lens[rng.random(batch) < 0.2] = 0
    return lens


# ----------------------------------------------------------------------------- geometry
def test_kernel_constants_are_emitted_from_python():
    """abi.cuh carries decode.plan's constants and its stage_tile rule, the one home of both."""
    from cupaged.core.compile import source
    header = source("decode")
    assert dp.cpp() in header
    for name in dp.KERNEL_CONSTANTS:
        assert f"constexpr int {name} = {getattr(dp, name)};" in header
    assert dp.NWARPS == dp.NTHREADS // 32 and dp.PAGE_THREADS == 32 * dp.PAGE_WARPS
    assert "constexpr int stage_tile(int row_bytes)" in header  # Cfg::TILE
    for itemsize in (2, 4):
        for d in HEAD_DIMS:
            assert dp.tile_config(itemsize, d, False, 1).tile == dp.stage_tile(d * itemsize)


def test_launch_holds_one_cta_per_slot():
    per_sm = dp.ctas_per_sm(dp.tile_config(2, 128, False, 1).smem_bytes)
    assert launch().columns == dp.DEFAULT_SMS * per_sm // 8   # d128 bf16, 8 row groups
    assert launch(slots=264).grid == (33, 8)
    assert launch(hq=32, hk=32, slots=264).grid == (8, 32)
    assert launch(hq=8, hk=8, slots=4).grid == (1, 8)     # more row groups than slots


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_specializations_cover_every_plan(dtype):
    specs = {s.expr for s in decode.kernel_specializations()}
    for d in HEAD_DIMS:
        assert decode._pieces_expr(dtype, d) in specs
        for layout in LAYOUTS:
            for hq, hk in ((8, 8), (32, 8), (16, 1), (32, 1), (128, 1), (24, 2)):
                lp = dp.plan_launch(itemsize=np.dtype(dtype).itemsize, head_dim=d, layout=layout,
                                    block_size=16, num_q_heads=hq, num_kv_heads=hk)
                assert decode._decode_expr(dtype, d, lp.vllm_v, lp.tiles.head_tiles) in specs
                assert lp.heads_per_group * lp.heads.head_chunks >= hq // hk
                assert lp.heads.head_warps <= dp.NWARPS
                if dp.pages_capable(90, np.dtype(dtype).itemsize, d, layout, 16, hq, hk):
                    pl = dp.plan_launch(itemsize=np.dtype(dtype).itemsize, head_dim=d,
                                        layout=layout, block_size=16, num_q_heads=hq,
                                        num_kv_heads=hk, pages=True)
                    assert pl.head_major == (layout == "HND")
                    assert decode._launch_expr(pl, dtype) in specs


def test_min_piece_tiles_balances_merge_and_streaming():
    """sqrt(n c) tiles a piece, c = 2 ceil(heads per row group / 4) / TILE; never under
    STAGES - 1."""
    mqa, gqa = launch(hq=32, hk=1, slots=264), launch(hq=32, hk=8, slots=264)
    assert mqa.heads_per_group == 32 and gqa.heads_per_group == 8

    def want(lp, n, heads_a_warp):
        return max(dp.STAGES - 1, math.ceil(math.sqrt(n * 2 * heads_a_warp / lp.tiles.tile)))
    for n in (0, 8, 32, 512, 2048):
        assert dp.min_piece_tiles(mqa, n) == want(mqa, n, 32 // dp.NWARPS), n
        assert dp.min_piece_tiles(mqa, n, "kernel") == want(mqa, n, 1), n  # one head a warp
        assert dp.min_piece_tiles(gqa, n) == want(gqa, n, 8 // dp.NWARPS), n
    length = 512 * mqa.tiles.tile - 1  # 512 tiles, the appended key included
    for merge in ("fused", "kernel"):
        work = dp.plan_work(mqa, np.array([length], np.int32), True, -1, merge=merge)
        assert work.max_pieces == -(-512 // dp.min_piece_tiles(mqa, 512, merge)), merge


def test_default_merge_by_heads_per_row_group():
    """The kernel merge (a warp per head) where the fused one would walk more than two
    heads a warp; explicit choices pass through."""
    mqa, gqa = launch(hq=32, hk=1, slots=264), launch(hq=32, hk=8, slots=264)
    assert dp.resolve_merge(None, mqa) == "kernel" and dp.merge_launch(mqa, 64)[0][2] == 8
    assert dp.resolve_merge(None, gqa) == "fused" and dp.merge_launch(gqa, 64)[0][2] == 2
    assert dp.resolve_merge(None, launch(hq=64, hk=4, slots=264)) == "kernel"  # 16 heads
    assert dp.resolve_merge(None, launch(hq=32, hk=32, pages=True)) == "kernel"  # 8 heads
    assert dp.resolve_merge("fused", mqa) == "fused" and dp.resolve_merge("kernel", gqa) == "kernel"


def test_merge_splits_many_pieces_over_warps():
    """merge_pieces_kernel gives a head one warp while sequences have about 16 pieces or
    fewer, else a power of two of warps (CTAs of up to MERGE_MAX_WARPS), by the batch alone."""
    lp = launch(pages=True)  # 132 columns, 32 heads in one row group
    got = {b: dp.merge_launch(lp, b) for b in (1, 2, 4, 8, 12, 13, 64, 300)}
    assert got[1] == ((1, 1, 32), 512, 16)
    assert got[2] == ((2, 1, 32), 256, 8)        # about 99 pieces: 13 a warp
    assert got[4] == ((4, 1, 32), 128, 4)
    assert got[8] == ((8, 1, 16), 128, 2)
    assert got[12] == ((12, 1, 16), 128, 2) and got[13] == ((13, 1, 8), 128, 1)
    assert got[64] == ((64, 1, 8), 128, 1) and got[300] == ((300, 1, 8), 128, 1)
    for b, (grid, threads, wph) in got.items():
        warps = threads // 32
        assert wph <= warps <= dp.MERGE_MAX_WARPS and warps % wph == 0
        assert grid[2] * (warps // wph) >= lp.heads_per_group  # every head has its warps
    staged = launch(hq=32, hk=8, slots=264)  # 8 row groups of 8 heads, 33 columns
    assert dp.merge_launch(staged, 1) == ((1, 8, 8), 128, 4)


def test_pages_kernel_applies_and_plans():
    """pages on sm_90+ for 16-bit NHD caches with blocks of 16k tokens or of a divisor of 16
    and HND ones with blocks of 16k tokens, d 64/96/128, up to 8 query heads a kv head;
    its launch: one row group of every head up to 8 kv heads, PAGE_THREADS threads, tiles of
    whole blocks (page_tile), a PAGE_STAGES ring of tiles."""
    ok = dict(itemsize=2, head_dim=128, layout="NHD", block_size=16, num_q_heads=32,
              num_kv_heads=8)
    assert dp.pages_capable("90", **ok) and dp.resolve_backend("auto", "90", **ok, batch=16)
    assert not dp.resolve_backend("auto", "90", **ok, batch=1)            # pages_preferred
    assert dp.resolve_backend("auto", "90", **ok, batch=2)
    assert dp.resolve_backend("pages", "90", **ok, batch=1)
    few = {**ok, "num_q_heads": 8, "num_kv_heads": 2}
    assert dp.pages_capable("90", **few) and dp.resolve_backend("auto", "90", **few, batch=64)
    for bs in (1, 2, 4, 8):
        assert dp.pages_capable("90", **{**ok, "block_size": bs}), bs
    for bs, hk in ((16, 8), (32, 4), (48, 2)):  # HND: whole blocks of 16k tokens a tile
        args = {**ok, "layout": "HND", "block_size": bs, "num_q_heads": 4 * hk, "num_kv_heads": hk}
        assert dp.pages_capable("90", **args), bs
    for bad in (dict(itemsize=4), dict(head_dim=80), dict(layout="HND", block_size=8),
                dict(layout="vllm"), dict(block_size=12),
                dict(block_size=3), dict(block_size=24),
                dict(num_q_heads=64, num_kv_heads=4),
                dict(block_size=64)):  # 64 x 8 x 128 x 2 B x 2 x 3 stages > 227 KB
        args = {**ok, **bad}
        assert not dp.pages_capable("90", **args), bad
        assert not dp.resolve_backend("auto", "90", **args, batch=64)
        with pytest.raises(ValueError, match="backend: 'pages' needs"):
            dp.resolve_backend("pages", "90", **args, batch=64)
    assert not dp.pages_capable("80", **ok)
    assert not dp.resolve_backend("staged", "90", **ok, batch=64)
    with pytest.raises(ValueError, match="backend"):
        dp.resolve_backend("tma", "90", **ok, batch=64)
    lp = launch(pages=True)
    assert lp.pages and lp.row_groups == 1 and lp.threads == dp.PAGE_THREADS
    assert lp.heads_per_group == 32 and lp.merge_kv_heads == 1
    for bs in (1, 4, 8, 16, 32, 48):
        lp_bs = dp.plan_launch(itemsize=2, head_dim=128, layout="NHD", block_size=bs,
                               num_q_heads=32, num_kv_heads=8, pages=True)
        tile = lp_bs.tiles.tile
        assert tile == dp.page_tile(bs, 8, 128, 2), bs
        assert lp_bs.tiles.smem_bytes == dp.PAGE_STAGES * 2 * tile * 8 * 128 * 2, bs
    assert lp.columns == dp.DEFAULT_SMS and lp.grid == (dp.DEFAULT_SMS, 1)
    assert dp.resolve_merge(None, lp) == "kernel"
    assert dp.merge_launch(lp, 64) == ((64, 1, 8), 128, 1)
    work = dp.plan_work(lp, np.array([8192] * 64, np.int32), False, -1, merge="kernel")
    assert work.desc[:, 3].max() == 8192 // lp.tiles.tile  # tile indices count page tiles


def test_pages_kernel_tiles_grow_as_heads_shrink():
    """PAGE_WARPS warps split a CTA's kv heads and their tokens: a tile is the fewest whole
    blocks holding 16 tokens a token warp, so a stage keeps its bytes however few the heads,
    but no more blocks than PAGE_TILE_BYTES an operand hold (at least one)."""
    for d in (64, 128):
        for hk in (1, 2, 3, 4, 8, 32):
            heads = dp.page_kv_heads(hk)
            want = 16 * (dp.PAGE_WARPS // heads)  # tokens of a tile's token warps
            for bs in (1, 2, 8, 16, 48, 64, 256):
                tile = dp.page_tile(bs, hk, d, 2)
                nbytes = lambda tokens: tokens * heads * d * 2  # noqa: E731 - an operand
                assert tile % bs == 0 and tile >= bs
                assert tile == bs or nbytes(tile) <= dp.PAGE_TILE_BYTES
                assert tile - bs < want                           # the fewest blocks
                assert tile >= want or nbytes(tile + bs) > dp.PAGE_TILE_BYTES
                assert dp.page_smem_bytes(bs, hk, d, 2) == dp.PAGE_STAGES * 2 * nbytes(tile)
        tiles = [dp.page_tile(16, hk, d, 2) for hk in (8, 4, 2, 1)]
        assert tiles == sorted(tiles)
    mqa8 = dp.plan_launch(itemsize=2, head_dim=128, layout="NHD", block_size=16, num_q_heads=8,
                          num_kv_heads=1, pages=True)
    assert mqa8.tiles.tile == dp.page_tile(16, 1, 128, 2)
    assert mqa8.row_groups == 1 and mqa8.heads_per_group == 8


def test_pages_kernel_row_groups_of_kv_heads():
    """Beyond 8 kv heads a pages CTA serves a group of them, the largest divisor of their
    number up to 8 (a warp each); the groups are the grid's rows and the merge's kv heads;
    preferred only with groups of 4 kv heads or more."""
    assert [dp.page_kv_heads(h) for h in (1, 4, 8, 12, 16, 32, 40, 11)] == [1, 4, 8, 6, 8, 8, 8, 1]
    mha = dict(itemsize=2, head_dim=128, layout="NHD", block_size=16, num_q_heads=32,
               num_kv_heads=32)
    for layout in ("NHD", "HND"):
        assert dp.pages_capable("90", **{**mha, "layout": layout})
        assert dp.resolve_backend("auto", "90", **{**mha, "layout": layout}, batch=2)
    lp = dp.plan_launch(**mha, pages=True)
    assert lp.heads.head_warps == 8 and lp.row_groups == 4 and lp.heads_per_group == 8
    assert lp.merge_kv_heads == 4 and lp.grid == (dp.DEFAULT_SMS // 4, 4)
    assert lp.tiles.smem_bytes == dp.PAGE_STAGES * 2 * lp.tiles.tile * 8 * 128 * 2
    assert dp.merge_launch(lp, 64)[0] == (64, 4, 2)
    hk12 = dp.plan_launch(**{**mha, "num_q_heads": 24, "num_kv_heads": 12}, pages=True)
    assert hk12.row_groups == 2 and hk12.heads_per_group == 12
    prime = {**mha, "num_q_heads": 22, "num_kv_heads": 11}   # a kv head a CTA: capable only
    assert dp.pages_capable("90", **prime) and not dp.resolve_backend("auto", "90", **prime,
                                                                      batch=64)
    assert dp.plan_launch(**prime, pages=True).row_groups == 11


def test_tiles_cover_visible_range_once():
    """tile_spans (the kernel's first_visible and tile count) covers [lo, kv_len) exactly."""
    for tile in (16, 32, 64):
        kv = np.array([0, 1, 2, 17, 63, 64, 65, 511, 513, 4097])
        for window in (-1, 0, 5, 100):
            first, n = dp.tile_spans(kv, window, tile)
            for kv_len, f, c in zip(kv, first, n):
                lo = max(0, kv_len - 1 - window) if window >= 0 else 0
                seen = [j for t in range(f, f + c) for j in range(t * tile, (t + 1) * tile)
                        if lo <= j < kv_len]
                assert seen == list(range(lo, kv_len))
                assert c == 0 or (f * tile <= lo < (f + 1) * tile and (f + c - 1) * tile < kv_len)


# ----------------------------------------------------------------------------- pieces
def assert_pieces_partition(pieces, n, columns):
    """Each sequence's pieces are consecutive cuts of its tiles, in order, none empty unless
    the sequence has no tile (then exactly one); columns non-decreasing and in range."""
    assert (np.diff(pieces.column) >= 0).all() and pieces.column.min() >= 0
    assert pieces.column.max() < columns
    np.testing.assert_array_equal(np.bincount(pieces.seq, minlength=len(n)), pieces.per_seq)
    for b in range(len(n)):
        mine = pieces.seq == b
        off, cnt = pieces.offset[mine], pieces.count[mine]
        np.testing.assert_array_equal(pieces.index[mine], np.arange(mine.sum()))
        if n[b] == 0:
            assert (mine.sum(), cnt[0], off[0]) == (1, 0, 0)
        else:
            assert (cnt > 0).all() and off[0] == 0 and off[-1] + cnt[-1] == n[b]
            np.testing.assert_array_equal(off[1:], off[:-1] + cnt[:-1])


@pytest.mark.parametrize("columns,min_share", [(1, 1), (3, 1), (33, 2), (264, 1), (264, 5)])
def test_balanced_pieces_split_tiles_evenly(rng, columns, min_share):
    for batch in (1, 5, 64, 300):
        n = dp.tile_spans(random_lengths(rng, batch), -1, 64)[1]
        pieces = dp.balanced_pieces(n, columns, min_share)
        assert_pieces_partition(pieces, n, columns)
        share = max(min_share, -(-int(n.sum()) // columns))
        load = np.bincount(pieces.column, weights=pieces.count, minlength=columns)
        assert load.max() <= share and load.sum() == n.sum()
        # only a column's first and last pieces can belong to a cut sequence
        cut = pieces.per_seq[pieces.seq] > 1
        for c in range(columns):
            inner = cut[pieces.column == c][1:-1]
            assert not inner.any()


def test_balanced_pieces_examples():
    p = dp.balanced_pieces(np.array([128] * 64), 33)     # B64 x L8K, 64-token tiles
    assert p.per_seq.max() == 2 and np.bincount(p.column, p.count).max() == 249
    p = dp.balanced_pieces(np.array([32]), 33)           # B1 x L2K: a tile per column
    assert p.per_seq[0] == 32 and (p.count == 1).all()
    p = dp.balanced_pieces(np.array([0, 0]), 4)          # no keys: one empty piece each
    assert list(p.count) == [0, 0] and list(p.column) == [0, 0]
    lp = launch(slots=264)                               # 33 columns
    work = dp.plan_work(lp, np.array([32 * lp.tiles.tile], np.int32), False, -1)
    share = dp.min_piece_tiles(lp, 32)                   # STAGES - 1 tiles at least
    assert share >= dp.STAGES - 1 and work.max_pieces == -(-32 // share)


def test_pool_takes_each_sequence_tail(rng):
    """The pool holds floor(n / 16) tiles of each sequence, after its fixed pieces, in
    pieces of one size (the last of a sequence shorter), about POOL_PIECES a column; none
    when the columns' fixed shares would be short."""
    for columns in (1, 33, 66):
        n = dp.tile_spans(random_lengths(rng, 70, 20000), -1, 16)[1]
        tail, size = dp.pool_tiles(n, columns, 2)
        np.testing.assert_array_equal(tail, n // 16)
        assert size >= 2 and -(-tail // size).sum() <= dp.POOL_PIECES * columns + len(n)
        pieces = dp.with_pool(dp.balanced_pieces(n - tail, columns, 2), n - tail, tail, size)
        pool = pieces.column < 0
        assert not pool[:np.argmax(pool)].any() and pool[np.argmax(pool):].all()
        assert (pieces.count[pool] <= size).all() and (pieces.count[pool] > 0).all()
        np.testing.assert_array_equal(np.bincount(pieces.seq[pool], pieces.count[pool],
                                                  len(n)), tail)
        for b in range(len(n)):  # fixed then pooled: consecutive cuts of all n tiles
            mine = pieces.seq == b
            order = np.argsort(pieces.index[mine])
            off, cnt = pieces.offset[mine][order], pieces.count[mine][order]
            np.testing.assert_array_equal(pieces.index[mine][order], np.arange(mine.sum()))
            assert off[0] == 0 and off[-1] + cnt[-1] == n[b]
            np.testing.assert_array_equal(off[1:], off[:-1] + cnt[:-1])
    assert dp.pool_tiles(np.array([400] * 8), 132, 2)[1] == 0      # 3200 tiles < 128 a column
    assert dp.pool_tiles(np.array([15] * 1000), 4, 2)[1] == 0       # tails of 0 tiles
    assert dp.pool_tiles(np.array([128] * 64), 132, 2)[1] == 0      # B64 x L2K: 62 a column
    tail, size = dp.pool_tiles(np.array([512] * 64), 132, 2)       # B64 x L8K, page 16
    assert (tail == 32).all() and size == 4


def test_whole_pieces_deal_sequences_back_and_forth(rng):
    """Each sequence one piece, the longest first, columns 0..C-1 then C-1..0; the makespan
    is the fullest column's tiles."""
    p, makespan = dp.whole_pieces(np.array([32] * 256), 132)     # B256 x L512, page 16
    assert makespan == 64 and (p.per_seq == 1).all() and (p.count == 32).all()
    assert_pieces_partition(p, np.array([32] * 256), 132)
    assert np.bincount(p.column, minlength=132).max() == 2
    n = dp.tile_spans(random_lengths(rng, 300), -1, 16)[1]
    p, makespan = dp.whole_pieces(n, 132)
    assert_pieces_partition(p, n, 132)
    assert makespan == np.bincount(p.column, p.count, 132).max()
    assert makespan <= -(-n.sum() // 132) + n.max()
    p, makespan = dp.whole_pieces(np.array([7, 0, 9]), 4)
    assert list(p.seq) == [2, 0, 1] and list(p.column) == [0, 1, 2] and makespan == 9


def test_balanced_plans_keep_short_sequences_whole():
    """Whole sequences where they end within WHOLE_SLACK of the equal share (no partials, no
    merge); the cut plan, with the pool for long shares, otherwise."""
    lp = launch(pages=True)  # 132 columns, 16-token tiles
    def plan(batch, length):
        return dp.plan_work(lp, np.full(batch, length, np.int32), False, -1, merge="kernel")
    for batch, length in ((256, 512), (128, 1024), (132, 100), (300, 64)):
        work = plan(batch, length)
        assert work.max_pieces == 1 and work.num_slots == 0 and work.pool_pieces == 0, batch
    work = plan(64, 2048)       # whole: 128 tiles a column against a share of 62
    assert work.max_pieces > 1 and work.pool_pieces == 0
    work = plan(200, 512)       # whole: 64 tiles a column against a share of 48.5
    assert work.max_pieces > 1
    assert plan(64, 8192).pool_pieces > 0


@pytest.mark.parametrize("splits", [1, 2, 7, 64, 256])
def test_split_pieces_cut_equally(rng, splits):
    n = dp.tile_spans(random_lengths(rng, 40), -1, 64)[1]
    for columns in (1, 7, 66):
        pieces = dp.split_pieces(n, splits, columns)
        assert_pieces_partition(pieces, n, columns)
        assert (pieces.per_seq <= max(1, splits)).all()
        count = np.bincount(pieces.column, minlength=columns)
        assert count.max() - count[count > 0].min() <= 1


def test_split_heuristic():
    def splits(batch, hk, length, hq=32):
        lp = launch(hq=hq, hk=hk, slots=264)
        return dp.plan_work(lp, np.full(batch, length, np.int32), False, -1, "split").max_pieces
    assert splits(64, 8, 8192) == 1          # 512 (sequence, kv head) pairs fill 264 slots
    s = splits(1, 8, 131072)                 # one long sequence fills every slot
    assert 132 <= 8 * s <= 264
    assert splits(1, 8, 2048) * 8 >= 64      # B1 x 2K still spreads over the GPU
    assert splits(1, 8, 64) == 1             # one tile: nothing to split
    assert splits(8, 8, 8192) * 64 <= 264


# ----------------------------------------------------------------------------- descriptors
def walk(desc, c):
    """Descriptor rows of column c's list, following `next` from row c."""
    rows, i = [], c
    while i >= 0 and desc[i, 0] >= 0:
        rows.append(i)
        i = desc[i, 7]
        assert len(rows) <= len(desc), "cycle"
    return rows


@pytest.mark.parametrize("schedule,num_splits", [("balanced", None), ("split", None),
                                                 ("split", 3), ("split", 256)])
@pytest.mark.parametrize("window,append", [(-1, False), (100, True)])
def test_work_descriptors(rng, schedule, num_splits, window, append):
    lp = launch(slots=5 * 8)
    lens = random_lengths(rng, 23)
    work = dp.plan_work(lp, lens, append, window, schedule, num_splits)
    kv = lens.astype(np.int64) + append
    first, n = dp.tile_spans(kv, window, lp.tiles.tile)
    lists = [walk(work.desc, c) for c in range(lp.columns)]
    pool_first, pool_count = work.desc[lp.columns, :2]
    assert pool_count == work.pool_pieces and pool_first + pool_count == len(work.desc)
    assert schedule == "balanced" or pool_count == 0
    pool = list(range(pool_first, pool_first + pool_count))
    assert all(work.desc[pool, 7] == -1)
    rows = sorted([r for rows in lists for r in rows] + pool)
    assert rows == sorted(set(rows))
    assert len(rows) == len(work.desc) - 1 - sum(not l for l in lists)  # less header, NO_PIECE
    b, kvl, t0, t1, k, npieces, slot, _ = work.desc[rows].T
    np.testing.assert_array_equal(kvl, kv[b])
    np.testing.assert_array_equal(npieces, work.seq_info[b, 0])
    for s in range(len(lens)):  # each sequence's pieces tile [first, first + n) in order
        mine = np.argsort(k[b == s])
        np.testing.assert_array_equal(k[b == s][mine], np.arange(work.seq_info[s, 0]))
        cuts = np.stack([t0[b == s][mine], t1[b == s][mine]])
        assert cuts[0, 0] == first[s] and cuts[1, -1] == first[s] + n[s]
        np.testing.assert_array_equal(cuts[0, 1:], cuts[1, :-1])
    split = npieces > 1
    assert (slot[~split] == -1).all()
    np.testing.assert_array_equal(np.sort(slot[split]), np.arange(work.num_slots))
    np.testing.assert_array_equal(slot[split] - k[split], work.seq_info[b[split], 1])
    assert work.max_pieces == work.seq_info[:, 0].max()


def test_work_fits_the_decoder_capacity(rng):
    lp = launch(slots=264)
    rows, slots = dp.work_capacity(lp, 300)
    for batch in (1, 7, 64, 300):
        for top in (10, 3000, 100000):
            work = dp.plan_work(lp, random_lengths(rng, batch, top), False, -1)
            assert len(work.desc) <= rows and work.num_slots <= slots


def test_pack_index_regions(rng):
    lp = launch(slots=12 * 8)
    lens = random_lengths(rng, 5)
    tables = rng.integers(0, 1000, (5, 200)).astype(np.int32)
    work = dp.plan_work(lp, lens, False, -1)
    lay = dp.IndexLayout(9, len(work.desc) + 3, 256)
    host = dp.pack_index(lay, lens, work, tables)
    assert lay.desc % 4 == 0 and lay.info + 2 * 9 <= lay.desc and lay.size == lay.tables + 9 * 256
    np.testing.assert_array_equal(host[:5], lens)
    np.testing.assert_array_equal(host[lay.info:lay.info + 10].reshape(5, 2), work.seq_info)
    desc = host[lay.desc:lay.tables].reshape(-1, dp.DESC_INTS)
    np.testing.assert_array_equal(desc[:len(work.desc)], work.desc)
    assert (desc[len(work.desc):, 0] == -1).all()
    t = host[lay.tables:].reshape(5, 256)
    np.testing.assert_array_equal(t[:, :200], tables)
    assert (t[:, 200:] == -1).all()


def test_check_variants():
    assert dc.check_variants(None, None, None) == ("balanced", None)  # merge: resolve_merge
    assert dc.check_variants(None, "kernel", 4) == ("split", "kernel")
    for args, text in (((None, None, 0), "num_splits"), (("balanced", None, 2), "num_splits"),
                       (("even", None, None), "schedule"), ((None, "late", None), "merge")):
        with pytest.raises(ValueError, match=text):
            dc.check_variants(*args)


# ----------------------------------------------------------------------------- the stream
def emulate_column(desc, column, pool, stages=dp.STAGES):
    """Mirror of paged_decode_kernel's tile stream for one CTA: the loader (TileCursor,
    prologue, one issue per iteration into stage (it + STAGES - 1) % STAGES, one commit
    group per iteration; after its column's list, pool pieces taken from the shared
    iterator ``pool``) and the consumer (pieces in list order, then the loader's taken pool
    pieces in turn; tile `it` read from stage it % STAGES after waiting for all but
    STAGES - 2 groups; each piece's combine in stage (it + STAGES - 1) % STAGES). Asserts
    every read finds its tile landed and every write lands in a stage nobody still needs;
    returns the (piece row, tile) pairs consumed."""
    taken = []                   # the loader's pool pieces (-1: none left), in order

    def take():
        taken.append(next(pool, -1))
        return taken[-1]

    def valid(i):
        return i >= 0 and desc[i, 0] >= 0

    def enter(i):
        while True:
            if valid(i) and desc[i, 2] < desc[i, 3]:
                return [i, desc[i, 2]]
            if valid(i):
                i = desc[i, 7]
            elif taken and taken[-1] < 0:
                return None
            else:
                i = take()

    def advance(cur):
        cur[1] += 1
        return cur if cur[1] < desc[cur[0], 3] else enter(desc[cur[0], 7])

    stage = [None] * stages      # (row, tile, group) issued into each stage, until read
    groups = 0                   # committed groups

    def issue(cur, st):
        assert stage[st] is None, "a copy into a stage whose tile is unread"
        stage[st] = (cur[0], cur[1], groups)

    cur = enter(column)
    for st in range(stages - 1):
        if cur is not None:
            issue(cur, st)
            cur = advance(cur)
        groups += 1
    used = iter(range(1 << 30))

    def after(i):                # the consumer's next piece: list order, then the pool's
        return i if valid(i) else taken[next(used)]

    consumed, it, row = [], 0, after(column)
    while row >= 0:
        for tile in range(desc[row, 2], desc[row, 3]):
            landed = groups - (stages - 2)          # cp.async.wait_group STAGES - 2
            r, t, g = stage[it % stages]
            assert (r, t) == (row, tile) and g < landed
            if cur is not None:
                issue(cur, (it + stages - 1) % stages)
                cur = advance(cur)
            groups += 1
            stage[it % stages] = None               # read: free from the next barrier on
            consumed.append((row, tile))
            it += 1
        assert stage[(it + stages - 1) % stages] is None, "combine over an unread tile"
        row = after(desc[row, 7])
    assert cur is None and all(s is None for s in stage) and taken[-1] < 0
    assert next(used) == len(taken), "every taken piece (and the last, failed take) read"
    return consumed


@pytest.mark.parametrize("schedule,num_splits", [("balanced", None), ("split", 2),
                                                 ("split", 256)])
def test_stream_reads_every_tile_from_its_stage(rng, schedule, num_splits):
    for slots, top in ((8, 200), (40, 3000), (264, 30)):
        lp = launch(slots=slots)
        work = dp.plan_work(lp, random_lengths(rng, 17, top), False, -1, schedule, num_splits)
        first, count = work.desc[lp.columns, :2]
        pool = iter(range(first, first + count))
        seen = [emulate_column(work.desc, c, pool) for c in range(lp.columns)]
        tiles = sorted((int(work.desc[r, 0]), int(t)) for col in seen for r, t in col)
        assert len(tiles) == len(set(tiles)) == int((work.desc[:, 3] - work.desc[:, 2]).sum())
