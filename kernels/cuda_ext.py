"""Build the CUDA teaching kernels of kernels/cuda/ and check each against PyTorch (needs a GPU).

Playbook chapter 4 (§4.0.3-4.0.7) and App. 5.1.9 "custom CUDA kernels from Python":
torch.utils.cpp_extension.load compiles bindings.cpp + coalescing.cu + matmul.cu + rmsnorm.cu with
nvcc for the visible GPU, and imports the result as a Python module. Every kernel is then compared
with PyTorch on an awkward shape (no dimension a multiple of the tile). Each is timed on a large
shape with CUDA events (10 warm-up calls, then the mean of the timed calls; App. 5.1.8: `time.time()`
would only measure the launch). The achieved bandwidth or FLOP rate is printed next to PyTorch's.

    python kernels/cuda_ext.py              # first build ~1 min, cached in ~/.cache/torch_extensions
    python kernels/cuda_ext.py --verbose    # show the nvcc / c++ command lines

What to expect, qualitatively: copy ≈ PyTorch's copy ≈ the HBM bandwidth. The naive transpose is
several times slower, and the tiled one is close to the copy. The matmul ladder climbs from naive to
coarsened and stays below cuBLAS. The block-per-row RMSNorm is far ahead of thread-per-row. No
figures are recorded here: run it and look. Without a GPU, `bash kernels/cuda/check_compile.sh`
still compiles every kernel.
"""
import argparse
import sys
from pathlib import Path

import torch

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
SOURCES = ["bindings.cpp", "coalescing.cu", "matmul.cu", "rmsnorm.cu"]


def build(verbose: bool = False):
    """Compile and import the extension (module `chapter4_kernels`)."""
    if not torch.cuda.is_available():
        raise RuntimeError("kernels/cuda_ext.py needs a CUDA GPU; none is visible. "
                           "`bash kernels/cuda/check_compile.sh` compiles the kernels without one.")
    from torch.utils.cpp_extension import load
    return load(name="chapter4_kernels", sources=[str(CUDA_DIR / s) for s in SOURCES],
                extra_include_paths=[str(CUDA_DIR)], extra_cuda_cflags=["-O3", "-lineinfo"], verbose=verbose)


def time_ms(fn, *args, warmup: int = 10, iters: int = 20) -> float:
    for _ in range(warmup):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def rmsnorm_torch(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def cases(ext):
    """(name, ours, torch's, inputs(small: bool), tolerance, (unit, amount of work per call))."""
    def matrix(small):          # (rows, cols)
        return ((torch.randn(1000, 777, device="cuda"),) if small
                else (torch.randn(8192, 8192, device="cuda"),))

    def matmul_inputs(small):   # a (M, K), b (K, N)
        m, k, n = (300, 257, 199) if small else (2048, 2048, 2048)
        return torch.randn(m, k, device="cuda"), torch.randn(k, n, device="cuda")

    def rms_inputs(small):      # x (rows, cols), w (cols,), eps
        rows, cols = (333, 1000) if small else (16384, 4096)
        return torch.randn(rows, cols, device="cuda"), torch.rand(cols, device="cuda") + 0.5, 1e-5

    copy_bytes = lambda x: ("GB/s", 2 * x.numel() * 4)                           # noqa: E731
    mm_flops = lambda a, b: ("TFLOP/s", 2 * a.shape[0] * a.shape[1] * b.shape[1])  # noqa: E731
    rms_bytes = lambda x, w, eps: ("GB/s", 2 * x.numel() * 4 + w.numel() * 4)     # noqa: E731
    return [
        ("copy_rows", ext.copy_rows, torch.clone, matrix, 0.0, copy_bytes),
        ("transpose_naive", ext.transpose_naive, lambda x: x.t().contiguous(), matrix, 0.0, copy_bytes),
        ("transpose_tiled", ext.transpose_tiled, lambda x: x.t().contiguous(), matrix, 0.0, copy_bytes),
        ("matmul_naive", ext.matmul_naive, torch.matmul, matmul_inputs, 1e-4, mm_flops),
        ("matmul_coalesced", ext.matmul_coalesced, torch.matmul, matmul_inputs, 1e-4, mm_flops),
        ("matmul_tiled", ext.matmul_tiled, torch.matmul, matmul_inputs, 1e-4, mm_flops),
        ("matmul_coarsened", ext.matmul_coarsened, torch.matmul, matmul_inputs, 1e-4, mm_flops),
        ("rmsnorm_thread_per_row", ext.rmsnorm_thread_per_row, rmsnorm_torch, rms_inputs, 1e-5, rms_bytes),
        ("rmsnorm_block_per_row", ext.rmsnorm_block_per_row, rmsnorm_torch, rms_inputs, 1e-5, rms_bytes),
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--verbose", action="store_true", help="print the compiler command lines")
    args = p.parse_args(argv)
    try:
        ext = build(args.verbose)
    except RuntimeError as e:
        sys.exit(str(e))
    torch.backends.cuda.matmul.allow_tf32 = False   # compare with true float32 cuBLAS: our kernels are fp32
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  CUDA {torch.version.cuda}")
    print(f"{'kernel':24s} {'max |err|':>10s} {'ours ms':>9s} {'torch ms':>9s} {'ours':>14s} {'torch':>14s}")
    failed = []
    for name, ours, ref, make_inputs, tol, work in cases(ext):
        small = make_inputs(True)
        expected = ref(*small)
        err = (ours(*small) - expected).abs().max().item()
        if err > tol * max(1.0, expected.abs().max().item()):
            failed.append(name)
        big = make_inputs(False)
        t_ours, t_ref = time_ms(ours, *big), time_ms(ref, *big)
        unit, amount = work(*big)
        scale = 1e-9 if unit == "GB/s" else 1e-12
        rate = lambda ms: f"{amount * scale / (ms * 1e-3):9.1f} {unit}"  # noqa: E731
        print(f"{name:24s} {err:10.2e} {t_ours:9.3f} {t_ref:9.3f} {rate(t_ours):>14s} {rate(t_ref):>14s}")
    if failed:
        sys.exit(f"mismatch against PyTorch: {', '.join(failed)}")
    print("all kernels match PyTorch")


if __name__ == "__main__":
    main()
