"""Tensor parallelism beyond the key/value heads: at tp > kv heads each kv head lives on tp/kv ranks.

Playbook §2.3 (grouped-query attention under TP), Megatron-LM's `num_query_groups` < tp. A rank needs
whole key/value heads. With tp ≤ kv heads the k_proj / v_proj rows are split like q's (each rank its
kv/tp heads); with tp > kv heads (Llama-3 70B: 8 kv heads at tp 16) rank r keeps kv head r // (tp/kv)
whole, the head its q heads read. The copies of one head see different q heads, so each copy's gradient
is a partial sum: the step adds them over the ranks holding the head
(`all_reduce_kv_replica_gradients`), and the gradient norm counts each head once (a weight's
`kv_replicas` divides its square in `clip_grad_norm_tp`).

    torchrun --nproc_per_node 4 04_tensor_parallel/train.py --tp 4   # 2 kv heads: each on 2 ranks

New compared with tensor_parallel.py: which kv rows a rank keeps, and the sum over a head's copies.
"""

import torch
import torch.distributed as dist

import mixed_precision
import process_grid


def check_kv_heads(num_kv_heads: int, tp: int):
    """Raise a clear error when neither of tp and the kv heads divides the other."""
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"tp={tp} and num_key_value_heads={num_kv_heads}: each rank needs whole key/value "
                         f"heads, so one must divide the other (tp ≤ kv heads splits them, tp > kv heads "
                         f"replicates each over tp/kv ranks); pass --num-kv-heads a divisor or multiple of "
                         f"{tp}, or another --tp")


def kv_replicas(num_kv_heads: int, tp: int) -> int:
    """How many tp ranks hold each key/value head: 1 when tp ≤ kv heads (split), tp/kv heads when tp > kv
    heads (Llama-3 70B has 8 kv heads: at tp 16 every head lives on 2 ranks, each with its own q heads)."""
    return max(1, tp // num_kv_heads)


def kv_shard(tp_rank: int, tp_size: int, num_kv_heads: int):
    """(index, count) of the slice of k_proj / v_proj rows this rank keeps: (tp_rank, tp) when the heads
    are split; at tp > kv heads the whole head tp_rank // (tp/kv) of the kv heads' slices."""
    replicas = kv_replicas(num_kv_heads, tp_size)
    return tp_rank // replicas, tp_size // replicas


def replica_group(grid, num_kv_heads: int):
    """The group of the tp ranks holding this rank's kv head, or None when no head is replicated
    (collective: every rank creates every replica group)."""
    replicas = kv_replicas(num_kv_heads, grid.tp_size)
    return process_grid.subgroup(grid, "tp", replicas) if replicas > 1 else None


def mark_replicas(weight, num_kv_heads: int, tp: int, group):
    """Tag a k_proj / v_proj shard held by several tp ranks with its replica count and their group."""
    if kv_replicas(num_kv_heads, tp) > 1:
        weight.kv_replicas, weight.replica_group = kv_replicas(num_kv_heads, tp), group


@torch.no_grad()
def all_reduce_kv_replica_gradients(params):
    """Sum the gradients of replicated key/value heads over the ranks holding the same head (in .grad, or
    in ZeRO's fp32 `main_grad` under bf16-20: 01's `main_grad`)."""
    for p in params:
        grad = mixed_precision.main_grad(p)
        if getattr(p, "kv_replicas", 1) > 1 and grad is not None:
            dist.all_reduce(grad, group=p.replica_group)                # (hd, C) summed over the replicas
