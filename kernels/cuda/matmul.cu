// Matrix multiplication, from naive to coalesced, shared-memory tiled and thread-coarsened.
//
// Playbook chapter 4, §4.0.3-4.0.5 (after S. Boehm, "How to Optimize a CUDA Matmul Kernel for
// cuBLAS-like Performance", kernels 1-4). C (M, N) = A (M, K) @ B (K, N), float32, row-major.
// FLOPs: 2·M·N·K for every version. What changes is the number of bytes each FLOP costs:
//
//   v1 matmul_naive      2-D blocks of 32×32. Thread (threadIdx.x, threadIdx.y) computes C[x][y], with
//                        x = the row. Consecutive threads of a warp have consecutive x, so they read 32
//                        different rows of A (K floats apart) and write 32 different rows of C:
//                        uncoalesced. This is the playbook's `matmul_naive`
//   v2 matmul_coalesced  the same work with 1-D blocks of 1024 threads and the playbook's mapping
//                        x = blockIdx.x·32 + threadIdx.x / 32,  y = blockIdx.y·32 + threadIdx.x % 32.
//                        A warp now shares one x: it reads one element of A (a broadcast) and 32
//                        consecutive floats of B, and writes 32 consecutive floats of C
//   v3 matmul_tiled      a block computes a 32×32 tile of C. It stages 32×32 tiles of A and B in shared
//                        memory (__syncthreads() before and after use). Each HBM element is loaded once
//                        per tile instead of once per output that needs it: 32× less global traffic.
//                        This is a complete version of the playbook's partial §4.0.4 snippet: its tile
//                        offsets use block indices, and the shared arrays are declared
//   v4 matmul_coarsened  tiled 64×64 with BK = 8, and each thread computes TM = 8 outputs of one column
//                        (thread coarsening, §4.0.5). The B value a thread loads from shared memory
//                        is reused from a register for 8 FMAs. v3 stalls on shared-memory loads (the
//                        playbook's "mio_throttle"); here there are 8 FMAs per B load instead of 1
// cuBLAS (torch.matmul) is the ceiling; kernels/cuda_ext.py prints each version's TFLOP/s next to it.
//
// Build and check: python kernels/cuda_ext.py (GPU); compile only: bash kernels/cuda/check_compile.sh.
#include "launchers.h"

namespace {

constexpr int BS = 32;                                        // v1-v3: 32×32 outputs per block
constexpr int BM = 64, BN = 64, BK = 8, TM = 8;               // v4: C tile, K step, outputs per thread

__global__ void matmul_naive_kernel(const float* A, const float* B, float* C, int M, int N, int K) {
    const int x = blockIdx.x * blockDim.x + threadIdx.x;      // row of C: neighbours in a warp differ in x
    const int y = blockIdx.y * blockDim.y + threadIdx.y;      // column of C
    if (x < M && y < N) {
        float acc = 0.f;
        for (int i = 0; i < K; ++i) acc += A[(size_t)x * K + i] * B[(size_t)i * N + y];
        C[(size_t)x * N + y] = acc;
    }
}

__global__ void matmul_coalesced_kernel(const float* A, const float* B, float* C, int M, int N, int K) {
    const int x = blockIdx.x * BS + threadIdx.x / BS;         // one row per group of 32 threads (a warp)
    const int y = blockIdx.y * BS + threadIdx.x % BS;         // neighbours in a warp: neighbouring columns
    if (x < M && y < N) {
        float acc = 0.f;
        for (int i = 0; i < K; ++i) acc += A[(size_t)x * K + i] * B[(size_t)i * N + y];
        C[(size_t)x * N + y] = acc;
    }
}

__global__ void matmul_tiled_kernel(const float* A, const float* B, float* C, int M, int N, int K) {
    __shared__ float As[BS][BS];
    __shared__ float Bs[BS][BS];
    const int ty = threadIdx.x / BS, tx = threadIdx.x % BS;  // position inside the tile; tx is the fast index
    const int row = blockIdx.x * BS + ty;
    const int col = blockIdx.y * BS + tx;
    float acc = 0.f;
    // exercise K.8: shared-memory tiling
    // hint: [PB] §4.0.4, Tiling (kernels/README.md, CUDA teaching kernels): the block's threads load one
    //   BS-wide tile of A and one of B into shared memory together (zeros outside the matrices), each one
    //   element, and every thread then reads them BS times; barriers keep the loads and the reads apart.
    // test: tests/test_kernels_cuda_compile.py::test_cuda_kernels_compile_for_sm80_and_sm90
    for (int k0 = 0; k0 < K; k0 += BS) {
        // Each thread loads one element of each tile; tx runs along rows of A and B: coalesced.
        As[ty][tx] = (row < M && k0 + tx < K) ? A[(size_t)row * K + k0 + tx] : 0.f;
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(size_t)(k0 + ty) * N + col] : 0.f;
        __syncthreads();                                      // tiles complete before anyone reads them
        for (int k = 0; k < BS; ++k) acc += As[ty][k] * Bs[k][tx];
        __syncthreads();                                      // everyone done before the tiles are overwritten
    }
    // end exercise
    if (row < M && col < N) C[(size_t)row * N + col] = acc;
}

__global__ void matmul_coarsened_kernel(const float* A, const float* B, float* C, int M, int N, int K) {
    __shared__ float As[BM][BK];
    __shared__ float Bs[BK][BN];
    // 512 threads: thread t owns column t % BN of the C tile, rows (t / BN)·TM ... + TM - 1.
    const int thread_col = threadIdx.x % BN;
    const int thread_row = threadIdx.x / BN;
    // Loading: 512 threads, 512 elements in each of the As (64×8) and Bs (8×64) tiles, so one element each.
    const int a_row = threadIdx.x / BK, a_col = threadIdx.x % BK;
    const int b_row = threadIdx.x / BN, b_col = threadIdx.x % BN;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    float acc[TM] = {0.f};
    for (int k0 = 0; k0 < K; k0 += BK) {
        As[a_row][a_col] = (row0 + a_row < M && k0 + a_col < K) ? A[(size_t)(row0 + a_row) * K + k0 + a_col] : 0.f;
        Bs[b_row][b_col] = (k0 + b_row < K && col0 + b_col < N) ? B[(size_t)(k0 + b_row) * N + col0 + b_col] : 0.f;
        __syncthreads();
        for (int k = 0; k < BK; ++k) {
            const float b = Bs[k][thread_col];                // one shared-memory load ...
            for (int i = 0; i < TM; ++i) acc[i] += As[thread_row * TM + i][k] * b;   // ... TM FMAs
        }
        __syncthreads();
    }
    for (int i = 0; i < TM; ++i) {
        const int row = row0 + thread_row * TM + i, col = col0 + thread_col;
        if (row < M && col < N) C[(size_t)row * N + col] = acc[i];
    }
}

int cdiv(int a, int b) { return (a + b - 1) / b; }

}  // namespace

cudaError_t launch_matmul_naive(const float* A, const float* B, float* C, int M, int N, int K, cudaStream_t stream) {
    matmul_naive_kernel<<<dim3(cdiv(M, BS), cdiv(N, BS)), dim3(BS, BS), 0, stream>>>(A, B, C, M, N, K);
    return cudaGetLastError();
}

cudaError_t launch_matmul_coalesced(const float* A, const float* B, float* C, int M, int N, int K, cudaStream_t stream) {
    matmul_coalesced_kernel<<<dim3(cdiv(M, BS), cdiv(N, BS)), BS * BS, 0, stream>>>(A, B, C, M, N, K);
    return cudaGetLastError();
}

cudaError_t launch_matmul_tiled(const float* A, const float* B, float* C, int M, int N, int K, cudaStream_t stream) {
    matmul_tiled_kernel<<<dim3(cdiv(M, BS), cdiv(N, BS)), BS * BS, 0, stream>>>(A, B, C, M, N, K);
    return cudaGetLastError();
}

cudaError_t launch_matmul_coarsened(const float* A, const float* B, float* C, int M, int N, int K, cudaStream_t stream) {
    static_assert(BM * BK == BM * BN / TM && BK * BN == BM * BN / TM, "one load per thread per tile");
    matmul_coarsened_kernel<<<dim3(cdiv(N, BN), cdiv(M, BM)), BM * BN / TM, 0, stream>>>(A, B, C, M, N, K);
    return cudaGetLastError();
}
