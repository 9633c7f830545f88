"""Context parallelism with all-gathered K/V: the ring's alternative that trades memory for fewer bytes.

Playbook §2.5 (the all-gather variant of context parallelism); Llama 3 (Dubey et al. 2024, §3.3.2:
"all-gather the K and V tensors, then compute attention for the local Q"). Each rank keeps its T/cp
tokens (the same `CPLayout`, contiguous or zig-zag); per layer it all-gathers the K/V of the whole
sequence once, attends its queries to every key with the causal mask (the ring's tiles, all at hand),
and in backward reduce-scatters dK/dV, each rank getting the sum over the cp ranks for its own tokens
(SP's g: all-gather forward, reduce-scatter backward, here along T of the stacked K/V):

    kv (2, B, nkv, T/cp, hd) --all-gather--> (2, B, nkv, T, hd) in rank order --tiles--> out (B, nh, T/cp, hd)
    dkv (2, B, nkv, T, hd) partial          --reduce-scatter--> (2, B, nkv, T/cp, hd) summed over cp

Per layer and micro-batch, with one block = 2·b·(s/cp)·h_kv elements (h_kv = nkv·hd):
    wire sent per rank   forward (cp−1) blocks (all-gather), backward (cp−1) blocks (reduce-scatter)
                         ring: (cp−1) forward, (cp−1) + cp backward: cp blocks more, in cp−1 + 2cp−1 hops
    K/V saved for backward   cp blocks (every rank's K/V)        ring: 1 block (its own; re-sent in backward)
So all-gather moves 2(cp−1) blocks instead of 3cp−2 in 2 collectives instead of 3cp−2 hops, but holds
the whole sequence's K/V per layer, (cp−1) blocks more than the ring, and cannot overlap the transfer
with the tiles. With GQA (nkv ≪ nh) K/V is small: this is Llama 3's choice.

    torchrun --nproc_per_node 2 05_sequence_context_parallel/train.py --cp 2 --cp-attn allgather
New compared with context_parallel.py: the same tiles and layouts, the K/V gathered once instead of a ring.
"""

import torch
import torch.distributed as dist

import sequence_parallel
import context_parallel


class LocalQueryAttention(torch.autograd.Function):
    """Causal attention of this rank's queries q (B, nh, T/cp, hd) to the whole sequence's K/V,
    kv (2, B, nkv, cp·T/cp, hd) in rank order (rank r's tokens at [r·T/cp, (r+1)·T/cp)) -> (B, nh, T/cp, hd).
    No communication: forward and backward run the ring's tiles with every block already here."""

    @staticmethod
    def forward(ctx, q, kv, layout, rank):
        n = len(layout.chunk_ids(rank))
        q_c = q.chunk(n, dim=2)                                            # n × (B, nh, c, hd)
        k_c, v_c = kv[0].chunk(layout.cp_size * n, dim=2), kv[1].chunk(layout.cp_size * n, dim=2)
        outs, lses = [None] * n, [None] * n
        for src in range(layout.cp_size):
            for i, j, causal in context_parallel._tiles(layout, rank, src):
                tile = context_parallel.tile_forward(q_c[i], k_c[src * n + j], v_c[src * n + j], causal)
                outs[i], lses[i] = context_parallel.merge(outs[i], lses[i], *tile)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)           # (B, nh, T/cp, hd), (B, nh, T/cp)
        ctx.save_for_backward(q, kv, out, lse)                             # kv: the whole sequence's
        ctx.layout, ctx.rank = layout, rank
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        layout, rank = ctx.layout, ctx.rank
        n, chunks = len(layout.chunk_ids(rank)), layout.cp_size * len(layout.chunk_ids(rank))
        delta = (dout * out).sum(-1)                                       # (B, nh, T/cp): rowsum(dO∘O)
        dq, dkv = torch.zeros_like(q), torch.zeros_like(kv)                # dkv: my queries' share, all T
        q_c, do_c, lse_c, delta_c, dq_c = (t.chunk(n, dim=2) for t in (q, dout, lse, delta, dq))
        k_c, v_c, dk_c, dv_c = (kv[0].chunk(chunks, 2), kv[1].chunk(chunks, 2),
                                dkv[0].chunk(chunks, 2), dkv[1].chunk(chunks, 2))
        for src in range(layout.cp_size):
            for i, j, causal in context_parallel._tiles(layout, rank, src):
                b = src * n + j
                dq_t, dk_t, dv_t = context_parallel.tile_backward(q_c[i], k_c[b], v_c[b], do_c[i], lse_c[i],
                                                                  delta_c[i], causal)
                dq_c[i].add_(dq_t), dk_c[b].add_(dk_t), dv_c[b].add_(dv_t)
        return dq, dkv, None, None


class AllGatherKVAttention:
    """`Attention.attn_fn` for context parallelism by all-gather: q (B, nh, T/cp, hd), k/v (B, nkv, T/cp, hd)
    of this rank's tokens -> (B, nh, T/cp, hd)."""

    def __init__(self, layout, cp_group):
        self.layout, self.cp_group = layout, cp_group

    def __call__(self, q, k, v):
        compute = torch.promote_types(q.dtype, torch.float32)              # the ring's rule: lse in fp32+
        with torch.autocast(q.device.type, enabled=False):
            kv = torch.stack([k.to(compute), v.to(compute)])               # (2, B, nkv, T/cp, hd)
            # exercise 05.4: all-gathered K/V
            # hint: Llama 3 §3.3.2, [PB] §2.5 (05's README, "All-gathered K/V"): gather every rank's K/V once
            #   and attend the local queries to all of it; dK/dV then come back as a sum over cp, each rank's
            #   for its own tokens: 05.1's g does both, along the dimension it gathers (the sequence here).
            # test: tests/test_context_parallel.py::test_attention_and_models_match_dense_twins[allgather]
            # all-gather along T forward, reduce-scatter of dK/dV backward: SP's g on the cp group
            kv = sequence_parallel.GatherFromSPRegion.apply(kv.transpose(1, 3), self.cp_group)   # along dim 1
            kv = kv.transpose(1, 3)                                        # (2, B, nkv, T, hd), rank order
            out = LocalQueryAttention.apply(q.to(compute), kv, self.layout, dist.get_rank(self.cp_group))
            # end exercise
        return out.to(q.dtype)


def apply_allgather_kv(model, layout, cp_group):
    """Swap every layer's attention core for all-gather context parallelism."""
    for layer in model.model.layers:
        layer.self_attn.attn_fn = AllGatherKVAttention(layout, cp_group)
    return model
