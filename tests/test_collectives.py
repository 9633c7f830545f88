"""02_data_parallel/collectives_demo.py: every collective gives the playbook's printed values.

Exact comparisons (small integers in float32 are exact). 3 ranks (a group of ranks 0-2 of one
4-rank spawn), the playbook appendix's setting; the ring all-reduce on 4 ranks with K = 10 (not
divisible by 4), where the elements each rank sends are 2K − |chunk r+1| − |chunk r+2| and add up
to 2(N−1)K over the ranks; with N | K that is 2(N−1)K/N per rank (checked with K = 12). The
communication meter must see the same bytes for the ring's isends, and the same counts whether
point-to-point calls are made one by one or batched, and wherever the group is passed; and count each ring
collective's bytes as 02's README table says (exactly: N divides K there).
"""

import torch

from harness import run_ranks

import collectives_demo as demo


def _all_checks_rank(numel):
    """On 4 ranks: the playbook's operations in a group of ranks 0-2, then the ring on all 4."""
    import torch.distributed as dist
    import comm
    three = dist.new_group([0, 1, 2])                                        # every rank creates it
    results = {}
    if dist.get_rank() < 3:
        results = {op.__name__: op(group=three) for op in demo.OPERATIONS}
        results["barrier"] = demo.barrier(0.2, group=three)
    results["ring"] = demo.ring_demo(numel)
    with comm.CommMeter() as meter:                                          # the ring's isends alone
        demo.ring_all_reduce(torch.zeros(numel))
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
        # each rank slept rank × 0.2 s first
        assert 0.2 * rank - 0.01 <= arrived < 0.2 * rank + 0.15
    sizes = [c.numel() for c in torch.tensor_split(torch.zeros(k), n)]      # [3, 3, 2, 2]
    for rank, r in enumerate(results):
        ring, reference, sent = r["ring"]
        assert ring == reference
        assert sent == 2 * k - sizes[(rank + 1) % n] - sizes[(rank + 2) % n]
        assert r["ring_wire"] == 4 * sent                                   # fp32: the meter agrees
    assert sum(r["ring"][2] for r in results) == 2 * (n - 1) * k
    assert all(r["ring_divisible_sent"] == 2 * (n - 1) * 12 // n for r in results)   # 18 each


# ======================================================================================
# The meter: the ring's bytes, batched point-to-point and positional groups
# ======================================================================================
def test_meter_counts_the_ring_algorithms_bytes_per_rank():
    """The meter's (payload, wire) of one call over N = 2, 3, 4, 8 ranks on K = 96 bytes (24 float32, so N
    divides K and the counts are exact), by 02's README table: all-reduce 2(N−1)K/N, the rest (N−1)K/N, K the
    full-size tensor (the gathered output, the scattered input, the list forms' pieces together) under
    every name torch 2.11 and 2.13 give the flat forms; an all-reduce costs a reduce-scatter plus an
    all-gather (ZeRO §7.1). Without ranks: the count needs only N."""
    import comm
    whole = torch.zeros(24)
    for n in (2, 3, 4, 8):
        k, part = 96, torch.zeros(24 // n)
        one_phase = (n - 1) * k // n
        counted = {op: comm._ring_bytes(op, n, args) for op, args in [
            ("all_reduce", [whole]), ("broadcast", [whole]), ("reduce", [whole]),
            ("all_gather_into_tensor", [whole, part]), ("all_gather_single", [whole, part]),
            ("reduce_scatter_tensor", [part, whole]), ("reduce_scatter_single", [part, whole]),
            ("all_gather", [[part] * n, part]), ("reduce_scatter", [part, [part] * n])]}
        assert counted.pop("all_reduce") == (k, 2 * (n - 1) * k // n), n
        assert counted == dict.fromkeys(counted, (k, one_phase)), n
        assert comm._wire_bytes("all_reduce", n, None, [whole])[1] == 2 * one_phase
        assert comm._ring_bytes("barrier", n, []) == (0, 0)


def _exchanges_rank(modes):
    """3 ranks: a ring in the world (rank r sends r+1 floats on) and, on ranks 0 and 1, an exchange and
    an all-reduce in a group passed positionally; with isend/irecv, or batched with P2POps built inside
    the meter (the ring's) and before it (the pair's)."""
    import torch.distributed as dist
    import comm
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 1])                                            # every rank creates it
    nxt, prv, other, in_pair = (rank + 1) % world, (rank - 1) % world, 1 - rank, rank < 2
    results = {}
    for mode in modes:
        send = torch.full((rank + 1,), float(rank))
        ring_in, pair_in = torch.empty(prv + 1), torch.empty(other + 1)
        if in_pair:
            prebuilt = [dist.P2POp(dist.isend, send, other, pair),
                        dist.P2POp(dist.irecv, pair_in, other, pair)]
        with comm.CommMeter({id(pair): "pair"}) as meter:
            if mode == "isend":
                works = [dist.isend(send, nxt), dist.irecv(ring_in, prv)]
                works += [dist.isend(send, other, pair), dist.irecv(pair_in, other, pair)] if in_pair else []
            else:
                ring = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, ring_in, prv)]
                assert ring[0].op is dist.distributed_c10d.isend, "torch tests op.op is isend"
                works = dist.batch_isend_irecv(ring) + (dist.batch_isend_irecv(prebuilt) if in_pair else [])
            for work in works:
                work.wait()
            if in_pair:
                dist.all_reduce(torch.ones(2), dist.ReduceOp.SUM, pair)
        assert dist.P2POp is dist.distributed_c10d.P2POp and dist.isend is dist.distributed_c10d.isend
        results[mode] = (dict(meter.calls), dict(meter.payload), dict(meter.wire),
                         ring_in.tolist(), pair_in.tolist())
    return results


def _expected_exchanges(rank):
    """calls, payload and wire bytes of _exchanges_rank by the meter's conventions (float32)."""
    prv, other = (rank - 1) % 3, 1 - rank
    calls = {("isend", "world"): 1, ("irecv", "world"): 1}
    payload = {("isend", "world"): 4 * (rank + 1), ("irecv", "world"): 4 * (prv + 1)}
    wire = {("isend", "world"): 4 * (rank + 1), ("irecv", "world"): 0}
    if rank < 2:
        calls.update({("isend", "pair"): 1, ("irecv", "pair"): 1, ("all_reduce", "pair"): 1})
        payload.update({("isend", "pair"): 4 * (rank + 1), ("irecv", "pair"): 4 * (other + 1),
                        ("all_reduce", "pair"): 8})
        wire.update({("isend", "pair"): 4 * (rank + 1), ("irecv", "pair"): 0, ("all_reduce", "pair"): 8})
    return calls, payload, wire


def test_meter_reads_the_group_passed_positionally():
    """`dist.isend(t, peer, pair)` and `dist.all_reduce(t, op, pair)` are counted under "pair", as with
    group=pair. Exact byte counts: float32 sizes, and the all-reduce's wire 2(N−1)/N·K is K for N = 2."""
    for rank, result in enumerate(run_ranks(_exchanges_rank, 3, args=(("isend",),))):
        calls, payload, wire, ring_in, pair_in = result["isend"]
        assert (calls, payload, wire) == _expected_exchanges(rank)
        assert ring_in == [float((rank - 1) % 3)] * ((rank - 1) % 3 + 1)


def test_meter_counts_batched_p2p_like_isend_irecv():
    """The same exchange through `batch_isend_irecv` (P2POps built inside the meter and before it) is
    counted exactly like isend/irecv: same operation and group names, same bytes; the data arrive."""
    for rank, result in enumerate(run_ranks(_exchanges_rank, 3, args=(("isend", "batch"),))):
        assert result["batch"] == result["isend"]
        assert result["batch"][:3] == _expected_exchanges(rank)
        if rank < 2:
            assert result["batch"][4] == [float(1 - rank)] * (2 - rank)
