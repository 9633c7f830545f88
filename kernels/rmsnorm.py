"""RMSNorm as one fused Triton kernel per direction.

What: y = x · rsqrt(mean(x²) + eps) · w over the last dimension, computed as Hugging Face's
`LlamaRMSNorm` does (in float32, cast back to x's dtype, then times the weight), so the forward matches
`01_single_gpu/model.py` bit for bit.

Playbook chapter 4, "fused kernels" (§4.0.7): eager PyTorch runs this as about six kernels (pow, mean,
add+rsqrt, mul, cast, mul), each reading a full (N, C) tensor from HBM and writing one back. The fused
kernel reads x and w once and writes y once; the row statistic stays in registers. It is memory bound
(≈ 4·N·C FLOPs forward, 10·N·C backward), so time ≈ bytes / HBM bandwidth:

    HBM bytes forward   fused 2·N·C·b + C·b + 4·N   (read x, write y, read w, save rstd); eager ≈ 6 passes
    HBM bytes backward  fused 3·N·C·b + P·C·4       (read x and dy, write dx, P partial dw rows)

Versions in this file:
    v0  rmsnorm_reference   eager PyTorch, the ground truth the tests compare against
    v1  rmsnorm             Triton. Forward: one program per row. Backward: one program per group of
                            rows, each accumulating a partial dw in registers; torch sums the P partial
                            rows at the end, so no atomics are needed

    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py -k rmsnorm   # CPU; GPU: kernels/bench.py
New compared with 01: replaces the model's `RMSNorm` modules, keeping their weights (`--kernels triton`).
Shape legend: N rows (= B·T), C hidden size, P backward programs, b bytes per element.
"""
import torch
import triton
import triton.language as tl


def rmsnorm_reference(x, weight, eps: float):
    """v0: the model's RMSNorm. x (..., C), weight (C,) -> (..., C) in promote(x, weight) dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@triton.jit
def _rmsnorm_fwd_kernel(X, W, Y, RSTD, C, eps, BLOCK_C: tl.constexpr):
    # One program normalises one row. BLOCK_C is C rounded up to a power of two; the mask hides the tail.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    # exercise K.1: RMSNorm forward kernel
    # hint: Zhang & Sennrich 2019 (01's RMSNorm, v0 above): y = x / RMS(x) · w over one row, summed in
    #   float32; a masked load covers C below BLOCK_C; the backward reads this row's 1/RMS, so store it.
    # test: tests/test_kernels.py::test_rmsnorm
    x = tl.load(X + row * C + cols, mask=mask, other=0.0).to(tl.float32)     # (BLOCK_C,)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / C + eps)       # padded columns are 0 and add nothing
    # Round the normalised row to x's dtype before the weight multiply, as HF does (a no-op in fp32).
    x_hat = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * C + cols, (x_hat * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)                             # 4 bytes per row, so backward skips the sum
    # end exercise


@triton.jit
def _rmsnorm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, N, C, rows_per_program, BLOCK_C: tl.constexpr):
    # With x̂ = x·r, r = (mean(x²)+eps)^(-1/2) and g = dy·w:
    #   ∂r/∂x_i = -r³·x_i/C   =>   dx = r·(g - x̂·mean(g·x̂))     and     dw = Σ_rows dy·x̂
    # dw is a reduction over rows. Each program keeps its own partial sum in registers, and the
    # wrapper adds the P partial rows afterwards. That is cheaper than one atomic add per row.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in range(rows_per_program):
        row = pid * rows_per_program + i
        m = mask & (row < N)                               # the last program may run past row N-1
        offs = row.to(tl.int64) * C + cols
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=row < N, other=0.0)
        x_hat = x * rstd
        g = dy * w
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / C))
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m)
        dw += dy * x_hat.to(X.dtype.element_ty).to(tl.float32)   # the rounded x̂ the forward multiplied w by
    tl.store(DW_PARTIAL + pid * C + cols, dw, mask=mask)


def _num_warps(block_c: int) -> int:
    # One warp handles 32 lanes × a few elements. Wider rows get more warps, up to 8 (Triton's layer-norm
    # tutorial).
    return min(max(block_c // 256, 1), 8)


def _num_programs(x) -> int:
    # Enough programs to fill the GPU a few times over. Fewer programs would mean fewer partial dw rows
    # to sum, but also less parallelism.
    if x.is_cuda:
        return 4 * torch.cuda.get_device_properties(x.device).multi_processor_count
    return 8


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()                             # (N, C)
        N, C = x2.shape
        y = torch.empty((N, C), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(N, dtype=torch.float32, device=x.device)            # (N,)
        block_c = triton.next_power_of_2(C)
        _rmsnorm_fwd_kernel[(N,)](x2, weight, y, rstd, C, eps, BLOCK_C=block_c, num_warps=_num_warps(block_c))
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        N, C = x2.shape
        dy2 = dy.reshape(N, C).contiguous()                                    # (N, C)
        dx = torch.empty_like(x2)
        rows_per_program = triton.cdiv(N, min(N, _num_programs(x2)))
        programs = triton.cdiv(N, rows_per_program)
        dw_partial = torch.empty((programs, C), dtype=torch.float32, device=x2.device)   # (P, C)
        block_c = triton.next_power_of_2(C)
        _rmsnorm_bwd_kernel[(programs,)](dy2, x2, weight, rstd, dx, dw_partial, N, C, rows_per_program,
                                         BLOCK_C=block_c, num_warps=_num_warps(block_c))
        dw = dw_partial.sum(0).to(weight.dtype)                                # (C,)
        return dx.view(dy.shape), dw, None


def rmsnorm(x, weight, eps: float = 1e-5):
    """v1: Triton RMSNorm. x (..., C), weight (C,) -> (..., C), differentiable in x and weight."""
    return RMSNormFunction.apply(x, weight.contiguous(), eps)
