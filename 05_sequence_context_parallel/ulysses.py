"""Context parallelism with all-to-all (DeepSpeed-Ulysses): trade the sequence split for a head split.

Playbook §2.5 (the all-to-all alternative to the ring); Jacobs et al. 2023,
"DeepSpeed Ulysses". Each rank holds T/cp tokens of every head. One all-to-all turns that into all T
tokens of nh/cp heads; attention then runs locally with the ordinary causal kernel (no merging, no
masks across blocks), and a second all-to-all turns the output back:

    q, k, v  (B, nh, T/cp, hd)  --all-to-all-->  (B, nh/cp, T, hd)  --attention-->
    out      (B, nh/cp, T, hd)  --all-to-all-->  (B, nh, T/cp, hd)

Communication per layer forward: 4 all-to-alls (q, k, v, out), each rank sending (cp−1)/cp of its
tensor: (cp−1)/cp·b·(s/cp)·(2h + 2h_kv) elements; backward the same. Unlike the ring it does not
grow with cp per rank, but it needs cp to divide the (local) query and key/value head counts.
The zig-zag layout works too: the gathered tokens are put back in sequence order before attention.

    torchrun --nproc_per_node 2 05_sequence_context_parallel/train.py --cp 2 --cp-attn ulysses

New compared with context_parallel.py: the same split of the sequence, attended by heads instead of a ring.
"""

import torch
import torch.distributed as dist

import model as modeling


def _all_to_all(x, group):
    """x (cp, …): block i goes to rank i; returns (cp, …) with block j received from rank j."""
    x = x.contiguous()            # before empty_like, which would copy a permuted x's strides
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x, group):   # (B, h, T/cp, hd) -> (B, h/cp, cp·T/cp, hd), tokens in rank order
    cp = dist.get_world_size(group)
    B, h, t, hd = x.shape
    # exercise 05.5: Ulysses all-to-all
    # hint: Jacobs et al. 2023, [PB] §2.5 (05's README, "Ulysses"): attention is independent per head, so
    #   one all-to-all can trade the sequence shard for a head shard: rank i receives head group i of every
    #   rank's tokens, which lie side by side in rank order; heads_to_seq is the inverse.
    # test: tests/test_context_parallel.py::test_attention_and_models_match_dense_twins[ulysses]
    blocks = x.view(B, cp, h // cp, t, hd).transpose(0, 1)                 # (cp: head group, B, h/cp, t, hd)
    received = _all_to_all(blocks, group)                                  # (cp: source rank, B, h/cp, t, hd)
    return received.permute(1, 2, 0, 3, 4).reshape(B, h // cp, cp * t, hd)
    # end exercise


def heads_to_seq(x, group):   # (B, h/cp, cp·T/cp, hd) -> (B, h, T/cp, hd): the inverse
    cp = dist.get_world_size(group)
    B, hc, T, hd = x.shape
    # exercise 05.5
    blocks = x.view(B, hc, cp, T // cp, hd).permute(2, 0, 1, 3, 4)         # (cp: dest rank, B, h/cp, t, hd)
    received = _all_to_all(blocks, group)                                  # (cp: head group, B, h/cp, t, hd)
    return received.transpose(0, 1).reshape(B, cp * hc, T // cp, hd)
    # end exercise


class SeqToHeads(torch.autograd.Function):
    """Forward all-to-all sequence-sharded -> head-sharded; backward the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad, ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """Forward all-to-all head-sharded -> sequence-sharded; backward the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad, ctx.group), None


class UlyssesAttention:
    """`Attention.attn_fn`: q (B, nh, T/cp, hd), k/v (B, nkv, T/cp, hd) of this rank's tokens."""

    def __init__(self, layout, cp_group, attn_fn=modeling.sdpa_attention):
        self.layout, self.cp_group, self.attn_fn = layout, cp_group, attn_fn

    def __call__(self, q, k, v):
        T = q.shape[2] * self.layout.cp_size
        # The gathered tokens come in rank order; their positions (rank 0's, rank 1's, …) say where
        # each belongs, so argsort puts them in sequence order and indexing by them undoes it (zig-zag).
        positions = torch.cat([self.layout.positions(r, T, q.device) for r in range(self.layout.cp_size)])
        to_sequence = positions.argsort()
        q, k, v = (SeqToHeads.apply(t, self.cp_group)[:, :, to_sequence]               # (B, h/cp, T, hd)
                   for t in (q, k, v))
        out = self.attn_fn(q, k, v)                                        # (B, nh/cp, T, hd), causal
        return HeadsToSeq.apply(out[:, :, positions], self.cp_group)     # (B, nh, T/cp, hd)


def check_ulysses(num_heads_local: int, num_kv_heads_local: int, cp: int):
    for name, n in (("query", num_heads_local), ("key/value", num_kv_heads_local)):
        if n % cp:
            raise ValueError(f"--cp-attn ulysses splits the heads over cp: cp={cp} does not divide the "
                             f"{n} {name} heads each rank holds (num heads / tp); use --cp-attn ring or "
                             f"another --cp")


def apply_ulysses(model, layout, cp_group):
    for layer in model.model.layers:
        # Wrap the layer's own core (sdpa, eager or kernels/flash_attention.py): it sees whole sequences.
        layer.self_attn.attn_fn = UlyssesAttention(layout, cp_group, layer.self_attn.attn_fn)
    return model
