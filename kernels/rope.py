"""Rotary position embedding (RoPE) in one Triton kernel, Hugging Face Llama convention.

What: out = x·cos + rotate_half(x)·sin, with rotate_half([x1, x2]) = [−x2, x1] for the two halves of the
head dimension; per half, out1 = x1·cos1 − x2·sin1 and out2 = x2·cos2 + x1·sin2. Dimension i is paired
with i + hd/2, not with its neighbour 2i+1 as in the RoPE paper (HF permutes the q/k weights so that both
layouts give the same model; Su et al. 2021, §3.4.2).

Backward: the map is linear, so dx = dy·cos + Rᵀ(dy·sin) with Rᵀ([a, b]) = [b, −a], which with Llama's
cos1 = cos2 and sin1 = sin2 is the same rotation by −θ: one kernel serves both directions, a constexpr
flag flipping the sign of sin (kernels/README.md). cos/sin depend on the positions only.

Playbook chapter 4, "fused kernels" (§4.0.7). Eager runs chunk, neg, cat, two muls and an add: about six
kernels and four (B, nh, T, hd) temporaries. This kernel reads x once, reads the (T, hd) tables and
writes out once: fused 2·B·nh·T·hd·b + 2·T·hd·b' HBM bytes per call against eager's ≈ 10·B·nh·T·hd·b.

Versions in this file:
    v0  rope_reference   eager PyTorch, exactly `apply_rotary` of 01_single_gpu/model.py
    v1  rope             Triton: one program per (batch·head, block of BLOCK_T positions), on the two
                         halves as two (BLOCK_T, hd/2) tiles

    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py -k rope   # CPU; GPU: kernels/bench.py
New compared with 01: replaces `apply_rotary` as `Attention.rope_fn` (`--kernels triton`).
Shape legend: B batch, nh heads (query or key/value), T sequence, hd head dim, b / b' bytes of x / cos.
"""
import torch
import triton
import triton.language as tl


def rotate_half(x):  # (..., hd) -> (..., hd): [x1, x2] -> [-x2, x1]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_reference(x, cos, sin):
    """v0: x (B, nh, T, hd), cos/sin (T, hd) -> (B, nh, T, hd) in promote(x, cos) dtype."""
    return x * cos + rotate_half(x) * sin


@triton.jit
def _rope_kernel(X, COS, SIN, OUT, H, T, HALF, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BACKWARD: tl.constexpr):
    # X and OUT are contiguous (B, H, T, 2·HALF); COS/SIN are contiguous (T, 2·HALF).
    pid_bh = tl.program_id(0)                       # which (batch, head)
    pid_t = tl.program_id(1)                        # which block of positions
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)     # (BLOCK_T,)
    d = tl.arange(0, BLOCK_HALF)                    # (BLOCK_HALF,) index within one half
    mask = (t[:, None] < T) & (d[None, :] < HALF)   # (BLOCK_T, BLOCK_HALF)
    row = t[:, None] * (2 * HALF) + d[None, :]      # offset of the first half inside one (T, hd) slab
    base = pid_bh.to(tl.int64) * T * (2 * HALF)     # int64: B·H·T·hd can pass 2³¹ at long context

    x1 = tl.load(X + base + row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + base + row + HALF, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(COS + row, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(COS + row + HALF, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(SIN + row, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(SIN + row + HALF, mask=mask, other=0.0).to(tl.float32)
    # exercise K.3: RoPE kernel
    # hint: forward turns each pair: out1 = x1·cos1 − x2·sin1, out2 = x2·cos2 + x1·sin2; BACKWARD applies the
    #   transpose of that rotation to dy.
    # test: tests/test_kernels.py::test_rope
    if BACKWARD:    # transpose of the rotation: dx1 = dy1·cos1 + dy2·sin2,  dx2 = dy2·cos2 - dy1·sin1
        out1 = x1 * cos1 + x2 * sin2
        out2 = x2 * cos2 - x1 * sin1
    else:           # out1 = x1·cos1 - x2·sin1,  out2 = x2·cos2 + x1·sin2
        out1 = x1 * cos1 - x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
    # end exercise
    tl.store(OUT + base + row, out1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + base + row + HALF, out2.to(OUT.dtype.element_ty), mask=mask)


def _launch(x, cos, sin, out_dtype, backward: bool):
    B, H, T, hd = x.shape
    x = x.contiguous()      # a (B, T, nh, hd) -> (B, nh, T, hd) transpose arrives strided: one copy
    out = torch.empty((B, H, T, hd), dtype=out_dtype, device=x.device)
    block_half = triton.next_power_of_2(hd // 2)
    block_t = max(1, min(64, 4096 // (2 * block_half)))   # about 4K elements per program
    grid = (B * H, triton.cdiv(T, block_t))
    _rope_kernel[grid](x, cos, sin, out, H, T, hd // 2, BLOCK_T=block_t, BLOCK_HALF=block_half,
                       BACKWARD=backward, num_warps=4)
    return out


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        out = _launch(x, cos, sin, torch.promote_types(x.dtype, cos.dtype), backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy, cos, sin, ctx.x_dtype, backward=True), None, None


def rope(x, cos, sin):
    """v1: Triton RoPE. x (B, nh, T, hd), cos/sin (T, hd) -> (B, nh, T, hd); differentiable in x only."""
    if x.shape[-1] % 2 or cos.shape != (x.shape[2], x.shape[3]) or sin.shape != cos.shape:
        raise ValueError(f"rope: x {tuple(x.shape)} needs an even head dim and cos/sin of shape (T, hd), "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    return RoPEFunction.apply(x, cos.contiguous(), sin.contiguous())


def apply_rotary(q, k, cos, sin):
    """The model's `rope_fn` contract: rotate q (B, nh, T, hd) and k (B, nkv, T, hd) by the same angles."""
    return rope(q, cos, sin), rope(k, cos, sin)
