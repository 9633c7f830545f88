"""SwiGLU's elementwise core, silu(gate) · up, fused forward and backward in Triton.

What: the activation inside Llama's MLP, down(silu(gate(x)) · up(x)). The three projections are GEMMs
and stay in cuBLAS; this file fuses the elementwise part between them:
    y = silu(g) · u,  silu(g) = g · σ(g)
    dg = dy · u · σ(g) · (1 + g · (1 − σ(g))),   du = dy · silu(g)

Playbook chapter 4, "fused kernels" (§4.0.7) plus recomputation (§2.1). Eager PyTorch runs two kernels
forward (silu, mul), writes silu(g) to HBM and autograd keeps it for backward. The fused kernel keeps
σ(g) in registers and the backward recomputes it from g, which it must read anyway, so the (N, F)
intermediate is never stored. For M = B·T·F elements of b bytes (memory bound, ~10 FLOPs each):

    HBM bytes forward   fused 3·M·b (read g, u; write y)          eager 5·M·b
    HBM bytes backward  fused 5·M·b (read dy, g, u; write dg, du) eager ≈ 9·M·b
    kept for backward   fused g, u (2·M·b)                        eager g, u, silu(g) (3·M·b)

Versions in this file:
    v0  swiglu_reference   eager PyTorch (F.silu(g) * u), the ground truth for the tests
    v1  swiglu             Triton: one flat 1-D grid over all elements, in both directions

    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py -k swiglu   # CPU; GPU: kernels/bench.py
New compared with 01: replaces `silu_mul` as every MLP's (and 07's experts') `act_fn` (`--kernels triton`).
Shape legend: B batch, T sequence, F intermediate size, M = B·T·F elements.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 1024   # elements per program: 4 warps × 32 lanes × 8 elements, so each lane issues wide loads


def swiglu_reference(gate, up):
    """v0: silu(gate) · up. gate, up (..., F) -> (..., F)."""
    return F.silu(gate) * up


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, M, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    # Round silu(g) to the input dtype before the product, as eager does (a no-op in fp32).
    silu = (g * tl.sigmoid(g)).to(G.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, (silu * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, M, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    # exercise K.2: SwiGLU backward kernel
    # hint: y = silu(g)·u (Shazeer 2020): the product rule, silu's derivative σ(g)·(1 + g·(1 − σ(g))),
    #   silu recomputed rather than stored; the forward rounded silu to the input dtype before the product.
    # test: tests/test_kernels.py::test_swiglu
    sig = tl.sigmoid(g)                                   # recomputed: cheaper than storing silu(g)
    silu = g * sig
    # d silu/dg = σ + g·σ·(1-σ) = σ·(1 + g·(1-σ))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * silu.to(G.dtype.element_ty).to(tl.float32)
    # end exercise
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=mask)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()                     # (..., F) each
        y = torch.empty_like(gate)
        M = gate.numel()
        _swiglu_fwd_kernel[(triton.cdiv(M, BLOCK),)](gate, up, y, M, BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        M = gate.numel()
        _swiglu_bwd_kernel[(triton.cdiv(M, BLOCK),)](dy, gate, up, dgate, dup, M, BLOCK=BLOCK, num_warps=4)
        return dgate, dup


def swiglu(gate, up):
    """v1: Triton silu(gate) · up, differentiable in both. gate, up (..., F) of one dtype -> (..., F)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    dtype = torch.promote_types(gate.dtype, up.dtype)
    return SwiGLUFunction.apply(gate.to(dtype), up.to(dtype))
