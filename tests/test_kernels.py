"""kernels/: each Triton kernel against the eager reference in its own file, forward and backward.

Compared: the output and the gradient of every differentiable input (RMSNorm dx and dw; SwiGLU dgate
and dup; RoPE dx; fused linear cross-entropy loss, dh and dW; FlashAttention dq, dk and dv). Then a
whole tiny Llama with `apply_kernels(model, "triton", "triton")` against the PyTorch path: loss and
every parameter gradient. The shapes are deliberately awkward: hidden 48/96 (not powers of two),
T = 37 (not a multiple of any block, and several blocks deep), head dim 24 (padded to 32), GQA 4:2,
ignored targets, chunks that do not divide the tokens.

Tolerances:
  float32   The kernels compute in float32 as the references do. Only the order of the reductions
            differs, which costs a few float32 ulps of the largest value: atol = rtol = 1e-5. The
            whole model, where errors pass through 2 layers and the loss, gets 1e-4. Under bf16 autocast
            the whole model gets a relative bound, explained in that test.
  bfloat16  The kernel and the eager bf16 reference both round, at different places. The rule is
            the FlashAttention test suite's: the kernel's error against the float64 truth (the
            reference run on the same bf16 values upcast) must be at most twice the eager bf16
            reference's own error, plus 1e-3·max|truth| so an exact reference does not demand zero.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below before anything imports
Triton). The shapes are tiny because the interpreter is slow. On a CUDA machine they are compiled.
"""
import json
import math
import os
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # Triton reads it when kernels/*.py are imported (at @triton.jit)


import pytest  # noqa: E402
import triton  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import model as modeling
import rope
from kernels import rmsnorm as rms
from kernels import swiglu as swi
from kernels import rope as rot
from kernels import fused_linear_cross_entropy as flce
from kernels import flash_attention as fa
from kernels import flash_attention_forward
from kernels import patch

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not triton.knobs.runtime.interpret:
    raise RuntimeError("kernels/ was imported before TRITON_INTERPRET=1 was set: "
                       "run with TRITON_INTERPRET=1 pytest")
DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.timeout(120)


def run(fn, inputs, grad_out_seed=1):
    """fn(*inputs) and the gradients of all inputs that require them, for a fixed random dy."""
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*inputs)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_out_seed)).to(out)
    out.backward(dy)
    return [out.detach()] + [x.grad for x in inputs if x.grad is not None]


def check(kernel, reference, inputs, dtype, names, by_truth=False):
    """Compare kernel and reference outputs and input gradients at `dtype` by the module's rules
    (by_truth: the bfloat16 rule at every dtype, with 1e-5·max|truth| of slack in float32)."""
    cast = [x.to(DEVICE, dtype) if x.is_floating_point() else x.to(DEVICE) for x in inputs]
    got = run(kernel, cast)
    ref = run(reference, cast)
    assert len(got) == len(ref) == len(names)
    if dtype == torch.float32 and not by_truth:
        for name, a, b in zip(names, got, ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        return
    truth = run(reference, [x.double() if x.is_floating_point() else x for x in cast])
    for name, a, b, t in zip(names, got, ref, truth):
        assert a.dtype == b.dtype, f"{name}: {a.dtype} != {b.dtype}"
        err = (a.double() - t).abs().max().item()
        ref_err = (b.double() - t).abs().max().item()
        slack = 1e-5 if dtype == torch.float32 else 1e-3
        assert err <= 2 * ref_err + slack * t.abs().max().item(), (f"{name}: error {err:.3g} vs reference "
                                                                   f"{ref_err:.3g}")


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# === elementwise and row-wise kernels ===

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm(dtype):
    x, w = randn(2, 37, 48), 1 + randn(48, seed=1, scale=0.1)     # C = 48: the mask hides 16 of 64 lanes
    check(lambda x, w: rms.rmsnorm(x, w, 1e-5), lambda x, w: rms.rmsnorm_reference(x, w, 1e-5),
          [x, w], dtype, ["y", "dx", "dw"])


def test_rmsnorm_mixed_precision_matches_model():
    """bf16 activations with a float32 weight (autocast training): the model's output dtype (float32)
    and its values, up to one bf16 ulp (2⁻⁷ relative): x̂ is rounded to bf16 before the weight multiply,
    and where the kernel's and torch's float32 rsqrt differ in the last bit, that rounding can flip."""
    norm = modeling.RMSNorm(96, 1e-5).to(DEVICE)
    x = randn(3, 5, 96).to(DEVICE, torch.bfloat16)
    out = rms.rmsnorm(x, norm.weight, norm.eps)
    assert out.dtype == norm(x).dtype == torch.float32
    torch.testing.assert_close(out, norm(x), atol=1e-6, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu(dtype):
    gate, up = randn(2, 37, 96, scale=3.0), randn(2, 37, 96, seed=1)   # 7104 elements: a partial last block
    check(swi.swiglu, swi.swiglu_reference, [gate, up], dtype, ["y", "dgate", "dup"])


def rope_tables(head_dim: int, T: int = 37):
    """The model's cos, sin (T, hd) for one head of this size, plain RoPE with theta 10000."""
    one_head = modeling.LlamaConfig(hidden_size=head_dim, num_attention_heads=1, num_key_value_heads=1)
    return rope.rotary_cos_sin(torch.arange(T), one_head, torch.float32)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 16), (torch.float32, 24), (torch.bfloat16, 16)],
                         ids=["float32-hd16", "float32-hd24", "bfloat16-hd16"])
def test_rope(dtype, head_dim):
    cos, sin = rope_tables(head_dim)                        # (T, hd)
    x = randn(2, 37, 4, head_dim).transpose(1, 2)           # (B, nh, T, hd), strided like the model's q
    check(lambda x: rot.rope(x, cos.to(x), sin.to(x)), lambda x: rot.rope_reference(x, cos.to(x), sin.to(x)),
          [x], dtype, ["out", "dx"])


def test_rope_backward_is_rotation_by_minus_sin():
    """The docstring's claim: with Llama's tables (cos1 = cos2, sin1 = sin2), dx = rope(dy, cos, -sin)."""
    cos, sin = rope_tables(16)
    x = randn(1, 2, 37, 16).to(DEVICE).requires_grad_()
    dy = randn(1, 2, 37, 16, seed=1).to(DEVICE)
    rot.rope(x, cos.to(DEVICE), sin.to(DEVICE)).backward(dy)
    torch.testing.assert_close(x.grad, rot.rope_reference(dy, cos.to(DEVICE), -sin.to(DEVICE)),
                               atol=1e-6, rtol=1e-6)


def test_rope_of_q_and_k_in_one_launch(monkeypatch):
    """apply_rotary (the model's rope_fn) rotates q (4 heads) and k (2 heads, GQA) in one kernel launch
    forward and one backward, reading the model's strided (B, T, nh, hd) -> (B, nh, T, hd) views in
    place; outputs and both gradients equal the reference's (float32: 1e-5, reduction-free)."""
    grids, kernel = [], rot._rope_kernel

    class CountingKernel:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(rot, "_rope_kernel", CountingKernel())
    cos, sin = rope_tables(24)                                          # (T, hd), hd 24: a masked half
    q, k = randn(2, 37, 4, 24).transpose(1, 2), randn(2, 37, 2, 24, seed=1).transpose(1, 2)
    both = lambda rotate: lambda q, k: torch.cat(rotate(q, k), dim=1)  # noqa: E731   (B, nh + nkv, T, hd)
    check(both(lambda q, k: rot.apply_rotary(q, k, cos.to(q), sin.to(q))),
          both(lambda q, k: (rot.rope_reference(q, cos.to(q), sin.to(q)),
                             rot.rope_reference(k, cos.to(k), sin.to(k)))),
          [q, k], torch.float32, ["out", "dq", "dk"])
    assert len(grids) == 2 and all(grid[0] == 2 * (4 + 2) for grid in grids)   # forward, backward


# === fused linear + cross-entropy ===

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_linear_cross_entropy(dtype):
    h, w = randn(2, 37, 48), randn(100, 48, seed=1, scale=0.3)        # N = 74 tokens, V = 100
    targets = torch.randint(0, 100, (2, 37), generator=torch.Generator().manual_seed(2))
    targets[0, :9] = -100                                               # ignored (e.g. padding)
    # chunk 16: 5 chunks, the last one 10 rows, so chunking, ignore_index and the mean all matter.
    check(lambda h, w, t: flce.fused_linear_cross_entropy(h, w, t, chunk=16),
          flce.linear_cross_entropy_reference, [h, w, targets], dtype, ["loss", "dh", "dW"])


def test_fused_cross_entropy_without_grad_and_chunk_rule():
    """Under no_grad only the loss is computed, and it is the same. The default chunk keeps the
    logits chunk within 2x of the hidden states (chunk·V ≈ N·C), or it is MIN_CHUNK_ROWS rows (or all)."""
    h, w = randn(74, 48).to(DEVICE), randn(100, 48, seed=1).to(DEVICE)
    t = torch.randint(0, 100, (74,)).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(flce.fused_linear_cross_entropy(h, w, t),
                                   flce.linear_cross_entropy_reference(h, w, t), atol=1e-5, rtol=1e-5)
    for n, c, v in [(74, 48, 100), (8 * 8192, 4096, 128256), (4096, 2048, 32000)]:
        chunk = flce.default_chunk(n, c, v)
        assert 1 <= chunk <= n and (chunk * v <= 2 * n * c or chunk == min(n, flce.MIN_CHUNK_ROWS))


class LargestTensor(TorchFunctionMode):
    """Records the largest tensor (in elements) returned by any torch call made from Python, and the
    (shape, dtype) of every one."""

    def __init__(self):
        super().__init__()
        self.numel, self.shape, self.shapes, self.typed = 0, None, set(), set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
                self.typed.add((tuple(t.shape), t.dtype))
                if t.numel() > self.numel:
                    self.numel, self.shape = t.numel(), tuple(t.shape)
        return out


def test_fused_cross_entropy_never_materialises_logits():
    """The docstring's memory claim, checked on what the code allocates. Eager creates the (N, V)
    logits. The fused path's largest tensor is dW (V, C). Its logits exist one (chunk, V) slab at a time."""
    N, C, V, chunk = 74, 48, 100, 16
    h = randn(N, C).to(DEVICE).requires_grad_()
    w = randn(V, C, seed=1).to(DEVICE).requires_grad_()
    t = torch.randint(0, V, (N,)).to(DEVICE)
    with LargestTensor() as eager:
        flce.linear_cross_entropy_reference(h, w, t).backward()
    with LargestTensor() as fused:
        flce.fused_linear_cross_entropy(h, w, t, chunk=chunk).backward()
    assert eager.shape == (N, V)
    assert fused.shape == (V, C) and fused.numel < N * V and chunk * V <= fused.numel
    assert (chunk, V) in fused.shapes and (N, V) not in fused.shapes      # slabs of logits, never all of them


def test_fused_cross_entropy_keeps_bf16_logits_in_place():
    """bf16 inputs: each (chunk, V) logits slab stays bf16 and the CE kernel turns it into dlogits in place,
    so no float32 (chunk, V) copy is ever made (the old version upcast every chunk: 2x its bytes), and no
    (V, C) tensor but dW's fp32 accumulator and the bf16 gradient returned."""
    N, C, V, chunk = 74, 48, 100, 16
    h = randn(N, C).to(DEVICE, torch.bfloat16).requires_grad_()
    w = randn(V, C, seed=1).to(DEVICE, torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,)).to(DEVICE)
    with LargestTensor() as fused:
        flce.fused_linear_cross_entropy(h, w, t, chunk=chunk).backward()
    assert ((chunk, V), torch.bfloat16) in fused.typed
    assert ((chunk, V), torch.float32) not in fused.typed
    assert {dtype for shape, dtype in fused.typed if shape == (V, C)} <= {torch.float32, torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_grad_weight_accumulates_in_float32(dtype):
    """dW += dlogitsᵀ h into an fp32 accumulator: fp32 operands by addmm_ (reordered fp32 sums only); bf16
    operands on CUDA by addmm's out_dtype overload (fp32 accumulation, no bf16 product: within fp32's
    reordering), on the CPU (no kernel for that overload) by a bf16 product then added (one bf16
    rounding, 2⁻⁸ relative, of each product entry). Bounds relative to |dlogits|ᵀ|h| + |dW|."""
    grad = randn(100, 48).to(DEVICE)
    d, h = randn(16, 100, seed=1).to(DEVICE, dtype), randn(16, 48, seed=2).to(DEVICE, dtype)
    truth = grad.double() + d.double().t() @ h.double()
    scale = grad.double().abs() + d.double().abs().t() @ h.double().abs()
    flce.add_grad_weight(grad, d, h)
    assert grad.dtype == torch.float32
    bound = 2 ** -8 if dtype == torch.bfloat16 and DEVICE == "cpu" else 1e-5
    assert ((grad.double() - truth).abs() <= bound * scale).all()


# === flash attention ===

@pytest.mark.parametrize("dtype,causal", [(torch.float32, True), (torch.float32, False),
                                          (torch.bfloat16, True), (torch.bfloat16, False)],
                         ids=["float32-causal", "float32-full", "bfloat16-causal", "bfloat16-full"])
def test_flash_attention_gqa(dtype, causal):
    """Forward and backward (exercise K.7's test) against the reference: 4 query heads share 2 K/V heads;
    T = 37 with 16-wide blocks: 3 blocks, the last one 5 rows. One sequence: the interpreter's cost is per
    program (batch × heads × blocks), and a second sequence would only repeat the same tiles (within 10 s
    on 2 cores for the four cases, pytest's start included)."""
    q, k, v = randn(1, 4, 37, 16), randn(1, 2, 37, 16, seed=1), randn(1, 2, 37, 16, seed=2)
    check(lambda q, k, v: fa.flash_attention(q, k, v, causal, block_m=16, block_n=16),
          lambda q, k, v: fa.attention_reference(q, k, v, causal), [q, k, v], dtype, ["o", "dq", "dk", "dv"])


def test_flash_attention_forward_is_softmax_attention():
    """The forward kernel alone (no_grad: no backward kernel runs), float32, causal, GQA 4:2, T = 37 in
    16-wide blocks (below the diagonal, on it, and a ragged last block of 5 rows): the reference's output."""
    q, k, v = (t.to(DEVICE) for t in (randn(1, 4, 37, 16), randn(1, 2, 37, 16, seed=1),
                                      randn(1, 2, 37, 16, seed=2)))
    with torch.no_grad():
        out = fa.flash_attention(q, k, v, True, block_m=16, block_n=16)
    torch.testing.assert_close(out, fa.attention_reference(q, k, v, True), atol=1e-5, rtol=1e-5)


def test_flash_attention_padded_head_dim_unequal_blocks():
    """hd = 24 is padded to 32; BLOCK_M = 16 ≠ BLOCK_N = 32 exercises the causal loop bounds."""
    q, k, v = randn(1, 2, 40, 24), randn(1, 2, 40, 24, seed=1), randn(1, 2, 40, 24, seed=2)
    check(lambda q, k, v: fa.flash_attention(q, k, v, True, block_m=16, block_n=32),
          lambda q, k, v: fa.attention_reference(q, k, v, True),
          [q, k, v], torch.float32, ["o", "dq", "dk", "dv"])


@pytest.mark.parametrize("dtype,causal",
                         [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)],
                         ids=["float32-causal", "bfloat16-causal", "float32-full"])
def test_flash_attention_tutorial_tiling(dtype, causal):
    """The tutorial's tiling at a scale the interpreter affords: T = 100, hd 80 (padded to 128), GQA 4:2.
    Forward tiles 64 × 32 (the causal diagonal spans two key blocks); backward programs own 64 rows and
    stream 32, the diagonal in 16-row sub-tiles. So every stage runs: unmasked blocks below the diagonal,
    masked diagonal sub-tiles, whole blocks after it and a ragged last block (100 = 3·32 + 4). On a GPU
    float32 is left to the interpreter: its exact FMA dots on these tiles spill 66-190 KB a thread (stores
    and loads) and took up to 28 CPU-s a compile on our CPU (kernels/compile_check.py); bf16 runs the same
    tiling there."""
    if DEVICE == "cuda" and dtype == torch.float32:
        pytest.skip("float32 on 64-row tiles: spills, minutes of compiles on a GPU; the interpreter tests it")
    q, k, v = randn(1, 4, 100, 80), randn(1, 2, 100, 80, seed=1), randn(1, 2, 100, 80, seed=2)
    check(lambda q, k, v: fa.flash_attention(q, k, v, causal, block_m=64, block_n=32),
          lambda q, k, v: fa.attention_reference(q, k, v, causal), [q, k, v], dtype, ["o", "dq", "dk", "dv"])


def test_flash_attention_default_tiles():
    """No tiles given: the autotuned forward and the default backward tiles, at hd 80 (padded to 128),
    T = 70 (ragged), GQA 4:2. Under the interpreter autotune holds one config, so it never benchmarks
    (Autotuner.run times configs only when it has several, with CUDA events); on a GPU it holds several."""
    if DEVICE == "cpu":
        assert len(flash_attention_forward._attn_fwd_tuned.configs) == 1
    q, k, v = randn(1, 4, 70, 80), randn(1, 2, 70, 80, seed=1), randn(1, 2, 70, 80, seed=2)
    check(lambda q, k, v: fa.flash_attention(q, k, v, True),
          lambda q, k, v: fa.attention_reference(q, k, v, True),
          [q, k, v], torch.float32, ["o", "dq", "dk", "dv"])


class CallNames(TorchFunctionMode):
    """Records the name of every torch function called from Python."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_flash_attention_reads_strided_inputs_without_copies():
    """q, k, v as the model makes them, (B, T, nh, hd) transposed to (B, nh, T, hd), and a strided dO: the
    kernels read them through their strides. Nothing is copied (no contiguous/clone/copy_ call), autograd
    saves the inputs themselves, and the results equal those of contiguous inputs."""
    q, k, v = (randn(2, 37, h, 16, seed=s).to(DEVICE).transpose(1, 2).requires_grad_() for s, h in
               enumerate((4, 2, 2)))                                          # (B, nh|nkv, T, hd), strided
    dy = randn(2, 37, 4, 16, seed=3).to(DEVICE).transpose(1, 2)               # (B, nh, T, hd), strided
    assert not (q.is_contiguous() or dy.is_contiguous())
    with CallNames() as calls:
        o = fa.flash_attention(q, k, v, True, block_m=16, block_n=16)
        saved_q = o.grad_fn.saved_tensors[0]
        o.backward(dy)
    assert not {"contiguous", "clone", "copy_"} & set(calls.names), calls.names
    assert saved_q.data_ptr() == q.data_ptr() and saved_q.stride() == q.stride()
    dense = [x.detach().contiguous().requires_grad_() for x in (q, k, v)]
    o_dense = fa.flash_attention(*dense, True, block_m=16, block_n=16)
    o_dense.backward(dy.contiguous())
    torch.testing.assert_close(o, o_dense, atol=0, rtol=0)
    for x, x_dense in zip((q, k, v), dense):
        torch.testing.assert_close(x.grad, x_dense.grad, atol=0, rtol=0)


# === on a GPU: the models' own sizes, with the default tiles ===
# The shapes above are tiny for the interpreter; compiled Triton has limits it does not check (tl.dot's
# minimum sizes, shared memory, registers), so on a GPU every kernel also runs at Llama sizes, still
# awkward: T = 1000 (not a multiple of the 64-wide tiles), hd 80 (padded to 128), GQA 8:2, hidden 3000
# (a masked 4096 row), vocabulary 32003. Large float32 sums reorder by more than 1e-5, so both dtypes
# are judged against the float64 truth (check's by_truth rule). The CPU interpreter would take minutes.
on_gpu = pytest.mark.skipif(DEVICE == "cpu", reason="Llama-sized shapes: compiled Triton on a GPU only")


@on_gpu
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flash_attention_model_shapes(dtype, head_dim):
    q, k, v = (randn(1, h, 1000, head_dim, seed=s) for s, h in enumerate((8, 2, 2)))   # (B, nh|nkv, T, hd)
    check(lambda q, k, v: fa.flash_attention(q, k, v, True),
          lambda q, k, v: fa.attention_reference(q, k, v, True),
          [q, k, v], dtype, ["o", "dq", "dk", "dv"], by_truth=True)


@on_gpu
def test_sdpa_float32_gqa_runs_without_the_math_backend():
    """01's sdpa_attention in float32 with fewer key/value heads than heads (GQA 8:2, T 1000, hd 64): with
    SDPA's math backend ruled out it still runs (repeated K/V, the memory-efficient backend; enable_gqa would
    need the math one), and equals the eager attention in float64 within float32's rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (randn(1, h, 1000, 64, seed=s).to(DEVICE) for s, h in enumerate((8, 2, 2)))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        out = modeling.sdpa_attention(q, k, v)
    truth = fa.attention_reference(q.double(), k.double(), v.double(), True)
    torch.testing.assert_close(out.double(), truth, rtol=1e-5, atol=1e-5)


@on_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_kernels_model_shapes(dtype):
    x, w = randn(4, 1000, 3000), 1 + randn(3000, seed=1, scale=0.1)
    check(lambda x, w: rms.rmsnorm(x, w, 1e-5), lambda x, w: rms.rmsnorm_reference(x, w, 1e-5),
          [x, w], dtype, ["y", "dx", "dw"], by_truth=True)
    gate, up = randn(2, 1000, 5632, scale=3.0), randn(2, 1000, 5632, seed=1)
    check(swi.swiglu, swi.swiglu_reference, [gate, up], dtype, ["y", "dgate", "dup"], by_truth=True)
    for head_dim in (80, 128):
        cos, sin = rope_tables(head_dim, T=1000)
        x = randn(2, 1000, 8, head_dim).transpose(1, 2)    # (B, nh, T, hd), strided like the model's q
        check(lambda x: rot.rope(x, cos.to(x), sin.to(x)),
              lambda x: rot.rope_reference(x, cos.to(x), sin.to(x)),
              [x], dtype, ["out", "dx"], by_truth=True)


@on_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_linear_cross_entropy_model_shapes(dtype):
    h, w = randn(2, 1000, 1024), randn(32003, 1024, seed=1, scale=0.03)   # N = 2000 tokens, V = 32003
    targets = torch.randint(0, 32003, (2, 1000), generator=torch.Generator().manual_seed(2))
    targets[0, :100] = -100
    check(flce.fused_linear_cross_entropy, flce.linear_cross_entropy_reference, [h, w, targets], dtype,
          ["loss", "dh", "dW"], by_truth=True)


# === the whole model, switched from outside ===

def test_apply_kernels_matches_torch_path():
    """A tiny Llama (2 layers, hd 16, GQA 4:2, vocab 96, untied) gives the same loss and gradients
    with every Triton kernel as with PyTorch + SDPA. float32, so 1e-4 absorbs reduction order only."""
    config = modeling.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = modeling.LlamaForCausalLM(config).to(DEVICE)
    with torch.no_grad():   # non-trivial norm weights, so dw of each RMSNorm is checked too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, 96, (2, 21)).to(DEVICE)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100

    def loss_and_grads(kernels, attn):
        patch.apply_kernels(model, kernels, attn)
        model.zero_grad()
        loss = model(ids, labels=labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    params_before = {n: id(p) for n, p in model.named_parameters()}
    loss_torch, grads_torch = loss_and_grads("torch", "sdpa")
    loss_triton, grads_triton = loss_and_grads("triton", "triton")
    assert isinstance(model.model.norm, patch.KernelRMSNorm)
    assert {n: id(p) for n, p in model.named_parameters()} == params_before   # same Parameters, same names
    torch.testing.assert_close(loss_triton, loss_torch, atol=1e-5, rtol=1e-5)
    for name in grads_torch:
        torch.testing.assert_close(grads_triton[name], grads_torch[name], atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"{name}: {m}")
    # ... and back: the torch path is restored exactly.
    loss_back, _ = loss_and_grads("torch", "eager")
    assert type(model.model.norm) is modeling.RMSNorm
    torch.testing.assert_close(loss_back, loss_torch, atol=1e-6, rtol=1e-6)


def test_apply_kernels_under_bf16_autocast():
    """Mixed precision as train.py runs it: float32 master weights, bf16 autocast. Both paths round to
    bf16 (8 significant bits) at different places. FlashAttention rounds P, the fused loss rounds
    dlogits, and RMSNorm/RoPE keep the model's dtype promotions. So each parameter's gradient may
    differ by a few bf16 roundings: 2% relative (Frobenius). A wrong formula would be off by O(1)."""
    config = modeling.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = modeling.LlamaForCausalLM(config).to(DEVICE)
    ids = torch.randint(0, 96, (2, 21)).to(DEVICE)
    labels = torch.roll(ids, -1, dims=1)

    def loss_and_grads(kernels, attn):
        patch.apply_kernels(model, kernels, attn)
        model.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(ids, labels=labels)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_torch, grads_torch = loss_and_grads("torch", "sdpa")
    loss_triton, grads_triton = loss_and_grads("triton", "triton")
    assert abs(loss_triton - loss_torch) <= 1e-3 * abs(loss_torch)
    for name, g in grads_torch.items():
        assert grads_triton[name].dtype == g.dtype == torch.float32
        rel = ((grads_triton[name] - g).norm() / g.norm()).item()
        assert rel < 2e-2, f"{name}: relative gradient difference {rel:.3g}"


def test_apply_kernels_rejects_unknown_choices():
    model = modeling.LlamaForCausalLM(modeling.LlamaConfig(num_hidden_layers=1))
    with pytest.raises(ValueError, match="kernels="):
        patch.apply_kernels(model, "cuda")
    with pytest.raises(ValueError, match="attn="):
        patch.apply_kernels(model, "torch", "flash")
    assert patch.KERNEL_CHOICES == ("torch", "triton") and patch.ATTN_CHOICES == ("sdpa", "eager", "triton")


def test_train_with_triton_kernels_reproduces_torch_losses():
    """`01_single_gpu/train.py --kernels triton --attn triton` trains with the losses of the default
    PyTorch path: 3 AdamW steps of the tiny test model, 2 layers deep, on synthetic tokens (the GPU
    machines have no `datasets` to build the corpus), float32, one 8-token window a step (the
    interpreter's cost is per row block and per layer; the kernels' own tests above cover the tilings).
    The kernels only reorder float32 reductions (see the tolerances above); AdamW's m/√v can amplify
    those for near-zero gradients, so the losses get 1e-4 and the final parameters 1e-3."""
    from common import single_device_run
    data = ("--dataset", "synthetic", "--device", DEVICE, "--seq-len", 8, "--num-layers", 2)
    losses_torch, state_torch = single_device_run(*data, steps=3, mbs=1)
    losses_triton, state_triton = single_device_run(*data, "--kernels", "triton", "--attn", "triton",
                                                    steps=3, mbs=1)
    assert len(losses_triton) == 3 and all(math.isfinite(loss) for loss in losses_triton)
    torch.testing.assert_close(torch.tensor(losses_triton), torch.tensor(losses_torch), atol=1e-4, rtol=0)
    assert state_triton.keys() == state_torch.keys()   # same parameter names: checkpoints interchange
    for name, p in state_torch.items():
        torch.testing.assert_close(state_triton[name], p, atol=1e-3, rtol=0, msg=lambda m: f"{name}: {m}")


def test_bench_code_path_runs_end_to_end_on_cpu(tmp_path, monkeypatch):
    """The benchmark's own logic (every kernel × implementation × pass, the rate arithmetic, the callback
    after every row, the markdown and JSON writers) run through once on tiny float32 shapes, with the
    kernels in the interpreter and a wall-clock timer in place of CUDA events, and --plot-from draws them.
    This checks the script, not the speed: the numbers go to a temporary directory, never to
    kernels/results/. On a GPU, `python kernels/bench.py` runs the same code with the real timer and
    shapes."""
    import argparse
    from kernels import bench
    monkeypatch.setattr(bench, "DEVICE", DEVICE)
    # SDPA's flash backend takes bf16 only
    monkeypatch.setattr(bench, "DTYPE", torch.float32 if DEVICE == "cpu" else torch.bfloat16)
    monkeypatch.setattr(bench, "ROW_SHAPES", [(20, 256, 48)])          # hd 128 RoPE needs C ≥ 128
    monkeypatch.setattr(bench, "ATTN_SHAPES", [(1, 2, 1, 20, 16)])
    monkeypatch.setattr(bench, "CE_SHAPES", [(12, 32, 96)])

    def wall_clock_ms(fn):
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    peaks = {"matmul_bf16_tflops": 1.0, "copy_gbps": 1.0}
    # The GPU time's plumbing, with the wall clock again standing in (gpu_timer.GpuTime is GPU-only: its
    # own test is test_gpu_time_hides_the_host below).
    gpu = lambda run: {"gpu_ms": wall_clock_ms(run), "launches": 1}   # noqa: E731
    seen = []     # what the callback saw: bench.py rewrites its files there, so a cut run keeps its rows
    rows, memory = bench.run_all(argparse.Namespace(quick=False, compile=False, largest=False, only=None),
                                 wall_clock_ms, peaks, gpu,
                                 on_row=lambda rows, memory: seen.append((len(rows), len(memory))))
    assert seen == [(n, 0) for n in range(1, len(rows) + 1)] + [(len(rows), 1), (len(rows), 2)]
    expected = {("rmsnorm", i) for i in ("eager", "triton")} | {("swiglu", i) for i in ("eager", "triton")} \
        | {("rope", i) for i in ("eager", "triton")} \
        | {("attention", i) for i in ("eager", "sdpa-flash", "triton")} \
        | {("linear+cross-entropy", i) for i in ("eager", "triton")}
    assert {(r["kernel"], r["impl"]) for r in rows} == expected
    assert len(rows) == 2 * len(expected)                                 # fwd and fwd+bwd each
    failed = [bench.format_row(r) for r in rows if r["ms"] is None]
    assert not failed, failed
    for r in (r for r in rows if r["ms"] is not None):
        assert r["rate"] > 0 and r["of_peak"] == pytest.approx(r["rate"] / 1.0)
        assert r["gpu_ms"] > 0 and r["gpu_of_peak"] == pytest.approx(r["of_peak"] * r["ms"] / r["gpu_ms"])
        assert r["launches"] == 1
    assert [m["impl"] for m in memory] == ["eager", "triton"]             # CUDA memory stats: n/a on CPU
    bench.write_results(dict(device="cpu interpreter check", torch=torch.__version__,
                             triton=triton.__version__, cuda=None, date="-"), peaks, rows, memory, tmp_path)
    text = (tmp_path / "cpu-interpreter-check.md").read_text()
    assert text.count("\n| rmsnorm |") == 4 and "peak extra GiB" in text
    assert "| GPU ms | launches |" in text and all(line.count("|") == 10 for line in text.splitlines()
                                                   if line.startswith("| rmsnorm |"))
    assert len(json.loads((tmp_path / "cpu-interpreter-check.json").read_text())["rows"]) == len(rows)
    bench.main(["--plot-from", str(tmp_path / "cpu-interpreter-check.json")])   # --plot's picture, no GPU
    assert (tmp_path / "cpu-interpreter-check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@on_gpu
def test_gpu_time_hides_the_host():
    """gpu_timer.GpuTime on a call whose host side is slow (5 ms of Python before one tiny kernel): the
    event time includes those 5 ms, the GPU time only the kernel's microseconds, and the profiler counts
    one launch. A Triton RMSNorm forward is one launch too."""
    from kernels import gpu_timer
    from kernels import bench
    timer = bench.Timer(warmup=2, iters=5)
    gpu = gpu_timer.GpuTime(timer)
    x = torch.zeros(1024, device=DEVICE)

    def slow_host():
        time.sleep(0.005)
        x.add_(1)
    result = gpu(slow_host)
    assert timer(slow_host) > 5 and result["gpu_ms"] < 1 and result["launches"] == 1
    rows, w = torch.randn(4096, 2048, device=DEVICE, dtype=torch.bfloat16), torch.ones(2048, device=DEVICE)
    assert gpu_timer.count_launches(lambda: rms.rmsnorm(rows, w, 1e-5)) == 1
