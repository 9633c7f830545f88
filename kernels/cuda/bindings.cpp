// Python bindings for the chapter-4 CUDA teaching kernels (playbook App. 5.1.9, cpp_extension).
//
// The only file here that includes PyTorch. Each function checks its tensors (CUDA, float32,
// contiguous), allocates the output, and calls a launcher from launchers.h with raw pointers on
// PyTorch's current stream. The calls are therefore ordered with PyTorch's own kernels and with
// the CUDA events kernels/cuda_ext.py times them with. Built by kernels/cuda_ext.py through
// torch.utils.cpp_extension.load, together with coalescing.cu, matmul.cu and rmsnorm.cu.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "launchers.h"

namespace {

void check_input(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
    TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32 (the teaching kernels are fp32 only)");
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (row-major)");
}

void check_launch(cudaError_t err) {
    TORCH_CHECK(err == cudaSuccess, "kernel launch failed: ", cudaGetErrorString(err));
}

cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream(); }

using TransposeLauncher = cudaError_t (*)(const float*, float*, int, int, cudaStream_t);
using MatmulLauncher = cudaError_t (*)(const float*, const float*, float*, int, int, int, cudaStream_t);
using RmsnormLauncher = cudaError_t (*)(const float*, const float*, float*, int, int, float, cudaStream_t);

torch::Tensor run_copy(const torch::Tensor& x, TransposeLauncher launch, bool transpose) {
    check_input(x, "x");
    TORCH_CHECK(x.dim() == 2, "x must be 2-D (rows, cols)");
    const c10::cuda::CUDAGuard guard(x.device());
    const int rows = x.size(0), cols = x.size(1);
    auto out = transpose ? torch::empty({cols, rows}, x.options()) : torch::empty_like(x);
    check_launch(launch(x.data_ptr<float>(), out.data_ptr<float>(), rows, cols, current_stream()));
    return out;
}

torch::Tensor run_matmul(const torch::Tensor& a, const torch::Tensor& b, MatmulLauncher launch) {
    check_input(a, "a");
    check_input(b, "b");
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "need a (M, K) and b (K, N)");
    const c10::cuda::CUDAGuard guard(a.device());
    const int M = a.size(0), K = a.size(1), N = b.size(1);
    auto c = torch::empty({M, N}, a.options());
    check_launch(launch(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), M, N, K, current_stream()));
    return c;
}

torch::Tensor run_rmsnorm(const torch::Tensor& x, const torch::Tensor& w, double eps, RmsnormLauncher launch) {
    check_input(x, "x");
    check_input(w, "w");
    TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "need x (rows, cols) and w (cols,)");
    const c10::cuda::CUDAGuard guard(x.device());
    auto y = torch::empty_like(x);
    check_launch(launch(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1),
                        static_cast<float>(eps), current_stream()));
    return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "Chapter-4 CUDA teaching kernels: coalescing, matmul ladder, fused RMSNorm (float32)";
    m.def("copy_rows", [](const torch::Tensor& x) { return run_copy(x, launch_copy_rows, false); });
    m.def("transpose_naive", [](const torch::Tensor& x) { return run_copy(x, launch_transpose_naive, true); });
    m.def("transpose_tiled", [](const torch::Tensor& x) { return run_copy(x, launch_transpose_tiled, true); });
    m.def("matmul_naive", [](const torch::Tensor& a, const torch::Tensor& b) { return run_matmul(a, b, launch_matmul_naive); });
    m.def("matmul_coalesced", [](const torch::Tensor& a, const torch::Tensor& b) { return run_matmul(a, b, launch_matmul_coalesced); });
    m.def("matmul_tiled", [](const torch::Tensor& a, const torch::Tensor& b) { return run_matmul(a, b, launch_matmul_tiled); });
    m.def("matmul_coarsened", [](const torch::Tensor& a, const torch::Tensor& b) { return run_matmul(a, b, launch_matmul_coarsened); });
    m.def("rmsnorm_thread_per_row", [](const torch::Tensor& x, const torch::Tensor& w, double eps) {
        return run_rmsnorm(x, w, eps, launch_rmsnorm_thread_per_row);
    });
    m.def("rmsnorm_block_per_row", [](const torch::Tensor& x, const torch::Tensor& w, double eps) {
        return run_rmsnorm(x, w, eps, launch_rmsnorm_block_per_row);
    });
}
