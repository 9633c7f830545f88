#!/usr/bin/env bash
# Compile every CUDA teaching kernel for Ampere (sm_80, A100) and Hopper (sm_90, H100) without a GPU.
#
#     bash kernels/cuda/check_compile.sh                  # the .cu files: nvcc -c, about 3 s each
#     bash kernels/cuda/check_compile.sh --with-bindings  # also type-check bindings.cpp against torch (~30 s)
#
# The .cu files are plain CUDA (no torch headers), so `nvcc -c` is a complete compile of the kernels,
# warnings treated as errors. bindings.cpp needs torch's CUDA headers, which a CPU-only torch wheel
# lacks (c10/cuda/impl/cuda_cmake_macros.h is generated at build time). --with-bindings therefore
# type-checks it with g++ -fsyntax-only against two stub headers that declare just the two CUDA
# helpers it uses (the current stream, the device guard). Everything else is checked against the
# real torch/extension.h. tests/test_kernels_cuda_compile.py runs the first form. The real build
# and run is `python kernels/cuda_ext.py` on a GPU.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

command -v nvcc >/dev/null || { echo "nvcc not found: install the CUDA toolkit to compile the kernels"; exit 2; }
echo "$(nvcc --version | tail -n 2 | head -n 1)"
# One nvcc call per file builds both architectures' machine code: the host side is compiled once (~30%
# less time than a call per architecture). A device-code error names the architecture it came from.
for cu in "$here"/*.cu; do
    nvcc -c -std=c++17 -O3 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
        --Werror all-warnings -I"$here" "$cu" -o "$out/$(basename "$cu" .cu).o"
    for arch in 80 90; do
        echo "ok  $(basename "$cu")  sm_$arch"
    done
done

if [[ "${1:-}" == "--with-bindings" ]]; then
    mkdir -p "$out/stub/ATen/cuda" "$out/stub/c10/cuda"
    cat > "$out/stub/ATen/cuda/CUDAContext.h" <<'EOF'
#pragma once
#include <cuda_runtime.h>
namespace at::cuda {
struct StreamStub { operator cudaStream_t() const { return nullptr; } };
inline StreamStub getCurrentCUDAStream() { return {}; }
}
EOF
    cat > "$out/stub/c10/cuda/CUDAGuard.h" <<'EOF'
#pragma once
#include <c10/core/Device.h>
namespace c10::cuda { struct CUDAGuard { explicit CUDAGuard(c10::Device) {} }; }
EOF
    cuda_include="${CUDA_HOME:-/usr/local/cuda}/include"   # cuda_runtime.h, for cudaStream_t
    mapfile -t torch_includes < <(python -c "from torch.utils.cpp_extension import include_paths; print('\n'.join(include_paths()))")
    g++ -std=c++20 -fsyntax-only -w -DTORCH_EXTENSION_NAME=chapter4_kernels -I"$out/stub" "${torch_includes[@]/#/-I}" \
        -I"$cuda_include" -I"$here" $(python3-config --includes) "$here/bindings.cpp"
    echo "ok  bindings.cpp  (g++ -fsyntax-only -std=c++20 as torch's cpp_extension uses, stub CUDA helpers)"
fi
