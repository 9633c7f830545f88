// RMSNorm as one fused CUDA kernel, first naive, then with warp-shuffle reductions.
//
// Playbook chapter 4, §4.0.7 "fused kernels". y = x · rsqrt(mean(x²) + eps) · w per row, float32.
// Eager PyTorch needs about five kernels and writes an (N, C) temporary for each. Both versions here
// are fused: one kernel, x read from HBM, y written, nothing in between. They differ in how the
// threads share the work:
//
//   v1 rmsnorm_thread_per_row  one thread owns a whole row and loops over its C elements twice (sum of
//                              squares, then scale). Simple, but the threads of a warp read addresses
//                              C floats apart (uncoalesced; §4.0.3), and a row is 2·C dependent steps
//                              of one thread. Only N threads exist, too few to fill a GPU for small N
//   v2 rmsnorm_block_per_row   one block of 256 threads per row. The threads stride over the row
//                              (coalesced), and each reduces its part of Σx² in a register. A warp adds
//                              its 32 partial sums with __shfl_xor_sync: a butterfly over registers,
//                              5 steps, no shared memory. The 8 warp sums then meet in 8 floats of
//                              shared memory. The second pass over x mostly hits L1/L2
//
// HBM bytes for N rows: 2·N·C·4 + C·4 for both versions; eager ≈ 10·N·C·4. The reduction pattern is
// the classic one (M. Harris, "Optimizing Parallel Reduction in CUDA"; CUDA Programming Guide
// "Warp Shuffle Functions"). The Triton version with backward is kernels/rmsnorm.py.
//
// Build and check: python kernels/cuda_ext.py (GPU); compile only: bash kernels/cuda/check_compile.sh.
#include "launchers.h"

namespace {

constexpr int WARP = 32;
constexpr int THREADS = 256;    // v2: 8 warps per row

__global__ void rmsnorm_thread_per_row_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                              float* __restrict__ y, int rows, int cols, float eps) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const float* xr = x + (size_t)row * cols;
    float sum_sq = 0.f;
    for (int j = 0; j < cols; ++j) sum_sq += xr[j] * xr[j];
    const float rstd = rsqrtf(sum_sq / cols + eps);
    for (int j = 0; j < cols; ++j) y[(size_t)row * cols + j] = xr[j] * rstd * w[j];
}

// Butterfly sum over the 32 lanes of a warp: after log2(32) = 5 exchanges every lane holds the total.
__device__ float warp_sum(float v) {
    for (int offset = WARP / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__global__ void rmsnorm_block_per_row_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                             float* __restrict__ y, int cols, float eps) {
    __shared__ float warp_sums[THREADS / WARP];
    const float* xr = x + (size_t)blockIdx.x * cols;
    float* yr = y + (size_t)blockIdx.x * cols;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;

    float sum_sq = 0.f;
    for (int j = threadIdx.x; j < cols; j += THREADS) sum_sq += xr[j] * xr[j];   // coalesced strides
    sum_sq = warp_sum(sum_sq);                          // 32 -> 1 inside each warp, in registers
    if (lane == 0) warp_sums[warp] = sum_sq;
    __syncthreads();
    if (warp == 0) {                                    // 8 -> 1 by the first warp
        sum_sq = warp_sum(lane < THREADS / WARP ? warp_sums[lane] : 0.f);
        if (lane == 0) warp_sums[0] = sum_sq;
    }
    __syncthreads();
    const float rstd = rsqrtf(warp_sums[0] / cols + eps);
    for (int j = threadIdx.x; j < cols; j += THREADS) yr[j] = xr[j] * rstd * w[j];
}

}  // namespace

cudaError_t launch_rmsnorm_thread_per_row(const float* x, const float* w, float* y, int rows, int cols, float eps,
                                          cudaStream_t stream) {
    rmsnorm_thread_per_row_kernel<<<(rows + THREADS - 1) / THREADS, THREADS, 0, stream>>>(x, w, y, rows, cols, eps);
    return cudaGetLastError();
}

cudaError_t launch_rmsnorm_block_per_row(const float* x, const float* w, float* y, int rows, int cols, float eps,
                                         cudaStream_t stream) {
    rmsnorm_block_per_row_kernel<<<rows, THREADS, 0, stream>>>(x, w, y, cols, eps);
    return cudaGetLastError();
}
