"""FP8 lab: a linear layer's inputs, weights and gradients in e4m3/e5m2, scaled per tensor or per block.

Playbook §2.1 "Mixed precision" (FP8 pretraining), Micikevicius et al. 2022 (FP8 formats), DeepSeek-V3
§3.3 (fine-grained scaling). Versions, in order:
  1. the formats (`FORMATS`): e4m3 (max 448, 3 mantissa bits) for the forward, e5m2 (max 57344, 2 bits)
     for gradients, which need range more than precision
  2. `quantize`/`dequantize`: s = amax/max_format over the whole tensor, or per tile (DeepSeek-V3:
     1×128 for activations and gradients, 128×128 for weights); q = fp8(x/s); x ≈ q·s. A normal
     number is off by at most 2^-(m+1) of itself (e4m3 1/16, e5m2 1/8); a tile keeps an outlier from
     pushing its neighbours' small values down into the subnormals (absolute error s·2^-(m+1)·2^emin)
  3. `Fp8Linear`: y = Q(x)·Q(W)ᵀ (e4m3), dX = Q(dY)·Q(W), dW = Q(dY)ᵀ·Q(x) (dY e5m2), simulated: the
     FP8 values (torch.float8_* dtypes, storage-only on a CPU) are widened and multiplied in fp32, as a
     tensor core multiplies FP8 inputs exactly and accumulates in fp32; FP8 copies are what is saved
  4. `scaled_mm`: the real FP8 GEMM (torch._scaled_mm, per-tensor scales): on a CUDA device of compute
     capability >= 8.9 (Ada, Hopper; untested in this project, no GPU), or torch's CPU kernel (tested)
  5. the measurement: relative errors against fp32, beside bf16's, for both scalings

    python kernels/fp8.py          # the error table (kernels/README.md shows a run)

New compared with 01's bf16: 1-byte operands, and the scale each one needs.
"""
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Format:
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_normal_exponent: int

    @property
    def unit_roundoff(self) -> float:                 # a normal number's largest relative rounding error
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def subnormal_error(self) -> float:               # the largest absolute rounding error below min normal
        return 2.0 ** (self.min_normal_exponent - self.mantissa_bits - 1)


FORMATS = {"e4m3": Format(torch.float8_e4m3fn, 448.0, 3, -6),
           "e5m2": Format(torch.float8_e5m2, 57344.0, 2, -14)}
BLOCK = 128                                          # DeepSeek-V3's tile edge


# ======================================================================================
# 2. quantise / dequantise: one scale per tensor, or per (rows × cols) tile
# ======================================================================================
def _tiles(x, tile):
    """(R, C) -> (R/r, r, C/c, c) views of its tiles (tile = (r, c)); a whole tensor is one tile."""
    r, c = tile
    rows, cols = x.shape
    if rows % r or cols % c:
        raise ValueError(f"a ({rows}, {cols}) tensor does not split into {r}×{c} tiles")
    return x.reshape(rows // r, r, cols // c, c)


def quantize(x, fmt: str, tile=None):
    """(fp8 values like x, fp32 scales (R/r, 1, C/c, 1)), x ≈ dequantize(q, s); tile None: per tensor."""
    f = FORMATS[fmt]
    x = x.float()
    tile = tile or tuple(x.shape)
    tiles = _tiles(x, tile)                                                     # (R/r, r, C/c, c)
    # exercise K.9: FP8 scaling per tile
    # hint: DeepSeek-V3 §3.3.2 (kernels/README.md, "FP8 lab"): one scale per tile maps the tile's largest
    #   magnitude onto the format's max (an all-zero tile needs a scale too); the values, divided by it,
    #   kept in range and rounded into the FP8 dtype, are the quantised tensor.
    # test: tests/test_fp8.py::test_quantization_error_is_within_the_format_bound
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)                          # (R/r, 1, C/c, 1)
    scale = torch.where(amax > 0, amax / f.max, torch.ones_like(amax))
    q = (tiles / scale).clamp(-f.max, f.max).to(f.dtype)                       # round to nearest even
    # end exercise
    return q.reshape(x.shape), scale


def dequantize(q, scale):
    r, c = q.shape[0] // scale.shape[0], q.shape[1] // scale.shape[2]
    return (_tiles(q.float(), (r, c)) * scale).reshape(q.shape)


def fake_quantize(x, fmt: str, tile=None):
    """x rounded through the format (what the FP8 GEMM sees), in fp32."""
    return dequantize(*quantize(x, fmt, tile))


# ======================================================================================
# 3. a linear layer in FP8 (simulated)
# ======================================================================================
def tiles_for(scaling: str, what: str):
    """DeepSeek-V3's tiles: 1×128 for activations and gradients, 128×128 for weights; None: per tensor."""
    if scaling == "tensor":
        return lambda shape: None
    if what == "weight":
        return lambda shape: (min(BLOCK, shape[0]), min(BLOCK, shape[1]))
    return lambda shape: (1, min(BLOCK, shape[1]))


class Fp8Linear(torch.autograd.Function):
    """y = x Wᵀ with x, W in e4m3 and dY in e5m2; x (N, K), W (M, K) -> y (N, M)."""

    @staticmethod
    def forward(ctx, x, weight, scaling="block"):
        xq, xs = quantize(x, "e4m3", tiles_for(scaling, "activation")(x.shape))
        wq, ws = quantize(weight, "e4m3", tiles_for(scaling, "weight")(weight.shape))
        ctx.save_for_backward(xq, xs, wq, ws)                  # 1 byte per element, not 2 or 4
        ctx.scaling, ctx.dtype = scaling, x.dtype
        return (dequantize(xq, xs) @ dequantize(wq, ws).t()).to(x.dtype)   # (N, K)·(K, M) -> (N, M)

    @staticmethod
    def backward(ctx, grad_out):
        xq, xs, wq, ws = ctx.saved_tensors
        g = fake_quantize(grad_out, "e5m2", tiles_for(ctx.scaling, "gradient")(grad_out.shape))  # (N, M)
        grad_x = g @ dequantize(wq, ws)                       # (N, M)·(M, K) -> (N, K)
        grad_w = g.t() @ dequantize(xq, xs)                   # (M, N)·(N, K) -> (M, K)
        return grad_x.to(ctx.dtype), grad_w.to(ctx.dtype), None


def fp8_linear(x, weight, scaling="block"):
    return Fp8Linear.apply(x, weight, scaling)


# ======================================================================================
# 4. the real FP8 GEMM (CUDA of compute capability >= 8.9, untested here; torch's CPU kernel)
# ======================================================================================
def fp8_gemm_available(device) -> bool:
    """torch._scaled_mm runs here: CUDA of compute capability >= 8.9, or a torch whose CPU build has it."""
    device = torch.device(device)
    if not hasattr(torch, "_scaled_mm"):
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu" and _cpu_kernel()


@functools.cache
def _cpu_kernel() -> bool:
    one, e4m3 = torch.ones((), dtype=torch.float32), torch.ones(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(e4m3, e4m3.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError):   # "not implemented for 'CPU'" in builds without it
        return False


def scaled_mm(x, weight, out_dtype=torch.bfloat16):
    """x (N, K), W (M, K) -> (N, M) on the FP8 tensor cores, e4m3 with one scale per tensor (N, K, M
    multiples of 16). torch._scaled_mm wants its second operand column-major: Wᵀ of a row-major W is."""
    if not fp8_gemm_available(x.device):
        raise RuntimeError(f"torch._scaled_mm does not run on {x.device}: it needs a CUDA GPU of compute "
                           f"capability >= 8.9 (Ada, Hopper) or a CPU build with its kernel; use fp8_linear, "
                           f"the simulation, elsewhere")
    xq, xs = quantize(x, "e4m3")
    wq, ws = quantize(weight, "e4m3")
    out = torch._scaled_mm(xq, wq.t(), scale_a=xs.reshape(()), scale_b=ws.reshape(()),
                           out_dtype=out_dtype)                # (N, K)·(K, M) -> (N, M)
    return out[0] if isinstance(out, tuple) else out          # older torch returned (out, amax)


# ======================================================================================
# 5. the measurement
# ======================================================================================
def relative_error(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def sample(n=256, k=512, m=384, outliers=True, seed=0):
    """x (n, k), W (m, k), dY (n, m); a few large activations per row, as LLM activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    if outliers:
        x[:4, :] *= 1e4        # a few tokens of huge activations ("massive activations", Sun et al. 2024)
    return x, torch.randn(m, k, generator=g) / k ** 0.5, torch.randn(n, m, generator=g) * 1e-3


def errors(x, weight, grad_out):
    """{(precision, scaling): relative errors of (y, y's rows 4: (ordinary tokens), dX, dW)} against fp32."""
    def run(fn):
        xx, ww = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y = fn(xx, ww)
        y.backward(grad_out.to(y.dtype))
        return y.float(), xx.grad.float(), ww.grad.float()
    reference = run(lambda a, b: a @ b.t())
    table = {("bf16", "-"): run(lambda a, b: (a.bfloat16() @ b.bfloat16().t()).float())}
    for scaling in ("tensor", "block"):
        table[("fp8", scaling)] = run(lambda a, b, s=scaling: fp8_linear(a, b, s))
    return {key: (relative_error(out[0], reference[0]), relative_error(out[0][4:], reference[0][4:]),
                  relative_error(out[1], reference[1]), relative_error(out[2], reference[2]))
            for key, out in table.items()}


def main():
    print("relative error (Frobenius) against fp32 of y = x Wᵀ, dX, dW; x (256, 512) whose first 4 rows "
          "are 1e4 times larger")
    print(f"  {'precision':<10}{'scaling':<18}{'y':>10}{'y rows 4:':>11}{'dX':>10}{'dW':>10}")
    for outliers in (True, False):
        for (precision, scaling), errs in errors(*sample(outliers=outliers)).items():
            label = {"tensor": "per tensor", "block": "1×128 / 128×128", "-": "-"}[scaling]
            print(f"  {precision:<10}{label:<18}"
                  + "".join(f"{e:>{width}.2e}" for e, width in zip(errs, (10, 11, 10, 10)))
                  + ("" if outliers else "   (no outliers)"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if fp8_gemm_available(device):
        x, w, _ = sample()
        x, w = x.to(device), w.to(device)
        error = relative_error(scaled_mm(x, w), x @ w.t())
        print(f"torch._scaled_mm on {device} (per tensor, e4m3, bf16 out): y error {error:.2e}")
    else:
        print(f"torch._scaled_mm: does not run on {device} here, not run")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
