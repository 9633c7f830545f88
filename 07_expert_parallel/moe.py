"""Mixture of experts: the MLP of every decoder layer replaced by E SwiGLU experts and a router.

Playbook §2.7 (Mixtral, Jiang et al. 2024; Switch Transformer, Fedus et al. 2021 §2.2; DeepSeek-V3
§2.1.2). For each token x (C,):

    p = softmax(x · Wgᵀ)   (E,), in float32;   S = top-k indices of p
    w_e = p_e / Σ_{j∈S} p_j  (k ≥ 2, Mixtral);   w_e = p_e  (k = 1, Switch: the router keeps a gradient)
    y = Σ_{e∈S, kept} w_e · expert_e(x) + shared(x)     expert_e = 01's SwiGLU; shared: DeepSeekMoE's
Dropless by default: the layer is an exact function of its input, so any split of the batch gives the
same numbers. `--capacity-factor F` keeps ⌈F·T·k/E⌉ rows per expert per sequence, and the block returns
(y, α·aux + β·z), the side losses the model adds to the task loss: both per sequence, in routing.py.
The experts are stored stacked (`Experts`: gate/up (E, F, C), down (E, C, F), 01's per-expert names
kept in checkpoints and state_dict), and `experts_fn(experts, rows, counts)` runs them on rows grouped by
expert, one batched matmul per projection reading the weights in place (expert_parallel.py swaps in the
all-to-all version). Derivations: this folder's README.md.

    python 07_expert_parallel/train.py --num-experts 4 --top-k 2        # the single-device MoE

New compared with 01: only the MLP; attention, norms, the loop and the optimizer are unchanged.
Shape legend: B batch, T sequence, C hidden, F expert intermediate size, E experts, k top-k,
N = B·T tokens, n rows (token-choices) = N·k.
"""
import dataclasses
import math

import torch
from torch import nn

import global_state
import materialize
import model as modeling                          # 01_single_gpu/model.py
import routing


class Experts(nn.Module):
    """E_local SwiGLU experts (01's MLP each) stored stacked: one parameter per projection, gate_proj and
    up_proj (E_local, F, C), down_proj (E_local, C, F), so the grouped matmuls read the weights as they are
    (torchtitan's GroupedExperts): stacking E nn.Linear weights per call would be a copy autograd saves.
    Slice i is global expert `first + i`; checkpoints and seeding keep 01's per-expert names through each
    parameter's `segments` (01's global_state.py), `model.layers.{l}.mlp.experts.{e}.gate_proj.weight`."""

    def __init__(self, config, num_experts: int):
        super().__init__()
        C, F = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(num_experts, F, C))     # (E_local, F, C)
        self.up_proj = nn.Parameter(torch.empty(num_experts, F, C))       # (E_local, F, C)
        self.down_proj = nn.Parameter(torch.empty(num_experts, C, F))     # (E_local, C, F)
        self.act_fn = modeling.silu_mul
        self.prefix, self.first = None, 0    # apply_moe names them; expert parallelism keeps a slice
        for p in self.parameters():          # nn.Linear's default, U(±1/√fan_in) (a block built by hand)
            nn.init.uniform_(p, -p.shape[-1] ** -0.5, p.shape[-1] ** -0.5)

    def __len__(self):
        return self.gate_proj.shape[0]

    # state_dict() and load_state_dict() speak 01's per-expert names, `{e}.gate_proj.weight` (F, C) …:
    # the same keys as an nn.ModuleDict of MLPs (Mixtral's layout), whatever slice a rank holds.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for proj, p in self._parameters.items():
            for i in range(len(p)):
                destination[f"{prefix}{self.first + i}.{proj}.weight"] = (p if keep_vars else p.detach())[i]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for proj, p in self._parameters.items():
            for i in range(len(p)):
                key = f"{prefix}{self.first + i}.{proj}.weight"
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                with torch.no_grad():
                    p[i].copy_(state_dict[key])

    def name_experts(self, prefix: str, first: int = 0):
        """Slice i of each stack is expert `first + i` of 01's MLP, under `{prefix}.{e}.{proj}.weight`."""
        self.prefix, self.first = prefix, first
        for proj, p in self.named_parameters():
            size = p[0].numel()
            p.segments = [global_state.Segment(f"{prefix}.{first + i}.{proj}.weight", tuple(p.shape[1:]),
                                               0, 0, p.shape[1], 0, size, i * size) for i in range(len(p))]

    def keep(self, start: int, stop: int):
        """Keep experts [start, stop) of the stacks (EP: this rank's slice); meta stays meta."""
        for proj, p in list(self.named_parameters()):
            setattr(self, proj, nn.Parameter(p.detach()[start:stop].clone(), requires_grad=p.requires_grad))
        self.first += start
        if self.prefix is not None:
            self.name_experts(self.prefix, self.first)
        return self


def run_experts(experts, rows, counts):
    """rows (n, C) grouped by expert, counts[e] rows for the e-th expert of `experts` (Experts) -> (n, C).

    Grouped, not a loop of small matmuls: the groups are padded to the largest, (E, M, C), so each
    projection is one batched matmul with the stacked weights (E, F, C) and (E, C, F), read in place
    (padding rows are zeros: they add nothing to the outputs kept or to any gradient). Every expert's
    weights enter the matmuls, even with zero rows, so each has a (possibly zero) gradient on every rank
    and the gradient all-reduces line up.
    """
    E, (n, C) = len(counts), rows.shape
    expert_of_row = torch.arange(E, device=rows.device).repeat_interleave(counts)      # (n,)
    slot = torch.arange(n, device=rows.device) - (counts.cumsum(0) - counts)[expert_of_row]   # (n,) in group
    M = int(counts.max()) if n else 0                                                  # the largest group
    padded = rows.new_zeros(E, M, C).index_put((expert_of_row, slot), rows)           # (E, M, C)
    hidden = experts.act_fn(padded @ experts.gate_proj.transpose(1, 2),               # (E, M, F)
                            padded @ experts.up_proj.transpose(1, 2))
    return (hidden @ experts.down_proj.transpose(1, 2))[expert_of_row, slot]          # (E, M, C) -> (n, C)


class MoE(nn.Module):
    """Router + E experts; a drop-in for a DecoderLayer's `mlp`: (B, T, C) -> ((B, T, C), α·aux), the
    layer's output and its α-weighted load-balancing loss, which the model adds to the task loss."""

    def __init__(self, config, num_experts: int, top_k: int, aux_loss_coef: float = 0.0,
                 shared_experts: int = 0, capacity_factor: float = 0.0, router_z_loss: float = 0.0):
        super().__init__()
        self.top_k, self.num_experts, self.aux_loss_coef = top_k, num_experts, aux_loss_coef
        self.capacity_factor, self.router_z_loss = capacity_factor, router_z_loss
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)    # the router
        self.experts = Experts(config, num_experts)     # stacked; under EP a rank keeps a slice of them
        # DeepSeekMoE's shared experts: N SwiGLUs every token passes through, as one MLP of N·F (the sum of
        # N SwiGLUs is one SwiGLU over their concatenated intermediates). Dense: replicated, averaged over dp.
        self.shared_experts = (modeling.MLP(dataclasses.replace(
            config, intermediate_size=shared_experts * config.intermediate_size)) if shared_experts else None)
        self.dropped = 0                    # rows over capacity in the last forward (a statistic for the log)
        self.load = None                    # (E,) rows each expert computed in the last forward (the same)
        self.experts_fn = run_experts                                      # EP swaps in the all-to-all
        self.stats_group = None             # 08's cp group: the ranks that split each sequence's tokens

    @property
    def act_fn(self):  # kernels/patch.py assigns layers[i].mlp.act_fn: it is every expert's SwiGLU
        return self.experts.act_fn

    @act_fn.setter
    def act_fn(self, fn):
        for expert in [self.experts, *([self.shared_experts] if self.shared_experts else [])]:
            expert.act_fn = fn

    def capacity(self, T: int) -> int:
        """Rows one sequence of T tokens may send to one expert: ⌈F·T·k/E⌉ (Switch §2.2, per sequence)."""
        return math.ceil(self.capacity_factor * T * self.top_k / self.num_experts)

    def forward(self, x):  # (B, T, C)
        B, T, C = x.shape
        # exercise 07.2: top-k routing
        # hint: Mixtral and Switch §2.1 (07's README, "The MoE block", its formulas): the router's
        #   probabilities in float32 (the z-loss reads the logits too), the k experts each token goes to and
        #   their weights; after the experts, each computed row back at its (token, choice) place (`order`
        #   says where; a dropped row contributes nothing) and the weighted sum of a token's choices.
        # test: tests/test_expert_parallel.py::
        #   test_moe_block_is_the_per_token_sum_and_aux_loss_is_per_sequence
        logits = self.gate(x)                                                # (B, T, E)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # bf16 -> fp32
        probs = logits.softmax(dim=-1)                                       # (B, T, E)
        top_p, chosen = probs.topk(self.top_k, dim=-1)                       # (B, T, k)
        # (B, T, k): Mixtral's renormalised weights, Σ_k = 1; Switch's raw probability when k = 1
        weights = top_p if self.top_k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)
        # end exercise
        expert_of_row = chosen.flatten()                                     # (n,) row = (token, choice)
        if self.capacity_factor:       # rows over capacity are not computed: output 0 (the residual only)
            within = routing.within_capacity(chosen, self.capacity(T), self.num_experts)   # (B, T, k) bool
            kept = within.flatten().nonzero().squeeze(1)                    # (n_kept,) rows within capacity
            order = kept[expert_of_row[kept].argsort(stable=True)]          # (n_kept,) kept rows by expert
        else:
            order = expert_of_row.argsort(stable=True)                       # (n,) rows grouped by expert
        self.dropped = expert_of_row.numel() - order.numel()
        counts = expert_of_row[order].bincount(minlength=self.num_experts)   # (E,)
        self.load = counts
        rows = x.reshape(B * T, C)[order // self.top_k]                      # (n_kept, C): each row's token
        if torch.is_autocast_enabled(x.device.type):  # the experts' matmuls would cast anyway: cast
            rows = rows.to(torch.get_autocast_dtype(x.device.type))   # before EP ships them (bf16 bytes)
        out = self.experts_fn(self.experts, rows, counts)                    # (n_kept, C), grouped by expert
        # exercise 07.2
        out = out.new_zeros(expert_of_row.numel(), C).index_copy(0, order, out)   # (n, C), token order
        y = (weights.to(out.dtype).unsqueeze(-1) * out.view(B, T, self.top_k, C)).sum(dim=2)   # (B, T, C)
        # end exercise
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)                                   # (B, T, C), every token
        side = 0.0
        if self.aux_loss_coef:
            side = self.aux_loss_coef * routing.load_balancing_loss(probs, chosen, self.stats_group)
        if self.router_z_loss:
            side = side + self.router_z_loss * routing.router_z_loss(logits)
        return y, side


def moe_blocks(model):
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]


def split_parameters(model):
    """(dense parameters, expert parameters): they are synchronised over different groups."""
    experts = [p for block in moe_blocks(model) for p in block.experts.parameters()]
    expert_ids = {id(p) for p in experts}
    return [p for p in model.parameters() if id(p) not in expert_ids], experts


@torch.no_grad()
def apply_moe(model, num_experts: int, top_k: int, aux_loss_coef: float, seed: int, upcycle: bool = False,
              **options):
    """Replace every layers[i].mlp of a LlamaForCausalLM by an MoE block, in place; returns the blocks.

    On a meta model (every trainer) the blocks are shapes only: 01's materialize.py gives each expert and
    router weight its values by name (`model.layers.{l}.mlp.experts.{e}.…`), seeded by (seed, name), so one
    rank and many hold the same experts and expert parallelism materialises only its slice; with --init-from
    a dense checkpoint every expert starts as the layer's MLP (sparse upcycling, Komatsuzaki et al. 2022:
    exactly that MLP for k ≥ 2, whose weights sum to 1; p_e times it for k = 1, Switch's weighting). On a real
    model (the layer tests) the same values are drawn here, `upcycle=True` copying the dense MLP instead.
    The experts inherit the MLP's act_fn (--kernels triton). `options`: shared_experts, capacity_factor,
    router_z_loss (`extras(args)`); shared experts are seeded by name too (upcycling leaves them so).
    """
    check_moe(num_experts, top_k, aux_loss_coef, **options)
    config = model.config
    initializer = materialize.Initializer(seed, std=config.initializer_range)
    for index, layer in enumerate(model.model.layers):
        dense = layer.mlp
        weight = dense.gate_proj.weight
        with torch.device("meta"):
            block = MoE(config, num_experts, top_k, aux_loss_coef, **options)
        if not weight.is_meta:
            block = block.to_empty(device=weight.device).to(weight.dtype)
        for name, p in block.named_parameters():
            p.global_name = f"model.layers.{index}.mlp.{name}"
        block.experts.name_experts(f"model.layers.{index}.mlp.experts")   # per-expert names: `segments`
        if not weight.is_meta:
            source = materialize.Source(block, initializer, weight.dtype, weight.device)
            for name, p in block.named_parameters():
                if upcycle and name.startswith("experts."):                  # (F, C) -> (E, F, C)
                    p.copy_(dense.get_parameter(f"{name.split('.')[1]}.weight").expand_as(p))
                else:
                    p.copy_(source.values(p))
        block.act_fn = dense.act_fn
        layer.mlp = block
    return moe_blocks(model)


def check_moe(num_experts: int, top_k: int, aux_loss_coef: float, shared_experts: int = 0,
              capacity_factor: float = 0.0, router_z_loss: float = 0.0):
    for flag, value in (("--shared-experts", shared_experts), ("--capacity-factor", capacity_factor),
                        ("--router-z-loss", router_z_loss), ("--aux-loss-coef", aux_loss_coef)):
        if not (math.isfinite(value) and value >= 0):    # NaN < 0 is False: it would pass a plain `< 0`
            raise ValueError(f"{flag} must be non-negative (a finite number), got {value}")
    if num_experts < 1:
        raise ValueError(f"--num-experts must be at least 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"--top-k {top_k} must be between 1 and --num-experts {num_experts} "
                         f"(each token picks k different experts)")


def add_arguments(parser, num_experts: int = 4):
    """--num-experts --top-k --aux-loss-coef (08's default is 0 experts: the dense Llama)."""
    g = parser.add_argument_group("mixture of experts (07)")
    g.add_argument("--num-experts", type=int, default=num_experts,
                   help="experts per MoE layer (every layer is MoE; 0 in 08: the dense Llama)")
    g.add_argument("--top-k", type=int, default=2, help="experts each token is sent to (Mixtral: 2)")
    g.add_argument("--aux-loss-coef", type=float, default=0.01,
                   help="α of the per-sequence load-balancing loss added to the cross-entropy (Switch: 0.01)")
    g.add_argument("--shared-experts", type=int, default=0,
                   help="experts every token passes through besides its top-k (DeepSeekMoE: 1-2)")
    g.add_argument("--capacity-factor", type=float, default=0.0,
                   help="rows per expert per sequence capped at ⌈F·T·k/E⌉, the rest dropped; 0: dropless")
    g.add_argument("--router-z-loss", type=float, default=0.0,
                   help="β of ST-MoE's router z-loss, mean logsumexp(logits)² (ST-MoE: 0.001)")
    return g


def extras(args) -> dict:
    """apply_moe's and check_moe's options from the parsed flags."""
    return dict(shared_experts=args.shared_experts, capacity_factor=args.capacity_factor,
                router_z_loss=args.router_z_loss)


def dropped_rows(model) -> int:
    """Rows (token-choices) over capacity in every MoE block's last forward."""
    return sum(block.dropped for block in moe_blocks(model))


def load_lines(model) -> list:
    """Rows each expert computed in every MoE block's last forward on this rank, one line per layer: what
    the load-balancing loss evens out."""
    return [f"  layer {i}: " + " ".join(str(int(n)) for n in block.load)
            for i, block in enumerate(moe_blocks(model)) if block.load is not None]


def dropped_line(dropped: int, rows: int, capacity_factor: float, steps: int) -> str:
    """The log line of --capacity-factor (07's trainer and 08's): `dropped` of all `rows` token-choices."""
    return (f"capacity factor {capacity_factor}: dropped {dropped} of {rows} token-choices "
            f"({dropped / rows:.2%}) over {steps} steps, all layers")


def flops_per_token(dense_flops_per_token: int, config, num_experts: int, top_k: int,
                    shared_experts: int = 0) -> int:
    """MFU's count for the parameters a token really uses: k experts, the shared ones and the router instead
    of one MLP, (k+shared−1)·3·C·F + C·E more matmul parameters per layer than the dense model, 6 FLOPs
    each (rows dropped over capacity are counted as computed: an upper bound)."""
    extra = ((top_k + shared_experts - 1) * 3 * config.hidden_size * config.intermediate_size
             + config.hidden_size * num_experts)
    return dense_flops_per_token + 6 * config.num_hidden_layers * extra
