"""The multi-rank harness itself: real gloo collectives on 4 ranks, failures and hangs reported.

Every other distributed test trusts this file: if a collective misbehaves here, nothing else can be
believed. Expected values are exact integers, so the comparisons are exact.
"""
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankError, run_ranks


def collectives_on_every_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    gathered = [torch.empty(2) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([rank, 10.0 * rank]))
    out["all_gather"] = [g.tolist() for g in gathered]
    scattered = torch.empty(2)
    dist.reduce_scatter(scattered, [torch.tensor([float(rank), float(j)]) for j in range(world)])
    out["reduce_scatter"] = scattered.tolist()
    # uneven all_to_all: rank r sends j+1 rows to rank j (all rows carry the sender's rank)
    send = torch.full((sum(range(1, world + 1)),), float(rank))
    recv = torch.empty((rank + 1) * world)
    dist.all_to_all_single(recv, send, output_split_sizes=[rank + 1] * world,
                           input_split_sizes=list(range(1, world + 1)))
    out["all_to_all"] = recv.tolist()
    # a ring of send/recv: even ranks send first, so no pair deadlocks
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(1)
    if rank % 2 == 0:
        dist.send(torch.tensor([float(rank)]), nxt)
        dist.recv(got, prv)
    else:
        dist.recv(got, prv)
        dist.send(torch.tensor([float(rank)]), nxt)
    out["ring_recv"] = got.item()
    return out


def test_collectives_on_four_ranks():
    results = run_ranks(collectives_on_every_rank, world_size=4)
    for rank, out in enumerate(results):
        assert out["all_reduce"] == [10.0] * 3
        assert out["all_gather"] == [[r, 10.0 * r] for r in range(4)]
        assert out["reduce_scatter"] == [0 + 1 + 2 + 3, 4.0 * rank]
        assert out["all_to_all"] == [float(src) for src in range(4) for _ in range(rank + 1)]
        assert out["ring_recv"] == (rank - 1) % 4


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one broke")
    dist.barrier()


def hang_on_rank_zero():
    if dist.get_rank() == 0:
        dist.barrier()   # the other rank never joins: it is busy elsewhere
    else:
        time.sleep(60)


def test_failures_and_hangs_are_reported():
    with pytest.raises(RankError, match="rank 1 of 2 failed(.|\n)*rank one broke"):
        run_ranks(fail_on_rank_one, world_size=2, timeout=30)
    with pytest.raises(RankError, match="no result within"):
        run_ranks(hang_on_rank_zero, world_size=2, timeout=8)


def many_tensors():
    return {f"p{i}": torch.full((256,), float(dist.get_rank() * 1000 + i)) for i in range(500)}


def test_ranks_can_return_many_tensors():
    """A state dict's worth of tensors comes back from every rank, even after the ranks have exited."""
    results = run_ranks(many_tensors, world_size=2, timeout=60)
    for rank, out in enumerate(results):
        assert len(out) == 500
        assert all(torch.equal(t, torch.full((256,), float(rank * 1000 + i))) for i, t in enumerate(out.values()))
