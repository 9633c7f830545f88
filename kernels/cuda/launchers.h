// Host-side launchers of the chapter-4 CUDA teaching kernels, one line each.
//
// The .cu files are plain CUDA: they do not include any PyTorch header, so `nvcc -c` compiles them in a
// second (kernels/cuda/check_compile.sh does, for sm_80 and sm_90). bindings.cpp is the only file that sees
// torch. It checks the tensors, allocates the outputs and calls these functions with raw pointers and the
// current PyTorch stream. All matrices are float32, row-major and contiguous. Each launcher returns
// cudaGetLastError(), so a bad launch configuration surfaces as a Python exception.
#pragma once
#include <cuda_runtime.h>

// coalescing.cu: in (rows, cols) -> out (rows, cols) for the copy, (cols, rows) for the transposes
cudaError_t launch_copy_rows(const float* in, float* out, int rows, int cols, cudaStream_t stream);
cudaError_t launch_transpose_naive(const float* in, float* out, int rows, int cols, cudaStream_t stream);
cudaError_t launch_transpose_tiled(const float* in, float* out, int rows, int cols, cudaStream_t stream);

// matmul.cu: C (M, N) = A (M, K) @ B (K, N)
cudaError_t launch_matmul_naive(const float* A, const float* B, float* C, int M, int N, int K, cudaStream_t stream);
cudaError_t launch_matmul_coalesced(const float* A, const float* B, float* C, int M, int N, int K, cudaStream_t stream);
cudaError_t launch_matmul_tiled(const float* A, const float* B, float* C, int M, int N, int K, cudaStream_t stream);
cudaError_t launch_matmul_coarsened(const float* A, const float* B, float* C, int M, int N, int K, cudaStream_t stream);

// rmsnorm.cu: y (rows, cols) = x · rsqrt(mean(x²) + eps) · w, w (cols,)
cudaError_t launch_rmsnorm_thread_per_row(const float* x, const float* w, float* y, int rows, int cols, float eps,
                                          cudaStream_t stream);
cudaError_t launch_rmsnorm_block_per_row(const float* x, const float* w, float* y, int rows, int cols, float eps,
                                         cudaStream_t stream);
