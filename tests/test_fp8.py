"""kernels/fp8.py: FP8 quantisation and a simulated FP8 linear layer, against fp32 on the CPU.

The bounds come from the formats, not from a run: rounding to nearest keeps a normal number within
2^-(m+1) of itself (e4m3: m = 3, 1/16; e5m2: m = 2, 1/8) and a subnormal within half its spacing,
2^(emin-m-1), times the tile's scale. A product of two rounded operands is then within the sum of their
errors times the other operand, so |y8 - y| <= |Δx|·|W8|ᵀ + |x|·|ΔW|ᵀ elementwise, plus fp32 rounding
of the sums (1e-5 of |x|·|W|ᵀ). The real FP8 GEMM (torch._scaled_mm) runs on torch's CPU kernel here
and must equal the simulation; on a GPU of compute capability >= 8.9 its tensor cores' shorter
accumulator gets a wider bound (the last test).
"""
import pytest
import torch

from kernels import fp8


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("tile", [None, (1, 128), (128, 128)], ids=["tensor", "1x128", "128x128"])
def test_quantization_error_is_within_the_format_bound(fmt, tile):
    f = fp8.FORMATS[fmt]
    x, _, _ = fp8.sample(n=256, k=256)                  # outlier rows: small values reach the subnormals
    q, scale = fp8.quantize(x, fmt, tile)
    assert q.dtype == f.dtype and q.shape == x.shape
    scales = fp8.dequantize(torch.ones_like(x).to(f.dtype), scale)     # each element's tile scale
    error = (fp8.dequantize(q, scale) - x).abs()
    assert (error <= f.unit_roundoff * x.abs() + f.subnormal_error * scales).all()
    assert (x.abs() / scales <= f.max * (1 + 1e-6)).all()   # in range: the tile's amax is max (± fp32)


def test_fp8_linear_forward_backward_bounds_and_scalings():
    """Forward e4m3 and backward e5m2 within their elementwise bounds; per-block scaling beats per-tensor
    on the ordinary tokens when a few tokens are 1e4 times larger (their small values no longer land in
    the subnormals); every FP8 error is at least bf16's (a coarser mantissa) and below its format's
    unit round-off relative to the output."""
    x, w, g = fp8.sample()
    for scaling in ("tensor", "block"):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8.fp8_linear(xx, ww, scaling)
        y.backward(g)
        tiles = fp8.tiles_for(scaling, "activation")(x.shape), fp8.tiles_for(scaling, "weight")(w.shape)
        x8, w8 = fp8.fake_quantize(x, "e4m3", tiles[0]), fp8.fake_quantize(w, "e4m3", tiles[1])
        slack = 1e-5 * (x.abs() @ w.abs().t())
        bound = (x8 - x).abs() @ w8.abs().t() + x.abs() @ (w8 - w).abs().t() + slack
        assert ((y - x @ w.t()).abs() <= bound).all(), scaling
        g8 = fp8.fake_quantize(g, "e5m2", fp8.tiles_for(scaling, "gradient")(g.shape))
        bound_dx = (g8 - g).abs() @ w8.abs() + g.abs() @ (w8 - w).abs() + 1e-5 * (g.abs() @ w.abs())
        assert ((xx.grad - g @ w).abs() <= bound_dx).all(), scaling
    table = fp8.errors(x, w, g)
    (_, rows_t, _, _), (_, rows_b, _, _) = table[("fp8", "tensor")], table[("fp8", "block")]
    assert rows_b < 0.75 * rows_t                      # measured: 3.7e-2 vs 5.8e-2
    for errs in (table[("fp8", "tensor")], table[("fp8", "block")]):
        assert all(table[("bf16", "-")][i] < e for i, e in enumerate(errs))
        assert errs[0] < fp8.FORMATS["e4m3"].unit_roundoff
        assert max(errs[2:]) < fp8.FORMATS["e5m2"].unit_roundoff


def test_scaled_mm_is_the_simulated_product_and_refuses_where_it_cannot_run(monkeypatch):
    """torch._scaled_mm (torch's CPU kernel here; a GPU's tensor cores elsewhere, untested) multiplies the
    same e4m3 values with the same per-tensor scales as the simulation: with an fp32 output they differ
    only by the order of the fp32 sums; with bf16 output by one bf16 rounding (2^-8). This checks the
    call: Wᵀ column-major, 0-d fp32 scales, the fp8 dtype. A device it cannot run on gets the error."""
    x, w, _ = fp8.sample(n=32, k=128, m=64)
    assert fp8.fp8_gemm_available("cpu")
    xq, xs = fp8.quantize(x, "e4m3")
    wq, ws = fp8.quantize(w, "e4m3")
    simulated = fp8.dequantize(xq, xs) @ fp8.dequantize(wq, ws).t()                  # (32, 64), fp32
    scale = (fp8.dequantize(xq, xs).abs() @ fp8.dequantize(wq, ws).abs().t())       # |x8|·|W8|ᵀ
    assert ((fp8.scaled_mm(x, w, out_dtype=torch.float32) - simulated).abs() <= 1e-5 * scale).all()
    assert ((fp8.scaled_mm(x, w) - simulated).abs() <= 2.0 ** -8 * simulated.abs() + 1e-5 * scale).all()
    monkeypatch.setattr(fp8, "_cpu_kernel", lambda: False)                        # a build without it
    with pytest.raises(RuntimeError, match="compute capability >= 8.9"):
        fp8.scaled_mm(x, w)


@pytest.mark.skipif(not fp8.fp8_gemm_available("cuda"),
                    reason="needs a CUDA GPU of compute capability >= 8.9")
def test_scaled_mm_on_gpu_tensor_cores():
    """The same check on an FP8 GPU's tensor cores (Hopper, Ada) at a Llama-sized product. They do not sum
    in fp32: their accumulator keeps about 14 bits (DeepSeek-V3 §3.3.2), and cuBLAS promotes its partial
    sums to fp32 every few K-blocks (use_fast_accum=False, the default). So the bound is 2^-11 of
    |x8|·|W8|ᵀ, not fp32's 1e-5: measured on an H200, the largest error was 2.6e-4 of it at K = 128 to
    8192 (2.0e-5 at this K), and 5e-4 with use_fast_accum=True, which never promotes (kernels/README.md)."""
    x, w, _ = fp8.sample(n=512, k=2048, m=1024)
    x, w = x.cuda(), w.cuda()
    xq, xs = fp8.quantize(x, "e4m3")
    wq, ws = fp8.quantize(w, "e4m3")
    x8, w8 = fp8.dequantize(xq, xs).double(), fp8.dequantize(wq, ws).double()
    exact, scale = x8 @ w8.t(), x8.abs() @ w8.abs().t()                               # (512, 1024), float64
    accumulator = 2.0 ** -11 * scale
    assert ((fp8.scaled_mm(x, w, out_dtype=torch.float32).double() - exact).abs() <= accumulator).all()
    assert ((fp8.scaled_mm(x, w).double() - exact).abs() <= 2.0 ** -8 * exact.abs() + accumulator).all()
