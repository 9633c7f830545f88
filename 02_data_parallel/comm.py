"""The flat-tensor collectives every folder calls, and a meter for what crosses the wire.

Playbook §5.1 (collective operations) and ZeRO §7 (communication volume). Two parts:

1. `all_gather_flat` / `reduce_scatter_flat`: torch 2.13 renamed `all_gather_into_tensor` and
   `reduce_scatter_tensor` to `*_single` and warns on the old names, while torch 2.11 may lack the
   new ones; they are wrapped here once.

2. `CommMeter`: `with CommMeter(grid.group_names()) as meter:` counts every collective and
   point-to-point call made through `torch.distributed` inside the block, per operation and per
   process group, without the technique code knowing about it: the group is read from the call's
   arguments, keyword or positional (a call without one counts as "world"), and each P2POp of a
   `batch_isend_irecv` counts as the isend or irecv it is. Technique code calls torch as usual.
   Collectives inside torch.compile'd code are not counted, and the table says so (`_compiled_note`).

Bytes per rank for a collective over N ranks on a K-byte tensor (the table of every operation is in
02_data_parallel/README.md): payload K; wire = the bytes this rank sends with the ring algorithm,
2(N−1)K/N for all_reduce, (N−1)K/N for all_gather, reduce_scatter, broadcast and reduce, the bytes
sent to the others for all_to_all, K for send/isend (0 for recv/irecv). So plain data parallelism
moves 2Ψ(N−1)/N bytes of gradients per rank per step, "2Ψ" in the ZeRO paper's units.

    torchrun --nproc_per_node 4 02_data_parallel/train.py --dp 4   # prints the meter's table

New compared with 01: 01 communicates nothing; every later folder's tables come from this meter.
"""
import functools
import inspect
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

# ======================================================================================
# Flat collectives with one name on torch 2.11 and 2.13
# ======================================================================================
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER = ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
                   else "reduce_scatter_tensor")


def all_gather_flat(output, input, group=None, async_op=False):
    """output (N·K,) = concat of every rank's input (K,), in group-rank order."""
    return getattr(dist, _ALL_GATHER)(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """output (K,) on group-rank r = sum over ranks of input[r·K:(r+1)·K] (input is (N·K,))."""
    return getattr(dist, _REDUCE_SCATTER)(output, input, op=op, group=group, async_op=async_op)


# ======================================================================================
# The meter
# ======================================================================================
def _nbytes(t):
    return t.numel() * t.element_size()


def _wire_bytes(op, n, group, args):
    """(payload, wire) bytes of one call, by the conventions in the module docstring; `args` are the
    call's arguments in the order of torch's signature, defaults filled in."""
    if op == "barrier":  # no tensor
        return 0, 0
    if op == "all_to_all_single":  # (output, input, output_split_sizes, input_split_sizes)
        inp = args[1]
        splits = args[3] or [inp.shape[0] // n] * n
        row = _nbytes(inp) // max(inp.shape[0], 1)
        return _nbytes(inp), row * (sum(splits) - splits[dist.get_rank(group)])
    if op in ("send", "isend"):
        return _nbytes(args[0]), _nbytes(args[0])
    if op in ("recv", "irecv"):
        return _nbytes(args[0]), 0
    return _ring_bytes(op, n, args)


def _ring_bytes(op, n, args):
    """(payload K, wire) of a collective the ring algorithm runs over n ranks; (0, 0) for another op."""
    # exercise 02.6: the meter's bytes of a ring collective
    # hint: [PB] App. §5.1, ZeRO §7.1 (02's README, "The meter's byte conventions"; 02.1's ring): a ring
    #   reduce-scatter or all-gather sends n−1 of the n chunks of K, an all-reduce is the two, broadcast and
    #   reduce are counted as one phase. K is the full-size tensor, whichever argument of torch's signature
    #   holds it (the list forms hold one piece per rank).
    # test: tests/test_collectives.py::test_meter_counts_the_ring_algorithms_bytes_per_rank
    if op == "all_reduce":
        k = _nbytes(args[0])
        return k, 2 * (n - 1) * k // n
    if op in ("broadcast", "reduce"):
        k = _nbytes(args[0])
        return k, (n - 1) * k // n
    if op in (_ALL_GATHER, "all_gather_into_tensor", "all_gather_single"):   # (output, input)
        k = _nbytes(args[0])
        return k, (n - 1) * k // n
    if op in (_REDUCE_SCATTER, "reduce_scatter_tensor", "reduce_scatter_single"):  # (output, input)
        k = _nbytes(args[1])
        return k, (n - 1) * k // n
    if op == "all_gather":  # (tensor_list, tensor)
        k = n * _nbytes(args[1])
        return k, (n - 1) * k // n
    if op == "reduce_scatter":  # (output, input_list)
        k = sum(_nbytes(t) for t in args[1])
        return k, (n - 1) * k // n
    return 0, 0
    # end exercise


METERED = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all_single",
           "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single",
           "send", "recv", "isend", "irecv", "barrier")


def _unmetered(fn):
    """torch's own function under the wrappers of any active meters."""
    while hasattr(fn, "unmetered"):
        fn = fn.unmetered
    return fn


class _P2POp(dist.distributed_c10d.P2POp):
    """`dist.P2POp` while a meter is active: torch's P2POp holding torch's own isend/irecv when given
    the meter's wrappers, since P2POp checks `op in [isend, irecv]` and `batch_isend_irecv` runs
    `op.op` (testing `op.op is isend`) with identity against torch's functions."""

    def __new__(cls, op, *args, **kwargs):
        return super().__new__(cls, _unmetered(op), *args, **kwargs)

    def __init__(self, op, *args, **kwargs):
        super().__init__(_unmetered(op), *args, **kwargs)


class CommMeter:
    """Counts calls and bytes per (operation, group name) while active. See the module docstring."""

    def __init__(self, group_names: dict | None = None):
        self.group_names = dict(group_names or {})
        self.calls = defaultdict(int)
        self.payload = defaultdict(int)
        self.wire = defaultdict(int)
        self._saved = {}
        self.paused = False

    def _group_name(self, group):
        if group is None or group is dist.group.WORLD:
            return "world"
        return self.group_names.get(id(group), f"group{dist.get_process_group_ranks(group)}")

    def _count(self, op, group, args):
        if self.paused:
            return
        payload, wire = _wire_bytes(op, dist.get_world_size(group), group, args)
        key = (op.replace("_single", "").replace("_into_tensor", "").replace("_tensor", ""),
               self._group_name(group))
        self.calls[key] += 1
        self.payload[key] += payload
        self.wire[key] += wire

    def _wrap(self, op, fn):
        signature = inspect.signature(fn)  # of torch's function (wraps below lets a nested meter see it)

        @functools.wraps(fn)
        def metered(*args, **kwargs):
            if torch.compiler.is_compiling():   # traced into a graph: see _compiled_note
                return fn(*args, **kwargs)
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()
            self._count(op, call.arguments.get("group"), list(call.arguments.values()))
            return fn(*args, **kwargs)
        metered.unmetered = fn
        return metered

    def _wrap_batch(self, fn):
        @functools.wraps(fn)
        def metered(p2p_op_list):
            if torch.compiler.is_compiling():
                return fn(p2p_op_list)
            for p2p in p2p_op_list:   # torch runs p2p.op unwrapped: count it here, once
                op = "isend" if p2p.op is dist.distributed_c10d.isend else "irecv"
                self._count(op, p2p.group, [p2p.tensor])
            return fn(p2p_op_list)
        metered.unmetered = fn
        return metered

    def __enter__(self):
        for op in METERED:
            if hasattr(dist, op):
                self._saved[op] = getattr(dist, op)
                setattr(dist, op, self._wrap(op, self._saved[op]))
        self._saved["batch_isend_irecv"], self._saved["P2POp"] = dist.batch_isend_irecv, dist.P2POp
        dist.batch_isend_irecv, dist.P2POp = self._wrap_batch(dist.batch_isend_irecv), _P2POp
        return self

    def __exit__(self, *exc):
        for op, fn in self._saved.items():
            setattr(dist, op, fn)
        self._saved.clear()

    def unmetered(self, fn):
        """`fn`, whose calls are not counted: evaluation's forward passes (the tables are per step)."""
        @functools.wraps(fn)
        def run(*args, **kwargs):
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False
        return run

    def reset(self):
        self.calls.clear(), self.payload.clear(), self.wire.clear()

    def total_wire(self, op=None, group=None) -> int:
        return sum(v for (o, g), v in self.wire.items() if op in (None, o) and group in (None, g))

    def table(self, title="communication per rank", steps: int = 1) -> str:
        """One row per (operation, group); divided by `steps` for a per-step average."""
        rows = [f"{title}:",
                f"  {'operation':<16}{'group':<10}{'calls':>7}{'payload MiB':>12}{'wire MiB':>10}"]
        for key in sorted(self.calls):
            calls = (self.calls[key] // steps if self.calls[key] % steps == 0
                     else round(self.calls[key] / steps, 2))
            rows.append(f"  {key[0]:<16}{key[1]:<10}{calls:>7}{self.payload[key] / steps / 2**20:>12.3f}"
                        f"{self.wire[key] / steps / 2**20:>10.3f}")
        return "\n".join(rows + _compiled_note())


def _compiled_note() -> list:
    """The table's last line once torch.compile has made a graph in this process. The meter counts in
    Python, which a compiled graph never runs: counting there would happen once, while tracing, and a
    counter mutated inside an autograd.Function breaks the graph. So the wrappers stay out of the trace
    (a layer stays one graph) and the collectives of compiled code (--compile's layers) are not counted."""
    dynamo = sys.modules.get("torch._dynamo")     # imported by torch.compile's first use
    if dynamo is None or not dynamo.utils.counters["stats"]["unique_graphs"]:
        return []
    return ["  (collectives inside torch.compile'd code are not counted: run without --compile for them)"]
