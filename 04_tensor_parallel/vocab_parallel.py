"""Vocab-parallel embedding and cross-entropy: the vocabulary split over the `tp` ranks.

Playbook §2.3–2.4 (the embedding is "a row-linear over the vocabulary"), Megatron-LM §3
(Shoeybi et al. 2019: "fuse the output GEMM with the cross-entropy loss ... reduces the
communication from b·s·V to b·s"). Rank r owns vocabulary rows [r·V/t, (r+1)·V/t):

    embedding   look up the ids this rank owns, zeros elsewhere, then sum over the ranks (f̄, or a
                reduce-scatter under sequence parallelism): one all-reduce of b·s·h elements
    loss        logits stay sharded (B, T, V/t); softmax statistics are combined with three
                all-reduces of b·s elements each (max, Σexp, target logit) instead of gathering the
                b·s·V logits

    loss_n = log Σ_v exp(z_nv − m_n) − (z_n,y_n − m_n),   m_n = max_v z_nv
    dL/dz_nv = (softmax(z_n)_v − [v = y_n]) / N_valid      (each rank computes its own columns)

    torchrun --nproc_per_node 2 04_tensor_parallel/train.py --tp 2

New compared with 01: replaces `embed_tokens` and `LlamaForCausalLM.loss_fn` (tensor_parallel.py does).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mappings

IGNORE_INDEX = -100


class VocabParallelEmbedding(nn.Module):
    """weight (V/t, C): rows [vocab_start, vocab_start + V/t) of the dense embedding, rank tp_rank's shard
    (tensor_parallel.shard_parameter along dim 0)."""

    def __init__(self, weight, tp_rank, tp_group, exit_region=mappings.reduce_from_tp_region):
        super().__init__()
        self.weight = weight                                                # (V/t, C)
        self.vocab_start = tp_rank * weight.shape[0]
        self.tp_group, self.exit_region = tp_group, exit_region

    def forward(self, input_ids):                                          # (B, T)
        # exercise 04.2: the vocab-parallel embedding
        # hint: [PB] §2.3, "a row-linear over the vocabulary" (04's README, "Derivations"): a one-hot row
        #   times the embedding is a lookup, and the rows are split over the ranks, so each rank looks up
        #   the ids in its range [vocab_start, vocab_start + V/t) (any other id must still be a valid
        #   index) and contributes nothing for the others; the exit region sums over tp.
        # test: tests/test_tensor_parallel.py::test_parallel_layers_match_dense_twins[embedding]
        local = input_ids - self.vocab_start
        foreign = (local < 0) | (local >= self.weight.shape[0])             # ids another rank owns
        x = F.embedding(local.masked_fill(foreign, 0), self.weight)         # (B, T, C)
        x = x.masked_fill(foreign[..., None], 0.0)                          # only the owner contributes
        return self.exit_region(x, self.tp_group)                           # (B, T, C) summed over tp
        # end exercise


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of sharded logits (N, V/t) against labels (N,); IGNORE_INDEX is skipped.

    Forward: three all-reduces of N elements over `group` (max, sum of exponentials, target logit).
    Backward: none; each rank writes softmax − one-hot into its own vocabulary columns.
    """

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):                  # (N, V/t), (N,)
        # exercise 04.3: vocab-parallel cross-entropy
        # hint: Megatron-LM §3 and the loss formula of this module's docstring (04's README, "Derivations"):
        #   the logits stay sharded; the softmax needs the max and the sum of exponentials over the whole
        #   vocabulary, and the target's logit lives on one rank only (three all-reduces of N numbers);
        #   the mean runs over the labels that are not IGNORE_INDEX; save what backward reads.
        # test: tests/test_tensor_parallel.py::test_parallel_layers_match_dense_twins[model]
        logits_max = logits.max(dim=-1).values                             # (N,)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)     # (N,) global max
        shifted = logits - logits_max[:, None]                             # (N, V/t)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)                                          # (N,)
        dist.all_reduce(sum_exp, group=group)                              # (N,) Σ over the whole vocab
        local = labels - vocab_start
        owned = (local >= 0) & (local < logits.shape[-1])                  # the label is in my columns
        local = local.masked_fill(~owned, 0)
        target = shifted.gather(1, local[:, None]).squeeze(1) * owned      # (N,) z_y − m on its owner
        dist.all_reduce(target, group=group)                               # (N,)
        valid = labels != IGNORE_INDEX
        count = valid.sum().clamp(min=1)
        loss = ((sum_exp.log() - target) * valid).sum() / count
        softmax = exp / sum_exp[:, None]                                   # (N, V/t)
        ctx.save_for_backward(softmax, local, owned, valid, count)
        return loss
        # end exercise

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, owned, valid, count = ctx.saved_tensors
        grad = softmax.clone()                                             # (N, V/t)
        grad.scatter_add_(1, local[:, None], -owned[:, None].to(grad.dtype))   # − one-hot where owned
        grad *= (valid.to(grad.dtype) * grad_loss / count)[:, None]
        return grad, None, None, None


def vocab_parallel_loss(hidden, lm_head, labels, *, group, vocab_start):
    """`LlamaForCausalLM.loss_fn` under TP: hidden (B, T, C), lm_head column-parallel, labels (B, T)."""
    logits = lm_head(hidden)                                               # (B, T, V/t)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # bf16 -> fp32, as 01
    return VocabParallelCrossEntropy.apply(logits.flatten(0, 1), labels.flatten(), vocab_start, group)
