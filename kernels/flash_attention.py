"""FlashAttention-2 in Triton: the autograd function that runs the forward and backward kernels.

What: O = softmax(Q Kᵀ · scale + mask) V for q (B, nh, T, hd) and k, v (B, nkv, T, hd); query head h
reads key/value head h // (nh/nkv), grouped-query attention's `repeat_interleave` convention.

Playbook chapter 4, FlashAttention (§4.0.8; Dao et al. 2022, Dao 2023). The forward kernel
(flash_attention_forward.py) keeps only O and the per-row LSE; the backward kernels
(flash_attention_backward.py) recompute P block by block from them. Derivation, cost and limits:
kernels/README.md.

Versions in this file:
    v0  attention_reference   eager: materialise S and P, float32 softmax (the model's eager path)
    v1  flash_attention       Triton FlashAttention-2: one forward kernel, three backward kernels

    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py -k flash     # CPU; GPU: kernels/bench.py
New compared with 01: replaces `sdpa_attention` as `Attention.attn_fn` (`--attn triton`, patch.py).
Shape legend: B batch, nh query heads, nkv key/value heads, T sequence, hd head dim.
"""
import math

import torch

from kernels.flash_attention_backward import attention_backward
from kernels.flash_attention_forward import attention_forward


def attention_reference(q, k, v, causal: bool = True, scale: float = None):
    """v0: q (B, nh, T, hd), k/v (B, nkv, T, hd) -> (B, nh, T, hd), with the (T, T) scores materialised."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)                                   # (B, nh, T, hd)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)).float() * scale                       # (B, nh, T, T)
    if causal:
        T = q.shape[2]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1).to(q.dtype) @ v                            # (B, nh, T, hd)


def unit_last_stride(x):
    """x itself when its head dim is contiguous (a transposed (B, T, nh, hd) view is), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, block_m: int, block_n: int):
        q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"   # the latter is ignored for bf16
        o, lse = attention_forward(q, k, v, causal, scale, precision, block_m, block_n)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.precision = causal, scale, precision
        ctx.blocks = (max(block_m, block_n), min(block_m, block_n)) if block_m else None
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, o, lse, unit_last_stride(do.to(q.dtype)), ctx.causal,
                                        ctx.scale, ctx.precision, ctx.blocks)
        return dq, dk, dv, None, None, None, None


def flash_attention(q, k, v, causal: bool = True, scale: float = None, block_m: int = None,
                    block_n: int = None):
    """v1: q (B, nh, T, hd), k/v (B, nkv, T, hd) with nkv | nh -> (B, nh, T, hd). Differentiable in q, k,
    v. block_m, block_n (powers of two ≥ 16, both or neither) fix the tiles instead of autotuning."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape or q.shape[0::2] != k.shape[0::2]:
        raise ValueError(f"flash_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "must be (B, nh, T, hd) and (B, nkv, T, hd) with nkv dividing nh")
    if bool(block_m) != bool(block_n) or (block_m and min(block_m, block_n) < 16):
        raise ValueError(f"flash_attention: block_m {block_m}, block_n {block_n}: give both, each ≥ 16 "
                         "(tl.dot's smallest tile), or neither")
    # Inside autocast run in the autocast dtype, as F.scaled_dot_product_attention would.
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return FlashAttentionFunction.apply(q.to(dtype), k.to(dtype), v.to(dtype), causal, scale, block_m,
                                        block_n)


def causal_flash_attention(q, k, v):
    """The model's `attn_fn(q, k, v)` contract: causal, default scale."""
    return flash_attention(q, k, v, causal=True)
