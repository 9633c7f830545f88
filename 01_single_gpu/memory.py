"""Memory accounting per rank: parameters, gradients, optimizer states and activations.

Playbook §2.1.1 and ZeRO §3. Model states are measured from the tensors that really exist on the rank
(so a sharded run reports its shard), in the dtypes of its precision layout (mixed_precision.py: bf16
weights and gradients, fp32 masters and accumulation buffers; `held_state_bytes` recounts them after a
step, which the tests compare with the table printed before the first); activations are estimated with
the playbook's formula (Korthikanti et al.) and measured, on any device, with `saved_activation_bytes`,
which follows what autograd stores for the backward pass (its peak over a training step is what the
trainers print after their first step). On a GPU the allocator's peak is reported too. Before anything
exists, `rank_lower_bound` gives what a rank needs at least: every trainer's preflight compares it with the
device's free memory.

Activation estimate per layer, in bytes for 16-bit activations (playbook §2.1;
Korthikanti et al. Table 2), for sequence s, micro-batch b, hidden h, heads a, tensor-parallel t,
context-parallel c (s → s/c):
    recompute   no TP                  TP (t ranks)                    TP + SP
    none        s·b·h·(34 + 5·a·s/h)   s·b·h·(10 + 24/t + 5·a·s/(h·t))  s·b·h·(34 + 5·a·s/h)/t
    selective   34·s·b·h               s·b·h·(10 + 24/t)               34·s·b·h/t
    full        2·s·b·h                2·s·b·h                         2·s·b·h
(selective drops the 5·a·s/h attention term: the scores, softmax and its dropout mask are recomputed).
Scaled by bytes_per_element/2 for other dtypes. It is an estimate for a GPT block with dropout;
the Llama block here has no dropout masks, so the measured bytes are somewhat lower.

    python 01_single_gpu/train.py --steps 3 --no-progress   # the table, then the measured peak
"""
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks

import mixed_precision
import model as modeling


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if torch.is_tensor(v) and v.dim() > 0)


def activation_bytes_estimate(config, mbs: int, seq_len: int, bytes_per_element: int, recompute: str = "none",
                              tp: int = 1, sp: bool = False, cp: int = 1) -> int:
    s, b, h, a = seq_len // cp, mbs, config.hidden_size, config.num_attention_heads
    # exercise 01.3: activation memory
    # hint: Korthikanti et al. Table 2: bytes per layer in 16-bit for each recomputation mode (01's README,
    #   "Derivations") and their TP and SP forms (its Reference, "Activation estimate"); CP holds s/cp
    #   tokens; scale to `bytes_per_element` and the model's layers.
    # test: tests/test_single_gpu.py::test_activation_estimate_matches_playbook_formula
    attention_scores = 0 if recompute == "selective" else 5 * a * s / h        # the quadratic term
    if recompute == "full":
        per_layer = 2 * s * b * h
    elif sp:
        per_layer = s * b * h * (34 + attention_scores) / tp
    else:   # without SP the norm and dropout regions (10·s·b·h) are replicated on every tp rank
        per_layer = s * b * h * (10 + 24 / tp + attention_scores / tp)
    return int(config.num_hidden_layers * per_layer * bytes_per_element / 2)
    # end exercise


def rank_lower_bound(config, args, element_bytes: int) -> dict:
    """Bytes the busiest rank of the flags' layout holds at least, known before anything is built (the
    trainers' memory preflight, cli_checks.check_memory): the parameters, counted from one decoder layer on
    meta, split over tp·pp (experts also over ep), in the precision layout's bytes (ZeRO-1/2/3 shard the
    optimizer states, gradients, weights over dp·cp); one micro-batch of a stage's activations (the table
    above; a fused attention core, SDPA's or Triton's, keeps no s×s scores: selective's row). Replicas, the
    embedding's stage, the micro-batches a schedule holds and the logits come on top of it."""
    tp, pp, cp, ep = (getattr(args, name, 1) for name in ("tp", "pp", "cp", "ep"))
    with torch.device("meta"):                # one layer: building L of them could take hours
        layer = modeling.DecoderLayer(config)
    mlp, whole = (sum(p.numel() for p in module.parameters()) for module in (layer.mlp, layer))
    experts = getattr(args, "num_experts", 0)
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    dense = config.num_hidden_layers * (whole - mlp * bool(experts)) + embeddings + config.hidden_size
    params = dense / (tp * pp) + config.num_hidden_layers * mlp * experts / (tp * pp * ep)
    shards, zero = getattr(args, "dp", 1) * cp, getattr(args, "zero_stage", 0)
    weights, gradients, optimizer = mixed_precision.layout_of(args).bytes_per_parameter()
    stored = "selective" if args.recompute == "none" and args.attn != "eager" else args.recompute
    activations = activation_bytes_estimate(config, args.mbs, args.seq_len, element_bytes, stored, tp,
                                            getattr(args, "sp", False), cp)
    need = {"parameters": weights * params / (shards if zero >= 3 else 1),
            "gradients": gradients * params / (shards if zero >= 2 else 1),
            "optimizer states": optimizer * params / (shards if zero >= 1 else 1),
            "activations": activations / pp}
    # 03's ZeRO-Offload keeps the optimizer's shard (--offload param: all the model states) in host memory
    offload = getattr(args, "offload", "none") if args.device == "cuda" else "none"
    hosted = {"none": [], "optimizer": ["optimizer states"], "param": list(need)[:3]}[offload]
    return {part: 0 if part in hosted else size for part, size in need.items()}


class _Saved:
    """What autograd keeps instead of a saved tensor while the meter is on; its deletion (the graph
    freed by backward) tells the meter the storage may be gone."""
    __slots__ = ("tensor", "release")

    def __init__(self, tensor, release):
        self.tensor, self.release = tensor, release

    def __del__(self):
        self.release()


class saved_activation_bytes(saved_tensors_hooks):
    """`with saved_activation_bytes() as m: loss = model(x, y)` -> m.bytes saved for backward.

    Each storage is counted once (views of the same tensor share it) and parameters are excluded,
    since they are model states, not activations. `m.bytes` adds up every storage ever saved;
    `m.peak` is the most that was held at once, which over a whole training step (forward and
    backward of every micro-batch, a pipeline's held micro-batches) is the activation memory.
    """

    def __init__(self, exclude=()):
        self.bytes, self.live, self.peak = 0, 0, 0
        self._seen, self._refs = set(), {}
        exclude = list(exclude)   # looked up at each save: ZeRO-3 re-allocates parameter storage

        def release(key, nbytes):
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self.live -= nbytes

        def pack(t):
            key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            if any(key == p.untyped_storage().data_ptr() for p in exclude):
                return t
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += nbytes
            self._refs[key] = self._refs.get(key, 0) + 1
            if self._refs[key] == 1:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            return _Saved(t, lambda: release(key, nbytes))
        super().__init__(pack, lambda saved: saved.tensor if isinstance(saved, _Saved) else saved)

    def __enter__(self):
        super().__enter__()
        return self


@dataclass
class MemoryReport:
    parameters: int
    gradients: int
    optimizer: int                      # AdamW's moments
    activations: int
    peak_allocated: int | None = None   # CUDA caching allocator's peak, when on a GPU
    master: int = 0                     # fp32 master weights (mixed_precision.py's bf16-16/20)
    accumulation: int = 0               # fp32 gradient accumulation buffers (bf16-20)
    numel: int = 0                      # the parameters these states belong to (for bytes per parameter)
    layout: str = ""

    def per_parameter(self):
        """(weights, gradients, optimizer) bytes per parameter, split as 08's planner splits them."""
        return (self.parameters / self.numel, (self.gradients + self.accumulation) / self.numel,
                (self.master + self.optimizer) / self.numel)

    def table(self, title="memory per rank") -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("gradient accumulation", self.accumulation), ("master weights", self.master),
                ("optimizer states", self.optimizer), ("activations (estimate)", self.activations)]
        rows = [(name, v) for name, v in rows if v or name not in ("gradient accumulation", "master weights")]
        total = sum(v for _, v in rows)
        lines = [f"{title}{' (' + self.layout + ')' if self.layout else ''}:"]
        lines += [f"  {name:<24}{v / 2**20:>10.2f} MiB" for name, v in rows]
        lines.append(f"  {'total':<24}{total / 2**20:>10.2f} MiB")
        if self.numel:
            split = " + ".join(f"{v:g}" for v in self.per_parameter())
            lines.append(f"  {'model states':<24}{sum(self.per_parameter()):>10.2f} bytes per parameter "
                         f"(weights, gradients, optimizer: {split})")
        if self.peak_allocated is not None:
            lines.append(f"  {'GPU allocator peak':<24}{self.peak_allocated / 2**20:>10.2f} MiB")
        return "\n".join(lines)


def memory_report(params, optimizer, activations: int, optimizer_bytes=None) -> MemoryReport:
    """Model states from the tensors this rank holds: the parameters, the master weights and gradient
    accumulators of a mixed-precision optimizer (mixed_precision.py), allocated before the first step.
    Gradients are as large as their parameters (backward writes .grad in the parameter's dtype); AdamW's
    states are measured once they exist, else its two moments per tensor it steps (zeros_like) are counted."""
    params = [p for p in params if p.requires_grad]
    mine = {id(p) for p in params}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    accumulators = getattr(optimizer, "accumulators", [])
    if optimizer_bytes is None:
        optimizer_bytes = optimizer_state_bytes(optimizer) or 2 * tensor_bytes(stepped)
    peak = (torch.cuda.max_memory_allocated()
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    layout = getattr(optimizer, "layout", None)
    return MemoryReport(tensor_bytes(params), tensor_bytes(params), optimizer_bytes, activations, peak,
                        master=tensor_bytes(p for p in stepped if id(p) not in mine),
                        accumulation=tensor_bytes(accumulators), numel=sum(p.numel() for p in params),
                        layout=layout.name if layout else "")


def held_state_bytes(params, optimizer) -> dict:
    """What the rank holds right now, tensor by tensor (the report's prediction is checked against it)."""
    params = [p for p in params if p.requires_grad]
    mine = {id(p) for p in params}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    accumulators = getattr(optimizer, "accumulators", [])
    return dict(parameters=tensor_bytes(params), gradients=tensor_bytes(p.grad for p in params),
                master=tensor_bytes(p for p in stepped if id(p) not in mine),
                accumulation=tensor_bytes(accumulators), optimizer=optimizer_state_bytes(optimizer))


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`: what the rank really holds (a ZeRO-3 parameter whose
    storage is freed counts 0, views of one flat buffer count it once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t is not None}
    return sum(storages.values())


def measured_state(model, optimizer, activations: int) -> dict:
    """This rank's memory after a step, measured: the parameters and gradients it holds (the model's and the
    optimizer's tensors, e.g. ZeRO's shards), AdamW's states, and `activations` (the measured peak)."""
    params = [*model.parameters(), *(p for group in optimizer.param_groups for p in group["params"])]
    return {"parameters": held_bytes(params), "gradients": held_bytes(p.grad for p in params),
            "optimizer": optimizer_state_bytes(optimizer), "activations": activations}


def print_report(model, optimizer, activations: int, args, config=None, title="memory per rank"):
    """The memory table of a rank's model states (measured from its tensors) and activations (estimate)."""
    if config is not None:
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {config}")
    report = memory_report(model.parameters(), optimizer, activations)
    print(report.table(title))
    return report
