// Pattern walking shared by the sparse index, plan and attention kernels: key ranges of one
// query block from its vertical+slash indices, the union of two blocks' ranges, the tile
// lists the attention kernel walks, and the tiles of a BSR row pair walked in place.
//
// Everything here is plain serial C++ (__host__ __device__): a kernel thread, or every lane
// of a warp in step, runs it for one item; the same code compiles on the host for tests.
//
// Vertical+slash (the rule of cupaged/reference/sparse.py): for a query block whose rows end
// at absolute position `end` (pattern block of bm rows), slash d < limit = min(end, kv_len)
// covers keys [hi - bm, hi), hi = max(end - d, bm). Taken by descending d the ranges ascend;
// one starting at or before the open range's end extends it by whole bn blocks, a later one
// opens a new range of ceil(bm / bn) blocks. Consecutive sorted slashes at most bm apart
// always merge (the later range starts before the earlier one ends), so the walk goes run by
// run: a run is a maximal stretch of the sorted slash row with gaps <= bm (run_first[i]: the
// first index of i's run), and costs O(1) whatever its length.
#pragma once
#ifdef __CUDACC__
#include "common.cuh"
#include "abi.cuh"
#define CP_HD __host__ __device__ __forceinline__
#else  // a host build (tests/test_sparse_tiles.py) defines the generated TILE_* first
namespace cupaged { typedef long long i64; }
#define CP_HD inline
#endif

namespace cupaged {

constexpr i64 KEY_END = 1LL << 62;  // past every key

CP_HD i64 imin(i64 a, i64 b) { return a < b ? a : b; }
CP_HD i64 imax(i64 a, i64 b) { return a > b ? a : b; }
// x rounded up to a multiple of n, for 0 <= x < 2^32 - n (every length here: keys < 2^31),
// in 32-bit arithmetic (a 64-bit division is a slow call on the GPU)
CP_HD i64 ceil_to(i64 x, int n) { return (i64)(((unsigned)x + n - 1) / (unsigned)n) * n; }

// First index i in [lo, hi) of the ascending row with row[i] >= x (hi if none).
CP_HD int lower_bound(const int* row, int lo, int hi, i64 x) {
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (row[mid] < x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Key interval [s, e).
struct Range {
  i64 s, e;
};

// Merged key ranges of one query block from its slashes, ascending, each cut at `clip`
// (ranges at or past it are dropped). s: sorted slash row, run_first: its runs (above).
struct SlashWalker {
  const int* s;
  const int* run_first;
  i64 end, clip;
  int bm, bn, i;  // i: next slash index of the walk (descending), -1: done
  bool open;
  Range cur;

  CP_HD void init(const int* s_, const int* run_first_, int n, i64 end_, i64 kv_len, i64 clip_,
                  int bm_, int bn_) {
    s = s_; run_first = run_first_; end = end_; clip = clip_; bm = bm_; bn = bn_;
    i = lower_bound(s, 0, n, imin(end, kv_len)) - 1;  // largest valid d
    open = false;
    cur = Range{0, 0};
  }

  CP_HD bool emit(Range r, Range& out) {
    if (r.s >= clip) { i = -1; open = false; return false; }  // every later range too
    out = Range{r.s, imin(r.e, clip)};
    return true;
  }

  CP_HD bool next(Range& out) {
    while (i >= 0) {
      const int f = run_first[i];
      const i64 lo = imax(end - s[i], bm) - bm, hi = imax(end - s[f], bm);
      i = f - 1;
      if (open && lo <= cur.e) {
        if (hi > cur.e) cur.e += ceil_to(hi - cur.e, bn);
        continue;
      }
      const bool had = open;
      const Range done = cur;
      cur.s = lo;
      cur.e = lo + ceil_to(bm, bn);
      if (hi > cur.e) cur.e += ceil_to(hi - cur.e, bn);
      open = true;
      if (had) return emit(done, out);
    }
    if (!open) return false;
    open = false;
    return emit(cur, out);
  }
};

// Gaps of a walker's ranges within [0, limit): where a block's vertical columns may lie.
template <typename W>
struct GapWalker {
  W w;
  i64 pos, limit;

  CP_HD void init(const W& w_, i64 limit_) { w = w_; pos = 0; limit = limit_; }

  CP_HD bool next(Range& out) {
    while (pos < limit) {
      Range r;
      if (!w.next(r)) {
        out = Range{pos, limit};
        pos = limit;
        return true;
      }
      const Range gap{pos, imin(r.s, limit)};
      pos = imax(pos, r.e);
      if (gap.s < gap.e) { out = gap; return true; }
    }
    return false;
  }
};

// Union of two ascending streams of disjoint ranges, as pieces [x, y) inside a constant set of
// them: emit(x, y, flags), flags bit 0: inside a range of a, bit 1: of b. Pieces ascend.
template <typename A, typename B, typename Emit>
CP_HD void sweep(A& a, B& b, Emit& emit) {
  Range ra{0, 0}, rb{0, 0};
  bool ha = a.next(ra), hb = b.next(rb);
  while (ha || hb) {
    const i64 sa = ha ? ra.s : KEY_END, sb = hb ? rb.s : KEY_END;
    const i64 x = imin(sa, sb);
    const bool ia = sa == x, ib = sb == x;
    i64 y = KEY_END;
    if (ha) y = imin(y, ia ? ra.e : ra.s);
    if (hb) y = imin(y, ib ? rb.e : rb.s);
    emit(x, y, (ia ? 1 : 0) | (ib ? 2 : 0));
    if (ia) { ra.s = y; if (ra.s >= ra.e) ha = a.next(ra); }
    if (ib) { rb.s = y; if (rb.s >= rb.e) hb = b.next(rb); }
  }
}

// ----------------------------------------------------------------------------- tile lists
// A CTA of the attention kernel computes two 64-row query tiles (halves a and b) over one
// list of K/V tiles of at most tile_n keys, int2 {x, width | flags << 8}: contiguous keys
// x .. x + width - 1, or (TILE_GATHER) the vertical columns at positions x .. x + width - 1
// of the head's deduplicated vertical row; TILE_A / TILE_B: the half's pattern holds every
// key of the tile (the other half skips it). Key tiles come first (ascending), then column
// tiles (ascending); the kernel walks the list from the end.
// (TILE_A, TILE_B, TILE_GATHER, TILE_WIDTH: from cupaged.sparse.tiles)

// The tiles of one piece [x, y) (keys, or column positions when gather) go to
// out.piece(x, y, flag bits, tile_n): tiles x + k * tile_n of width min(tile_n, y - start).
template <typename Out>
CP_HD void cut_tiles(i64 x, i64 y, int flags, bool gather, int tile_n, Out& out) {
  out.piece((int)x, (int)y, (flags << 8) | (gather ? TILE_GATHER : 0), tile_n);
}

// Key tiles of a sweep: every piece inside some half's ranges.
template <typename Out>
struct KeyTiles {
  Out& out;
  int tile_n;
  CP_HD void operator()(i64 x, i64 y, int flags) { cut_tiles(x, y, flags, false, tile_n, out); }
};

// Column tiles of a sweep over the halves' gaps: each key piece -> vertical positions
// [lower_bound(x), lower_bound(y)); adjacent position pieces of equal flags are joined so
// that only real changes of membership cut a tile short.
template <typename Out>
struct ColumnTiles {
  Out& out;
  const int* v;   // deduplicated vertical row, ascending
  int nv, tile_n;
  int at;         // lower_bound hint (keys ascend)
  i64 ps, pe;     // pending position piece
  int pflags;

  CP_HD void operator()(i64 x, i64 y, int flags) {
    const int a = lower_bound(v, at, nv, x);
    const int b = lower_bound(v, a, nv, y);
    at = b;
    if (a == b) return;
    if (pe == a && pflags == flags) { pe = b; return; }
    flush();
    ps = a; pe = b; pflags = flags;
  }
  CP_HD void flush() {
    if (ps < pe) cut_tiles(ps, pe, pflags, true, tile_n, out);
    ps = pe = 0;
  }
};

// Geometry of one 64-row query tile of a CTA: its pattern block end, the clip of its keys
// (causal: past its last row) and whether it has rows at all.
struct HalfTile {
  bool valid;
  i64 end, clip;
  int prow;   // pattern row (64-row tile / m_div)

  CP_HD void init(int tile, int q_len, int kv_len, int bm, int m_div, bool causal) {
    const i64 off = (i64)kv_len - q_len, m0 = (i64)tile * 64;
    valid = m0 < q_len;
    prow = tile / m_div;
    end = off + (i64)prow * bm + bm;
    const i64 last = off + imin(m0 + 64, q_len) - 1;
    clip = causal ? last + 1 : kv_len;
  }
};

// ----------------------------------------------------------------------------- items
// One prepared (sequence, head) row of vertical+slash indices.
struct VsRow {
  const int* s;
  const int* run_first;
  int ns;
  const int* v;  // unique verticals < kv_len
  int nv;

  CP_HD void init(const int* s_sorted, const int* rf, int ns_, const int* v_unique, const int* v_count,
                  int nv_stride, i64 row) {
    s = s_sorted + row * ns_;
    run_first = rf + row * ns_;
    ns = ns_;
    v = v_unique + row * nv_stride;
    nv = v_count[row];
  }
};

// The key ranges of query block m (rows [m * bm, m * bm + bm)) and the vertical columns
// between and after them: out.blocks(rs, re) per merged range, out.columns(a, b) per run of
// verticals (positions in p.v) outside every range and below min(end, kv_len).
template <typename Out>
CP_HD void vs_block_lists(const VsRow& p, int m, int q_len, int kv_len, int bm, int bn, Out& out) {
  if ((i64)m * bm >= q_len) return;
  const i64 end = (i64)kv_len - q_len + (i64)m * bm + bm, limit = imin(end, kv_len);
  SlashWalker w;
  w.init(p.s, p.run_first, p.ns, end, kv_len, KEY_END, bm, bn);
  i64 prev = 0;
  int at = 0;
  Range r;
  while (w.next(r)) {
    out.blocks(r.s, r.e);
    const int a = lower_bound(p.v, at, p.nv, prev);
    const int b = lower_bound(p.v, a, p.nv, imin(r.s, limit));
    if (a < b) out.columns(a, b);
    at = a;
    prev = r.e;
  }
  const int a = lower_bound(p.v, at, p.nv, prev), b = lower_bound(p.v, a, p.nv, limit);
  if (a < b) out.columns(a, b);
}

// Tiles of the CTA of 64-row tiles 2c and 2c + 1 of one (sequence, head), vertical+slash:
// key tiles of the union of the two blocks' ranges, then column tiles of their verticals.
template <typename Out>
CP_HD void vs_cta_tiles(const VsRow& p, int c, int q_len, int kv_len, int bm, int bn, int tile_n,
                        Out& out) {
  HalfTile half[2];
  SlashWalker w[2];
  GapWalker<SlashWalker> g[2];
  for (int k = 0; k < 2; ++k) {
    half[k].init(2 * c + k, q_len, kv_len, bm, bm / 64, true);
    w[k].init(p.s, p.run_first, half[k].valid ? p.ns : 0, half[k].end, kv_len, half[k].clip, bm, bn);
    g[k].init(w[k], half[k].valid ? imin(imin(half[k].end, kv_len), half[k].clip) : 0);
  }
  KeyTiles<Out> keys{out, tile_n};
  sweep(w[0], w[1], keys);
  ColumnTiles<Out> cols{out, p.v, p.nv, tile_n, 0, 0, 0, -1};
  sweep(g[0], g[1], cols);
  cols.flush();
}

// ----------------------------------------------------------------------------- BSR rows
// The tiles of a CTA's two halves under a BSR pattern, walked straight from `indices` (no
// list is built; the attention kernel's thread 0 asks for one tile at a time): half k keeps
// the block ids ids[lo, hi) of its CSR row, strictly increasing, each block the keys
// [id * bn, id * bn + bn). Tiles come out with descending keys (the diagonal first), at most
// tile_n keys each, every key of a tile held by the same halves (TILE_A / TILE_B), none at
// or past a half's clip; runs of adjacent blocks share tiles. A call reads at most
// tile_n / bn + 2 ids per half.
struct BsrHalf {
  const int* ids;
  int lo, i;  // blocks ids[lo, i) are still to walk, each starting before clip
  int clip;

  // End of the keys left in the top block (x: keys at or past it are done), -1 if none.
  // Keys are below 2^31, and so is every block start: 32-bit arithmetic throughout.
  CP_HD int top_end(int bn, int x) const {
    if (i <= lo) return -1;
    const int s = ids[i - 1] * bn, e = clip - s <= bn ? clip : s + bn;
    return e < x ? e : x;
  }
  // Start of the run of adjacent blocks below the top one, walked down to z at most.
  CP_HD int run_start(int bn, int z) const {
    int cov = ids[i - 1] * bn;
    for (int j = i - 1; cov > z && j > lo && ids[j - 1] == ids[j] - 1; --j) cov -= bn;
    return cov;
  }
  // Drop the blocks starting at or past z (all their keys are done).
  CP_HD void pop(int bn, int z) {
    while (i > lo && ids[i - 1] * bn >= z) --i;
  }
};

struct BsrStream {
  BsrHalf half[2];
  int x;  // keys at or past x are done
  int bn, tile_n;

  CP_HD void init(int bn_, int tile_n_) { bn = bn_; tile_n = tile_n_; x = 0x7fffffff; }

  // Half k walks ids[lo, hi) below clip (clip <= 0: nothing; clip <= kv_len < 2^31).
  CP_HD void init_half(int k, const int* ids, int lo, int hi, int clip) {
    half[k].ids = ids;
    half[k].lo = lo;
    half[k].clip = clip;
    // blocks before ceil(clip / bn) start before clip
    half[k].i = clip > 0 ? lower_bound(ids, lo, hi, ((unsigned)clip + bn - 1) / (unsigned)bn) : lo;
  }

  // The next tile: keys [start, start + width), word = width | flags << 8; false when done.
  // Its top y is the highest key left; the halves whose top block reaches y hold it (flags),
  // the others bound it below (a tile holds none of their keys), and so do tile_n and the
  // start of each holding half's run.
  CP_HD bool next(int& start, int& word) {
    const int e0 = half[0].top_end(bn, x), e1 = half[1].top_end(bn, x);
    const int y = e0 > e1 ? e0 : e1;
    if (y < 0) return false;
    const int flags = (e0 == y ? 1 : 0) | (e1 == y ? 2 : 0);
    int z = y - tile_n;
    if (e0 != y && e0 > z) z = e0;
    if (e1 != y && e1 > z) z = e1;
    for (int k = 0; k < 2; ++k)
      if (flags >> k & 1) {
        const int r = half[k].run_start(bn, z);
        if (r > z) z = r;
      }
    start = z;
    word = (y - z) | flags << 8;
    x = z;
    for (int k = 0; k < 2; ++k)
      if (flags >> k & 1) half[k].pop(bn, z);
    return true;
  }
};

}  // namespace cupaged
