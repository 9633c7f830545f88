// Memory coalescing: the same bytes moved with coalesced and with uncoalesced accesses.
//
// Playbook chapter 4, §4.0.3 "memory coalescing". The 32 threads of a warp issue a load or store
// together. When they touch 32 consecutive floats (128 bytes), the memory system serves the warp
// with four 32-byte sectors. When each thread touches a different row, the warp needs 32 sectors
// and uses 4 of every 32 bytes it moves. A transpose cannot make both its reads and its writes run
// along rows, unless the tile passes through shared memory (on-chip, any access order is cheap).
//
// Versions (float32; in is (rows, cols) row-major; out is (rows, cols) for the copy, (cols, rows)
// for the transposes):
//   v1 copy_rows         out[i][j] = in[i][j]. Reads and writes are coalesced: the bandwidth ceiling
//   v2 transpose_naive   out[j][i] = in[i][j]. Reads are coalesced. A warp's writes land `rows` floats
//                        apart: uncoalesced
//   v3 transpose_tiled   a 32×32 tile is read along rows into shared memory, then written along rows
//                        of out, read from the tile along columns. The tile has one column of padding,
//                        so a column of 32 floats sits in 32 different shared-memory banks (without it,
//                        all 32 share one bank and the reads serialize)
// Bytes moved: 2·rows·cols·4 for all three. Only the access pattern differs, so GB/s = bytes / time
// measures coalescing directly. The design is the one in M. Harris, "An Efficient Matrix Transpose
// in CUDA C/C++" (NVIDIA blog, 2013).
//
// Build and check: python kernels/cuda_ext.py (GPU); compile only: bash kernels/cuda/check_compile.sh.
#include "launchers.h"

namespace {

constexpr int TILE = 32;        // a tile is TILE × TILE floats; TILE = warp size, so one tile row = one warp
constexpr int BLOCK_ROWS = 8;   // blocks are TILE × BLOCK_ROWS threads; each thread handles TILE / BLOCK_ROWS rows

__global__ void copy_rows_kernel(const float* __restrict__ in, float* __restrict__ out, int rows, int cols) {
    const int col = blockIdx.x * TILE + threadIdx.x;   // consecutive threads -> consecutive columns
    for (int k = 0; k < TILE; k += BLOCK_ROWS) {
        const int row = blockIdx.y * TILE + threadIdx.y + k;
        if (row < rows && col < cols) {
            out[(size_t)row * cols + col] = in[(size_t)row * cols + col];
        }
    }
}

__global__ void transpose_naive_kernel(const float* __restrict__ in, float* __restrict__ out, int rows, int cols) {
    const int col = blockIdx.x * TILE + threadIdx.x;
    for (int k = 0; k < TILE; k += BLOCK_ROWS) {
        const int row = blockIdx.y * TILE + threadIdx.y + k;
        if (row < rows && col < cols) {
            // Read: consecutive threads, consecutive addresses. Write: consecutive threads, addresses
            // `rows` floats apart. Each thread of the warp writes its own sector.
            out[(size_t)col * rows + row] = in[(size_t)row * cols + col];
        }
    }
}

__global__ void transpose_tiled_kernel(const float* __restrict__ in, float* __restrict__ out, int rows, int cols) {
    __shared__ float tile[TILE][TILE + 1];   // +1: column j of the tile spreads over all 32 banks

    // Phase 1: read tile (blockIdx.y, blockIdx.x) of `in` along its rows (coalesced).
    int col = blockIdx.x * TILE + threadIdx.x;
    for (int k = 0; k < TILE; k += BLOCK_ROWS) {
        const int row = blockIdx.y * TILE + threadIdx.y + k;
        if (row < rows && col < cols) {
            tile[threadIdx.y + k][threadIdx.x] = in[(size_t)row * cols + col];
        }
    }
    __syncthreads();   // the whole tile must be in shared memory before anyone reads a column of it

    // Phase 2: that tile is tile (blockIdx.x, blockIdx.y) of `out` (which has `rows` columns).
    // Write it along out's rows (coalesced), reading the shared tile down its columns.
    col = blockIdx.y * TILE + threadIdx.x;                  // column of out = row of in
    for (int k = 0; k < TILE; k += BLOCK_ROWS) {
        const int row = blockIdx.x * TILE + threadIdx.y + k;   // row of out = column of in
        if (row < cols && col < rows) {
            out[(size_t)row * rows + col] = tile[threadIdx.x][threadIdx.y + k];
        }
    }
}

dim3 tile_grid(int rows, int cols) { return dim3((cols + TILE - 1) / TILE, (rows + TILE - 1) / TILE); }

}  // namespace

cudaError_t launch_copy_rows(const float* in, float* out, int rows, int cols, cudaStream_t stream) {
    copy_rows_kernel<<<tile_grid(rows, cols), dim3(TILE, BLOCK_ROWS), 0, stream>>>(in, out, rows, cols);
    return cudaGetLastError();
}

cudaError_t launch_transpose_naive(const float* in, float* out, int rows, int cols, cudaStream_t stream) {
    transpose_naive_kernel<<<tile_grid(rows, cols), dim3(TILE, BLOCK_ROWS), 0, stream>>>(in, out, rows, cols);
    return cudaGetLastError();
}

cudaError_t launch_transpose_tiled(const float* in, float* out, int rows, int cols, cudaStream_t stream) {
    transpose_tiled_kernel<<<tile_grid(rows, cols), dim3(TILE, BLOCK_ROWS), 0, stream>>>(in, out, rows, cols);
    return cudaGetLastError();
}
