"""The planner's links: the bus bandwidth each dimension's bytes move at, typed or measured.

Typed: --bw-intra and --bw-inter, one figure (GB/s) for every collective inside a node and across nodes.
Measured: --bandwidths FILE, the records of 02's bench_collectives.py: per scope (intra: a node's ranks;
inter: one rank per node) the bus bandwidth each collective reached at the largest size measured
(02's bus_bandwidth.large_message). A dimension's bytes then move at its own collectives' figure:

    tp     all_reduce; with SP all_gather and reduce_scatter
    cp     send_recv (ring), all_gather and reduce_scatter (all-gathered K/V), all_to_all (Ulysses)
    pp     send_recv
    dp     all_reduce; with ZeRO reduce_scatter and all_gather (zero3: the same)
    ep     all_to_all

Two collectives that carry half of a dimension's bytes each take the time of their harmonic mean,
2/(1/a + 1/b). Which scope a dimension uses is `bandwidths`' rank order. A scope the file lacks
(one node measured, a layout across nodes) takes --bw-intra/--bw-inter, else the --gpu datasheet's figure;
the planner prints every figure it used.

    python 08_5d_combined/planner.py --search --gpus 8 --bandwidths links.jsonl --preset 1b --seq-len 4096
"""
import argparse
from dataclasses import dataclass

import bus_bandwidth


@dataclass(frozen=True)
class Measured:
    """One scope's bus bandwidths in bytes/s per collective, and what measured them."""
    scope: str
    busbw: dict
    source: str

    def for_dimension(self, layout, dim: str) -> float:
        names = collectives(layout, dim)
        missing = [name for name in names if name not in self.busbw]
        if missing:
            raise ValueError(f"--bandwidths ({self.source}) has no {self.scope}-node {', '.join(missing)}: "
                             f"measure it with bench_collectives.py --collectives {','.join(missing)}")
        return len(names) / sum(1 / self.busbw[name] for name in names)


def collectives(layout, dim: str) -> tuple:
    """The collectives that carry dimension `dim`'s bytes under `layout` (the module docstring's table)."""
    pair = ("all_gather", "reduce_scatter")
    if dim == "tp":
        return pair if layout.sp else ("all_reduce",)
    if dim == "cp":
        return {"ring": ("send_recv",), "allgather": pair}.get(layout.cp_attn, ("all_to_all",))
    if dim in ("dp", "zero3"):
        return pair if layout.zero_stage or dim == "zero3" else ("all_reduce",)
    return ("all_to_all",) if dim == "ep" else ("send_recv",)


def link(value, layout, dim: str):
    """A dimension's bytes/s from a scope's figure: measured per collective, or the one typed figure."""
    return value.for_dimension(layout, dim) if isinstance(value, Measured) else value


def read(path: str) -> dict:
    """--bandwidths FILE: {scope: Measured}, or argparse's error naming the fix."""
    try:
        best = bus_bandwidth.large_message(bus_bandwidth.read_records(path))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    scopes = {}
    for (collective, scope), record in sorted(best.items()):
        if record["busbw"] <= 0:
            raise argparse.ArgumentTypeError(
                f"{path}: {collective} ({scope}-node, {record['ranks']} rank(s)) has bus bandwidth 0, as "
                f"every collective over one rank: measure a world of two ranks or more")
        source = (f"{path}: {record['ranks']} ranks, {record['backend']}, {record['device']} on "
                  f"{record['host']}, {record['date']}")
        scopes.setdefault(scope, Measured(scope, {}, source)).busbw[collective] = record["busbw"] * 1e9
    return scopes


def add_arguments(group):
    group.add_argument("--bw-intra", type=float, help="GB/s (bus bandwidth) inside a node")
    group.add_argument("--bw-inter", type=float, help="GB/s (bus bandwidth) across nodes")
    group.add_argument("--bandwidths", metavar="FILE", type=read,
                       help="bench_collectives.py's records: measured bus bandwidths per collective, instead "
                            "of --bw-intra/--bw-inter (a scope it lacks takes those)")


def links_of(args, intra=None, inter=None) -> tuple:
    """(intra, inter): the measured scope, else the typed GB/s, else the given default (bytes/s or None)."""
    measured = args.bandwidths or {}
    typed = [None if v is None else v * 1e9 for v in (args.bw_intra, args.bw_inter)]
    return tuple(measured.get(scope) or (flag if flag is not None else default)
                 for scope, flag, default in (("intra", typed[0], intra), ("inter", typed[1], inter)))


def describe(value) -> str:
    """One scope's figures as the planner prints them."""
    if not isinstance(value, Measured):
        return f"{value / 1e9:g} GB/s"
    return ", ".join(f"{name} {bw / 1e9:.3g}" for name, bw in value.busbw.items()) + " GB/s"


def sources(*values) -> str:
    """What measured the scopes among `values` (the file, ranks, backend, device, host, date)."""
    return "; ".join(dict.fromkeys(f"{v.scope}-node: {v.source}" for v in values if isinstance(v, Measured)))


def dimensions(layout) -> list:
    """The dimensions of `layout` that communicate (degree above 1), as overlap_ratios names them."""
    data = "zero3" if layout.zero_stage == 3 else "dp"
    degrees = {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, data: layout.dp * layout.cp,
               "ep": layout.ep if layout.num_experts else 1}
    return [dim for dim, degree in degrees.items() if degree > 1]


def used(layout, where: dict, bw: dict) -> list:
    """Per communicating dimension of `layout`: its scope, collectives and the bus bandwidth used."""
    return [f"  {dim:<8}{where[dim]}-node  {'+'.join(collectives(layout, dim)):<26}{bw[dim] / 1e9:.3g} GB/s"
            for dim in dimensions(layout)]


def bandwidths(layout, gpus_per_node: int, intra: float, inter: float) -> dict:
    """Rank order [TP, CP, PP, DP]: a group stays in a node while the degrees up to its own fit in one.
    `intra`, `inter`: bytes/s, or each collective's measured figure (Measured)."""
    span = {"tp": layout.tp, "cp": layout.tp * layout.cp, "pp": layout.tp * layout.cp * layout.pp}
    span["dp"] = span["zero3"] = span["pp"] * layout.dp                       # ZeRO-3 gathers in the dp group
    span["ep"] = span["pp"] * layout.ep                                      # ep: consecutive dp ranks
    return {dim: link(intra if s <= gpus_per_node else inter, layout, dim)
            for dim, s in span.items()}
