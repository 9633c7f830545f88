"""The process grid: which global rank plays which part in every parallel dimension.

Playbook §4.1 (Llama-3's 4D layout) and picotron: the ranks are laid out as

    grid = torch.arange(world).view(dp, pp, cp, tp)        # tp varies fastest, dp slowest

so tensor-parallel peers are neighbours (inside one node, where bandwidth is highest), then
context-parallel, then pipeline, and data parallelism spans the farthest ranks. With 16 ranks and
every degree 2: ranks 0,1 share a TP group; 0,2 a CP group; 0,4 a PP group; 0,8 a DP group.

Expert parallelism does not get a dimension of its own: it is carved out of data parallelism, as
DeepSpeed-MoE and Megatron do (playbook §2.7: "EP as a sub-case of DP"). `ep` must divide `dp`; the
ep consecutive DP ranks of a block hold different experts (the `ep_group`) and the dp/ep blocks
replicate them, as do the cp ranks (the `expert_dp_group`, cp·dp/ep ranks). Dense weights are averaged
over the `cp_dp_group`, since context-parallel ranks see different tokens of the same samples, exactly
like DP ranks.

Every group of every dimension is created on every rank, in the same order, as torch.distributed
requires; a rank keeps the ones it belongs to in a frozen dataclass that is passed explicitly.
"""
import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import watchdog


def grid_layout(world_size: int, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1):
    """The (dp, pp, cp, tp) tensor of global ranks; raises a clear error for a bad layout."""
    for name, degree in dict(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep).items():
        if degree < 1:
            raise ValueError(f"--{name} must be at least 1, got {degree}")
    if dp * pp * cp * tp != world_size:
        raise ValueError(f"dp·pp·cp·tp = {dp}·{pp}·{cp}·{tp} = {dp * pp * cp * tp} does not equal the "
                         f"world size {world_size}; launch with --nproc_per_node {dp * pp * cp * tp} "
                         f"or change the degrees")
    if dp % ep:
        raise ValueError(f"ep={ep} does not divide dp={dp}: expert parallelism splits the data-parallel "
                         f"ranks")
    return torch.arange(world_size).view(dp, pp, cp, tp)


def _groups_along(grid, dims):
    """All rank lists that vary only along `dims` (the other coordinates fixed), in a fixed order."""
    # exercise 02.5: the process grid's groups
    # hint: [PB] §4.1, Llama 3's 4D layout (02's README, "The process grid"): the ranks of one group share
    #   every coordinate of the (dp, pp, cp, tp) grid but those along `dims`; a permute can bring those
    #   dimensions last, so each group is one row.
    # test: tests/test_5d_combined.py::test_llama3_sixteen_rank_groups
    keep = [d for d in range(grid.dim()) if d not in dims]
    moved = grid.permute(*keep, *dims)                                      # (...kept, ...varying)
    return moved.reshape(-1, int(torch.tensor([grid.shape[d] for d in dims]).prod())).tolist()
    # end exercise


@dataclass(frozen=True)
class ProcessGrid:
    world_size: int
    rank: int
    dp_size: int
    pp_size: int
    cp_size: int
    tp_size: int
    ep_size: int
    dp_rank: int
    pp_rank: int
    cp_rank: int
    tp_rank: int
    ep_rank: int
    dp_group: object
    pp_group: object
    cp_group: object
    tp_group: object
    cp_dp_group: object        # dense-weight gradients are averaged over these ranks
    ep_group: object           # ranks that hold different experts
    expert_dp_group: object    # ranks that hold the same experts (over dp/ep and cp)
    pp_ranks: tuple            # global ranks of this rank's pipeline, stage 0 first

    def group_names(self) -> dict:
        """id(group) -> name, for the communication meter's tables."""
        names = {}
        for name in ("cp_dp", "expert_dp", "ep", "dp", "pp", "cp", "tp"):  # later wins for equal groups
            names[id(getattr(self, f"{name}_group"))] = name
        return names


_MADE = []   # every group new_group created, in order: distributed() gives back those of its run
_KEEPING = [0]   # how many keep_groups() are open


def new_group(ranks):
    """dist.new_group, remembered (collective over the world: every rank creates every group)."""
    group = dist.new_group(ranks)
    _MADE.append(group)
    return group


def build_process_grid(dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1) -> ProcessGrid:
    """Create every group of the grid (collective: call it on every rank, same arguments)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = grid_layout(world, dp, pp, cp, tp, ep)
    DP, PP, CP, TP = 0, 1, 2, 3
    mine = {}
    # The grid with dp split into (dp/ep, ep) for the expert groups; cp ranks hold the same experts.
    expert_grid = grid.view(dp // ep, ep, pp, cp, tp)
    for name, source, dims in (("dp", grid, (DP,)), ("pp", grid, (PP,)), ("cp", grid, (CP,)),
                               ("tp", grid, (TP,)), ("cp_dp", grid, (DP, CP)),
                               ("ep", expert_grid, (1,)), ("expert_dp", expert_grid, (0, 3))):
        for ranks in _groups_along(source, dims):
            group = new_group(ranks)  # collective over the world: every rank creates every group
            if rank in ranks:
                mine[name] = (group, ranks)
    dp_rank, pp_rank, cp_rank, tp_rank = (grid == rank).nonzero()[0].tolist()
    return ProcessGrid(world_size=world, rank=rank,
                       dp_size=dp, pp_size=pp, cp_size=cp, tp_size=tp, ep_size=ep,
                       dp_rank=dp_rank, pp_rank=pp_rank, cp_rank=cp_rank, tp_rank=tp_rank,
                       ep_rank=dp_rank % ep, pp_ranks=tuple(mine["pp"][1]),
                       **{f"{name}_group": group for name, (group, _) in mine.items()})


def init_distributed(device_type: str, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1,
                     timeout_s: float = watchdog.DEFAULT_TIMEOUT_S) -> ProcessGrid:
    """Join the job `torchrun` (or the test harness) started and build the grid.

    The degrees are checked against WORLD_SIZE before any process group exists, so a bad layout
    fails at once with a message instead of hanging in a collective. Gloo on the CPU, NCCL on GPUs:
    the one place where device and backend are chosen. A collective that waits a little over `timeout_s`
    (--timeout-s; watchdog.group_timeout_s) for a peer fails instead of hanging, and a worker of torchrun
    ends with its agent (watchdog.py).
    """
    grid_layout(int(os.environ.get("WORLD_SIZE", 1)), dp, pp, cp, tp, ep)
    if "TORCHELASTIC_RUN_ID" in os.environ:   # started by torchrun's agent: never train on as an orphan
        watchdog.exit_with_parent()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        timeout = timedelta(seconds=watchdog.group_timeout_s(timeout_s))   # the watchdog speaks first
        if "RANK" in os.environ:     # torchrun (or the test harness) set RANK, WORLD_SIZE, MASTER_ADDR/PORT
            dist.init_process_group(backend, timeout=timeout)
        else:   # plain `python train.py`: a world of one meets in its own memory, so it needs no TCP port
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return build_process_grid(dp, pp, cp, tp, ep)


def subgroup(grid: ProcessGrid, dim: str, size: int):
    """This rank's group of `size` consecutive ranks of its `dim` group (collective: every rank creates
    every such group of every `dim` group, in the same order); e.g. the tp ranks holding the same kv
    head."""
    layout = grid_layout(grid.world_size, grid.dp_size, grid.pp_size, grid.cp_size, grid.tp_size,
                         grid.ep_size)
    mine = None
    for ranks in _groups_along(layout, (("dp", "pp", "cp", "tp").index(dim),)):
        for start in range(0, len(ranks), size):
            part = ranks[start:start + size]
            group = new_group(part)
            if grid.rank in part:
                mine = group
    return mine


@contextlib.contextmanager
def distributed(device_type: str, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1,
                timeout_s: float = watchdog.DEFAULT_TIMEOUT_S):
    """`with distributed(...) as grid:` init_distributed, and at the end destroy the process group this
    call created: a process that exits with live gloo/NCCL threads can abort ("terminate called without
    an active exception") and make a finished run look failed. In a world the caller made (the test
    harness, a notebook) the world is left to it, and a finished run destroys the groups it made: each
    holds threads, and a process that runs many layouts would slow down under hundreds of them."""
    created, made = not dist.is_initialized(), len(_MADE)
    grid = init_distributed(device_type, dp, pp, cp, tp, ep, timeout_s)
    finished = False
    try:
        yield grid
        finished = True
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
            del _MADE[made:]
        elif not _KEEPING[0]:
            _give_back(made, finished)


def _give_back(made: int, finished: bool):
    """Destroy the groups made since _MADE[made], after a barrier: no peer still sends in one of them.
    After a failure a peer may still wait in one: they are only forgotten (and so are those of a world
    that is already gone)."""
    if finished and dist.is_initialized():
        dist.barrier()
        for group in _MADE[made:]:
            if group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
                dist.destroy_process_group(group)
    del _MADE[made:]


@contextlib.contextmanager
def keep_groups():
    """`with keep_groups():` (or `@keep_groups()`) runs inside it leave their groups alive until it ends
    (for a caller that uses what a run returned, e.g. steps its pipeline again); then they are given back."""
    made, finished = len(_MADE), False
    _KEEPING[0] += 1
    try:
        yield
        finished = True
    finally:
        _KEEPING[0] -= 1
        if not _KEEPING[0]:
            _give_back(made, finished)


DEGREES = {"dp": "data-parallel degree: replicas that split the global batch",
           "tp": "tensor-parallel degree: ranks that split every weight matrix",
           "cp": "context-parallel degree: ranks that split each sequence",
           "pp": "pipeline stages (ranks per pipeline)",
           "ep": "expert-parallel degree: dp ranks that split the experts"}


def add_degree_arguments(parser, *dims):
    """--dp/--tp/--cp/--pp/--ep, the grid's degrees (every trainer takes the ones it implements)."""
    group = parser.add_argument_group("process grid: arange(world).view(dp, pp, cp, tp)")
    for dim in dims:
        group.add_argument(f"--{dim}", type=int, default=1, help=DEGREES[dim])
    return group
