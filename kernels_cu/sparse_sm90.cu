// Block-sparse attention on Hopper warpgroup tensor cores (wgmma, sm_90a): the vertical+slash
// and batched BSR patterns of sparse_attention.cu on the warp-specialised loop of
// prefill_sm90.cu (prefill_ws), fp16/bf16, every head size of the dense kernel, dense packed
// or paged K/V, GQA, sinks, LSE, window_left, ALiBi and soft-cap.
//
// A CTA computes 128 query rows of one head, sparse_attention.cu's 64-row halves a and b
// (tiles 2c and 2c + 1 of the sequence), over the descriptor stream of its tile source
// (sparse_source.cuh). Warpgroup 0 produces: its thread 0 pulls each descriptor (one tile
// ahead) and publishes it in its stage's slot in shared memory; the 128 threads copy Q and
// each tile's K and V rows with cp.async (contiguous keys, or vertical columns gathered row
// by row with their keys; dense rows or pages) into swizzled stages. Warpgroups 1 and 2 consume, consumer g
// computing half g: the wgmma loop of ws_consume over the tiles whose flags name its half
// and whose keys some row of it sees, skipping the others (their stages released at once).
// The union of both halves' tiles is loaded once, and each half computes only its own: a
// half does not idle through the other's tiles as on one mma.sync CTA. A computed tile is
// S = Q K^T in the consumer's turn (Turns: the two consumers' batches alternate, so one's
// softmax runs under the other's), the softmax, then O += P V; every consumer takes one
// turn a tile, computing or not, and one at the end, so that their turns stay paired.
#include "prefill_sm90.cu"
#include "sparse_source.cuh"

namespace cupaged {
namespace sm90 {

// A stage's descriptor slot (8 bytes: {x, width | flags << 8} as pulled) and, for a
// gathered tile, the keys of its rows (BN ints, copied with the rows).
__device__ __forceinline__ void st_shared_int2(u32 addr, int2 d) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" :: "r"(addr), "r"(d.x), "r"(d.y) : "memory");
}
__device__ __forceinline__ int2 ld_shared_int2(u32 addr) {
  int2 d;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(d.x), "=r"(d.y) : "r"(addr) : "memory");
  return d;
}
__device__ __forceinline__ int ld_shared_int(u32 addr) {
  int x;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(x) : "r"(addr) : "memory");
  return x;
}

// A stage's tile as the consumers see it: descriptor d, its rows' keys at `keys` (gathered)
// and its first and last key.
struct StageTile {
  int2 d;
  u32 keys;
  int first, last;
  __device__ __forceinline__ int width() const { return d.y & TILE_WIDTH; }
  __device__ __forceinline__ bool gathered() const { return (d.y & TILE_GATHER) != 0; }
  __device__ __forceinline__ int key(int r) const { return gathered() ? ld_shared_int(keys + 4 * r) : d.x + r; }
  __device__ __forceinline__ void load(u32 slot, u32 keys_) {
    d = ld_shared_int2(slot);
    keys = keys_;
    const int w = width();
    first = w > 0 ? key(0) : 0;
    last = w > 0 ? key(w - 1) : -1;
  }
};

// The CTA's key rows (SparseKeys, sparse_source.cuh) and the producer's copies of them;
// hk, kv_start: the kv head and (dense rows) the sequence's first key, the TMA coordinates.
template <typename T, typename C>
struct SparseKV : SparseKeys<T> {
  static constexpr int BN = C::KEYS, RPT = BN / C::ROW_STEP;  // rows a thread copies a part
  int hk, kv_start;

  __device__ __forceinline__ void init(const SparseArgs<T>& P, int b, int h) {
    SparseKeys<T>::init(P, b, h);
    hk = h / P.group;
    kv_start = P.block_tables == nullptr ? P.cu_k[b] : 0;
  }

  // One part (K: KP, else V rows) of the tile of descriptor d -> dst (swizzled [BN][D]):
  // thread tid copies 16-byte chunk tid % CL of rows tid / CL + ROW_STEP i, rows past the
  // width zero-filled; each row's key and page read just before its copy (no state across
  // the producer's waits, which run in few registers). A gathered tile's K part also copies
  // each row's key to `keys` (chunk 0's thread).
  template <bool KP>
  __device__ __forceinline__ void issue_part(int2 d, u32 dst, u32 keys) const {
    const int c = threadIdx.x % C::CL, r0 = threadIdx.x / C::CL;
    if (C::CL != C::CH && c >= C::CH) return;
    const int w = d.y & TILE_WIDTH;
    const bool gather = (d.y & TILE_GATHER) != 0;
    const int* cols = this->cols;
    const T* base = (KP ? this->kb : this->vb) + c * 8;
#pragma unroll 4
    for (int i = 0; i < RPT; ++i) {
      const int r = r0 + i * C::ROW_STEP;
      const bool ok = r < w;
      const int j = !ok ? 0 : gather ? __ldg(cols + d.x + r) : d.x + r;
      if (KP && gather && ok && c == 0) cp_async4(keys + 4 * r, cols + d.x + r);
      cp_async16(dst + swizzled<BN, C::SW>(r, c), base + (ok ? this->offset(j) : 0), ok ? 16 : 0);
    }
  }
  // TMA (dense rows, a whole tile of contiguous keys): one part of tile d as D / 64 tensor
  // copies (the map's boxes of 64 dims x BN keys, 128-byte swizzle, kernels_cu/bulk_copy.cuh
  // and cupaged.core.tma) at the sequence's first key plus d.x, landing on `full`.
  __device__ __forceinline__ void tma_part(const TensorMap* map, int2 d, u32 dst, u32 full) const {
#pragma unroll
    for (int b = 0; b < C::HEAD / 64; ++b)
      tma_load_4d(dst + b * BN * 128, map, 64 * b, kv_start + d.x, hk, 0, full);
  }
};

// The thread's two rows (Rows over the CTA's head) and the half's flag (TILE_A or TILE_B).
struct SparseRows {
  Rows rw;
  int half;

  // The half computes tile t: its pattern holds the tile and a row of it sees a key in
  // [first key, last key].
  __device__ __forceinline__ bool runs(const StageTile& t) const {
    return (t.d.y & half) != 0 && rw.gk.sees(t.first, t.last - t.first + 1);
  }
  // Raw dots of tile t -> scores (log2 units on the general path); keys a row does not see,
  // and rows past the tile's width, -> -inf.
  template <typename C>
  __device__ __forceinline__ void scores(float (&s)[C::KEYS / 2], const StageTile& t) const {
    constexpr int BN = C::KEYS;
    const int w = t.width();
    if (t.gathered()) {
      if (C::GENERAL_SCORES || w < BN || rw.gk.needs_mask(t.first, t.last - t.first + 1)) {
        if (rw.epi.softcap) gathered<C, true>(s, t);
        else gathered<C, false>(s, t);
      }
    } else {
      rw.epilogue<C>(s, t.d.x);
      if (w < BN || rw.gk.needs_mask(t.d.x, w)) {
        const int hi[2] = {min(rw.hi[0], t.d.x + w), min(rw.hi[1], t.d.x + w)};
        mask<BN>(s, rw.lo, hi, t.d.x, rw.lane);
      }
    }
  }
  // Gathered columns: key j of column c from the stage's keys, per score the epilogue and
  // ALiBi term (general path) and the mask.
  template <typename C, bool CAP>
  __device__ __forceinline__ void gathered(float (&s)[C::KEYS / 2], const StageTile& t) const {
    constexpr int BN = C::KEYS;
    const int w = t.width();
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        const int c = 8 * i + 2 * (rw.lane % 4) + e1;
        const int j = c < w ? t.key(c) : EMPTY_KEY;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float& x = s[4 * i + 2 * hr + e1];
          if constexpr (C::GENERAL_SCORES) x = rw.epi.at<CAP, true>(x) + rw.slope[hr] * (float)(j - rw.p[hr]);
          if (j < rw.lo[hr] || j >= rw.hi[hr]) x = neg_inf();
        }
      }
  }
};

// Producer (warpgroup 0): Q, then per tile its descriptor, its K part and its V part.
// Thread 0 holds the next descriptor (pulled from the source under the copies of the
// tile before), waits until the consumers are done with the stage's previous tile, writes
// the stage's slot and arrives on the K full barrier (the META arrival, whose release
// orders the slot before the consumers' reads); the producer's named barrier hands the slot
// to the 128 threads, which copy the K rows (and a gathered tile's keys) and then, once the
// stage's previous V is released, the V rows. A width-0 descriptor ends the stream: the
// consumers find it in the slot with no copies behind it.
template <typename T, typename C, typename Src, typename Bar>
__device__ __forceinline__ void sparse_produce(const SparseArgs<T>& P, const WorkItem& it, Src& src,
                                               const SparseKV<T, C>& kv, const Bar& bar, u32 sQ, u32 sKV,
                                               u32 slots, u32 keys, const TensorMap* k_map,
                                               const TensorMap* v_map) {
  constexpr int STAGES = C::BUFFERS, BN = C::KEYS;
  if (k_map != nullptr && threadIdx.x == 0) {
    prefetch_tensor_map(k_map);
    prefetch_tensor_map(v_map);
  }
  const bool lead = threadIdx.x == 0;
  load_q<T, C::HEAD, C>(P, it, sQ);
  cp_async_arrive(bar.q());
  int2 next = lead ? src.pull() : make_int2(0, 0);
  for (int i = 0;; ++i) {
    const int st = i % STAGES, u = i / STAGES;
    const u32 slot = slots + 8 * st, sK = sKV + 2 * st * C::KV_BYTES, sKeys = keys + 4 * BN * st;
    if (lead) {
      if (u > 0) mbar_wait(bar.k_empty(st), (u - 1) & 1);
      st_shared_int2(slot, next);
      mbar_arrive(bar.k_full(st));
    }
    bar_sync(PRODUCER_BAR, 128);
    const int2 d = ld_shared_int2(slot);
    if ((d.y & TILE_WIDTH) == 0) {  // the end: the phase completes without copies
      mbar_arrive(bar.k_full(st));
      break;
    }
    // a whole tile of contiguous keys by TMA (the lead's arrival announces its bytes), any
    // other by the 128 threads' cp.async (rows past the width zero-filled)
    const bool tma = k_map != nullptr && (d.y & (TILE_GATHER | TILE_WIDTH)) == BN;
    if (!tma) {
      kv.template issue_part<true>(d, sK, sKeys);
      cp_async_arrive(bar.k_full(st));
    } else if (lead) {
      mbar_arrive_expect_tx(bar.k_full(st), C::KV_BYTES);
      kv.tma_part(k_map, d, sK, bar.k_full(st));
    } else {
      mbar_arrive(bar.k_full(st));
    }
    if (lead) next = src.pull();
    // every thread waits for the stage's previous V to be released, so that no arrival of
    // this use reaches its full barrier before the previous use's phase (its bytes) completed
    if (u > 0) mbar_wait(bar.v_empty(st), (u - 1) & 1);
    if (!tma) {
      kv.template issue_part<false>(d, sK + C::KV_BYTES, sKeys);
      cp_async_arrive(bar.v_full(st));
    } else if (lead) {
      mbar_arrive_expect_tx(bar.v_full(st), C::KV_BYTES);
      kv.tma_part(v_map, d, sK + C::KV_BYTES, bar.v_full(st));
    } else {
      mbar_arrive(bar.v_full(st));
    }
  }
  cp_async_wait_all();
}

// Consumer g (rows 64 g .. 64 g + 63: half g) over the stages' tiles (the header's
// order). A tile it computes: S = Q K^T in the consumer's turn, the softmax, then O += P V
// (the other consumer's batches run under this one's softmax: the ping-pong); a tile it
// skips takes its turn with nothing to issue and releases the stage.
template <typename T, typename C, typename Bar>
__device__ __forceinline__ void sparse_consume(const SparseRows& rows, const Bar& bar, const Turns& turn, u32 sQg,
                                               u32 sKV, u32 slots, u32 keys, float (&o)[C::HEAD / 2],
                                               float (&m)[2], float (&l)[2]) {
  constexpr int D = C::HEAD, BN = C::KEYS, STAGES = C::BUFFERS;
  mbar_wait(bar.q(), 0);
  for (int i = 0;; ++i) {
    const int st = i % STAGES;
    const u32 par = (i / STAGES) & 1, sK = sKV + 2 * st * C::KV_BYTES;
    mbar_wait(bar.k_full(st), par);
    StageTile t;
    t.load(slots + 8 * st, keys + 4 * BN * st);
    if (t.width() == 0) break;
    turn.wait();
    if (rows.runs(t)) {
      float s[BN / 2], alpha[2];
      u32 pf[BN / 16][4];
      qk<T, C>(s, sQg, sK);
      turn.pass();
      wgmma_wait<0>();
      fence_operands(s);
      rows.template scores<C>(s, t);
      mbar_arrive(bar.k_empty(st));  // after the scores: a gathered tile's keys are the stage's
      softmax<T, BN>(s, m, l, pf, alpha, rows.rw.sc);
      rescale<D>(o, alpha);
      mbar_wait(bar.v_full(st), par);
      pv<T, C>(o, pf, sK + C::KV_BYTES);
      drain<D>(o, pf);
    } else {
      turn.pass();
      mbar_arrive(bar.k_empty(st));
      mbar_wait(bar.v_full(st), par);
    }
    mbar_arrive(bar.v_empty(st));
  }
  turn.wait();  // the end's turn
  if (turn.g == 0) turn.pass();  // consumer 1's last turn is nobody's to wait for
}

// Body of sparse_ws_kernel and bsr_ws_kernel: the CTA of grid (x, y) placed by its source
// (head head0 + x), its rows as a work item of one head (group 1), then the producer and
// the two consumers (WS_THREADS threads; the producer's budget PRODUCER_REGS, the
// consumers' the rest). GENERAL: window_left and scores through the score epilogue.
template <typename T, int D, int BN, int STAGES, bool GENERAL, int PRODUCER_REGS, typename Src>
__device__ __forceinline__ void sparse_ws(const SparseArgs<T>& P, const TensorMap* k_map = nullptr,
                                          const TensorMap* v_map = nullptr) {
  using C = Config<T, T, D, BN, STAGES, false, GENERAL, 128>;
  using Bar = WsBarriers<STAGES, false, 0, 1>;
  static_assert(C::BLOCK_M == 2 * HALF_ROWS, "a consumer a pattern half");
  static_assert(PRODUCER_REGS + 2 * ws_consumer_regs(PRODUCER_REGS) <= 3 * WS_ENTRY_REGS,
                "the consumers' increase fits in what the producer's decrease frees");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ Src src;
  const u32 sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
  const u32 sKV = sQ + C::Q_BYTES;  // stage s: K at sKV + 2 s KV_BYTES, V right after
  const Bar bar{sKV + 2 * STAGES * C::KV_BYTES};
  const u32 slots = bar.base + 8 * Bar::COUNT;  // STAGES descriptor slots, then their keys
  const u32 keys = slots + 8 * STAGES;
  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;

  const int hh = blockIdx.x, h = P.head0 + hh;
  CtaSeq cs;
  if (!Src::locate(P, cs)) return;
  const int m0 = cs.c * C::BLOCK_M;
  if (m0 >= cs.q_len) return;
  WorkItem it;
  it.b = cs.b;
  it.hk = h;  // group 1: head(r) = h, token_row(r) = q0 + m0 + r
  it.row0 = m0;
  it.rows = min(C::BLOCK_M, cs.q_len - m0);
  it.group = 1;
  it.q_start = cs.q0;
  it.q_len = cs.q_len;
  it.kv_len = cs.kv_len;
  it.kv_start = 0;
  it.table = nullptr;
  src.template init<2>(P, cs, hh, BN);
  if (threadIdx.x == 0) bar.init();
  __syncthreads();

  if (wg == 0) {
    setmaxnreg_dec<PRODUCER_REGS>();
    SparseKV<T, C> kv;
    kv.init(P, cs.b, h);
    sparse_produce<T, C>(P, it, src, kv, bar, sQ, sKV, slots, keys, k_map, v_map);
  } else {
    setmaxnreg_inc<ws_consumer_regs(PRODUCER_REGS)>();
    const int g = wg - 1, warp = (threadIdx.x / 32) % 4;
    SparseRows rows;
    rows.rw.init<C>(P, it, g, warp, lane, P.sm_scale);
    rows.half = g == 0 ? TILE_A : TILE_B;
    float o[D / 2], m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    const Turns turn{g};
    if (g == 1) turn.pass();  // consumer 0 takes the first turn
    sparse_consume<T, C>(rows, bar, turn, sQ + g * 64 * C::SW, sKV, slots, keys, o, m, l);
    store_rows<T, C>(P, it, 64 * g + 16 * warp, o, m, l, rows.rw.sc, 1.f, sQ, lane);
  }
}

}  // namespace sm90

// grid (heads in this call, cta_bound), block WS_THREADS (a producer and two consumer
// warpgroups); dynamic smem: Q [128][D], STAGES K and V tiles [BN][D] (swizzled, 1024-byte
// aligned), the WsBarriers, the stages' descriptor slots and keys (cupaged.sparse.launch
// ws_smem). CTA
// (x, y) computes the 128 query rows of its CTA map entry, head head0 + x, over its tile
// list (ListSource, tiles of at most BN keys).
template <typename T, int D, int BN, int STAGES, bool GENERAL, int PRODUCER_REGS>
__global__ void __launch_bounds__(sm90::WS_THREADS, 1) sparse_ws_kernel(CUPAGED_PARAMS_SparseArgs) {
  const SparseArgs<T> P{CUPAGED_FIELDS_SparseArgs};
  sm90::sparse_ws<T, D, BN, STAGES, GENERAL, PRODUCER_REGS, ListSource>(P);
}

// The same over a batched BSR pattern walked in place (BsrSource), CTAs of 128 rows.
template <typename T, int D, int BN, int STAGES, bool GENERAL, int PRODUCER_REGS>
__global__ void __launch_bounds__(sm90::WS_THREADS, 1) bsr_ws_kernel(CUPAGED_PARAMS_SparseArgs) {
  const SparseArgs<T> P{CUPAGED_FIELDS_SparseArgs};
  sm90::sparse_ws<T, D, BN, STAGES, GENERAL, PRODUCER_REGS, BsrSource>(P);
}

// The two kernels over dense rows of head size 64 or 128 (rows of whole 128-byte column
// blocks), each whole tile of contiguous keys copied by TMA: the tensor maps k_map and v_map
// over K and V (cupaged.core.tma, boxes of BN keys). Arguments: SparseArgs' fields, then
// the maps (SparseArgsTma, abi.cuh).
template <typename T, int D, int BN, int STAGES, bool GENERAL, int PRODUCER_REGS>
__global__ void __launch_bounds__(sm90::WS_THREADS, 1) sparse_ws_tma_kernel(CUPAGED_PARAMS_SparseArgsTma) {
  static_assert(D == 64 || D == 128, "rows of whole 128-byte column blocks");
  const SparseArgs<T> P{CUPAGED_FIELDS_SparseArgs};
  sm90::sparse_ws<T, D, BN, STAGES, GENERAL, PRODUCER_REGS, ListSource>(P, &k_map, &v_map);
}

template <typename T, int D, int BN, int STAGES, bool GENERAL, int PRODUCER_REGS>
__global__ void __launch_bounds__(sm90::WS_THREADS, 1) bsr_ws_tma_kernel(CUPAGED_PARAMS_SparseArgsTma) {
  static_assert(D == 64 || D == 128, "rows of whole 128-byte column blocks");
  const SparseArgs<T> P{CUPAGED_FIELDS_SparseArgs};
  sm90::sparse_ws<T, D, BN, STAGES, GENERAL, PRODUCER_REGS, BsrSource>(P, &k_map, &v_map);
}

}  // namespace cupaged
