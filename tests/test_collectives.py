"""02_data_parallel/collectives_demo.py: every collective gives the playbook's printed values.

Exact comparisons (small integers in float32 are exact). 3 ranks (a group of ranks 0-2 of one
4-rank spawn), the playbook appendix's setting; the ring all-reduce on 4 ranks with K = 10 (not
divisible by 4), where the elements each rank sends are 2K − |chunk r+1| − |chunk r+2| and add up
to 2(N−1)K over the ranks; with N | K that is 2(N−1)K/N per rank (checked with K = 12). The
communication meter must see the same bytes for the ring's isends.
"""
from importlib import import_module

import torch

from harness import run_ranks

demo = import_module("02_data_parallel.collectives_demo")


def _all_checks_rank(numel):
    """On 4 ranks: the playbook's operations in a group of ranks 0-2, then the ring on all 4."""
    import torch.distributed as dist
    comm = import_module("02_data_parallel.comm")
    three = dist.new_group([0, 1, 2])                                        # every rank creates it
    results = {}
    if dist.get_rank() < 3:
        results = {op.__name__: op(group=three) for op in demo.OPERATIONS}
        results["barrier"] = demo.barrier(0.2, group=three)
    with comm.CommMeter() as meter:
        results["ring"] = demo.ring_demo(numel)
    results["ring_wire"] = meter.total_wire(op="isend")
    results["ring_divisible_sent"] = demo.ring_demo(12)[2]                   # 4 | 12
    return {k: _plain(v) for k, v in results.items()}


def _plain(value):   # tensors -> lists, so results are pickled by value
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def test_collectives_match_playbook_and_ring_all_reduce():
    n, k = 4, 10
    results = run_ranks(_all_checks_rank, n, args=(k,))
    five = lambda v: [float(v)] * 5                                          # noqa: E731
    for rank, r in enumerate(results[:3]):
        assert r["broadcast"] == [[1., 2., 3., 4., 5.] if rank == 0 else [0.] * 5, [1., 2., 3., 4., 5.]]
        assert r["reduce"] == [five(rank + 1), five(6) if rank == 0 else five(rank + 1)]
        assert r["all_reduce"] == [five(rank + 1), five(6)]
        assert r["gather"] == [five(rank + 1), [five(1), five(2), five(3)] if rank == 0 else None]
        assert r["all_gather"] == [five(rank + 1), [five(1), five(2), five(3)]]
        assert r["scatter"] == [[five(1), five(2), five(3)] if rank == 0 else None, five(rank + 1)]
        assert r["reduce_scatter"][1] == [[6., 12.], [14., 56.], [36., 288.]][rank]
        assert r["all_to_all"] == [[10. * rank + j for j in range(3)], [10. * j + rank for j in range(3)]]
        arrived, passed = r["barrier"]
        assert passed >= 0.4 - 0.01 and arrived <= passed                   # the slowest rank slept 2 × 0.2 s
    sizes = [c.numel() for c in torch.tensor_split(torch.zeros(k), n)]      # [3, 3, 2, 2]
    for rank, r in enumerate(results):
        ring, reference, sent = r["ring"]
        assert ring == reference
        assert sent == 2 * k - sizes[(rank + 1) % n] - sizes[(rank + 2) % n]
        assert r["ring_wire"] == 4 * sent                                   # fp32: the meter agrees
    assert sum(r["ring"][2] for r in results) == 2 * (n - 1) * k
    assert all(r["ring_divisible_sent"] == 2 * (n - 1) * 12 // n for r in results)   # 18 each
