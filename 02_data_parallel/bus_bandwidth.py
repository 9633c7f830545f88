"""nccl-tests' algorithm and bus bandwidth of a collective, and bench_collectives.py's records read back.

nccl-tests (NVIDIA, doc/PERFORMANCE.md and each src/*.cu's GetBw): an operation on S bytes that took t
seconds has the algorithm bandwidth algbw = S/t, and the bus bandwidth busbw = algbw · factor(n) over n
ranks: what each rank's link carried per second, comparable with the link's peak whatever n is.

    collective      S                                              factor
    all_reduce      the array                                      2(n−1)/n
    all_gather      the gathered output: n × each rank's input     (n−1)/n
    reduce_scatter  the input: n × each rank's output              (n−1)/n
    all_to_all      each rank's send buffer: n pieces              (n−1)/n
    broadcast       the array                                      1
    send_recv       what each rank sends (to its ring neighbour)   1

The bytes a rank sends by 02's meter (comm.py, the ring) are factor · S, so a time predicted as those
bytes / busbw is the planner's (08). At n = 1 the first four factors are 0: nothing crosses a link, and
the bus bandwidth is zero by definition; a world of one only proves the path. GB/s: 1e9 bytes/s.
"""
import json
from pathlib import Path

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n,
              "all_to_all": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0,
              "send_recv": lambda n: 1.0}
COLLECTIVES = tuple(BUS_FACTOR)
FIELDS = {"collective", "scope", "bytes", "busbw", "correct"}       # what the planner reads of a record


def algbw(size_bytes: int, seconds: float) -> float:
    """S/t in GB/s, in nccl-tests' order of operations (S / 1e9 / t)."""
    return size_bytes / 1e9 / seconds


def busbw(collective: str, size_bytes: int, seconds: float, n: int) -> float:
    """algbw · nccl-tests' factor for `collective` over n ranks, in GB/s."""
    return algbw(size_bytes, seconds) * BUS_FACTOR[collective](n)


def read_records(path) -> list:
    """The JSON lines bench_collectives.py wrote (--out); a ValueError naming the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--bandwidths {path}: no such file; write it with `torchrun ... "
                         f"02_data_parallel/bench_collectives.py --out {path}`")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as error:
            raise ValueError(f"--bandwidths {path} line {number} is not JSON ({error}): pass the file "
                             f"bench_collectives.py --out wrote") from None
        if record is None:
            continue
        if not isinstance(record, dict) or not FIELDS <= set(record):
            raise ValueError(f"--bandwidths {path} line {number} is not a record of bench_collectives.py "
                             f"(collective, scope, bytes, busbw, correct): pass the file its --out wrote")
        records.append(record)
    if not records:
        raise ValueError(f"--bandwidths {path} holds no records: run bench_collectives.py --out {path}")
    return records


def large_message(records) -> dict:
    """{(collective, scope): the record of the largest size measured}, out-of-place where both were
    measured at that size (the faster placement otherwise hides a copy); wrong results are refused."""
    best = {}
    for record in records:
        if not record["correct"]:
            raise ValueError(f"{record['collective']} at {record['bytes']} bytes ({record['scope']}) gave a "
                             f"wrong result: its bandwidth means nothing; fix the setup and measure again")
        key = (record["collective"], record["scope"])
        rank = (record["bytes"], record.get("place") == "out")
        if key not in best or rank > (best[key]["bytes"], best[key].get("place") == "out"):
            best[key] = record
    return best
