"""How fast are the links? Every collective the techniques use, timed over a sweep of sizes (nccl-tests).

Playbook App. §5.1 (the collectives) and §3.5 (benchmarking); nccl-tests' definitions (bus_bandwidth.py).
all_reduce, all_gather, reduce_scatter, all_to_all, broadcast and send/recv (each rank to its ring
neighbour), from --min-bytes to --max-bytes by --factor, in place and out of place where torch has both
(all_gather's input is its slice of the output, reduce_scatter's output its slice of the input;
all_reduce and broadcast work in place only, all_to_all and send/recv out of place only). Per row: the
median of --iters timed iterations after --warmup (CUDA events on a GPU), each the slowest rank's time;
algbw and busbw; and a check that every rank's result is exactly right (small integers: sums are exact).
NCCL with --device cuda, gloo on the CPU (02's process grid chooses). A world over several nodes (torchrun's
LOCAL_WORLD_SIZE ranks each, or --ranks-per-node) is measured twice: the groups inside each node (the grid's
tp groups) and the groups of one rank per node (its dp groups), all groups of a scope at once, as in training.

    torchrun --nproc_per_node 8 02_data_parallel/bench_collectives.py --device cuda --out links.jsonl
    torchrun --nproc_per_node 4 02_data_parallel/bench_collectives.py --max-bytes 64M --plot links.png
    python 08_5d_combined/planner.py --search --bandwidths links.jsonl ...   # the planner uses them

New compared with collectives_demo.py: the same operations, timed where bandwidth, not latency, counts.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime"),
                os.path.join(ROOT, "02_data_parallel")]

import argparse
import json
import platform
import re
import time

import torch
import torch.distributed as dist

import cli_checks
import process_grid
from rank0 import print0
import comm
import bus_bandwidth

PLACES = {"all_reduce": ("in",), "broadcast": ("in",), "all_gather": ("out", "in"),
          "reduce_scatter": ("out", "in"), "all_to_all": ("out",), "send_recv": ("out",)}
DIVIDED = ("all_gather", "reduce_scatter", "all_to_all")     # S is n pieces: the count is a multiple of n
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_size(text: str) -> int:
    """'64', '4K', '64M', '1G' (powers of 1024) -> bytes."""
    match = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not match or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size in bytes such as 64, 4K, 64M or 1G")
    return int(match.group(1)) * 1024 ** " KMG".index(match.group(2) or " ")


# ======================================================================================
# One collective on one group: the buffers, the call, the expected result
# ======================================================================================
def case(collective: str, place: str, size: int, group, device, dtype):
    """(run, expected result, the tensor holding the result, S bytes) on this rank of `group`, with its
    buffers holding the check's values: small integers, so every sum is exact in float32 and bfloat16."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    e = torch.empty((), dtype=dtype).element_size()
    count = max(size // e // n * n, n) if collective in DIVIDED else max(size // e, 1)
    piece = count // n
    index = torch.arange(count, device=device) % 7                           # (count,)
    full = lambda values: values.to(dtype)                                   # noqa: E731
    if collective == "all_reduce":
        x = full(r + 1 + index)                                              # (count,), summed in place
        return (lambda: dist.all_reduce(x, group=group)), full(n * (n + 1) // 2 + n * index), x, count * e
    if collective == "broadcast":
        x = full((1 + index) * (r == 0))                                     # group rank 0's array to all
        root = dist.get_global_rank(group, 0)
        return (lambda: dist.broadcast(x, src=root, group=group)), full(1 + index), x, count * e
    if collective == "all_gather":
        out = torch.zeros(count, device=device, dtype=dtype)                # (n·piece,)
        mine = out[r * piece:(r + 1) * piece] if place == "in" else torch.empty(piece, device=device,
                                                                                 dtype=dtype)
        mine.copy_(full(r + 1 + index[:piece]))                             # (piece,) rank j's: j + 1 + k%7
        expected = full(torch.arange(count, device=device) // piece + 1 + index[:piece].repeat(n))
        return (lambda: comm.all_gather_flat(out, mine, group=group)), expected, out, count * e
    if collective == "reduce_scatter":
        inp = full(r + 1 + index)                                            # (n·piece,)
        out = inp[r * piece:(r + 1) * piece] if place == "in" else torch.empty(piece, device=device,
                                                                                dtype=dtype)
        expected = full(n * (n + 1) // 2 + n * index[r * piece:(r + 1) * piece])     # (piece,)
        return (lambda: comm.reduce_scatter_flat(out, inp, group=group)), expected, out, count * e
    if collective == "all_to_all":
        pieces = torch.arange(count, device=device) // piece                 # (n·piece,) which peer's piece
        inp, out = full(r * n + pieces + 1), torch.empty(count, device=device, dtype=dtype)
        expected = full(pieces * n + r + 1)                                  # piece j: rank j's piece r
        return (lambda: dist.all_to_all_single(out, inp, group=group)), expected, out, count * e
    send = full(torch.full((count,), r + 1, device=device))                  # send_recv: to r+1, from r−1
    recv = torch.zeros(count, device=device, dtype=dtype)
    right, left = (dist.get_global_rank(group, (r + k) % n) for k in (1, -1))

    def exchange():
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                            dist.P2POp(dist.irecv, recv, left, group)]):
            work.wait()
    return exchange, full(torch.full((count,), (r - 1) % n + 1, device=device)), recv, count * e


def timed(run, iters: int, warmup: int, device) -> float:
    """The median over `iters` of each iteration's time on the slowest rank of the world (every group of
    the scope runs at once, started together by a barrier)."""
    for _ in range(warmup):
        run()
    times, events = [], []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            events.append((start, end))
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    if events:
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.median())


def checked(run, expected, result, device) -> bool:
    """Whether every rank's `result` equals `expected` exactly after one `run`."""
    run()
    right = torch.tensor([int(torch.equal(result, expected))], device=device)
    dist.all_reduce(right, op=dist.ReduceOp.MIN)
    return bool(right.item())


# ======================================================================================
# The sweep over scopes, collectives, placements and sizes
# ======================================================================================
def scopes(grid, per_node: int) -> list:
    """[(scope, this rank's group, its ranks, groups at once)]: one node's ranks and one rank per node."""
    nodes = grid.world_size // per_node
    found = [("intra", grid.tp_group, per_node, nodes)]
    return found + ([("inter", grid.dp_group, nodes, per_node)] if nodes > 1 else [])


def sizes(args) -> list:
    found, size = [], args.min_bytes
    while size <= args.max_bytes:
        found.append(size)
        size *= args.factor
    return found


def measure(args, grid, device) -> list:
    """Every record of the sweep (the same list on every rank); rank 0 prints the table as it goes."""
    records, dtype = [], DTYPES[args.dtype]
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    common = dict(backend=dist.get_backend(), device=name,
                  host=platform.node(), dtype=args.dtype, iters=args.iters, torch=torch.__version__,
                  date=time.strftime("%Y-%m-%d"))
    for scope, group, n, at_once in scopes(grid, args.ranks_per_node):
        clock = "CUDA events" if device.type == "cuda" else "wall clock"
        print0(f"\n{scope}-node: {at_once} group(s) of {n} rank(s) at once, {common['backend']}, "
               f"{args.dtype}, median of {args.iters} iterations ({clock})"
               + ("; n = 1: nothing crosses a link, busbw is zero by definition" if n == 1 else ""))
        print0(f"{'place':<6}{'collective':<16}{'bytes':>12}{'time':>14}{'algbw GB/s':>12}{'busbw GB/s':>12}"
               f"  check")
        for collective in args.collectives:
            if collective == "send_recv" and n == 1:
                print0(f"-     {collective:<16}(no peer in a group of one rank)")
                continue
            for place in [p for p in PLACES[collective] if p in args.place]:
                for size in sizes(args):
                    run, expected, result, nbytes = case(collective, place, size, group, device, dtype)
                    correct = checked(run, expected, result, device)
                    seconds = timed(run, args.iters, args.warmup, device)
                    record = dict(collective=collective, place=place, scope=scope, ranks=n, groups=at_once,
                                  bytes=nbytes, seconds=seconds,
                                  algbw=bus_bandwidth.algbw(nbytes, seconds),
                                  busbw=bus_bandwidth.busbw(collective, nbytes, seconds, n),
                                  correct=correct, **common)
                    records.append(record)
                    verdict = "ok" if correct else "WRONG"
                    print0(f"{place:<6}{collective:<16}{nbytes:>12}{seconds:>12.6f} s{record['algbw']:>12.3f}"
                           f"{record['busbw']:>12.3f}  {verdict}")
                    del run, expected, result
    return records


def plot(records, path):
    """Bus bandwidth against size, one line per collective (dashed: in place), one panel per scope."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({r["scope"] for r in records}, key=("intra", "inter").index)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, scope in zip(axes[0], panels):
        mine = [r for r in records if r["scope"] == scope]
        for k, collective in enumerate(dict.fromkeys(r["collective"] for r in mine)):
            for place, style in (("out", "-"), ("in", "--")):
                line = [r for r in mine if r["collective"] == collective and r["place"] == place]
                if line:
                    ax.plot([r["bytes"] for r in line], [r["busbw"] for r in line], style, marker=".",
                            color=f"C{k}", label=f"{collective}{' (in place)' if place == 'in' else ''}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size S (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"{scope}-node, {mine[0]['ranks']} ranks, {mine[0]['backend']}: {mine[0]['device']}",
                     fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL; cpu: gloo")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--min-bytes", type=parse_size, default=parse_size("1K"))
    p.add_argument("--max-bytes", type=parse_size, default=parse_size("1G"))
    p.add_argument("--factor", type=int, default=4, help="each size is the previous one × this")
    p.add_argument("--collectives", default=",".join(bus_bandwidth.COLLECTIVES),
                   type=lambda text: text.split(","), help="a comma-separated list")
    p.add_argument("--place", default="out,in", type=lambda text: text.split(","),
                   help="out, in or out,in (where torch has the placement)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per row")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    p.add_argument("--ranks-per-node", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None,
                   help="default: torchrun's LOCAL_WORLD_SIZE (set it to measure a one-node world as nodes)")
    p.add_argument("--out", metavar="JSONL", help="one JSON record per row (planner.py --bandwidths)")
    p.add_argument("--plot", metavar="PNG", help="bus bandwidth against size")
    p.add_argument("--timeout-s", type=float, default=600.0, help="a collective waiting longer fails")
    return p


def check(args, world: int):
    """Every bad flag, before any process group exists: a ValueError naming the fix."""
    unknown = sorted(set(args.collectives) - set(bus_bandwidth.COLLECTIVES))
    if unknown or not set(args.place) <= {"in", "out"}:
        raise ValueError(f"--collectives takes {','.join(bus_bandwidth.COLLECTIVES)} and --place out,in; got "
                         f"{','.join(unknown or args.place)}")
    if args.min_bytes > args.max_bytes or args.factor < 2 or args.iters < 1 or args.warmup < 0:
        raise ValueError("need --min-bytes ≤ --max-bytes, --factor ≥ 2, --iters ≥ 1 and --warmup ≥ 0")
    if args.ranks_per_node is not None and (args.ranks_per_node < 1 or world % args.ranks_per_node):
        raise ValueError(f"--ranks-per-node {args.ranks_per_node} does not divide the world of {world} ranks")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA GPU; drop the flag to measure gloo on the CPU")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ValueError(f"--plot {args.plot}: the plot is a PNG; name the file *.png")
    cli_checks.check_output_file(args.out, "--out")
    cli_checks.check_output_file(args.plot, "--plot")


def main(argv=None) -> list:
    parser = build_parser()
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        check(args, world)
    except ValueError as error:
        parser.error(str(error))
    per_node = args.ranks_per_node or world
    args = argparse.Namespace(**{**vars(args), "ranks_per_node": per_node})
    with process_grid.distributed(args.device, dp=world // per_node, tp=per_node,
                                  timeout_s=args.timeout_s) as grid:
        device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else \
            torch.device("cpu")
        records = measure(args, grid, device)
    if grid.rank == 0 and args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
        print(f"records: {args.out}")
    if grid.rank == 0 and args.plot:
        plot(records, args.plot)
        print(f"plot: {args.plot}")
    return records


if __name__ == "__main__":
    main()
