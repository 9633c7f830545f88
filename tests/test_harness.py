"""The multi-rank harness itself: real gloo collectives on 4 ranks, failures and hangs reported.

Every other distributed test trusts this file: if a collective misbehaves here, nothing else can be
believed. Expected values are exact integers, so the comparisons are exact. Several layouts in one
spawn: a layout that raises or hangs is named, and the layouts before it keep their results; those
after it still run unless a rank may be blocked in a collective with the failed one.
"""
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist

import harness
import rank_server
from harness import RankError, layout_results, run_layouts, run_ranks


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


def test_the_rendezvous_port_is_held_from_the_moment_it_is_chosen(monkeypatch):
    """Between choosing the ranks' port and the rendezvous on it, nobody else can take it. The old harness
    asked the system for a free port, let it go, and rank 0 bound it a second later: in CI a gloo socket
    of a test on the other worker took it in between (rank 0: EADDRINUSE, three tests failed). Here a
    squatter tries to take the port just before the ranks start."""
    squatter, squatted = socket.socket(), []
    start = harness._RANKS.Process.start

    def start_after_a_squat(process):
        port = process._args[3]                      # _rank_main(environment, rank, world_size, port, ...)
        if not squatted:
            try:
                squatter.bind(("127.0.0.1", port))
                squatter.listen()
                squatted.append(port)
            except OSError:                          # taken: held for the ranks
                squatted.append(None)
        start(process)
    monkeypatch.setattr(harness._RANKS.Process, "start", start_after_a_squat)
    with squatter:
        results = run_ranks(collectives_on_every_rank, world_size=2, timeout=60)
    assert squatted == [None], f"the squatter took the ranks' port {squatted[0]}"
    assert [out["all_reduce"] for out in results] == [[3.0] * 3] * 2


def many_tensors():
    return {f"p{i}": torch.full((256,), float(dist.get_rank() * 1000 + i)) for i in range(500)}


def test_ranks_can_return_many_tensors():
    """A state dict's worth of tensors comes back from every rank, even after the ranks have exited."""
    results = run_ranks(many_tensors, world_size=2, timeout=60)
    for rank, out in enumerate(results):
        assert len(out) == 500
        assert all(torch.equal(t, torch.full((256,), float(rank * 1000 + i)))
                   for i, t in enumerate(out.values()))


def not_imported(names):
    return [name for name in names if name not in sys.modules]


def test_ranks_start_with_the_project_imported():
    """The rank server imported the eight trainers, and so the project, before it forked the ranks: a rank
    does not compile them again (rank_server.py). This file, which the rank imports, imports none of them."""
    assert run_ranks(not_imported, world_size=2, args=(rank_server.TRAINERS,), timeout=60) == [[], []]


def layout(kind):
    """One layout of the tests below: sums the ranks (1 on 2 ranks) unless it raises or never ends."""
    rank = dist.get_rank()
    if kind == "raises everywhere":
        raise ValueError(f"layout broke on rank {rank}")
    if kind == "raises on rank 1":
        if rank == 1:
            raise ValueError("rank one broke")
        dist.barrier()   # rank 0 waits for rank 1, which never comes
    if kind == "never ends":
        time.sleep(60)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return total.item()


def test_a_failing_layout_names_itself_and_the_next_ones_run_unless_a_rank_is_blocked():
    """"broken" raised on every rank, so no rank waits for another: "after" runs. "one rank" raised on
    rank 1 while rank 0 waits for it in a barrier: going on would pair rank 1's next collectives with
    that barrier, so the ranks stop after `settle` s, and "last" says why it did not run."""
    kinds = {"first": "sum", "broken": "raises everywhere", "after": "sum", "one rank": "raises on rank 1",
             "last": "sum"}
    outcomes = run_layouts(layout, kinds, world_size=2, timeout=60, settle=2)
    assert layout_results(outcomes, "first") == layout_results(outcomes, "after") == [1.0, 1.0]
    failures = {"broken": r"layout broken failed on rank \d of 2 \(and on ranks \[\d\]\):\n(.|\n)*"
                          r"ValueError: layout broke on rank",
                # rank 0's barrier may fail too once rank 1 has gone: "(and on ranks [0])"
                "one rank": r"layout one rank failed on rank 1 of 2( \(and on ranks \[0\]\))?:\n(.|\n)*"
                            r"ValueError: rank one broke",
                "last": r"layout last was not run: layout one rank failed and not every rank finished it "
                        r"within 2s"}
    for layout_id, message in failures.items():
        with pytest.raises(RankError, match=message):
            layout_results(outcomes, layout_id)


def test_a_layout_that_never_ends_is_named_and_the_ones_before_it_stand():
    """After `timeout` s of silence the layout the ranks are in is named; the one after it was not run."""
    kinds = {"first": "sum", "stuck": "never ends", "last": "sum"}
    outcomes = run_layouts(layout, kinds, world_size=2, timeout=10)
    assert layout_results(outcomes, "first") == [1.0, 1.0]
    with pytest.raises(RankError, match=r"layout stuck did not finish on ranks \[0, 1\]: ranks \[0, 1\] "
                                        r"sent nothing for 10s while in layouts \{0: 'stuck', 1: 'stuck'\}"):
        layout_results(outcomes, "stuck")
    with pytest.raises(RankError, match=r"layout last was not run: ranks \[0, 1\] sent nothing"):
        layout_results(outcomes, "last")
