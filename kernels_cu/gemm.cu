// C = A @ B for float32 row-major matrices: the tiny model's projections inside a CUDA
// graph (CuPy does not call cuBLAS while a stream captures).
#include "abi.cuh"

namespace cupaged {

// Grid (ceil(n / TILE), ceil(m / TILE)), block TILE x TILE: each thread computes one
// element of C; the block stages TILE x TILE tiles of A and B in shared memory, zeros past
// the matrices' edges.
template <int TILE>
__global__ void __launch_bounds__(TILE * TILE) gemm_f32(CUPAGED_PARAMS_GemmArgs) {
  __shared__ float sa[TILE][TILE];
  __shared__ float sb[TILE][TILE + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
  float acc = 0.f;
  for (int k0 = 0; k0 < k; k0 += TILE) {
    sa[ty][tx] = (row < m && k0 + tx < k) ? a[row * lda + k0 + tx] : 0.f;
    sb[ty][tx] = (k0 + ty < k && col < n) ? b[(k0 + ty) * ldb + col] : 0.f;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < TILE; ++j) acc += sa[ty][j] * sb[j][tx];
    __syncthreads();
  }
  if (row < m && col < n) c[row * ldc + col] = acc;
}

}  // namespace cupaged
