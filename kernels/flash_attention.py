"""FlashAttention-2 forward and backward in Triton: tiled, online softmax, causal or not, GQA.

What: O = softmax(Q Kᵀ · scale + mask) V for q (B, nh, T, hd) and k, v (B, nkv, T, hd); query head h
reads key/value head h // (nh/nkv), grouped-query attention's `repeat_interleave` convention.

Playbook chapter 4, FlashAttention (§4.0.8; Dao et al. 2022, Dao 2023). One program owns BLOCK_M
queries and streams K/V through on-chip memory in blocks of BLOCK_N keys, never writing S or P to HBM
(the "online softmax", Milakov & Gimelshein 2018):

    for each key block j:   S_j = Q K_jᵀ · scale;   m' = max(m, rowmax(S_j));   P_j = exp(S_j − m')
                            l = l·exp(m − m') + rowsum(P_j);   acc = acc·exp(m − m') + P_j V_j
    O = acc / l,   LSE = m + log l  (the only per-row statistic kept for backward)

The backward recomputes P_j = exp(S_j − LSE) block by block (FlashAttention-2, Algorithm 2): a Δ
preprocess, a dK/dV kernel per key block and a dQ kernel per query block, so no atomics. Extra memory
O(B·nh·T) instead of O(B·nh·T²); forward 4·B·nh·T²·hd FLOPs (causal halves it). Derivation, cost and
limits (hd padded to a power of two ≥ 16): kernels/README.md.

Versions in this file:
    v0  attention_reference   eager: materialise S and P, float32 softmax (the model's eager path)
    v1  flash_attention       Triton FlashAttention-2: one forward, three backward kernels

    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py -k flash     # CPU; GPU: kernels/bench.py
New compared with 01: replaces `sdpa_attention` as `Attention.attn_fn` (`--attn triton`, patch.py).
Shape legend: B batch, nh query heads, nkv key/value heads, T sequence, hd head dim, b bytes per element.
"""
import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634   # exp(x) = exp2(x·log2 e); exp2 is the GPU's native instruction


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


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, qk_scale, T, H, H_KV, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)                          # which block of BLOCK_M queries
    pid_bh = tl.program_id(1)                         # which (batch, query head) = b·H + h
    kv_bh = (pid_bh // H) * H_KV + (pid_bh % H) // (H // H_KV)   # GQA: the group's key/value head
    q_base = Q + pid_bh.to(tl.int64) * T * HEAD_DIM   # int64: B·nh·T·hd can pass 2³¹
    kv_offset = kv_bh.to(tl.int64) * T * HEAD_DIM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query positions (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM                 # padding columns of hd load as 0 and add nothing

    q = tl.load(q_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                mask=(offs_m[:, None] < T) & d_ok, other=0.0)              # (BLOCK_M, BLOCK_D)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)   # running max, in log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                 # running Σ exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)        # running Σ exp2(s - m_i) · v

    # Causal: keys after the block's last query are all masked, so the loop stops there (half the work).
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    else:
        hi = T
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n                                                  # key positions
        kv_ptrs = kv_offset + cols[:, None] * HEAD_DIM + offs_d[None, :]
        kv_mask = (cols[:, None] < T) & d_ok
        k = tl.load(K + kv_ptrs, mask=kv_mask, other=0.0)                       # (BLOCK_N, BLOCK_D)
        v = tl.load(V + kv_ptrs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale       # (BLOCK_M, BLOCK_N), log2
        valid = cols[None, :] < T
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= cols[None, :])
        s = tl.where(valid, s, -float("inf"))
        # exercise K.5: FlashAttention's online softmax
        # hint: per key block, in log2 units: the new running max, alpha = exp2(old max − new max) to rescale
        #   l_i and acc, p = exp2(s − new max), l_i and acc updated with p (tl.dot(p in v's dtype, v)), the
        #   max kept.
        # test: tests/test_kernels.py::test_flash_attention_gqa
        # Online softmax. Key 0 is in the first block and visible to every row, so m_new is finite
        # from the first iteration on, and exp2(-inf - m_new) = 0 for masked entries.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)                  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])               # (BLOCK_M, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
        # end exercise

    acc = acc / l_i[:, None]
    row_ok = offs_m < T
    tl.store(O + pid_bh.to(tl.int64) * T * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok)
    tl.store(LSE + pid_bh.to(tl.int64) * T + offs_m, m_i + tl.log2(l_i), mask=row_ok)   # log2 units


@triton.jit
def _attn_bwd_preprocess(O, DO, DELTA, T, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    # Δ_i = Σ_d dO_id·O_id. It equals Σ_j dP_ij·P_ij (since O = P V and dP = dO Vᵀ), the term that
    # softmax's Jacobian subtracts. One number per row, so dS never needs a full row of P.
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
    ptrs = pid_bh.to(tl.int64) * T * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(O + ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + pid_bh.to(tl.int64) * T + offs_m, tl.sum(o * do, axis=1), mask=offs_m < T)


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sm_scale, qk_scale, T, H, H_KV,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)                          # which block of BLOCK_N keys
    pid_bkv = tl.program_id(1)                        # which (batch, key/value head) = b·H_KV + kv_h
    group = H // H_KV
    kv_offset = pid_bkv.to(tl.int64) * T * HEAD_DIM
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    kv_ptrs = kv_offset + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv_ptrs, mask=(offs_n[:, None] < T) & d_ok, other=0.0)     # (BLOCK_N, BLOCK_D), on chip
    v = tl.load(V + kv_ptrs, mask=(offs_n[:, None] < T) & d_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Causal: queries before this key block's first key cannot see it, so the loop starts there.
    if CAUSAL:
        lo = pid_n * BLOCK_N
    else:
        lo = 0
    for g in range(group):                            # every query head that reads this K/V head (GQA)
        bh = (pid_bkv // H_KV) * H + (pid_bkv % H_KV) * group + g
        q_offset = bh.to(tl.int64) * T * HEAD_DIM
        for start_m in range(lo, T, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_ptrs = q_offset + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
            q_mask = (offs_m[:, None] < T) & d_ok
            q = tl.load(Q + q_ptrs, mask=q_mask, other=0.0)                     # (BLOCK_M, BLOCK_D)
            do = tl.load(DO + q_ptrs, mask=q_mask, other=0.0)
            lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
            delta = tl.load(DELTA + bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
            # Work with the transposes (keys as rows), so the accumulators dK, dV need no transpose.
            s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale   # (BLOCK_N, BLOCK_M)
            p_t = tl.exp2(s_t - lse[None, :])                                   # Pᵀ, recomputed from LSE
            valid = offs_m[None, :] < T
            if CAUSAL:
                valid = valid & (offs_m[None, :] >= offs_n[:, None])
            p_t = tl.where(valid, p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)        # dV += Pᵀ dO
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)           # dPᵀ = V dOᵀ
            ds_t = p_t * (dp_t - delta[None, :])                                # dSᵀ = Pᵀ ∘ (dPᵀ - Δ)
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)         # dK += dSᵀ Q
    out_mask = (offs_n[:, None] < T) & d_ok
    tl.store(DK + kv_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=out_mask)
    tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sm_scale, qk_scale, T, H, H_KV,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    kv_bh = (pid_bh // H) * H_KV + (pid_bh % H) // (H // H_KV)
    kv_offset = kv_bh.to(tl.int64) * T * HEAD_DIM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    q_ptrs = pid_bh.to(tl.int64) * T * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q_mask = (offs_m[:, None] < T) & d_ok
    q = tl.load(Q + q_ptrs, mask=q_mask, other=0.0)                             # (BLOCK_M, BLOCK_D)
    do = tl.load(DO + q_ptrs, mask=q_mask, other=0.0)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    else:
        hi = T
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_ptrs = kv_offset + cols[:, None] * HEAD_DIM + offs_d[None, :]
        kv_mask = (cols[:, None] < T) & d_ok
        k = tl.load(K + kv_ptrs, mask=kv_mask, other=0.0)                       # (BLOCK_N, BLOCK_D)
        v = tl.load(V + kv_ptrs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale       # (BLOCK_M, BLOCK_N)
        p = tl.exp2(s - lse[:, None])
        valid = cols[None, :] < T
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= cols[None, :])
        p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                # dP = dO Vᵀ
        ds = p * (dp - delta[:, None])                                          # dS = P ∘ (dP - Δ)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)               # dQ += dS K
    tl.store(DQ + q_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def _config(head_dim: int, block_m, block_n):
    """Tile sizes and launch options. 64×64 tiles keep dK, dV (2·64·128 fp32) in registers on an
    A100/H100 for hd = 128. Bigger forward tiles are faster but need tuning per GPU."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return dict(BLOCK_D=block_d, BLOCK_M=block_m or 64, BLOCK_N=block_n or 64,
                num_warps=4 if block_d <= 64 else 8, num_stages=2)


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, block_m: int, block_n: int):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        B, H, T, D = q.shape
        H_KV = k.shape[1]
        cfg = _config(D, block_m, block_n)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"   # the latter is ignored for bf16
        o = torch.empty_like(q)                                                  # (B, nh, T, hd)
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)       # (B, nh, T), log2 units
        grid = (triton.cdiv(T, cfg["BLOCK_M"]), B * H)
        _attn_fwd_kernel[grid](q, k, v, o, lse, scale * LOG2E, T, H, H_KV, HEAD_DIM=D, CAUSAL=causal,
                               PRECISION=precision, **cfg)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.cfg, ctx.precision = causal, scale, cfg, precision
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous().to(q.dtype)     # tl.dot needs both operands in one dtype
        B, H, T, D = q.shape
        H_KV = k.shape[1]
        cfg, causal, scale = ctx.cfg, ctx.causal, ctx.scale
        delta = torch.empty_like(lse)                                            # (B, nh, T)
        _attn_bwd_preprocess[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](
            o, do, delta, T, HEAD_DIM=D, BLOCK_D=cfg["BLOCK_D"], BLOCK_M=cfg["BLOCK_M"])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        common = dict(HEAD_DIM=D, CAUSAL=causal, PRECISION=ctx.precision, **cfg)
        _attn_bwd_dkdv_kernel[(triton.cdiv(T, cfg["BLOCK_N"]), B * H_KV)](
            q, k, v, do, lse, delta, dk, dv, scale, scale * LOG2E, T, H, H_KV, **common)
        _attn_bwd_dq_kernel[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](
            q, k, v, do, lse, delta, dq, scale, scale * LOG2E, T, H, H_KV, **common)
        return dq, dk, dv, None, None, None, None


def flash_attention(q, k, v, causal: bool = True, scale: float = None, block_m: int = None,
                    block_n: int = None):
    """v1: q (B, nh, T, hd), k/v (B, nkv, T, hd) with nkv | nh -> (B, nh, T, hd). Differentiable in q, k,
    v."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape or q.shape[0::2] != k.shape[0::2]:
        raise ValueError(f"flash_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "must be (B, nh, T, hd) and (B, nkv, T, hd) with nkv dividing nh")
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
