// Merge kernels: the combine step of split-KV attention (merge.cuh has the math).
//
//   merge_states_kernel  combines two (or more) states of the same rows (merge_states)
//   merge_pieces_kernel  merges the fp32 pieces of split decode sequences (adding sinks
//                        once) when the decode kernel does not merge them itself (fused)
#include "common.cuh"
#include "abi.cuh"
#include "merge.cuh"

namespace cupaged {
namespace merge {

// grid ceil(num_rows / 4); block 128: warp w of CTA c merges row 4c + w (row = token * heads
// + head) over num_parts states; output rows are contiguous [num_rows][dim].
// Part s of row i: o_first/o_rest as in PartRow, offset by i * o_row_stride; lse alike.
template <typename TI, typename TO>
__global__ void __launch_bounds__(128) merge_states_kernel(CUPAGED_PARAMS_MergeStatesArgs) {
  const int row = blockIdx.x * 4 + (threadIdx.x >> 5);
  if (row >= num_rows) return;
  const PartRow<TI> o{o_first + row * o_row_stride, o_rest + row * o_row_stride, o_part_stride};
  const PartRow<float> ls{l_first + row * l_row_stride, l_rest + row * l_row_stride, l_part_stride};
  const float sink = sinks != nullptr ? sinks[row % num_heads] : neg_inf();
  merge_row_warp<TI, TO>(o, ls, num_parts, sink, dim, out + (i64)row * dim,
                         lse_out != nullptr ? lse_out + row : nullptr);
}

// grid (batch, num_kv_heads * head_chunks, ceil(HPC / (W / WPH))); block 32 * W threads,
// W = max(NWARPS, WPH) warps, WPH (warps per head) a power of two up to MERGE_MAX_WARPS.
// CTA (b, y, z) merges the pieces of row group y of sequence b when b was split
// (seq_info[b] = (npieces, first slot), npieces > 1); the decode kernel wrote every other
// sequence's rows. Out row of sequence b: b, or rows[b] (paged_attention's decode rows; only
// decode rows are split). Its W / WPH heads (z * W / WPH + warp / WPH of the row group) each take
// WPH warps, which split the head's pieces into equal runs (merge_pieces_share: one L2
// round trip a run of up to 16 pieces). With WPH > 1 the runs' shares meet in shared memory
// and the head's first warp combines them and writes the row. Few sequences have many
// pieces each (B1: one a column), which one warp a head would walk a batch after another.
// At most 128 registers a thread (4 CTAs of 4 warps an SM, or one of 16), so that B64 x 32
// heads merge in one wave: a second wave would double the time the merge adds after the
// decode kernel.
using decode::MERGE_MAX_WARPS;  // cupaged.decode_plan (abi.cuh)

template <typename TO, int CH>
__global__ void __launch_bounds__(32 * MERGE_MAX_WARPS, 1)
merge_pieces_kernel(CUPAGED_PARAMS_MergePiecesArgs) {
  __shared__ float4 s_acc[MERGE_MAX_WARPS][CH][32];  // the runs' shares (WPH > 1)
  __shared__ float s_m[MERGE_MAX_WARPS], s_den[MERGE_MAX_WARPS];
  const int b = blockIdx.x, y = blockIdx.y;
  const int np = seq_info[2 * b], slot0 = seq_info[2 * b + 1];
  if (np <= 1) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = num_q_heads / num_kv_heads;
  const int hc = y % head_chunks;
  const int heads = min(group - hc * hpc, hpc);
  const int h = blockIdx.z * ((blockDim.x >> 5) / wph) + warp / wph;  // head in the row group
  const int part = warp % wph;                                         // run of its pieces
  const int hq = (y / head_chunks) * group + hc * hpc + h;             // query head
  const i64 stride = (i64)gridDim.y * hpc;  // rows from one piece to the next
  const i64 row = ((i64)slot0 * gridDim.y + y) * hpc + h;
  RowShare<CH> r{neg_inf(), 0.f};
  if (h < heads)
    r = merge_pieces_share<CH>(part_out + row * dim, stride * dim, part_lse + row, stride,
                               part * np / wph, (part + 1) * np / wph, dim, lane);
  if (wph > 1) {
    if (lane == 0) {
      s_m[warp] = r.m;
      s_den[warp] = r.den;
    }
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) s_acc[warp][ch][lane] = r.acc[ch];
    __syncthreads();
    if (part != 0 || h >= heads) return;
    for (int w = warp + 1; w < warp + wph; ++w) {
      RowShare<CH> q{s_m[w], s_den[w]};
#pragma unroll
      for (int ch = 0; ch < CH; ++ch) q.acc[ch] = s_acc[w][ch][lane];
      r.combine(q);
    }
  } else if (h >= heads) {
    return;
  }
  const i64 orow = (i64)(rows != nullptr ? __ldg(rows + b) : b) * num_q_heads + hq;
  write_merged<TO, CH>(r, sinks != nullptr ? sinks[hq] : neg_inf(), dim, out + orow * dim,
                       lse != nullptr ? lse + orow : nullptr, lane);
}

}  // namespace merge
}  // namespace cupaged
