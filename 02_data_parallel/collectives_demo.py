"""The collective operations every parallelism is built from, each on a tiny tensor, before and after.

Playbook appendix §5.1 (collective operations): the same examples, on 3 ranks, with the values the
playbook prints (its `example_reduce` prints an undefined `rank`, erratum E12: dist.get_rank() here).

    broadcast       rank 0's tensor is copied to every rank
    reduce          the sum lands on rank 0 only; the other ranks keep their input
    all_reduce      every rank gets the sum
    gather          rank 0 gets the list of every rank's tensor, in rank order
    all_gather      every rank gets that list
    scatter         rank 0 hands element i of its list to rank i
    reduce_scatter  rank i gets the sum over ranks of their i-th tensor
    all_to_all      rank i sends its j-th piece to rank j (a transpose of who-holds-what)
    barrier         nobody passes until everybody has arrived

Then a ring all-reduce from send/recv only: a reduce-scatter phase (N−1 steps, each rank adds the
chunk its left neighbour sends) and an all-gather phase (N−1 steps, each rank forwards the finished
chunk). Each rank sends 2(N−1) chunks of K/N elements: 2(N−1)·K/N in all, ≈ 2K for large N and
independent of N, which is why the ring is bandwidth-optimal (ZeRO §7.1: all-reduce = reduce-scatter
+ all-gather).

    torchrun --nproc_per_node 3 02_data_parallel/collectives_demo.py
    torchrun --nproc_per_node 4 02_data_parallel/collectives_demo.py --ring-numel 10   # K not divisible by N
New compared with 01: more than one process; every later folder is built from these operations.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "02_data_parallel")]

import argparse
import math
import time

import torch
import torch.distributed as dist

import comm


# ======================================================================================
# The nine operations: each returns (before, after) as this rank sees them
# ======================================================================================
def broadcast(group=None):
    rank = dist.get_rank(group)
    tensor = torch.tensor([1., 2., 3., 4., 5.]) if rank == 0 else torch.zeros(5)
    before = tensor.clone()
    dist.broadcast(tensor, src=0, group=group)                                    # (5,)
    return before, tensor


def reduce(group=None):
    """The sum on rank 0. Only dst's buffer is defined afterwards: gloo uses the other ranks' buffers
    as scratch space (NCCL, in the playbook's printout, leaves them alone), so a copy is reduced."""
    tensor = torch.full((5,), float(dist.get_rank(group) + 1))
    work = tensor.clone()
    dist.reduce(work, dst=0, op=dist.ReduceOp.SUM, group=group)
    return tensor, work if dist.get_rank(group) == 0 else tensor


def all_reduce(group=None):
    tensor = torch.full((5,), float(dist.get_rank(group) + 1))
    before = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return before, tensor


def gather(group=None):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    tensor = torch.full((5,), float(rank + 1))
    gather_list = [torch.zeros(5) for _ in range(size)] if rank == 0 else None   # only the destination
    dist.gather(tensor, gather_list, dst=0, group=group)
    return tensor, gather_list


def all_gather(group=None):
    tensor = torch.full((5,), float(dist.get_rank(group) + 1))
    tensor_list = [torch.zeros(5) for _ in range(dist.get_world_size(group))]
    dist.all_gather(tensor_list, tensor, group=group)
    return tensor, tensor_list


def scatter(group=None):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    scatter_list = [torch.full((5,), float(i + 1)) for i in range(size)] if rank == 0 else None
    tensor = torch.zeros(5)
    dist.scatter(tensor, scatter_list, src=0, group=group)
    return scatter_list, tensor


def reduce_scatter(group=None):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    inputs = [((rank + 1) * torch.tensor([1., 2.])) ** (j + 1) for j in range(size)]   # size × (2,)
    output = torch.zeros(2)
    # the flat form, (size·2,) -> (2,): gloo implements it on every torch version this project supports
    comm.reduce_scatter_flat(output, torch.cat(inputs), op=dist.ReduceOp.SUM, group=group)
    return inputs, output


def all_to_all(group=None):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    tensor = torch.arange(size, dtype=torch.float32) + 10 * rank    # piece j goes to rank j
    output = torch.empty(size)
    dist.all_to_all_single(output, tensor, group=group)             # (size,) -> (size,): piece j from rank j
    return tensor, output


def barrier(sleep_s: float = 1.0, group=None):
    """Rank r sleeps r·sleep_s, then waits at the barrier: all pass after ≈ the longest sleep."""
    start = time.perf_counter()
    time.sleep(dist.get_rank(group) * sleep_s)
    arrived = time.perf_counter() - start
    dist.barrier(group=group)
    return arrived, time.perf_counter() - start


# ======================================================================================
# Ring all-reduce from send/recv
# ======================================================================================
def ring_all_reduce(tensor, group=None):
    """Sum `tensor` over the ranks in place with 2(N−1) neighbour exchanges; returns elements sent.

    The tensor is cut into N chunks (sizes differ by one when N does not divide K). Rank r sends to
    r+1 and receives from r−1; after the N−1 reduce-scatter steps it holds the full sum of chunk (r+1) mod N.
        reduce-scatter step s: send chunk (r−s) mod N, add the received chunk (r−s−1) mod N
        all-gather step s:     send chunk (r+1−s) mod N, overwrite chunk (r−s) mod N with the received one
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    chunks = list(torch.tensor_split(tensor.view(-1), size))        # N views of (≈K/N,)
    right = dist.get_global_rank(group, (rank + 1) % size) if group else (rank + 1) % size
    left = dist.get_global_rank(group, (rank - 1) % size) if group else (rank - 1) % size
    sent = 0

    def exchange(send_index, recv_index):
        nonlocal sent
        incoming = torch.empty_like(chunks[recv_index])
        works = [dist.isend(chunks[send_index].contiguous(), right, group=group),
                 dist.irecv(incoming, left, group=group)]
        for work in works:
            work.wait()
        sent += chunks[send_index].numel()
        return incoming

    # exercise 02.1: ring all-reduce
    # hint: [PB] App. §5.1 (02's README, "Collectives and the ring all-reduce"): N−1 reduce-scatter steps,
    #   then N−1 all-gather steps, each one `exchange(send_index, recv_index)` (it sends a chunk to the right
    #   and returns the one from the left). In each step a rank passes on the chunk it updated last; which
    #   chunk is that at step s, if rank r is to end the first phase holding chunk (r+1) mod N summed?
    # test: tests/test_collectives.py::test_collectives_match_playbook_and_ring_all_reduce
    # hides: "send chunk (r−s) mod N, add the received chunk (r−s−1) mod N"
    #   "send chunk (r+1−s) mod N, overwrite chunk (r−s) mod N with the received one"
    for s in range(size - 1):                                       # === reduce-scatter phase ===
        chunks[(rank - s - 1) % size] += exchange((rank - s) % size, (rank - s - 1) % size)
    for s in range(size - 1):                                       # === all-gather phase ===
        chunks[(rank - s) % size].copy_(exchange((rank + 1 - s) % size, (rank - s) % size))
    # end exercise
    return sent


def ring_demo(numel: int, group=None):
    """(ring result, dist.all_reduce result, elements this rank sent) for a (numel,) tensor."""
    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(rank)
    tensor = torch.randint(-9, 10, (numel,), generator=g).float()   # small integers: sums are exact
    reference = tensor.clone()
    sent = ring_all_reduce(tensor, group)
    dist.all_reduce(reference, op=dist.ReduceOp.SUM, group=group)
    return tensor, reference, sent


# ======================================================================================
# The demo: print before/after on every rank, one operation at a time
# ======================================================================================
OPERATIONS = (broadcast, reduce, all_reduce, gather, all_gather, scatter, reduce_scatter, all_to_all)


def show(value):
    if isinstance(value, torch.Tensor):
        return str(value.tolist())
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


def print_in_rank_order(text):
    for r in range(dist.get_world_size()):
        if r == dist.get_rank():
            print(text, flush=True)
        dist.barrier()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ring-numel", type=int, default=12,
                   help="K, the elements of the ring all-reduce's tensor")
    p.add_argument("--sleep", type=float, default=1.0, help="seconds rank r sleeps ×r before the barrier")
    args = p.parse_args(argv)
    if not (math.isfinite(args.sleep) and args.sleep >= 0) or args.ring_numel < 1:
        p.error(f"--sleep must be 0 or more seconds (a finite number) and --ring-numel at least 1, got "
                f"{args.sleep} and {args.ring_numel}")
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    for op in OPERATIONS:
        if rank == 0:
            print(f"=== {op.__name__} ===", flush=True)
        dist.barrier()
        before, after = op()
        print_in_rank_order(f"rank {rank}: before {show(before)}  after {show(after)}")
    arrived, passed = barrier(args.sleep)
    print_in_rank_order(f"=== barrier === rank {rank}: arrived at {arrived:.2f} s, passed at {passed:.2f} s")
    ring, reference, sent = ring_demo(args.ring_numel)
    assert torch.equal(ring, reference), "the ring all-reduce disagrees with dist.all_reduce"
    print_in_rank_order(f"=== ring all-reduce === rank {rank}: equals dist.all_reduce, sent {sent} elements "
                        f"(2(N−1)K/N = {2 * (size - 1) * args.ring_numel / size:g}, exact when N divides K)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
