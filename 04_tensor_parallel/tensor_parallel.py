"""Tensor parallelism (Megatron-LM): every weight matrix of a block split over the `tp` ranks.

Playbook §2.3, Megatron-LM (Shoeybi et al. 2019; Narayanan et al. 2021 §2.3, §4.2.2). Two block
identities of matrix multiplication:

    column-parallel  Y = X·Aᵀ with A split by output rows:  Y = [X·A₁ᵀ, X·A₂ᵀ, …]   (X replicated)
    row-parallel     Y = X·Aᵀ with A split by input columns: Y = Σᵢ Xᵢ·Aᵢᵀ         (X sharded)

A block is column-then-row (q/k/v → o_proj, gate/up → down_proj; [MEG] Fig. 5), entered through
f = `copy_to_tp_region` (identity forward, all-reduce backward) and left through f̄ =
`reduce_from_tp_region` (all-reduce forward, identity backward; mappings.py): per layer and micro-batch 2
all-reduces of b·s·h elements forward and 2 backward, 8·b·s·h·(t−1)/t on the wire per rank ([MEG]
§4.2.2). The embedding and the loss are vocab-parallel (`vocab_parallel.py`); the RMSNorm weights are
replicated and their gradients agree without communication. Weights, gradients and AdamW states of
the linears shrink to 1/t per rank. Derivations: 04_tensor_parallel/README.md.

    torchrun --nproc_per_node 4 04_tensor_parallel/train.py --tp 4 --num-kv-heads 4

New compared with 02: the model itself is split, from outside, by `apply_tensor_parallel`, which
slices the full, identically seeded weights (so the loss equals 01's from step one).
Shape legend (model.py): B batch, T sequence, C hidden, F intermediate, V vocab, t = tp size.
"""
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import materialize
import mappings
import kv_replication
import vocab_parallel


# ======================================================================================
# Parallel linear layers
# ======================================================================================
def shard_parameter(full, dim, tp_rank, tp_size):
    """This rank's contiguous 1/tp of the full weight along `dim`, as a marked Parameter. On the meta device
    (every trainer) only the shape is sliced: 01's materialize.py fills the rank's block, which `block`
    names."""
    size = full.shape[dim] // tp_size
    shard = nn.Parameter(full.detach().narrow(dim, tp_rank * size, size).clone())
    shard.tp_sharded = True   # counted once per shard by `clip_grad_norm_tp`
    shard.block = materialize.Block(tuple(full.shape), dim, tp_rank * size, (tp_rank + 1) * size)
    if hasattr(full, "global_name"):
        shard.global_name = full.global_name
    return shard


class ColumnParallelLinear(nn.Module):
    """Y_r = X·A_rᵀ: weight (out/t, in), rows [r·out/t, (r+1)·out/t) of the dense one.

    X (…, in) must be identical on every rank, i.e. already inside the region: the module that reads it
    holds an `EnterRegion` (one f for q, k and v together, as Megatron's fused QKV has one).
    Output (…, out/t), or (…, out) with gather_output.
    """

    def __init__(self, weight, tp_rank, tp_size, tp_group, gather_output=False):
        super().__init__()
        self.weight = shard_parameter(weight, 0, tp_rank, tp_size)        # (out/t, in)
        self.tp_group, self.gather_output = tp_group, gather_output
        self.linear_fn = F.linear           # the local matmul; ZB-H1 swaps in its split (06's zero_bubble.py)

    def forward(self, x):                                                 # (…, in)
        # f is not here: the parent's EnterRegion applied it to x before the parent's forward ran
        y = self.linear_fn(x, self.weight)                                # (…, out/t)
        return mappings.gather_from_tp_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = Σ_r X_r·A_rᵀ: weight (out, in/t), columns [r·in/t, (r+1)·in/t) of the dense one.

    X (…, in/t) is this rank's shard (the output of a column-parallel layer); the partial products
    are summed by `exit_region` (f̄ all-reduce; sequence parallelism's reduce-scatter). `linear_fn`
    is the local matmul before that collective, so a split backward (ZB-H1) can defer its dW alone.
    """

    def __init__(self, weight, tp_rank, tp_size, tp_group, exit_region=mappings.reduce_from_tp_region):
        super().__init__()
        self.weight = shard_parameter(weight, 1, tp_rank, tp_size)        # (out, in/t)
        self.tp_group, self.exit_region = tp_group, exit_region
        self.linear_fn = F.linear

    def forward(self, x):                                                 # (…, in/t)
        return self.exit_region(self.linear_fn(x, self.weight), self.tp_group)   # (…, out) partial -> summed

    def extra_repr(self):
        return f"exit {contract(self.exit_region)}"


class EnterRegion(nn.Module):
    """Where a region begins: Megatron's f (`copy_to_tp_region`; SP: g), run on the input of the module
    holding it by a forward pre-hook (as torchtitan's PrepareModuleInput): 01's forward stays as it was,
    and `print(model)` lists the collective as `(enter_tp_region): EnterRegion(...)`."""

    def __init__(self, enter, group):
        super().__init__()
        self.enter, self.group = enter, group

    def forward(self, x):                                                 # (…, C): as the region needs it
        return self.enter(x, self.group)

    def extra_repr(self):
        return contract(self.enter)


def contract(region):
    """A region function's name and docstring, for print(model)."""
    return f"{region.__name__} ({(region.__doc__ or '').strip().rstrip('.')})"


def enter_region(module, enter, group):
    """Run `enter` on the first input of `module`, from outside: no parameter, so no name, changes."""
    module.enter_tp_region = EnterRegion(enter, group)
    module.register_forward_pre_hook(lambda m, args: (m.enter_tp_region(args[0]), *args[1:]))


# ======================================================================================
# Applying it to the 01 model
# ======================================================================================
def check_tensor_parallel(config, tp: int):
    """Raise a clear error for a layout TP cannot split (call before any process group exists)."""
    for name, n in (("num_attention_heads", config.num_attention_heads),
                    ("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
        if n % tp:
            raise ValueError(f"tp={tp} does not divide {name}={n} (choose --tp dividing it, or change "
                             f"--{name.replace('_', '-').replace('num-attention', 'num')})")
    kv_replication.check_kv_heads(config.num_key_value_heads, tp)


def apply_tensor_parallel(model, grid, regions: mappings.Regions = mappings.TENSOR_PARALLEL):
    """Split a full LlamaForCausalLM over grid.tp_group in place; returns it.

    Every rank built the same full model (same seed or --init-from), so slicing gives exactly the
    dense weights, sharded. Parameter names are unchanged; each rank's state dict holds its shards.
    """
    config = model.config
    check_tensor_parallel(config, grid.tp_size)
    tp = (grid.tp_rank, grid.tp_size, grid.tp_group)
    # kv_replication.py: the kv heads split like q's, or (tp > kv heads) whole on tp/kv ranks each
    nkv = config.num_key_value_heads
    kv_rows = kv_replication.kv_shard(grid.tp_rank, grid.tp_size, nkv)  # (index, count) of k/v's row slices
    replica_group = kv_replication.replica_group(grid, nkv)             # collective
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = ColumnParallelLinear(attn.q_proj.weight, *tp)     # split by heads: rows are (heads, hd)
        for name in ("k_proj", "v_proj"):
            linear = ColumnParallelLinear(getattr(attn, name).weight, *kv_rows, grid.tp_group)
            kv_replication.mark_replicas(linear.weight, nkv, grid.tp_size, replica_group)
            setattr(attn, name, linear)
        attn.o_proj = RowParallelLinear(attn.o_proj.weight, *tp, exit_region=regions.exit)
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj.weight, *tp)
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj.weight, *tp)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight, *tp, exit_region=regions.exit)
        enter_region(attn, regions.enter, grid.tp_group)
        enter_region(mlp, regions.enter, grid.tp_group)
    embedding = shard_parameter(model.model.embed_tokens.weight, 0, grid.tp_rank, grid.tp_size)   # (V/t, C)
    model.model.embed_tokens = vocab_parallel.VocabParallelEmbedding(embedding, grid.tp_rank, grid.tp_group,
                                                                     exit_region=regions.exit)
    model.lm_head = ColumnParallelLinear(model.lm_head.weight, *tp)     # (V/t, C): the logits stay sharded
    if model.config.tie_word_embeddings:  # both are vocab rows [r·V/t, (r+1)·V/t): the same shard
        model.lm_head.weight = model.model.embed_tokens.weight
    enter_region(model.lm_head, regions.enter, grid.tp_group)
    model.loss_fn = functools.partial(vocab_parallel.vocab_parallel_loss, group=grid.tp_group,
                                      vocab_start=grid.tp_rank * model.config.vocab_size // grid.tp_size)
    return model


# ======================================================================================
# Gradient clipping with sharded parameters
# ======================================================================================
@torch.no_grad()
def clip_grad_norm_tp(params, max_norm, tp_group, pp_group=None):
    """Clip by the norm of the whole model's gradient, as 01 does.

    ‖g‖² = Σ_tp ‖sharded part‖² + ‖replicated part‖²: the shards are disjoint pieces (summed over
    the group), the replicated norms are equal on every rank (counted once). With pipeline stages
    (08) each stage holds other layers, so the stage's ‖g‖² is summed over `pp_group` too. Returns ‖g‖.
    """
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [p for p in params if p.grad is not None and getattr(p, "tp_sharded", False)]
    replicated = [p.grad for p in params if p.grad is not None and not getattr(p, "tp_sharded", False)]
    dtype = torch.promote_types(grads[0].dtype, torch.float32)     # bf16 grads are summed in fp32
    zero = torch.zeros((), dtype=dtype, device=grads[0].device)
    # exercise 04.4: the gradient norm over tensor-parallel shards
    # hint: the formula of the docstring (04's README, "Derivations"), in `dtype`: only the sharded part
    #   needs a sum over tp; a kv head that kv_replication.py keeps on r ranks (its `kv_replicas`) would be
    #   counted r times.
    # test: tests/test_tensor_parallel.py::test_parallel_layers_match_dense_twins[clip]
    # a kv head replicated on r ranks (tp > kv heads) is summed r times over tp: count it 1/r each time
    sharded_sq = sum((p.grad.to(dtype).pow(2).sum() / getattr(p, "kv_replicas", 1) for p in sharded), zero)
    dist.all_reduce(sharded_sq, group=tp_group)                     # scalar: Σ over the tp shards
    squares = sharded_sq + sum((g.to(dtype).pow(2).sum() for g in replicated), zero)
    # end exercise
    if pp_group is not None:
        dist.all_reduce(squares, group=pp_group)                    # scalar: Σ over the stages
    total = squares.sqrt()
    if max_norm > 0:  # the same coefficient as torch.nn.utils.clip_grad_norm_
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total
