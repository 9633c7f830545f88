"""Context parallelism: the sequence split over `cp` ranks, attention computed as a ring.

Playbook §2.5 (ring attention §2.5.1, zig-zag §2.5.2); Liu et al. 2023 (Ring Attention);
Brandon et al. 2023 (striped / zig-zag load balancing). Every layer except attention works token by
token, so each rank keeps only its T/cp tokens of every activation. Attention needs all earlier
keys and values: the K/V blocks travel around the cp ring, one hop per step, and each rank merges
the partial results with the online-softmax (log-sum-exp) rule, as FlashAttention does on one GPU:

    lse = log(e^lse₁ + e^lse₂),   out = out₁·e^(lse₁ − lse) + out₂·e^(lse₂ − lse)

    step s = 0 … cp−1:  send my current K/V to rank+1, receive the next from rank−1   (overlapped)
                        attend my queries to the K/V block of rank (r − s) mod cp, merge
                        wait for the transfer
Per rank, layer and micro-batch: cp−1 K/V blocks of 2·b·(s/cp)·h_kv elements sent forward, cp−1 K/V
plus cp dK/dV blocks backward (README.md derives it); activation memory 1/cp of the whole model's.

Layouts (--cp-layout). The sequence is cut into equal chunks; a tile (query chunk, key chunk) is
computed fully below the diagonal, with the causal mask on it, and skipped above it:
    contiguous  rank r holds chunk r of cp:             rank r computes r+1 tiles: unbalanced
    zigzag      rank r holds chunks r and 2cp−1−r of 2cp: every rank computes 2cp+1 tiles
Positions follow the tokens (RoPE gets this rank's `position_ids`), labels are sharded alike.

    torchrun --nproc_per_node 4 05_sequence_context_parallel/train.py --cp 4 --cp-layout zigzag

New compared with 04: the attention core swapped for the ring (`Attention.attn_fn`); the rest is per token.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class CPLayout:
    kind: str        # "contiguous" | "zigzag"
    cp_size: int

    @property
    def zigzag(self) -> bool:        # one cp rank holds the whole sequence: a single chunk, any length
        return self.kind == "zigzag" and self.cp_size > 1

    @property
    def num_chunks(self):
        return self.cp_size * (2 if self.zigzag else 1)

    def chunk_ids(self, rank):
        """Which equal chunks of the sequence rank `rank` holds, in order."""
        if self.zigzag:
            # exercise 05.2: the zig-zag layout
            # hint: [PB] §2.5.2, Brandon et al. 2023 (05's README, "Ring attention", its layouts): cut the
            #   sequence into 2·cp chunks; a causal query chunk's work grows with its position, so a rank that
            #   takes one chunk from the start takes its mirror from the end.
            # test: tests/test_context_parallel.py::test_zigzag_gives_every_rank_the_same_tiles
            # hides: "rank r holds chunks r and 2cp−1−r of 2cp"
            return (rank, 2 * self.cp_size - 1 - rank)
            # end exercise
        return (rank,)

    def positions(self, rank, seq_len, device=None):
        """(T/cp,) positions of rank's tokens: index its inputs/labels and its RoPE angles."""
        c = seq_len // self.num_chunks
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunk_ids(rank)])


def check_context_parallel(seq_len: int, cp: int, kind: str):
    if kind not in LAYOUTS:
        raise ValueError(f"--cp-layout {kind!r}: choose one of {LAYOUTS}")
    chunks = CPLayout(kind, cp).num_chunks
    if seq_len % chunks:
        raise ValueError(f"seq_len={seq_len} is not divisible by {chunks} "
                         f"({'2·cp' if kind == 'zigzag' else 'cp'} chunks for the {kind} layout with "
                         f"cp={cp}): choose --seq-len a multiple of {chunks}")


# ======================================================================================
# One tile: attention of a query chunk to a key/value chunk, forward and backward
# ======================================================================================
def _expand(kv, groups):  # (B, nkv, c, hd) -> (B, nh, c, hd): grouped-query heads share a K/V head
    return kv.repeat_interleave(groups, dim=1)


def _scores(q, k, causal):  # q (B, nh, c, hd), k (B, nh, c, hd) -> (B, nh, c, c)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:  # the diagonal tile: query i sees keys 0…i of the same chunk
        s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    return s


def tile_forward(q, k, v, causal):
    """-> out (B, nh, c, hd) normalised within the tile, lse (B, nh, c)."""
    groups = q.shape[1] // k.shape[1]
    s = _scores(q, _expand(k, groups), causal)
    lse = s.logsumexp(dim=-1)                                              # (B, nh, c)
    return (s - lse[..., None]).exp() @ _expand(v, groups), lse


def tile_backward(q, k, v, dout, lse, delta, causal):
    """Recompute the tile's probabilities from the final lse (FlashAttention-2's backward);
    -> dq (B, nh, c, hd), dk/dv (B, nkv, c, hd)."""
    B, nkv, c, hd = k.shape
    groups = q.shape[1] // nkv
    ke, ve = _expand(k, groups), _expand(v, groups)
    p = (_scores(q, ke, causal) - lse[..., None]).exp()                    # (B, nh, c, c) final softmax
    dv = p.transpose(-2, -1) @ dout                                        # (B, nh, c, hd)
    ds = p * (dout @ ve.transpose(-2, -1) - delta[..., None]) / math.sqrt(hd)
    dq, dk = ds @ ke, ds.transpose(-2, -1) @ q

    def fold(t):                             # (B, nh, c, hd) -> (B, nkv, c, hd): Σ over a kv head's q heads
        return t.view(B, nkv, groups, c, hd).sum(2)
    return dq, fold(dk), fold(dv)


def merge(out, lse, tile_out, tile_lse):
    """Online softmax: combine two partial attentions over disjoint key sets."""
    if out is None:
        return tile_out, tile_lse
    new_lse = torch.logaddexp(lse, tile_lse)
    return out * (lse - new_lse).exp()[..., None] + tile_out * (tile_lse - new_lse).exp()[..., None], new_lse


# ======================================================================================
# The ring
# ======================================================================================
def ring_shift(tensor, group, tag):
    """Start sending `tensor` (any shape) to the next rank of the ring and receiving the previous
    rank's into a tensor like it, as one batch; -> (received, requests to wait on)."""
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    received = torch.empty_like(tensor)
    # One batch, never a lone isend then irecv: NCCL's send and receive each block the GPU stream until
    # the peer's matching call runs, and with cp = 2 the next and previous rank are the same peer, so
    # both ranks' sends would wait for receives queued behind them. A batch is one NCCL group, whose
    # calls progress together (NCCL user guide, "Point-to-point communication": sendrecv).
    return received, dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, tensor.contiguous(), ranks[(me + 1) % len(ranks)], group=group, tag=tag),
         dist.P2POp(dist.irecv, received, ranks[(me - 1) % len(ranks)], group=group, tag=tag)])


def _wait(requests):
    for r in requests:
        r.wait()


def _tiles(layout, rank, src):
    """(query chunk index, key chunk index, causal) of the tiles rank computes against src's block."""
    return [(i, j, qc == kc) for i, qc in enumerate(layout.chunk_ids(rank))
            for j, kc in enumerate(layout.chunk_ids(src)) if kc <= qc]


class RingAttentionFunction(torch.autograd.Function):
    """Causal attention of this rank's queries to every rank's keys/values over the cp ring.

    Forward: cp−1 send/receive of the stacked K/V block (2, B, nkv, T/cp, hd), each overlapped with
    the tiles of the block in hand. Backward: the same ring for K/V, plus the accumulated dK/dV of
    each block travelling one hop behind it, cp hops, so that each block's gradient ends at home.
    """

    @staticmethod
    def forward(ctx, q, k, v, attn):
        layout, group = attn.layout, attn.cp_group
        size, rank = layout.cp_size, dist.get_rank(group)
        n = len(layout.chunk_ids(rank))
        q_chunks = q.chunk(n, dim=2)                                       # n × (B, nh, c, hd)
        outs, lses = [None] * n, [None] * n
        # exercise 05.3: ring attention
        # hint: Liu et al. 2023, [PB] §2.5.1 (05's README, "Ring attention"): the K/V blocks travel round the
        #   ring one hop per step, the next hop overlapped with the tiles of the block in hand (`_tiles`
        #   says which, and whose block it is); each tile's partial attention merges into its query chunk's
        #   by the online-softmax rule.
        # test: tests/test_context_parallel.py::test_attention_and_models_match_dense_twins[ring]
        kv = torch.stack([k, v])                                           # (2, B, nkv, T/cp, hd)
        for step in range(size):
            if step < size - 1:
                next_kv, requests = ring_shift(kv, group, tag=0)            # overlaps with the tiles below
            k_chunks, v_chunks = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
            for i, j, causal in _tiles(layout, rank, (rank - step) % size):
                tile = tile_forward(q_chunks[i], k_chunks[j], v_chunks[j], causal)
                outs[i], lses[i] = merge(outs[i], lses[i], *tile)
            if step < size - 1:
                _wait(requests)
                kv = next_kv
        # end exercise
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)           # (B, nh, T/cp, hd), (B, nh, T/cp)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attn = attn
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, group = ctx.attn.layout, ctx.attn.cp_group
        size, rank = layout.cp_size, dist.get_rank(group)
        n = len(layout.chunk_ids(rank))
        delta = (dout * out).sum(-1)                                       # (B, nh, T/cp): rowsum(dO∘O)
        dq = torch.zeros_like(q)
        q_c, do_c, lse_c, delta_c, dq_c = (t.chunk(n, dim=2) for t in (q, dout, lse, delta, dq))
        kv = torch.stack([k, v])                                           # (2, B, nkv, T/cp, hd)
        dkv_in, dkv_requests = None, []      # the dK/dV arriving from the rank before: none before step 1
        for step in range(size):
            if step < size - 1:
                next_kv, kv_requests = ring_shift(kv, group, tag=0)
            dkv = torch.zeros_like(kv)                                     # this block's dK/dV, my queries'
            k_c, v_c, dk_c, dv_c = (kv[0].chunk(n, 2), kv[1].chunk(n, 2),
                                    dkv[0].chunk(n, 2), dkv[1].chunk(n, 2))
            for i, j, causal in _tiles(layout, rank, (rank - step) % size):
                dq_t, dk_t, dv_t = tile_backward(q_c[i], k_c[j], v_c[j], do_c[i], lse_c[i], delta_c[i],
                                                 causal)
                dq_c[i].add_(dq_t), dk_c[j].add_(dk_t), dv_c[j].add_(dv_t)
            if step > 0:          # what the ranks before me accumulated for this block
                _wait(dkv_requests)
                dkv += dkv_in
            if size > 1:          # pass it on: after cp hops every block's gradient is back home
                dkv_in, dkv_requests = ring_shift(dkv, group, tag=1)
            if step < size - 1:
                _wait(kv_requests)
                kv = next_kv
        if size > 1:
            _wait(dkv_requests)
            dkv = dkv_in
        return dq, dkv[0], dkv[1], None


class RingAttention:
    """`Attention.attn_fn` for context parallelism: q (B, nh, T/cp, hd), k/v (B, nkv, T/cp, hd) of this
    rank's tokens -> (B, nh, T/cp, hd). Its work is the tiles `_tiles` lists for each hop."""

    def __init__(self, layout: CPLayout, cp_group):
        self.layout, self.cp_group = layout, cp_group

    def __call__(self, q, k, v):
        # The softmax statistics are merged across blocks: keep them in float32 (or float64) even under
        # bf16 autocast; the casts are ordinary autograd ops, so gradients come back in q's dtype.
        compute = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            out = RingAttentionFunction.apply(q.to(compute), k.to(compute), v.to(compute), self)
        return out.to(q.dtype)


def apply_context_parallel(model, layout: CPLayout, cp_group):
    """Swap every layer's attention core for ring attention (the rest of the model is per token)."""
    for layer in model.model.layers:
        layer.self_attn.attn_fn = RingAttention(layout, cp_group)
    return model
