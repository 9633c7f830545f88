"""The flat-tensor collectives every folder calls, and a meter for what crosses the wire.

Playbook §5.1 (collective operations) and ZeRO §7 (communication volume). Two parts:

1. `all_gather_flat` / `reduce_scatter_flat`: torch 2.13 renamed `all_gather_into_tensor` and
   `reduce_scatter_tensor` to `*_single` and warns on the old names, while torch 2.11 may lack the
   new ones; they are wrapped here once.

2. `CommMeter`: `with CommMeter(grid.group_names()) as meter:` counts every collective and
   point-to-point call made through `torch.distributed` inside the block, per operation and per
   process group, without the technique code knowing about it. Pass the group by keyword
   (`group=...`), as this project always does; a call without one is counted as "world". Call `dist.isend`/`dist.irecv`
   directly rather than `batch_isend_irecv`, whose `P2POp` checks identity with the unwrapped ops.

Byte conventions (per rank, for a collective over N ranks on a K-byte tensor, where K is the
full-size tensor: the all-reduced tensor, the gathered output, the reduce-scattered input):
    payload  K                          what the call operates on
    wire     ring algorithm, bytes this rank sends:
             all_reduce      2(N−1)K/N    (reduce-scatter phase + all-gather phase)
             all_gather      (N−1)K/N     reduce_scatter (N−1)K/N
             broadcast/reduce K·(N−1)/N   (pipelined ring: each rank forwards every chunk once;
                                           counted alike on every rank)
             all_to_all      the bytes sent to the other ranks
             send / isend    K            recv / irecv  0 (counted by the sender)
So plain data parallelism moves 2Ψ(N−1)/N bytes of gradients per rank per step: "2Ψ" in the ZeRO
paper's units, and ZeRO-1/2's reduce-scatter + all-gather move the same.
"""
from collections import defaultdict

import torch.distributed as dist

# ======================================================================================
# Flat collectives with one name on torch 2.11 and 2.13
# ======================================================================================
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


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


def _wire_bytes(op, n, args, kwargs):
    """(payload, wire) bytes of one call, by the conventions in the module docstring."""
    if op == "barrier":  # no tensor (and maybe no arguments at all)
        return 0, 0
    a0 = args[0] if args else next(iter(kwargs.values()))
    if op == "all_reduce":
        k = _nbytes(a0)
        return k, 2 * (n - 1) * k // n
    if op in ("broadcast", "reduce"):
        k = _nbytes(a0)
        return k, (n - 1) * k // n
    if op in (_ALL_GATHER, "all_gather_into_tensor", "all_gather_single"):   # (output, input)
        k = _nbytes(a0)
        return k, (n - 1) * k // n
    if op in (_REDUCE_SCATTER, "reduce_scatter_tensor", "reduce_scatter_single"):  # (output, input)
        k = _nbytes(args[1] if len(args) > 1 else kwargs["input"])
        return k, (n - 1) * k // n
    if op == "all_gather":  # (tensor_list, tensor)
        k = n * _nbytes(args[1])
        return k, (n - 1) * k // n
    if op == "reduce_scatter":  # (output, input_list)
        k = sum(_nbytes(t) for t in args[1])
        return k, (n - 1) * k // n
    if op == "all_to_all_single":  # (output, input, output_splits, input_splits)
        inp = args[1]
        splits = (args[3] if len(args) > 3 else kwargs.get("input_split_sizes")) or [inp.shape[0] // n] * n
        row = _nbytes(inp) // max(inp.shape[0], 1)
        me = dist.get_rank(kwargs.get("group"))
        return _nbytes(inp), row * (sum(splits) - splits[me])
    if op in ("send", "isend"):
        return _nbytes(a0), _nbytes(a0)
    if op in ("recv", "irecv"):
        return _nbytes(a0), 0
    return 0, 0  # barrier


METERED = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all_single",
           "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single",
           "send", "recv", "isend", "irecv", "barrier")


class CommMeter:
    """Counts calls and bytes per (operation, group name) while active. See the module docstring."""

    def __init__(self, group_names: dict | None = None):
        self.group_names = dict(group_names or {})
        self.calls = defaultdict(int)
        self.payload = defaultdict(int)
        self.wire = defaultdict(int)
        self._saved = {}

    def _group_name(self, group):
        if group is None or group is dist.group.WORLD:
            return "world"
        return self.group_names.get(id(group), f"group{dist.get_process_group_ranks(group)}")

    def _wrap(self, op, fn):
        def metered(*args, **kwargs):
            group = kwargs.get("group")  # this project always passes the group by keyword
            n = dist.get_world_size(group)
            payload, wire = _wire_bytes(op, n, args, kwargs)
            key = (op.replace("_single", "").replace("_into_tensor", "").replace("_tensor", ""),
                   self._group_name(group))
            self.calls[key] += 1
            self.payload[key] += payload
            self.wire[key] += wire
            return fn(*args, **kwargs)
        return metered

    def __enter__(self):
        for op in METERED:
            if hasattr(dist, op):
                self._saved[op] = getattr(dist, op)
                setattr(dist, op, self._wrap(op, self._saved[op]))
        return self

    def __exit__(self, *exc):
        for op, fn in self._saved.items():
            setattr(dist, op, fn)
        self._saved.clear()

    def reset(self):
        self.calls.clear(), self.payload.clear(), self.wire.clear()

    def total_wire(self, op=None, group=None) -> int:
        return sum(v for (o, g), v in self.wire.items() if op in (None, o) and group in (None, g))

    def table(self, title="communication per rank", steps: int = 1) -> str:
        """One row per (operation, group); divided by `steps` for a per-step average."""
        rows = [f"{title}:", f"  {'operation':<16}{'group':<10}{'calls':>7}{'payload MiB':>12}{'wire MiB':>10}"]
        for key in sorted(self.calls):
            calls = self.calls[key] // steps if self.calls[key] % steps == 0 else round(self.calls[key] / steps, 2)
            rows.append(f"  {key[0]:<16}{key[1]:<10}{calls:>7}{self.payload[key] / steps / 2**20:>12.3f}"
                        f"{self.wire[key] / steps / 2**20:>10.3f}")
        return "\n".join(rows)
