"""Memory accounting per rank: parameters, gradients, optimizer states and activations.

Playbook §2.1.1 and ZeRO §3. Model states are measured from the tensors that really exist on the
rank (so a sharded run reports its shard); activations are estimated with the playbook's formula
(Korthikanti et al.), and can be measured exactly on any device with `saved_activation_bytes`,
which adds up what autograd stores for the backward pass. On a GPU the allocator's peak is
reported too.

Activation estimate per layer, in bytes for 16-bit activations (playbook §2.1, seed digest SG-9),
for sequence s, micro-batch b, hidden h, heads a, tensor-parallel t, context-parallel c (s → s/c):
    none           s·b·h·(34 + 5·a·s/h)          TP only     s·b·h·(10 + 24/t + 5·a·s/(h·t))
    TP + SP        s·b·h·(34 + 5·a·s/h)/t        selective   34·s·b·h (/t with TP+SP)
    full           2·s·b·h
scaled by bytes_per_element/2 for other dtypes. It is an estimate for a GPT block with dropout;
the Llama block here has no dropout masks, so the measured bytes are somewhat lower.
"""
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if torch.is_tensor(v) and v.dim() > 0)


def activation_bytes_estimate(config, mbs: int, seq_len: int, bytes_per_element: int, recompute: str = "none",
                              tp: int = 1, sp: bool = False, cp: int = 1) -> int:
    s, b, h, a = seq_len // cp, mbs, config.hidden_size, config.num_attention_heads
    if recompute == "full":
        per_layer = 2 * s * b * h
    elif recompute == "selective":
        per_layer = 34 * s * b * h / (tp if sp else 1)
    elif sp:
        per_layer = s * b * h * (34 + 5 * a * s / h) / tp
    else:
        per_layer = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    return int(config.num_hidden_layers * per_layer * bytes_per_element / 2)


class saved_activation_bytes(saved_tensors_hooks):
    """`with saved_activation_bytes() as m: loss = model(x, y)` -> m.bytes saved for backward.

    Each storage is counted once (views of the same tensor share it) and parameters are excluded,
    since they are model states, not activations.
    """

    def __init__(self, exclude=()):
        self.bytes, self._seen = 0, {p.untyped_storage().data_ptr() for p in exclude}

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
            return t
        super().__init__(pack, lambda t: t)

    def __enter__(self):
        super().__enter__()
        return self


@dataclass
class MemoryReport:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    peak_allocated: int | None = None   # CUDA caching allocator's peak, when on a GPU

    def table(self, title="memory per rank") -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer states", self.optimizer), ("activations (estimate)", self.activations)]
        total = sum(v for _, v in rows)
        lines = [f"{title}:"] + [f"  {name:<24}{v / 2**20:>10.2f} MiB" for name, v in rows]
        lines.append(f"  {'total':<24}{total / 2**20:>10.2f} MiB")
        if self.peak_allocated is not None:
            lines.append(f"  {'GPU allocator peak':<24}{self.peak_allocated / 2**20:>10.2f} MiB")
        return "\n".join(lines)


def memory_report(params, optimizer, activations: int, grad_dtype=None, optimizer_bytes=None) -> MemoryReport:
    """Model states from the tensors this rank holds. Gradients are as large as their parameters
    (in `grad_dtype` if given); optimizer states are measured once they exist, else AdamW's two
    moments per parameter, in the parameters' dtype, are assumed."""
    params = [p for p in params if p.requires_grad]
    grads = sum(p.numel() * (torch.empty(0, dtype=grad_dtype or p.dtype).element_size()) for p in params)
    if optimizer_bytes is None:
        optimizer_bytes = optimizer_state_bytes(optimizer) or 2 * tensor_bytes(params)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return MemoryReport(tensor_bytes(params), grads, optimizer_bytes, activations, peak)
