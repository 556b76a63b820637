// Checks of device index entries that more than one kernel family reads (block-table rows):
// a bad entry is reported to the error word (report_error) and never followed.
#pragma once
#include "common.cuh"
#include "abi.cuh"

namespace cupaged {

constexpr int INT32_MAX_ = 2147483647;

// Whether sequence b's length len is not negative and its kv keys (len and any appended
// ones) fit its block-table row of `width` blocks; a failure is reported (err may be null): a
// negative length as a range error, keys past the row as a table error (value kv).
__device__ __forceinline__ bool keys_fit(int len, i64 kv, int width, int block_size,
                                         long long* err, int b) {
  if (len < 0) {
    report_error(err, error_code(ARG_SEQ_LENS, CHECK_RANGE), b, -1, len, INT32_MAX_);
    return false;
  }
  if ((kv + block_size - 1) / block_size > width) {
    report_error(err, error_code(ARG_SEQ_LENS, CHECK_TABLE), b, -1, kv, (i64)width * block_size);
    return false;
  }
  return true;
}

// Whether the first `need` entries of block-table row b are block ids in [0, num_blocks); the
// first bad one found is reported (err may be null). Every thread of the CTA (THREADS) calls.
template <int THREADS>
__device__ __forceinline__ bool table_row_ok(const int* row, int need, int num_blocks,
                                             long long* err, int b) {
  int bad = 0;
  for (int j = threadIdx.x; j < need; j += THREADS) {
    const int id = __ldg(row + j);
    if ((unsigned)id >= (unsigned)num_blocks) {
      bad = 1;
      report_error(err, error_code(ARG_BLOCK_TABLES, CHECK_RANGE), b, j, id, num_blocks);
    }
  }
  return !__syncthreads_or(bad);
}

}  // namespace cupaged
