"""Pipeline parallelism: the 01 model cut into stages of consecutive layers, one stage per rank.

Playbook §2.6 (pipeline parallelism), Megatron-LM §2.2 / §4.2.1 (interleaved stages). Rank r of a
pipeline of p ranks keeps only its layers; micro-batches flow forward through the stages as
activations (B, T, C) and come back as gradients of the same shape, sent point to point:

    stage 0: embedding, layers ─x─▶ stage 1: layers ─x─▶ … ─▶ stage p−1: layers, norm, head, loss
                               ◀─dx─                  ◀─dx─

With V model chunks per rank (interleaving), the L layers form p·V blocks of L/(p·V) layers and
chunk c of rank r holds block c·p + r (Megatron: "device 1 holds layers 1, 2, 9, 10"), so a
micro-batch goes round the ring of ranks V times: the last rank's chunk c feeds rank 0's chunk c+1.

Communication per micro-batch and block boundary: one send of mbs·T·C elements forward and one
backward ([PB] App. 5.3.4: 4·mbs·T·C per micro-batch counting both ends); per rank and step:
    sends = m·(2V − [first rank] − [last rank])  messages of mbs·T·C elements
(only the first block sends no gradient and only the last block no activation).
Parameters, gradients and optimizer states shrink by p; the activations a stage holds do not
(the schedule decides how many micro-batches are in flight, schedules.py).

This file: validation, the stage modules cut from the full model, the point-to-point primitives, the
gradient norm over all stages and the loss broadcast. The schedules are in schedules.py.

    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 4 --pp-schedule 1f1b --grad-acc 8
New compared with 02: the model is cut by layers, not replicated; activations travel point to point.
"""
import math
from importlib import import_module

import torch
import torch.distributed as dist
from torch import nn

modeling = import_module("01_single_gpu.model")
process_grid = import_module("02_data_parallel.process_grid")

SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1")


def add_arguments(parser):
    """--pp-schedule --pp-chunks --timeline (the degree --pp is process_grid's); 08 takes them too."""
    g = parser.add_argument_group("pipeline parallelism (06; --grad-acc is the number of micro-batches m)")
    g.add_argument("--pp-schedule", choices=SCHEDULES, default="1f1b")
    g.add_argument("--pp-chunks", type=int, default=1, help="model chunks per rank (V, interleaved schedule)")
    g.add_argument("--timeline", metavar="PATH.png",
                   help="draw the last step's executed timeline (needs matplotlib)")
    return g


def check_pipeline(num_layers: int, pp: int, chunks: int, schedule: str, grad_acc: int, tie_embeddings: bool):
    """Every pipeline layout error, raised before any process group exists."""
    if pp < 1 or chunks < 1:
        raise ValueError(f"--pp and --pp-chunks must be at least 1 (got pp={pp}, pp-chunks={chunks})")
    if schedule not in SCHEDULES:
        raise ValueError(f"--pp-schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if chunks > 1 and schedule != "interleaved":
        raise ValueError(f"--pp-chunks {chunks} needs --pp-schedule interleaved (the {schedule} schedule "
                         f"runs one chunk per rank)")
    if num_layers % (pp * chunks):
        raise ValueError(f"pp·pp-chunks = {pp}·{chunks} = {pp * chunks} does not divide "
                         f"num_layers={num_layers}: every stage chunk needs the same number of layers; "
                         f"change --num-layers, --pp or --pp-chunks")
    if schedule == "interleaved" and grad_acc % pp:
        raise ValueError(f"the interleaved schedule needs --grad-acc (micro-batches) a multiple of pp={pp}, "
                         f"got {grad_acc} (Megatron §4.2.1); use --grad-acc {math.ceil(grad_acc / pp) * pp}")
    if tie_embeddings and pp > 1:
        raise ValueError("--tie-embeddings with --pp > 1 is not supported: the embedding (first stage) and "
                         "the lm head (last stage) live on different ranks; drop --tie-embeddings")


def layer_blocks(num_layers: int, pp: int, chunks: int, pp_rank: int):
    """[range of layer indices of chunk c] for c < chunks: chunk c of rank r holds block c·pp + r."""
    size = num_layers // (pp * chunks)
    return [range((c * pp + pp_rank) * size, (c * pp + pp_rank + 1) * size) for c in range(chunks)]


# ======================================================================================
# Stages cut from the full model
# ======================================================================================
class PipelineStage(nn.Module):
    """One model chunk: some consecutive decoder layers, plus the embedding on the first chunk of the
    pipeline and the final norm, lm head and loss on the last. Submodules are the 01 model's own
    (same objects, same initialisation) under the same names, keyed by global layer index."""

    def __init__(self, full, layers: range, is_first: bool, is_last: bool, position_ids=None):
        super().__init__()
        self.config = full.config
        self.is_first, self.is_last = is_first, is_last
        # (T,) positions of the tokens this rank holds, for RoPE; None: 0 … T−1 of its input. Context
        # parallelism (08) gives its shard's; under sequence parallelism x holds only T/tp of them.
        self.position_ids = position_ids
        self.model = nn.Module()
        if is_first:
            self.model.embed_tokens = full.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in layers})
        if is_last:
            self.model.norm, self.lm_head, self.loss_fn = full.model.norm, full.lm_head, full.loss_fn

    def forward(self, x, labels=None):
        """x: token ids (B, T) on the first chunk, else activations (B, T, C). Returns (the loss on the last
        chunk, else the activations (B, T, C); the chunk's auxiliary losses: 07's MoE, else 0.0)."""
        if self.is_first:
            x = self.model.embed_tokens(x)                                    # (B, T) -> (B, T, C)
        positions = (self.position_ids if self.position_ids is not None
                     else torch.arange(x.shape[1], device=x.device))
        cos, sin = modeling.rotary_cos_sin(positions, self.config, x.dtype)
        aux = 0.0
        for layer in self.model.layers.values():
            x, layer_aux = layer(x, cos, sin)                                 # (B, T, C), () or 0.0
            aux = aux + layer_aux
        if self.is_last:
            return self.loss_fn(self.model.norm(x), self.lm_head, labels), aux   # scalar
        return x, aux


class AttachSideLoss(torch.autograd.Function):
    """A loss a stage computes besides its activations (07's load-balancing loss) and never sends on:
    forward passes x unchanged; backward passes x's gradient and gives the side loss the gradient
    `scale` (1/m, as every micro-batch's loss), so it trains its stage as if added to the final loss
    (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x, side_loss, scale):
        ctx.scale, ctx.dtype = scale, side_loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.tensor(ctx.scale, dtype=ctx.dtype, device=grad.device), None


def build_stages(full, pp_rank: int, pp_size: int, chunks: int = 1, position_ids=None) -> nn.ModuleList:
    """This rank's V chunks of the full (seeded) model; the other ranks' layers are dropped.
    `position_ids` (T/cp,): the RoPE positions of this rank's tokens under context parallelism (08)."""
    blocks = layer_blocks(full.config.num_hidden_layers, pp_size, chunks, pp_rank)
    return nn.ModuleList(PipelineStage(full, layers, is_first=pp_rank == 0 and c == 0,
                                       is_last=pp_rank == pp_size - 1 and c == chunks - 1,
                                       position_ids=position_ids)
                         for c, layers in enumerate(blocks))


def boundary_shape(mbs: int, seq_len: int, hidden_size: int, cp: int = 1, tp: int = 1, sp: bool = False):
    """Shape of the activations (and gradients) sent between stages: (mbs, T, C) alone; (mbs, T/cp, C)
    under context parallelism; (mbs, T/(cp·tp), C) under sequence parallelism, where the residual stream
    between blocks is sharded along the sequence. Plain TP sends the full (replicated) stream from each
    tp rank to its peer of the next stage (Megatron's scatter/gather optimisation is not done)."""
    return (mbs, seq_len // cp // (tp if sp else 1), hidden_size)


def single_device_name(name: str) -> str:
    """'1.model.layers.5.mlp.up_proj.weight' (chunk 1 of this rank) -> 01's
    'model.layers.5.mlp.up_proj.weight'."""
    return name.split(".", 1)[1]


# ======================================================================================
# Point to point: activations forward, gradients backward
# ======================================================================================
def direction_groups(grid, chunks: int):
    """{(direction, wraps): process group} with this rank's pipeline in each (collective: every rank
    creates every pipeline's groups, in the same order).

    Forward and backward messages get process groups of their own, and so does the wrap-around from
    the last rank to the first (interleaving): NCCL runs the sends and receives between two ranks of
    one communicator in issue order, so a send waiting for its receiver must never sit in front of a
    receive the receiver is itself waiting to complete. Within one direction both ends issue the
    messages in the same micro-batch order, so each channel's queue always matches."""
    layout = process_grid.grid_layout(grid.world_size, grid.dp_size, grid.pp_size, grid.cp_size, grid.tp_size)
    pipelines = layout.permute(0, 2, 3, 1).reshape(-1, grid.pp_size).tolist()       # (dp·cp·tp, pp)
    mine = {}
    for key in [("F", False), ("B", False)] + ([("F", True), ("B", True)] if chunks > 1 else []):
        for ranks in pipelines:
            group = dist.new_group(ranks)
            if grid.rank in ranks:
                mine[key] = group
    return mine


class P2P:
    """Sends and receives of (mbs, T, C) tensors between neighbouring stages of one pipeline.

    A send is asynchronous (`dist.isend`, completed at the end of the step), a receive blocks until
    its tensor has arrived (`dist.irecv(...).wait()`), so the schedule only fixes the order of the
    computations. Every message carries a tag naming (micro-batch, block boundary, direction): a
    schedule that received out of order would fail loudly instead of mixing micro-batches up.
    Each travels in the process group of its direction (`direction_groups`). The ring wraps
    (rank p−1 -> rank 0) for interleaved chunks.
    """

    def __init__(self, pp_ranks, pp_rank: int, groups: dict, chunks: int, shape, dtype, device):
        self.ranks, self.rank, self.groups = pp_ranks, pp_rank, groups
        self.p, self.chunks, self.shape, self.dtype, self.device = len(pp_ranks), chunks, shape, dtype, device
        self.pending = []                                 # (work, tensor) of unfinished sends
        self.sent = []                                    # (to pp rank, micro-batch, "F"/"B") of this step

    def _tag(self, micro: int, boundary: int, direction: int):    # boundary b: between blocks b and b+1
        return (micro * self.p * self.chunks + boundary) * 2 + direction

    def _block(self, chunk: int):
        return chunk * self.p + self.rank

    def send_forward(self, x, micro: int, chunk: int):
        """Activations (mbs, T, C) of block b to block b+1 (the next rank)."""
        self._send(x, (self.rank + 1) % self.p, self._tag(micro, self._block(chunk), 0), micro, "F",
                   wraps=self.rank == self.p - 1)

    def recv_forward(self, micro: int, chunk: int):
        """Activations (mbs, T, C) from block b−1; a leaf that will collect their gradient."""
        x = self._recv((self.rank - 1) % self.p, self._tag(micro, self._block(chunk) - 1, 0), "F",
                       wraps=self.rank == 0)
        return x.requires_grad_()

    def send_backward(self, dx, micro: int, chunk: int):
        """Gradient (mbs, T, C) w.r.t. the input of block b, to block b−1 (the previous rank)."""
        self._send(dx, (self.rank - 1) % self.p, self._tag(micro, self._block(chunk) - 1, 1), micro, "B",
                   wraps=self.rank == 0)

    def recv_backward(self, micro: int, chunk: int):
        """Gradient (mbs, T, C) w.r.t. the output of block b, from block b+1."""
        return self._recv((self.rank + 1) % self.p, self._tag(micro, self._block(chunk), 1), "B",
                          wraps=self.rank == self.p - 1)

    def _send(self, tensor, to: int, tag: int, micro: int, kind: str, wraps: bool):
        tensor = tensor.detach().to(self.dtype).contiguous()
        group = self.groups[kind, wraps]
        self.pending.append((dist.isend(tensor, self.ranks[to], group=group, tag=tag), tensor))
        self.sent.append((to, micro, kind))

    def _recv(self, source: int, tag: int, kind: str, wraps: bool):
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.irecv(buffer, self.ranks[source], group=self.groups[kind, wraps], tag=tag).wait()
        return buffer

    def group_names(self) -> dict:
        """id(group) -> name, for the communication meter."""
        return {id(g): f"pp_{kind}" + ("_wrap" if wraps else "") for (kind, wraps), g in self.groups.items()}

    def finish(self):
        """Wait for every send of the step (their buffers may be freed afterwards)."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


# ======================================================================================
# Gradient norm over all stages, and the loss every rank logs
# ======================================================================================
def clip_grad_norm_pp(params, max_norm: float, pp_group):
    """Clip by the global norm ‖g‖ = sqrt(Σ_stages Σ_params ‖g‖²), as 01 clips the whole model.

    Data-parallel replicas hold identical (averaged) gradients, so the pipeline group suffices.
    """
    grads = [p.grad for p in params if p.grad is not None]    # every stage holds at least one layer
    dtype = torch.promote_types(grads[0].dtype, torch.float32)  # fp64 stays fp64; bf16 sums in fp32
    squares = torch.stack([g.detach().to(dtype).pow(2).sum() for g in grads]).sum()
    dist.all_reduce(squares, group=pp_group)                  # () summed over the p stages
    norm = squares.sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)     # torch.nn.utils.clip_grad_norm_'s formula
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return norm


def broadcast_loss(loss, device, pp_ranks, pp_group, dp_group, dp_size: int) -> float:
    """The last stage's loss on every rank of the pipeline, averaged over the data-parallel replicas."""
    loss = torch.tensor(float(loss), dtype=torch.float64, device=device)
    dist.broadcast(loss, src=pp_ranks[-1], group=pp_group)    # () from the last stage
    if dp_size > 1:
        dist.all_reduce(loss, group=dp_group)
        loss /= dp_size
    return float(loss)
