"""FlashAttention-2 backward in Triton (Algorithm 2 of Dao 2023), tiled as Triton's tutorial 06.

The forward (flash_attention_forward.py) kept only O and LSE. This file recomputes P block by block from
them, with Δ = rowsum(dO ∘ O) = rowsum(dP ∘ P):

    dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − Δ),   dQ = dS K · scale,   dK = dSᵀ Q · scale

Three kernels, each output tile with exactly one owner program, so no atomics:
    _attn_bwd_preprocess   Δ for every row (one pass over O and dO)
    _attn_bwd_dkdv_kernel  one program owns BLOCK_N keys (128) and streams BLOCK_M queries (32) past them,
                           over the nh/nkv query heads of its group (which sums the GQA gradient)
    _attn_bwd_dq_kernel    one program owns BLOCK_M queries (128) and streams BLOCK_N keys (32)
Causal tiles on the diagonal are masked and streamed in half-size sub-tiles as in the tutorial; every
other tile runs without a mask. Scores stay in log2 units: the resident K (dK/dV) or Q (dQ) carries
scale·log2 e, so P = exp2(S − LSE). Cost and derivation: kernels/README.md.

    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py -k flash     # CPU; GPU: kernels/bench.py
Shape legend: B batch, nh query heads, nkv key/value heads, T sequence, hd head dim.
"""
import torch
import triton
import triton.language as tl

from kernels.flash_attention_forward import LOG2E, load_tile, strides, tile_class


@triton.jit
def _attn_bwd_preprocess(O, DO, DELTA, T, H, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh,
                         stride_dot, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    # Δ_i = Σ_d dO_id·O_id. It equals Σ_j dP_ij·P_ij (since O = P V and dP = dO Vᵀ), the term that
    # softmax's Jacobian subtracts. One number per row, so dS never needs a full row of P.
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = load_tile(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :], offs_m,
                  offs_d, T, HEAD_DIM, BLOCK_D, True).to(tl.float32)
    do = load_tile(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                   offs_m, offs_d, T, HEAD_DIM, BLOCK_D, True).to(tl.float32)
    tl.store(DELTA + pid_bh.to(tl.int64) * T + offs_m, tl.sum(o * do, axis=1), mask=offs_m < T)


@triton.jit
def _dkdv_inner(dk, dv, k_scaled, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, offs_n,
                offs_d, lo, hi, T, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                CAUSAL: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    # Query blocks [lo, hi) past the resident keys. Work with the transposes (keys as rows), so the
    # accumulators dK, dV need no transpose.
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], offs_m, offs_d, T, HEAD_DIM,
                      BLOCK_D, MASKED)                                            # (BLOCK_M, BLOCK_D)
        do = load_tile(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], offs_m, offs_d, T, HEAD_DIM,
                       BLOCK_D, MASKED)
        if MASKED:
            lse = tl.load(lse_base + offs_m, mask=offs_m < T, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=offs_m < T, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        s_t = tl.dot(k_scaled, tl.trans(q), input_precision=PRECISION)          # (BLOCK_N, BLOCK_M), log2
        p_t = tl.exp2(s_t - lse[None, :])                                       # Pᵀ, recomputed from LSE
        if MASKED:
            valid = offs_m[None, :] < T
            if CAUSAL:
                valid = valid & (offs_m[None, :] >= offs_n[:, None])
            p_t = tl.where(valid, p_t, 0.0)
        # exercise K.7: FlashAttention's backward
        # hint: Dao 2023 Algorithm 2 (kernels/README.md, FlashAttention-2: dV, dP, dS, dK, dQ and Δ): with
        #   P recomputed above, each tile adds its share to the resident keys' dV and dK (kept as transposes
        #   here, keys as rows; the scale is applied at the store) and to the resident queries' dQ; the
        #   products take their operands in the inputs' dtype.
        # test: tests/test_kernels.py::test_flash_attention_gqa
        # level: 2
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)            # dV += Pᵀ dO
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)               # dPᵀ = V dOᵀ
        ds_t = p_t * (dp_t - delta[None, :])                                    # dSᵀ = Pᵀ ∘ (dPᵀ - Δ)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)             # dK += dSᵀ Q
        # end exercise
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sm_scale, qk_scale, T, H, H_KV,
                          stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                          stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                          stride_dkb, stride_dkh, stride_dkt, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M_DIAG: tl.constexpr,
                          CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)                          # which block of BLOCK_N keys
    pid_bkv = tl.program_id(1)                        # which (batch, key/value head) = b·H_KV + kv_h
    b, kv_h = (pid_bkv // H_KV).to(tl.int64), (pid_bkv % H_KV).to(tl.int64)
    group = H // H_KV
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = load_tile(K + b * stride_kb + kv_h * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :],
                  offs_n, offs_d, T, HEAD_DIM, BLOCK_D, True)                    # (BLOCK_N, BLOCK_D), on chip
    v = load_tile(V + b * stride_vb + kv_h * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :],
                  offs_n, offs_d, T, HEAD_DIM, BLOCK_D, True)
    # scale·log2 e folded in once (in fp32, then back), so Sᵀ comes out in log2 units
    k_scaled = (k.to(tl.float32) * qk_scale).to(k.dtype)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Causal: queries before n0 cannot see these keys; queries in [n0, n0 + BLOCK_N) are the diagonal
    # (masked, in BLOCK_M_DIAG sub-tiles); later ones see every key (no mask). Full: no diagonal.
    # full_hi: the end of the whole query blocks; a ragged one after it is masked.
    if CAUSAL:
        diag_lo = n0
        diag_hi = tl.minimum(n0 + BLOCK_N, T)
        lo = n0 + BLOCK_N
        full_hi = lo + tl.maximum(T - lo, 0) // BLOCK_M * BLOCK_M
    else:
        diag_lo = 0
        diag_hi = 0
        lo = 0
        full_hi = T // BLOCK_M * BLOCK_M
    for g in range(group):                            # every query head that reads this K/V head (GQA)
        h = (kv_h * group + g).to(tl.int64)
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        lse_row = LSE + (b * H + h) * T               # LSE and Δ are contiguous (B, nh, T)
        delta_row = DELTA + (b * H + h) * T
        dk, dv = _dkdv_inner(dk, dv, k_scaled, v, q_base, do_base, lse_row, delta_row, stride_qt,
                             stride_dot, offs_n, offs_d, diag_lo, diag_hi, T, HEAD_DIM, BLOCK_D,
                             BLOCK_M_DIAG, CAUSAL, True, PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k_scaled, v, q_base, do_base, lse_row, delta_row, stride_qt,
                             stride_dot, offs_n, offs_d, lo, full_hi, T, HEAD_DIM, BLOCK_D, BLOCK_M,
                             CAUSAL, False, PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k_scaled, v, q_base, do_base, lse_row, delta_row, stride_qt,
                             stride_dot, offs_n, offs_d, full_hi, T, T, HEAD_DIM, BLOCK_D, BLOCK_M,
                             CAUSAL, True, PRECISION)
    out_mask = (offs_n[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
    out = b * stride_dkb + kv_h * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=out_mask)   # dV, dK share a layout
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit
def _dq_inner(dq, q_scaled, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, hi, T,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              MASKED: tl.constexpr, PRECISION: tl.constexpr):
    # Key blocks [lo, hi) past the resident queries.
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_base + cols[:, None] * stride_kt + offs_d[None, :], cols, offs_d, T, HEAD_DIM,
                      BLOCK_D, MASKED)                                           # (BLOCK_N, BLOCK_D)
        v = load_tile(v_base + cols[:, None] * stride_vt + offs_d[None, :], cols, offs_d, T, HEAD_DIM,
                      BLOCK_D, MASKED)
        s = tl.dot(q_scaled, tl.trans(k), input_precision=PRECISION)            # (BLOCK_M, BLOCK_N), log2
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            valid = cols[None, :] < T
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= cols[None, :])
            p = tl.where(valid, p, 0.0)
        # exercise K.7
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                # dP = dO Vᵀ
        ds = p * (dp - delta[:, None])                                          # dS = P ∘ (dP - Δ)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)               # dQ += dS K
        # end exercise
    return dq


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sm_scale, qk_scale, T, H, H_KV,
                        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                        stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                        stride_dqb, stride_dqh, stride_dqt, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N_DIAG: tl.constexpr,
                        CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = (pid_bh // H).to(tl.int64), pid_bh % H
    kv_h = (h // (H // H_KV)).to(tl.int64)
    h = h.to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_tile(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :], offs_m,
                  offs_d, T, HEAD_DIM, BLOCK_D, True)                            # (BLOCK_M, BLOCK_D)
    do = load_tile(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                   offs_m, offs_d, T, HEAD_DIM, BLOCK_D, True)
    q_scaled = (q.to(tl.float32) * qk_scale).to(q.dtype)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh

    # Causal: keys before m0 are visible to every row (no mask); keys [m0, m0 + BLOCK_M) are the
    # diagonal, masked in BLOCK_N_DIAG sub-tiles. Full: whole key blocks, then a masked ragged one.
    if CAUSAL:
        dq = _dq_inner(dq, q_scaled, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
                       0, m0, T, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, False, PRECISION)
        dq = _dq_inner(dq, q_scaled, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
                       m0, tl.minimum(m0 + BLOCK_M, T), T, HEAD_DIM, BLOCK_D, BLOCK_N_DIAG, CAUSAL, True,
                       PRECISION)
    else:
        full_hi = T // BLOCK_N * BLOCK_N
        dq = _dq_inner(dq, q_scaled, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
                       0, full_hi, T, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, False, PRECISION)
        dq = _dq_inner(dq, q_scaled, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
                       full_hi, T, T, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, True, PRECISION)
    out = b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :]
    tl.store(DQ + out, (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < T) & (offs_d[None, :] < HEAD_DIM))


# Rows a program owns and streams, (owned, streamed), and the (num_warps, num_stages) autotune may pick,
# per kernel, by flash_attention_forward.tile_class: the tutorial's 128 × 32 where it fits the registers, else
# fewer. All fit an A100's and an H100's shared memory without spilling (kernels/compile_check.py); the
# tutorial's 4-warp dK/dV configs spilled 0.4-6.2 KB a thread for sm_90 at hd 64-128 (stores and loads).
BACKWARD_TILES = {"16-bit": {"dkdv": ((128, 32), [(8, 2)]), "dq": ((128, 32), [(8, 3), (4, 3)])},
                  "16-bit, hd 128": {"dkdv": ((64, 16), [(8, 2)]), "dq": ((128, 32), [(8, 3), (8, 2)])},
                  "float32": {"dkdv": ((32, 16), [(8, 1)]), "dq": ((32, 16), [(8, 1)])}}


def _backward_configs(kernel: str):
    """Every (num_warps, num_stages) of BACKWARD_TILES for this kernel; `_backward_fits` keeps the
    launch's own. The CPU interpreter gets one (it never benchmarks then)."""
    if triton.knobs.runtime.interpret:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    listed = dict.fromkeys(c for tiles in BACKWARD_TILES.values() for c in tiles[kernel][1])
    return [triton.Config({}, num_warps=w, num_stages=s) for w, s in listed]


def _backward_fits(kernel: str):
    def fits(configs, named_args, **kwargs):   # autotune's early_config_prune
        mine = BACKWARD_TILES[tile_class(named_args["Q"].dtype, kwargs["BLOCK_D"])][kernel][1]
        return [c for c in configs if (c.num_warps, c.num_stages) in mine]
    return fits


_KEY = ["T", "HEAD_DIM", "BLOCK_M", "BLOCK_N", "CAUSAL"]


def _tuned(name: str, kernel):
    return triton.autotune(_backward_configs(name), key=_KEY,
                           prune_configs_by={"early_config_prune": _backward_fits(name)})(kernel)


_dkdv_tuned, _dq_tuned = _tuned("dkdv", _attn_bwd_dkdv_kernel), _tuned("dq", _attn_bwd_dq_kernel)
# Tiles a caller fixed (the tests' small ones): one launch each, no autotuning. The interpreter's time
# goes per tile operation, so on the CPU the default is 64 × 64 (test_flash_attention_tutorial_tiling
# keeps the GPU's proportions).
FIXED_CONFIG = dict(num_warps=4, num_stages=1)
INTERPRETER_TILES = (64, 64)


def attention_backward(q, k, v, o, lse, do, causal: bool, scale: float, precision: str, blocks=None):
    """dq (B, nh, T, hd), dk, dv (B, nkv, T, hd) from the forward's q, k, v, o, lse and dO, all read through
    their strides. blocks = (owned, streamed) rows per program for both kernels, powers of two ≥ 16, one
    launch each; default BACKWARD_TILES', autotuned."""
    B, H, T, D = q.shape
    H_KV = k.shape[1]
    block_d = max(16, triton.next_power_of_2(D))
    delta = torch.empty_like(lse)                                                # (B, nh, T)
    _attn_bwd_preprocess[(triton.cdiv(T, 64), B * H)](o, do, delta, T, H, *strides(o), *strides(do),
                                                      HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=64)
    dq = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    dk, dv = (torch.empty((B, H_KV, T, D), dtype=k.dtype, device=k.device) for _ in range(2))
    tensors = (q, k, v, do, lse, delta)
    layout = (*strides(q), *strides(k), *strides(v), *strides(do))
    common = dict(HEAD_DIM=D, BLOCK_D=block_d, CAUSAL=causal, PRECISION=precision)
    if triton.knobs.runtime.interpret and not blocks:
        blocks = INTERPRETER_TILES
    if blocks:
        dkdv, dq_kernel, dkdv_tiles, dq_tiles = _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, blocks, blocks
        common.update(FIXED_CONFIG)
    else:
        tiles = BACKWARD_TILES[tile_class(q.dtype, block_d)]
        dkdv, dq_kernel, dkdv_tiles, dq_tiles = _dkdv_tuned, _dq_tuned, tiles["dkdv"][0], tiles["dq"][0]
    owned, streamed = dkdv_tiles               # a dK/dV program owns keys, a dQ program queries
    dkdv[(triton.cdiv(T, owned), B * H_KV)](
        *tensors, dk, dv, scale, scale * LOG2E, T, H, H_KV, *layout, *strides(dk), BLOCK_M=streamed,
        BLOCK_N=owned, BLOCK_M_DIAG=max(16, streamed // 2), **common)   # tl.dot's smallest tile is 16
    owned, streamed = dq_tiles
    dq_kernel[(triton.cdiv(T, owned), B * H)](
        *tensors, dq, scale, scale * LOG2E, T, H, H_KV, *layout, *strides(dq), BLOCK_M=owned,
        BLOCK_N=streamed, BLOCK_N_DIAG=max(16, streamed // 2), **common)
    return dq, dk, dv
