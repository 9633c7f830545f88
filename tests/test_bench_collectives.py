"""02_data_parallel/bench_collectives.py: the bus bandwidth is nccl-tests' arithmetic; every result is right.

Real gloo ranks: a world of 2 (one node) and of 4 measured as 2 nodes of 2 (--ranks-per-node 2: the intra
and the inter groups). Sizes that no count divides (60, 480, 3840 bytes) make the benchmark round as
nccl-tests does. `nccl_tests` transcribes each src/*.cu's GetCollByteCount and GetBw (NVIDIA/nccl-tests):
S, algbw and busbw of every record must equal them bit for bit, from the requested size, the element
size, n and the measured seconds. The check must fail when a collective did not run (the buffers keep
their inputs).
"""
import math

import pytest
import torch

from harness import run_ranks

import bench_collectives
import bus_bandwidth

SWEEP = ["--min-bytes", "60", "--max-bytes", "4K", "--factor", "8", "--iters", "2", "--warmup", "1"]
REQUESTED = [60, 480, 3840]


def nccl_tests(collective: str, requested: int, typesize: int, n: int, sec: float):
    """(S bytes, algbw, busbw GB/s) as nccl-tests computes them for `requested` bytes (its -b/-e sizes)."""
    count = requested // typesize                                            # common.cu: size / wordSize
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        param = count // n                                       # sendcount, recvcount, count/nranks
        base = param * n * typesize / 1.0E9 / sec                            # (count * typesize * nranks)
        factor = (n - 1) / n                                                 # ((double)(nranks-1))/nranks
    else:
        param = count
        base = param * typesize / 1.0E9 / sec
        factor = 2 * (n - 1) / n if collective == "all_reduce" else 1        # broadcast, sendrecv: 1
    size = param * n * typesize if collective in ("all_gather", "reduce_scatter", "all_to_all") else \
        param * typesize
    return size, base, base * factor


def _bench(argv):
    records = bench_collectives.main(argv)
    # a collective that does not run: the all-reduce's buffer keeps this rank's input
    run, expected, result, _ = bench_collectives.case("all_reduce", "in", 64, None, torch.device("cpu"),
                                                      torch.float32)
    return records, bench_collectives.checked(lambda: None, expected, result, torch.device("cpu"))


@pytest.mark.parametrize("world, per_node", [(2, 2), (4, 2)], ids=["world2", "world4-two-nodes"])
def test_bus_bandwidth_is_nccl_tests_arithmetic_and_results_are_right(world, per_node, tmp_path):
    out = tmp_path / "links.jsonl"
    results = run_ranks(_bench, world, args=(SWEEP + ["--ranks-per-node", str(per_node), "--out", str(out)],))
    records, caught = results[0]
    assert all(r[1] is False for r in results), "the check passed a collective that did not run"
    assert all(r[0] == records for r in results)                             # the same list on every rank
    scopes = {("intra", per_node)} | ({("inter", world // per_node)} if world > per_node else set())
    assert {(r["scope"], r["ranks"]) for r in records} == scopes
    rows = {(c, p) for c, places in bench_collectives.PLACES.items() for p in places}
    assert len(records) == len(scopes) * len(rows) * len(REQUESTED)
    for record, requested in zip(records, REQUESTED * (len(records) // 3)):
        assert record["correct"], record
        n, seconds = record["ranks"], record["seconds"]
        size, algbw, busbw = nccl_tests(record["collective"], requested, 4, n, seconds)
        assert (record["bytes"], record["algbw"], record["busbw"]) == (size, algbw, busbw), record
    assert bus_bandwidth.read_records(out) == records                         # what the planner reads


def test_a_world_of_one_proves_the_path_at_zero_bus_bandwidth():
    """`python bench_collectives.py` (no torchrun): one rank, in its own memory. The collectives run and
    are right; all-reduce, all-gather, reduce-scatter and all-to-all move nothing, so their busbw is 0
    (factor (n−1)/n); send/recv has no peer and is left out."""
    records = bench_collectives.main(["--min-bytes", "1K", "--max-bytes", "1K", "--iters", "1"])
    assert records and all(r["correct"] and r["ranks"] == 1 for r in records)
    assert "send_recv" not in {r["collective"] for r in records}
    for r in records:
        assert r["busbw"] == (r["algbw"] if r["collective"] == "broadcast" else 0.0)
        assert math.isfinite(r["algbw"]) and r["algbw"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--ranks-per-node", "3"], "--ranks-per-node 3 does not divide the world of 4 ranks"),
    (["--collectives", "all_reduce,gather"], "--collectives takes all_reduce,"),
    (["--min-bytes", "2M", "--max-bytes", "1M"], "need --min-bytes ≤ --max-bytes"),
    (["--min-bytes", "1X"], "a size in bytes such as 64, 4K, 64M or 1G"),
    (["--plot", "links.svg"], "the plot is a PNG"),
], ids=["per-node", "collective", "sizes", "size-text", "plot"])
def test_bad_flags_stop_before_any_process_group(flags, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as stop:
        bench_collectives.main(flags)
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not torch.distributed.is_initialized()
