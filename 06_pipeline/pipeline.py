"""Pipeline parallelism: the 01 model cut into stages of consecutive layers, one stage per rank.

Playbook §2.6 (pipeline parallelism), Megatron-LM §2.2 / §4.2.1 (interleaved stages). Rank r of a
pipeline of p ranks keeps only its layers; micro-batches flow forward through the stages as
activations (B, T, C) and come back as gradients of the same shape, sent point to point:

    stage 0: embedding, layers ─x─▶ stage 1: layers ─x─▶ … ─▶ stage p−1: layers, norm, head, loss
                               ◀─dx─                  ◀─dx─

With V model chunks per rank (interleaving), the L layers form p·V blocks of L/(p·V) layers and
chunk c of rank r holds block c·p + r (Megatron: "device 1 holds layers 1, 2, 9, 10"), so a
micro-batch goes round the ring of ranks V times: the last rank's chunk c feeds rank 0's chunk c+1.
The V-shaped schedules (zb-v, dualpipev: v_schedules.py) place 2 chunks V-wise instead: rank r holds
blocks r and 2p−1−r, so a micro-batch goes down the ranks and back up, turns on rank p−1 without a
message, and rank 0 holds both the embedding and the loss.

Communication: one mbs·T·C message each way per micro-batch and block boundary (point_to_point.py).
Parameters, gradients and optimizer states shrink by p; the activations a stage holds do not
(the schedule decides how many micro-batches are in flight, schedules.py).

    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 4 --pp-schedule 1f1b --grad-acc 8
New compared with 02: the model is cut by layers, not replicated; activations travel point to point.
"""
import math

import torch
import torch.distributed as dist
from torch import nn

import rope

SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
V_SHAPED = ("zb-v", "dualpipev")             # two chunks per rank placed V-wise (v_schedules.py)


def add_arguments(parser):
    """--pp-schedule --pp-chunks --timeline (the degree --pp is process_grid's); 08 takes them too."""
    g = parser.add_argument_group("pipeline parallelism (06; --grad-acc is the number of micro-batches m)")
    g.add_argument("--pp-schedule", choices=SCHEDULES, default="1f1b",
                   help="all-forward-all-backward, 1F1B, interleaved 1F1B, zero bubble (H1, V) or DualPipeV")
    g.add_argument("--pp-chunks", type=int, default=1,
                   help="model chunks per rank (V): interleaved, or 2 for zb-v and dualpipev")
    g.add_argument("--timeline", metavar="PATH.png",
                   help="draw the last step's executed timeline (needs matplotlib)")
    return g


def check_pipeline(num_layers: int, pp: int, chunks: int, schedule: str, grad_acc: int, tie_embeddings: bool):
    """Every pipeline layout error, raised before any process group exists."""
    if pp < 1 or chunks < 1:
        raise ValueError(f"--pp and --pp-chunks must be at least 1 (got pp={pp}, pp-chunks={chunks})")
    if schedule not in SCHEDULES:
        raise ValueError(f"--pp-schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if schedule in V_SHAPED and chunks != 2:
        raise ValueError(f"--pp-schedule {schedule} places two chunks per rank V-wise: pass --pp-chunks 2 "
                         f"(got {chunks})")
    if chunks > 1 and schedule not in ("interleaved",) + V_SHAPED:
        raise ValueError(f"--pp-chunks {chunks} needs --pp-schedule interleaved (the {schedule} schedule "
                         f"runs one chunk per rank)")
    if schedule == "dualpipev" and grad_acc < 2 * pp:
        raise ValueError(f"the dualpipev schedule needs --grad-acc (micro-batches) at least 2·pp = {2 * pp}, "
                         f"got {grad_acc} (DeepSeek's DualPipeV); use --grad-acc {2 * pp}")
    if num_layers % (pp * chunks):
        raise ValueError(f"pp·pp-chunks = {pp}·{chunks} = {pp * chunks} does not divide "
                         f"num_layers={num_layers}: every stage chunk needs the same number of layers; "
                         f"change --num-layers, --pp or --pp-chunks")
    if schedule == "interleaved" and grad_acc % pp:
        raise ValueError(f"the interleaved schedule needs --grad-acc (micro-batches) a multiple of pp={pp}, "
                         f"got {grad_acc} (Megatron §4.2.1); use --grad-acc {math.ceil(grad_acc / pp) * pp}")
    if tie_embeddings and pp > 1:
        raise ValueError("--tie-embeddings with --pp > 1 is not supported: the embedding (first stage) and "
                         "the lm head (last stage) live on different ranks; drop --tie-embeddings (a tying "
                         "preset: pass --no-tie-embeddings)")


def block_index(pp_rank: int, chunk: int, pp: int, v_shape: bool = False) -> int:
    """The block of layers chunk c of rank r holds: c·pp + r round the ring, or V-wise r going down
    and 2·pp − 1 − r coming back up."""
    if v_shape:
        return 2 * pp - 1 - pp_rank if chunk else pp_rank
    return chunk * pp + pp_rank


def rank_of_block(block: int, pp: int, v_shape: bool = False) -> int:
    """The pp rank holding `block` (the inverse of block_index)."""
    return min(block, 2 * pp - 1 - block) if v_shape else block % pp


def layer_blocks(num_layers: int, pp: int, chunks: int, pp_rank: int, v_shape: bool = False):
    """[range of layer indices of chunk c] for c < chunks, chunk c holding block_index(r, c)."""
    size = num_layers // (pp * chunks)
    blocks = [block_index(pp_rank, c, pp, v_shape) for c in range(chunks)]
    return [range(b * size, (b + 1) * size) for b in blocks]


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
        cos, sin = rope.rotary_cos_sin(positions, self.config, x.dtype)
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


def build_stages(full, pp_rank: int, pp_size: int, chunks: int = 1, position_ids=None,
                 v_shape: bool = False) -> nn.ModuleList:
    """This rank's V chunks of the full (seeded) model; the other ranks' layers are dropped.
    `position_ids` (T/cp,): the RoPE positions of this rank's tokens under context parallelism (08)."""
    blocks = layer_blocks(full.config.num_hidden_layers, pp_size, chunks, pp_rank, v_shape)
    last = full.config.num_hidden_layers
    return nn.ModuleList(PipelineStage(full, layers, is_first=layers.start == 0, is_last=layers.stop == last,
                                       position_ids=position_ids) for layers in blocks)


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
# Gradient norm over all stages, and the loss every rank logs
# ======================================================================================
def clip_grad_norm_pp(params, max_norm: float, pp_group):
    """Clip by the global norm ‖g‖ = sqrt(Σ_stages Σ_params ‖g‖²), as 01 clips the whole model (the dp
    replicas hold the same averaged gradients, so the pipeline group suffices)."""
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


def broadcast_loss(loss, device, source: int, pp_group, dp_group, dp_size: int) -> float:
    """The loss of the last block (on global rank `source`: the last stage, or V-wise the first) on
    every rank of the pipeline, averaged over the data-parallel replicas."""
    loss = torch.tensor(float(loss), dtype=torch.float64, device=device)
    dist.broadcast(loss, src=source, group=pp_group)          # () from the stage holding the loss
    if dp_size > 1:
        dist.all_reduce(loss, group=dp_group)
        loss /= dp_size
    return float(loss)
