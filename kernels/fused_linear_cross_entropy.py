"""Fused linear + cross-entropy: the LM-head loss without ever holding the (N, V) logits.

What: loss = mean over the non-ignored tokens of −log softmax(h Wᵀ)[target], for hidden states h (N, C),
the LM-head weight W (V, C) and targets (N,), ignore_index = −100, processed in chunks of `chunk` rows:

    logits_c = h_c Wᵀ                       (chunk, V)   torch GEMM, in h's dtype (bf16: no fp32 copy)
    lse, loss, dlogits/n = softmax-CE(logits_c)          Triton, one program per row, fp32 inside, in place
    dh_c = dlogits_c W,   dW += dlogits_cᵀ h_c           torch GEMMs; dW accumulates in fp32 (addmm)

Playbook chapter 4, "fused kernels" + online softmax (§4.0.7-4.0.8); Liger-Kernel (Hsu et al. 2024).
Eager holds ≈ N·V·(b + 4 + 4) bytes of logits at its peak; fused, one chunk (chunk·V·b, with
chunk·V ≈ N·C by default, at least 1024 rows) plus dh (N·C·b) and a float32 dW (V·C·4), into which
each chunk's dlogitsᵀ h is added by one GEMM with fp32 output (Liger). FLOPs 6·N·V·C, as eager. The
gradients are computed inside the forward (the softmax that gives the loss gives dlogits), so backward
only scales the stored dh, dW; under torch.no_grad the gradient GEMMs are skipped. The trade-offs and
a worked Llama-3-8B example: kernels/README.md.

Versions in this file:
    v0  linear_cross_entropy_reference  eager: logits = h Wᵀ, F.cross_entropy(logits.float())
    v1  fused_linear_cross_entropy      chunked GEMMs + Triton online-softmax CE, grads in forward

    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py -k cross_entropy   # CPU; GPU: bench.py
New compared with 01: replaces `cross_entropy_loss` as `LlamaForCausalLM.loss_fn` (`--kernels triton`).
Shape legend: N tokens (= B·T), C hidden size, V vocabulary, b bytes per element.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

IGNORE_INDEX = -100


def linear_cross_entropy_reference(hidden, weight, targets, ignore_index: int = IGNORE_INDEX):
    """v0: hidden (..., C), weight (V, C), targets (...) -> mean loss over non-ignored targets."""
    logits = hidden @ weight.t()                                             # (..., V)
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index)


@triton.jit
def _cross_entropy_kernel(LOGITS, TARGETS, LOSS, N_VALID, V, ignore_index, BLOCK_V: tl.constexpr,
                          WRITE_GRAD: tl.constexpr):
    # One program per row of the chunk; sums are fp32. LOGITS (chunk, V), in the GEMM's dtype, is
    # overwritten in place by the gradient of the mean loss: (softmax(logits) - onehot(target)) / n_valid.
    row = tl.program_id(0).to(tl.int64)
    logits_row = LOGITS + row * V
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    inv_n = 1.0 / tl.load(N_VALID).to(tl.float32)     # read on the device: no host sync for n_valid

    # exercise K.4: cross-entropy's online log-sum-exp
    # hint: the online softmax (Milakov & Gimelshein 2018; kernels/README.md, FlashAttention-2's loop): one
    #   pass over the row in blocks, a running max and a running sum of exponentials, the sum rescaled
    #   whenever the max grows; the log-sum-exp from the two at the end.
    # test: tests/test_kernels.py::test_fused_cross_entropy_without_grad_and_chunk_rule
    # Pass 1, online log-sum-exp. Keep the running max m and sum s = Σ exp(x - m). When a block raises
    # the max to m', rescale: s' = s·exp(m - m') + Σ_block exp(x - m'). The result never overflows
    # and needs only one read of the row.
    m = -float("inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(logits_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    # end exercise

    # loss_row = lse - logit[target]. An ignored row reads column 0 (in bounds) and is zeroed below.
    safe_target = tl.where(valid, target, 0)
    target_logit = tl.load(logits_row + safe_target).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - target_logit, 0.0))

    # Pass 2 (skipped under no_grad): the gradient of the mean loss, in place of the logits.
    if WRITE_GRAD:
        # exercise K.5: the fused loss's backward
        # hint: kernels/README.md, "Fused linear + cross-entropy": the softmax that gives the loss gives
        #   dloss/dlogits (the mean runs over the n_valid tokens; an ignored one gets none), written over the
        #   logits; then, per chunk, the chain rule through logits = h·Wᵀ gives dh and adds into dW
        #   (add_grad_weight: an fp32 accumulator).
        # test: tests/test_kernels.py::test_fused_linear_cross_entropy
        # hides: "(softmax(logits) - onehot(target)) / n_valid"
        # dlogits = (exp(x - lse) - [col == target]) / n_valid, 0 if ignored
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(logits_row + cols, mask=cols < V, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * inv_n
            tl.store(logits_row + cols, tl.where(valid, grad, 0.0).to(LOGITS.dtype.element_ty), mask=cols < V)
        # end exercise


# thinner chunks re-read W (V, C) three times each, and their GEMMs starve the tensor cores
MIN_CHUNK_ROWS = 1024


def default_chunk(n_tokens: int, hidden_size: int, vocab: int) -> int:
    """Rows per chunk such that chunk·V ≈ N·C (the logits chunk costs about what h already costs), but
    at least MIN_CHUNK_ROWS: each chunk reads all of W for its three GEMMs (kernels/README.md)."""
    rows = triton.next_power_of_2(triton.cdiv(n_tokens, triton.cdiv(vocab, hidden_size)))
    return min(max(rows, MIN_CHUNK_ROWS), n_tokens)


def add_grad_weight(grad_weight, dlogits, h_c):
    """grad_weight (V, C) fp32 += dlogitsᵀ (V, chunk) @ h_c (chunk, C), in one GEMM where torch has one.

    On CUDA, addmm's out_dtype overload (torch ≥ 2.8) multiplies bf16/fp16 operands and accumulates
    into the fp32 output, so no (V, C) product in low precision is made. It has no CPU kernel: on the
    CPU, low-precision operands give a (V, C) product in their dtype, which is then added."""
    if dlogits.dtype == grad_weight.dtype:
        grad_weight.addmm_(dlogits.t(), h_c)
    elif dlogits.is_cuda:
        torch.addmm(grad_weight, dlogits.t(), h_c, out_dtype=grad_weight.dtype, out=grad_weight)
    else:
        grad_weight += dlogits.t() @ h_c


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, chunk: int, need_grad: bool):
        N, C = hidden.shape
        V = weight.shape[0]
        loss_rows = torch.empty(N, dtype=torch.float32, device=hidden.device)            # (N,)
        grad_hidden = torch.empty_like(hidden) if need_grad else None                    # (N, C)
        grad_weight = torch.zeros(V, C, dtype=torch.float32, device=hidden.device) if need_grad else None
        # Mean over the tokens that count. n_valid stays a tensor: no host sync. If every token is
        # ignored this is 0/0 = nan, as with F.cross_entropy.
        n_valid = (targets != ignore_index).sum()
        block_v = min(triton.next_power_of_2(V), 4096)
        for start in range(0, N, chunk):
            h_c = hidden[start:start + chunk]                                            # (chunk, C)
            logits = h_c @ weight.t()                                                    # (chunk, V)
            _cross_entropy_kernel[(h_c.shape[0],)](logits, targets[start:start + chunk],
                                                   loss_rows[start:start + chunk], n_valid, V, ignore_index,
                                                   BLOCK_V=block_v, WRITE_GRAD=need_grad, num_warps=8)
            if need_grad:                                         # logits now holds dloss/dlogits
                # exercise K.5
                torch.mm(logits, weight, out=grad_hidden[start:start + chunk])           # (chunk, C)
                add_grad_weight(grad_weight, logits, h_c)                                # (V, C)
                # end exercise
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return loss_rows.sum() / n_valid

    @staticmethod
    def backward(ctx, grad_loss):       # grad_loss: a scalar, usually 1 (or 1/grad_acc)
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None


def _matmul_dtype(a, b):
    """The dtype torch would run a @ b in: the autocast dtype inside autocast, else the promoted one."""
    if torch.is_autocast_enabled(a.device.type):
        return torch.get_autocast_dtype(a.device.type)
    return torch.promote_types(a.dtype, b.dtype)


def fused_linear_cross_entropy(hidden, weight, targets, ignore_index: int = IGNORE_INDEX, chunk: int = None):
    """v1: mean CE of (hidden @ weight.T) against targets without the full logits.

    hidden (..., C), weight (V, C), targets (...) -> scalar float32 loss; differentiable in hidden and weight.
    """
    dtype = _matmul_dtype(hidden, weight)
    # Cast outside the Function so autograd routes the gradients back to float32 master weights.
    hidden2 = hidden.reshape(-1, hidden.shape[-1]).to(dtype).contiguous()              # (N, C)
    targets = targets.reshape(-1).contiguous()                                         # (N,)
    chunk = chunk or default_chunk(*hidden2.shape, weight.shape[0])
    # Decided out here: inside Function.forward autograd has already switched grad mode off.
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(hidden.device.type, enabled=False):   # the GEMMs inside already run in `dtype`
        return FusedLinearCrossEntropyFunction.apply(hidden2, weight.to(dtype), targets, ignore_index, chunk,
                                                     need_grad)


def fused_lm_head_loss(hidden, lm_head, labels):
    """The model's `loss_fn(hidden, lm_head, labels)` contract, with lm_head an nn.Linear without bias."""
    return fused_linear_cross_entropy(hidden, lm_head.weight, labels)
