"""CPU tests of the sparse kernels' planning: the walks of kernels_cu/sparse_plan.cuh built for
the host with a C++ compiler (skipped without one) against cupaged.reference.sparse, and
the host side of cupaged.sparse.tiles. check_lists also checks device-built lists in
test_sparse_gpu.py."""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from cupaged.core.compile import KERNEL_DIR
from cupaged.reference import sparse as ref
from cupaged.sparse import launch as kernels
from cupaged.sparse import tiles

HARNESS = r"""
#include "sparse_plan.cuh"
using namespace cupaged;
struct Lists {
  const int* v; int* offs; int* cols; int bn, nblk = 0, ncol = 0;
  void blocks(i64 rs, i64 re) { for (i64 s = rs; s < re; s += bn) offs[nblk++] = (int)s; }
  void columns(int a, int b) { for (int k = a; k < b; ++k) cols[ncol++] = v[k]; }
};
struct Tiles {
  int* xy; long n = 0;
  void piece(int x, int y, int f, int tile_n) {
    for (int s = x; s < y; s += tile_n, ++n) { xy[2 * n] = s; xy[2 * n + 1] = (y - s < tile_n ? y - s : tile_n) | f; }
  }
};
extern "C" {
void index_lists(const int* s, const int* rf, int ns, const int* v, int nv, int m, int q_len,
                 int kv_len, int bm, int bn, int* blocks, int* nblk, int* cols, int* ncol) {
  VsRow p;
  p.init(s, rf, ns, v, &nv, nv, 0);
  Lists out{v, blocks, cols, bn};
  vs_block_lists(p, m, q_len, kv_len, bm, bn, out);
  *nblk = out.nblk;
  *ncol = out.ncol;
}
long vs_tiles(const int* s, const int* rf, int ns, const int* v, int nv, int c, int q_len,
              int kv_len, int bm, int bn, int tile_n, int* xy) {
  VsRow p;
  p.init(s, rf, ns, v, &nv, nv, 0);
  Tiles out{xy};
  vs_cta_tiles(p, c, q_len, kv_len, bm, bn, tile_n, out);
  return out.n;
}
long bsr_tiles(const int* indptr, const int* indices, int c, int q_len, int kv_len, int bm, int bn,
               int causal, int tile_n, int* xy) {
  BsrStream st;  // set up as sparse_attention.cu's BsrSource does
  st.init(bn, tile_n);
  for (int k = 0; k < 2; ++k) {
    HalfTile half;
    half.init(2 * c + k, q_len, kv_len, bm, bm / HALF_ROWS, causal != 0);
    const int lo = half.valid ? indptr[half.prow] : 0, hi = half.valid ? indptr[half.prow + 1] : 0;
    st.init_half(k, indices, lo, hi, half.valid ? half.clip : 0);
  }
  long n = 0;
  int start, word;
  while (st.next(start, word)) { xy[2 * n] = start; xy[2 * n + 1] = word; ++n; }
  return n;
}
}
"""


@pytest.fixture(scope="module")
def plan_lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler for the host build of sparse_plan.cuh")
    d = tmp_path_factory.mktemp("plan")
    # the tile flags and half rows the device build takes from the generated abi.cuh
    (d / "harness.cpp").write_text(f"namespace cupaged {{\n{tiles.cpp()}\n{kernels.cpp()}\n}}\n"
                                   f"{HARNESS}")
    subprocess.run([cxx, "-O1", "-std=c++17", "-shared", "-fPIC", f"-I{KERNEL_DIR}",
                    str(d / "harness.cpp"), "-o", str(d / "libplan.so")], check=True)
    lib = ctypes.CDLL(str(d / "libplan.so"))
    arr = np.ctypeslib.ndpointer(dtype=np.int32, flags="C_CONTIGUOUS")
    i = ctypes.c_int
    lib.index_lists.argtypes = [arr, arr, i, arr, i, i, i, i, i, i, arr, arr, arr, arr]
    lib.vs_tiles.argtypes = [arr, arr, i, arr, i, i, i, i, i, i, i, arr]
    lib.vs_tiles.restype = ctypes.c_long
    lib.bsr_tiles.argtypes = [arr, arr, i, i, i, i, i, i, i, arr]
    lib.bsr_tiles.restype = ctypes.c_long
    return lib


def prepare_row(v_row, s_row, kv_len, block_m):
    """What vs_prepare makes of one row: unique verticals < kv_len (front of a row as long as
    v_row), sorted slashes and the first index of each slash's run (gaps <= block_m)."""
    v, s = np.sort(np.asarray(v_row, np.int64)), np.sort(np.asarray(s_row, np.int64))
    keep = (v < kv_len) & np.concatenate([[True], v[1:] != v[:-1]])
    v_unique = np.zeros(max(len(v), 1), np.int32)
    v_unique[:keep.sum()] = v[keep]
    start = np.concatenate([[True], np.diff(s) > block_m])[:len(s)]
    run_first = np.maximum.accumulate(np.where(start, np.arange(len(s)), 0)) if len(s) else []
    pad = lambda x: np.asarray(list(x) or [0], np.int32)  # noqa: E731
    return pad(s), pad(run_first), len(s), v_unique, int(keep.sum())


def check_lists(list_of, ctas, mask, q_len, kv_len, tile_n, causal=True):
    """Tile lists of CTAs 0 .. ctas - 1 (``list_of(c)`` -> (int32 [n, 2] tiles, the head's
    unique verticals)) hold, for each 64-row half, every visible key of ``mask`` [q_len,
    kv_len] once (keys past a row's position masked by causality), nothing else, and nothing
    past the half's last row."""
    pos0 = kv_len - q_len
    for c in range(ctas):
        t, v_unique = list_of(c)
        width = t[:, 1] & tiles.TILE_WIDTH
        assert ((width >= 1) & (width <= tile_n)).all()
        assert (t[:, 1] & (tiles.TILE_A | tiles.TILE_B)).all()
        count = np.zeros((2, kv_len), np.int64)
        for (x, wf), w in zip(t, width):
            keys = v_unique[x:x + w] if wf & tiles.TILE_GATHER else np.arange(x, x + w)
            assert len(keys) == w and keys.min() >= 0 and keys.max() < kv_len
            for half, bit in enumerate((tiles.TILE_A, tiles.TILE_B)):
                count[half, keys] += bool(wf & bit)
        assert count.max(initial=0) <= 1, f"CTA {c}: a key twice in one half"
        for half in range(2):
            rows = np.arange(128 * c + 64 * half, min(128 * c + 64 * half + 64, q_len))
            if len(rows) == 0:
                assert count[half].sum() == 0
                continue
            got = np.broadcast_to(count[half] > 0, (len(rows), kv_len))
            if causal:
                got = got & (np.arange(kv_len)[None, :] <= pos0 + rows[:, None])
                assert count[half, pos0 + rows[-1] + 1:].sum() == 0
            np.testing.assert_array_equal(got, mask[rows], err_msg=f"CTA {c}, half {half}")


def random_rows(rng, kv_len, nv, ns, band):
    """A vertical row with duplicates and padding, and a slash row (a band of recent diagonals
    plus strays, or random with the first few)."""
    v_row = rng.integers(0, kv_len + 3, nv)
    if band:
        s_row = np.concatenate([np.arange(min(ns, kv_len)), rng.integers(0, kv_len, 5)])
    else:
        s_row = np.concatenate([np.arange(rng.integers(0, 20)), rng.integers(0, kv_len + 5, ns)])
    return v_row.astype(np.int32), s_row.astype(np.int32)


SHAPES = [(64, 64), (128, 64), (64, 32), (100, 48), (192, 64), (64, 100), (128, 128)]


@pytest.mark.parametrize("seed", range(4))
def test_host_walks_match_reference(plan_lib, seed):
    rng = np.random.default_rng(seed)
    for it in range(60):
        q_len = int(rng.integers(1, 600))
        kv_len = q_len + int(rng.integers(0, 500)) * int(rng.integers(0, 2))
        bm, bn = SHAPES[it % len(SHAPES)]
        tile_n = 32 if it % 3 == 0 else 64
        v_row, s_row = random_rows(rng, kv_len, int(rng.integers(0, 60)), int(rng.integers(0, 40)),
                                   it % 5 == 0)
        s, rf, ns, vu, nvu = prepare_row(v_row, s_row, kv_len, bm)
        # MInference lists of every query block, exactly
        for m in range(-(-q_len // bm)):
            blocks = np.zeros(len(s_row) * (-(-bm // bn)) + kv_len // bn + 8, np.int32)
            cols = np.zeros(len(v_row) + 1, np.int32)
            nb, nc = np.zeros(1, np.int32), np.zeros(1, np.int32)
            plan_lib.index_lists(s, rf, ns, vu, nvu, m, q_len, kv_len, bm, bn, blocks, nb, cols, nc)
            end = kv_len - q_len + m * bm + bm
            want = ref.slash_blocks(s_row, end, kv_len, bm, bn)
            assert blocks[:nb[0]].tolist() == want
            assert cols[:nc[0]].tolist() == ref.vertical_columns(v_row, want, end, kv_len, bn)
        if bm % 64:
            continue
        # CTA tile lists cover the reference pattern
        bc, bo, cc, ci = ref.vertical_slash_index([q_len], v_row[None, None], s_row[None, None],
                                                  q_len, bm, bn, kv_seqlens=[kv_len])
        mask = ref.vertical_slash_mask(bc[0], bo[0], cc[0], ci[0], q_len, kv_len, bm, bn)[0]

        def vs_list(c):
            xy = np.zeros((4 * (kv_len // tile_n + 4 * (len(s_row) + len(v_row))) + 64, 2), np.int32)
            n = plan_lib.vs_tiles(s, rf, ns, vu, nvu, c, q_len, kv_len, bm, bn, tile_n, xy.reshape(-1))
            return xy[:n], vu[:nvu]
        check_lists(vs_list, -(-q_len // 128), mask, q_len, kv_len, tile_n)


@pytest.mark.parametrize("causal", [True, False])
def test_host_bsr_stream_matches_reference(plan_lib, rng, causal):
    """BsrStream (walked in place by sparse_attention.cu) against the reference mask, with
    rows that keep nothing, everything, or runs of adjacent blocks."""
    for it in range(60):
        q_len = int(rng.integers(1, 500))
        kv_len = q_len + int(rng.integers(0, 300)) * int(rng.integers(0, 2))
        bm, bn, tile_n = (64, 128, 192)[it % 3], (64, 96, 16, 128)[it % 4], (64, 32)[it % 2]
        cols = -(-kv_len // bn)
        indptr, indices = [0], []
        for _ in range(-(-q_len // bm)):
            n = (0, cols, int(rng.integers(0, cols + 1)))[int(rng.integers(0, 3))]
            indices += sorted(rng.choice(cols, n, replace=False).tolist())
            indptr.append(len(indices))
        indptr, indices = np.array(indptr, np.int32), np.array(indices + [0], np.int32)
        mask = ref.bsr_mask(indptr, indices, q_len, kv_len, bm, bn, causal)

        def bsr_list(c):
            xy = np.zeros((4 * (kv_len // tile_n + 2 * len(indices)) + 64, 2), np.int32)
            n = plan_lib.bsr_tiles(indptr, indices, c, q_len, kv_len, bm, bn, int(causal), tile_n,
                                   xy.reshape(-1))
            return xy[:n], np.zeros(0, np.int32)
        check_lists(bsr_list, -(-q_len // 128), mask, q_len, kv_len, tile_n, causal)


def test_band_lists_are_mostly_shared_full_tiles(plan_lib):
    """A band of 1000 recent diagonals and 4 sinks: the two halves share all but their two
    edge tiles, and every tile but the diagonal one and the 4-column tile is full (the point
    of 128-row CTAs)."""
    q_len = kv_len = 4096
    s, rf, ns, vu, nvu = prepare_row([0, 1, 2, 3], np.arange(1000), kv_len, 64)
    xy = np.zeros((256, 2), np.int32)
    n = plan_lib.vs_tiles(s, rf, ns, vu, nvu, 20, q_len, kv_len, 64, 64, 64, xy.reshape(-1))
    t = xy[:n]
    shared = (t[:, 1] & tiles.TILE_A).astype(bool) & (t[:, 1] & tiles.TILE_B).astype(bool)
    assert n == 19 and shared.sum() == 17           # 16 shared key tiles, 2 edges, 1 column tile
    assert ((t[:, 1] & tiles.TILE_WIDTH) == 64).sum() == 17
    assert t[-1, 1] & tiles.TILE_GATHER and t[-1, 1] & tiles.TILE_WIDTH == 4


def test_head_groups_fit_the_budget():
    assert tiles.head_groups(3, 10, 1 << 30) == [(0, 3)]
    assert tiles.head_groups(5, 40, 80) == [(0, 2), (2, 2), (4, 1)]
    assert tiles.head_groups(3, 100, 80) == [(0, 1), (1, 1), (2, 1)]   # a head alone may exceed
    assert tiles.head_groups(0, 8, 80) == []


def test_list_bound_arithmetic():
    """ceil(K / tile_n) + 4R key tiles, R = min(ns, ceil(K / (block_m + 1))) ranges a half,
    and min(nv, nv // tile_n + 4R + 3) column tiles."""
    assert tiles.list_bound(0, 0, 0, 64, 64) == 1
    assert tiles.list_bound(1000, 0, 0, 64, 64) == 16            # the dense sequence
    assert tiles.list_bound(1000, 10, 3, 64, 64) == 16 + 12 + 10
    # 128K, the fixed 1000 / 6096 budget: R = ceil(131072 / 65) = 2017 < 6096
    assert tiles.list_bound(131072, 1000, 6096, 64, 64) == 2048 + 4 * 2017 + 1000
    assert tiles.list_bound(1000, 500, 3, 128, 32) == 32 + 12 + (15 + 12 + 3)


def _adversarial_rows(rng, kv_len, kind):
    """Index rows built to cut lists into many short tiles."""
    if kind == "spread":          # one slash per run, runs just over block_m apart
        s_row = np.arange(0, kv_len, 65)
    elif kind == "dense":         # every diagonal
        s_row = np.arange(kv_len)
    elif kind == "pairs":         # runs of two slashes 63 apart, 130 apart
        s_row = np.sort(np.concatenate([np.arange(0, kv_len, 130), np.arange(63, kv_len, 130)]))
    else:
        s_row = rng.integers(0, kv_len, int(rng.integers(1, 200)))
    v_row = rng.integers(0, kv_len, int(rng.integers(0, 3 * kv_len // 2 + 1)))
    return v_row.astype(np.int32), s_row.astype(np.int32)


@pytest.mark.parametrize("kind", ["spread", "dense", "pairs", "random"])
def test_lists_fit_the_bound(plan_lib, rng, kind):
    """Every CTA's list (the host build of vs_cta_tiles) fits list_bound's slot, for block
    rows of 64 and 128 and tiles of 64 and 32 keys, in sequences of one chunk or of a
    prefix."""
    for it in range(16):
        q_len = int(rng.integers(1, 900))
        kv_len = q_len + int(rng.integers(0, 400)) * (it % 2)
        bm, tile_n = (64, 128)[it % 2], (64, 32)[(it // 2) % 2]
        v_row, s_row = _adversarial_rows(rng, kv_len, kind)
        s, rf, ns, vu, nvu = prepare_row(v_row, s_row, kv_len, bm)
        cap = tiles.list_bound(kv_len + int(rng.integers(0, 50)), len(v_row), len(s_row), bm,
                               tile_n)
        xy = np.zeros((4 * cap + 1024, 2), np.int32)
        for c in range(-(-q_len // 128)):
            n = plan_lib.vs_tiles(s, rf, ns, vu, nvu, c, q_len, kv_len, bm, 64, tile_n,
                                  xy.reshape(-1))
            assert n <= cap, (kind, it, c, n, cap)
