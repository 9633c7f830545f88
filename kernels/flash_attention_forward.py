"""FlashAttention-2 forward in Triton: tiled, online softmax, causal or not, GQA, strided inputs.

Playbook chapter 4, FlashAttention (§4.0.8; Dao et al. 2022, Dao 2023). One program owns BLOCK_M
queries and streams K/V through on-chip memory in blocks of BLOCK_N keys, never writing S or P to HBM
(the "online softmax", Milakov & Gimelshein 2018):

    for each key block j:   S_j = Q K_jᵀ · scale;   m' = max(m, rowmax(S_j));   P_j = exp(S_j − m')
                            l = l·exp(m − m') + rowsum(P_j);   acc = acc·exp(m − m') + P_j V_j
    O = acc / l,   LSE = m + log l  (the only per-row statistic kept for backward)

As in Triton's tutorial 06: q carries scale·log2 e (one multiply per program, then exp2); causal key
blocks below the diagonal run without masks, only the diagonal and the ragged last block are masked;
the tiles are autotuned. Inputs are read through their strides (no copies). The backward kernels
(flash_attention_backward.py) reuse `load_tile`; flash_attention.py's autograd function runs both.
Derivation, cost and limits: kernels/README.md.

    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py -k flash     # CPU; GPU: kernels/bench.py
Shape legend: B batch, nh query heads, nkv key/value heads, T sequence, hd head dim, b bytes per element.
"""
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634   # exp(x) = exp2(x·log2 e); exp2 is the GPU's native instruction


@triton.jit
def load_tile(ptrs, rows, offs_d, T, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """A (rows, BLOCK_D) tile, masked only where it can leave the tensor: rows past T, padded hd."""
    if CHECK_ROWS:
        tile = tl.load(ptrs, mask=(rows[:, None] < T) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == BLOCK_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, hi, T,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    # Key blocks [lo, hi). MASKED = False only where every (query, key) pair is visible and in bounds.
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                                  # key positions
        k = load_tile(k_base + cols[:, None] * stride_kt + offs_d[None, :], cols, offs_d, T, HEAD_DIM,
                      BLOCK_D, MASKED)                                           # (BLOCK_N, BLOCK_D)
        v = load_tile(v_base + cols[:, None] * stride_vt + offs_d[None, :], cols, offs_d, T, HEAD_DIM,
                      BLOCK_D, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)        # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            valid = cols[None, :] < T
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= cols[None, :])
            s = tl.where(valid, s, -float("inf"))
        # exercise K.6: FlashAttention's online softmax
        # hint: kernels/README.md, FlashAttention-2 (its loop over key blocks; Dao 2023 Algorithm 1): a
        #   running row max, denominator and numerator, the older two rescaled whenever the max grows; here
        #   in log2 units (q carries scale·log2 e, so exp2), p in v's dtype for the product.
        # test: tests/test_kernels.py::test_flash_attention_forward_is_softmax_attention
        # Online softmax. Key 0 is in the first block and visible to every row, so m_new is finite
        # from the first iteration on, and exp2(-inf - m_new) = 0 for masked entries.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)                  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])               # (BLOCK_M, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
        # end exercise
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, qk_scale, T, H, H_KV, stride_qb, stride_qh, stride_qt,
                     stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                     stride_ob, stride_oh, stride_ot, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)                          # which block of BLOCK_M queries
    pid_bh = tl.program_id(1)                         # which (batch, query head) = b·H + h
    b = (pid_bh // H).to(tl.int64)                    # int64: b·stride can pass 2³¹
    h = pid_bh % H
    kv_h = (h // (H // H_KV)).to(tl.int64)            # GQA: the group's key/value head
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query positions (BLOCK_M,)
    offs_d = tl.arange(0, BLOCK_D)                    # padding columns of hd load as 0 and add nothing

    q_base = Q + b * stride_qb + h.to(tl.int64) * stride_qh
    q = load_tile(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], offs_m, offs_d, T, HEAD_DIM,
                  BLOCK_D, True)                                                 # (BLOCK_M, BLOCK_D)
    # Fold scale·log2 e into q once, so every S tile comes out in log2 units for exp2. In fp32: a bf16
    # tensor times a scalar stays bf16 in Triton, which would round the scale itself.
    q = (q.to(tl.float32) * qk_scale).to(q.dtype)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)   # running max, in log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                 # running Σ exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)        # running Σ exp2(s - m_i) · v

    # Causal: key blocks that end before the first query are visible to all rows (no mask); the
    # diagonal is masked and the loop stops at the last query (half the work). Full: only the ragged
    # last key block needs a mask.
    if CAUSAL:
        lo = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    else:
        lo = T // BLOCK_N * BLOCK_N
        hi = T
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
                                    0, lo, T, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, False, PRECISION)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
                                    lo, hi, T, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, True, PRECISION)

    acc = acc / l_i[:, None]
    row_ok = offs_m < T
    tl.store(O + b * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(LSE + pid_bh.to(tl.int64) * T + offs_m, m_i + tl.log2(l_i), mask=row_ok)   # log2 units


# Forward tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) of Triton's tutorial space that fit an A100's
# and an H100's shared memory without spilling registers (python kernels/compile_check.py shows it), by
# the operands' dtype and the padded head dim. float32 runs exact FMA dots, which need far more registers
# than a tensor-core dot: only small tiles keep theirs (64 × 32 at hd 80 spills 66-75 KB a thread, stores
# and loads, on sm_90 and sm_80).
FORWARD_TILES = {"16-bit": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4),
                            (128, 128, 8, 2)],
                 "16-bit, hd 128": [(128, 64, 8, 3), (64, 32, 4, 4)],
                 "float32": [(32, 16, 8, 1)]}


def tile_class(dtype, block_d: int) -> str:
    """Which tile list serves these operands: FORWARD_TILES' and flash_attention_backward's keys."""
    if dtype == torch.float32:
        return "float32"
    return "16-bit, hd 128" if block_d > 64 else "16-bit"


def _forward_configs():
    """Every tile of FORWARD_TILES; `_forward_fits` keeps a launch's own. The CPU interpreter gets one,
    so it never benchmarks (autotune times configs only when it has several), and a large one, since its
    time goes per tile operation."""
    if triton.knobs.runtime.interpret:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=1)]
    tiles = dict.fromkeys(t for listed in FORWARD_TILES.values() for t in listed)
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles]


def _forward_fits(configs, named_args, **kwargs):
    """autotune's early_config_prune: the tiles of this launch's dtype and head dim."""
    mine = FORWARD_TILES[tile_class(named_args["Q"].dtype, kwargs["BLOCK_D"])]
    return [c for c in configs
            if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in mine]


# Re-tuned per head dim, sequence length, causality and dtypes (autotune adds the tensors' dtypes).
_attn_fwd_tuned = triton.autotune(_forward_configs(), key=["T", "HEAD_DIM", "CAUSAL"],
                                  prune_configs_by={"early_config_prune": _forward_fits})(_attn_fwd_kernel)


def strides(x):
    """(b, h, t) strides of a (B, H, T, hd) tensor, for kernels that assume only hd's stride is 1."""
    return x.stride(0), x.stride(1), x.stride(2)


def attention_forward(q, k, v, causal: bool, scale: float, precision: str, block_m: int, block_n: int):
    """(o (B, nh, T, hd), lse (B, nh, T) in log2 units) of q (B, nh, T, hd), k/v (B, nkv, T, hd), all read
    through their strides; block_m, block_n fix the tiles (one launch), else FORWARD_TILES', autotuned."""
    B, H, T, D = q.shape
    block_d = max(16, triton.next_power_of_2(D))
    o = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)            # (B, nh, T, hd)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)       # (B, nh, T), log2 units
    args = (q, k, v, o, lse, scale * LOG2E, T, H, k.shape[1], *strides(q), *strides(k), *strides(v),
            *strides(o))
    if block_m:   # tiles chosen by the caller (the tests' small shapes): the plain kernel
        _attn_fwd_kernel[(triton.cdiv(T, block_m), B * H)](
            *args, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
            PRECISION=precision, num_warps=4, num_stages=2)
    else:
        _attn_fwd_tuned[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](
            *args, HEAD_DIM=D, BLOCK_D=block_d, CAUSAL=causal, PRECISION=precision)
    return o, lse
