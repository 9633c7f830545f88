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
    v0  rope_reference   eager PyTorch, exactly `apply_rotary` of 01_single_gpu/rope.py
    v1  rope             Triton: one program per (batch·head, block of BLOCK_T positions), on the two
                         halves as two (BLOCK_T, hd/2) tiles; x read through its strides (no copy);
                         apply_rotary rotates q's and k's heads in one launch (one grid over both)

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
def _rotate(X, OUT, COS, SIN, stride_xt, stride_ot, T, HALF, BLOCK_T: tl.constexpr,
            BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr):
    # One (BLOCK_T, hd) tile of one head: X and OUT point at the head's (T, hd) slab, rows stride_*t apart;
    # COS/SIN are contiguous (T, 2·HALF).
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)     # (BLOCK_T,) positions
    d = tl.arange(0, BLOCK_HALF)                    # (BLOCK_HALF,) index within one half
    mask = (t[:, None] < T) & (d[None, :] < HALF)   # (BLOCK_T, BLOCK_HALF)
    x_row = t[:, None] * stride_xt + d[None, :]     # the first half of each row of x
    o_row = t[:, None] * stride_ot + d[None, :]
    row = t[:, None] * (2 * HALF) + d[None, :]      # the same in the tables

    x1 = tl.load(X + x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(COS + row, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(COS + row + HALF, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(SIN + row, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(SIN + row + HALF, mask=mask, other=0.0).to(tl.float32)
    # exercise K.3: RoPE kernel
    # hint: kernels/README.md, "RoPE backward": the forward turns each pair (x_i, x_{i+hd/2}) by its angle
    #   (01's apply_rotary, with rotate_half); the map is linear, so BACKWARD applies its transpose to dy.
    # test: tests/test_kernels.py::test_rope
    if BACKWARD:    # transpose of the rotation: dx1 = dy1·cos1 + dy2·sin2,  dx2 = dy2·cos2 - dy1·sin1
        out1 = x1 * cos1 + x2 * sin2
        out2 = x2 * cos2 - x1 * sin1
    else:           # out1 = x1·cos1 - x2·sin1,  out2 = x2·cos2 + x1·sin2
        out1 = x1 * cos1 - x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
    # end exercise
    tl.store(OUT + o_row, out1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + o_row + HALF, out2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(XQ, XK, OQ, OK, COS, SIN, H_Q, H_K, T, HALF, stride_qb, stride_qh, stride_qt,
                 stride_kb, stride_kh, stride_kt, stride_oqb, stride_oqh, stride_oqt,
                 stride_okb, stride_okh, stride_okt, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BACKWARD: tl.constexpr):
    # Axis 0 runs over B·(H_Q + H_K): each batch's q heads, then its k heads, so one launch rotates both.
    pid = tl.program_id(0)
    b = (pid // (H_Q + H_K)).to(tl.int64)          # int64: b·stride can pass 2³¹ at long context
    h = (pid % (H_Q + H_K)).to(tl.int64)
    if h < H_Q:
        _rotate(XQ + b * stride_qb + h * stride_qh, OQ + b * stride_oqb + h * stride_oqh, COS, SIN, stride_qt,
                stride_oqt, T, HALF, BLOCK_T, BLOCK_HALF, BACKWARD)
    else:
        _rotate(XK + b * stride_kb + (h - H_Q) * stride_kh, OK + b * stride_okb + (h - H_Q) * stride_okh, COS,
                SIN, stride_kt, stride_okt, T, HALF, BLOCK_T, BLOCK_HALF, BACKWARD)


def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _launch(q, k, cos, sin, dtypes, backward: bool):
    """Rotate q (B, nh, T, hd) and k (B, nkv, T, hd) or None, read through their strides, in one launch."""
    B, H_Q, T, hd = q.shape
    # Only hd must be contiguous: a (B, T, nh, hd) -> (B, nh, T, hd) transpose is read in place.
    q, k = (x if x is None or x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    out_q = torch.empty((B, H_Q, T, hd), dtype=dtypes[0], device=q.device)
    out_k = None if k is None else torch.empty(k.shape, dtype=dtypes[1], device=k.device)
    H_K = 0 if k is None else k.shape[1]
    k_or_q, out_k_or_q = (q, out_q) if k is None else (k, out_k)     # H_K = 0: the k branch never runs
    block_half = triton.next_power_of_2(hd // 2)
    block_t = max(1, min(64, 4096 // (2 * block_half)))   # about 4K elements per program
    grid = (B * (H_Q + H_K), triton.cdiv(T, block_t))
    _rope_kernel[grid](q, k_or_q, out_q, out_k_or_q, cos, sin, H_Q, H_K, T, hd // 2, *_strides(q),
                       *_strides(k_or_q), *_strides(out_q), *_strides(out_k_or_q), BLOCK_T=block_t,
                       BLOCK_HALF=block_half, BACKWARD=backward, num_warps=4)
    return out_q, out_k


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        dtypes = [torch.promote_types(x.dtype, cos.dtype) if x is not None else None for x in (q, k)]
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = (q.dtype, None if k is None else k.dtype)
        return _launch(q, k, cos, sin, dtypes, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors     # dk is None only when k was (autograd fills unused grads with 0)
        dq, dk = _launch(dq, dk, cos, sin, ctx.dtypes, backward=True)
        return dq, dk, None, None


def _check(x, cos, sin):
    if x.shape[-1] % 2 or cos.shape != (x.shape[2], x.shape[3]) or sin.shape != cos.shape:
        raise ValueError(f"rope: x {tuple(x.shape)} needs an even head dim and cos/sin of shape (T, hd), "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")


def rope(x, cos, sin):
    """v1: Triton RoPE. x (B, nh, T, hd), cos/sin (T, hd) -> (B, nh, T, hd); differentiable in x only."""
    _check(x, cos, sin)
    return RoPEFunction.apply(x, None, cos.contiguous(), sin.contiguous())[0]


def apply_rotary(q, k, cos, sin):
    """The model's `rope_fn` contract: rotate q (B, nh, T, hd) and k (B, nkv, T, hd) by the same angles,
    both in one launch (forward and backward)."""
    _check(q, cos, sin)
    _check(k, cos, sin)
    return RoPEFunction.apply(q, k, cos.contiguous(), sin.contiguous())
