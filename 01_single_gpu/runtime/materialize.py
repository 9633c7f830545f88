"""Shard before you materialise: the model is built on `meta`, parallelised on shapes, then each rank
creates only the parameters it keeps, with exactly the values one device would have.

Playbook §2.2 (ZeRO-3: "the model does not fit on one device") and §2.3. Every later folder builds 01's
model with `torch.device("meta")` (shapes, no memory), slices it from outside (TP shards, PP stages, EP
experts, ZeRO-3 flat shards) and then materialises what the rank holds. A parameter's values depend only
on its global name, never on the layout:

    --init-from DIR   the block this rank keeps, read from DIR's safetensors (a sliced read: only its bytes)
    otherwise         norm gains 1; every other tensor normal(0, 0.02), drawn in full from a generator seeded
                      by (seed, name), then sliced: one full tensor at a time

so a rank's peak while building is its own parameters plus one full tensor. Where a rank holds a slice of
a parameter, the parameter says so (`block`: the global shape and the dim/start/stop of its slice, set by
04's `shard_parameter`); a whole parameter has none. MoE experts (07) have names of their own
(`...mlp.experts.{e}...`); with --init-from a dense checkpoint they start as its MLP (sparse upcycling).

    python 04_tensor_parallel/train.py --tp 2     # 04 builds on meta, slices, then materialise(model, ...)
"""
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass(frozen=True)
class Block:
    """This rank's slice [start, stop) along `dim` of a parameter whose whole shape is `shape`."""
    shape: tuple
    dim: int
    start: int
    stop: int


def block_of(p) -> Block:
    """The slice of its global tensor that parameter p holds (the whole tensor unless TP sliced it)."""
    return getattr(p, "block", None) or Block(tuple(p.shape), 0, 0, p.shape[0] if p.dim() else 1)


def generator_for(seed: int, name: str) -> torch.Generator:
    """A generator seeded by (seed, name): the same stream for a parameter in every process and layout."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


class Initializer:
    """name, block -> this rank's values: seeded (01's init rule) or read from an HF directory."""

    def __init__(self, seed: int, init_from=None, std: float = 0.02):
        self.seed, self.std, self.files = seed, std, {}
        if init_from:
            directory = Path(init_from)
            index = directory / "model.safetensors.index.json"
            weight_map = (json.loads(index.read_text())["weight_map"] if index.exists() else None)
            from safetensors import safe_open
            for file in sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]:
                handle = safe_open(directory / file, "pt")
                for key in handle.keys():
                    self.files[key] = handle

    def values(self, name: str, block: Block, dtype) -> torch.Tensor:
        index = tuple(slice(block.start, block.stop) if d == block.dim else slice(None)
                      for d in range(len(block.shape)))
        if self.files:
            return self._read(name, block, index).to(dtype)
        if name.endswith("norm.weight"):
            return torch.ones(block.shape, dtype=torch.float32)[index].clone().to(dtype)
        generator = generator_for(self.seed, name)
        full = torch.empty(block.shape, dtype=torch.float32).normal_(0.0, self.std, generator=generator)
        return full[index].clone().to(dtype)           # a copy: a view would keep the full tensor alive

    def _read(self, name, block, index):
        source = name
        # upcycling: every expert is the dense MLP
        if source not in self.files and ".mlp.experts." in source:
            prefix, rest = source.split(".mlp.experts.", 1)
            source = f"{prefix}.mlp.{rest.split('.', 1)[1]}"
        if source not in self.files:
            if name.endswith(".mlp.gate.weight") or ".mlp.shared_experts." in name:   # nor router nor shared
                generator = generator_for(self.seed, name)
                full = torch.empty(block.shape).normal_(0.0, self.std, generator=generator)
                return full[index].clone()
            raise ValueError(f"--init-from has no weight {source!r} (the model's {name})")
        tensor = self.files[source].get_slice(source)
        if tuple(tensor.get_shape()) != tuple(block.shape):
            raise ValueError(f"--init-from: {source} has shape {tuple(tensor.get_shape())}, the model "
                             f"expects {tuple(block.shape)}")
        return tensor[index].contiguous()      # a column block is strided: fused AdamW, --resume want rows


class Source:
    """Where the meta parameters of one model get their values: each one's global name (its name in 01's
    model; a tied weight: its first name, the embedding's), the initializer, the dtype and the device."""

    def __init__(self, root: nn.Module, initializer: Initializer, dtype, device):
        self.names = {id(p): getattr(p, "global_name", name) for name, p in root.named_parameters()}
        self.initializer, self.dtype, self.device = initializer, dtype, device

    def values(self, p) -> torch.Tensor:
        """This rank's values of meta parameter p (its block), on the device, in the dtype. A parameter
        that stacks several global tensors (07's experts) lists them as `segments` (global_state.py)."""
        if not hasattr(p, "segments"):
            return self.initializer.values(self.names[id(p)], block_of(p), self.dtype).to(self.device)
        flat = torch.empty(p.numel(), dtype=self.dtype)
        for s in p.segments:                          # one global tensor at a time, as for any parameter
            values = self.initializer.values(s.name, Block(s.shape, s.dim, s.start, s.stop), self.dtype)
            flat[s.offset:s.offset + s.flat_stop - s.flat_start] = values.flatten()[s.flat_start:s.flat_stop]
        return flat.view(p.shape).to(self.device)


def swap_parameters(root: nn.Module, new: dict):
    """Put new[id(old)] wherever module `root` (or a submodule) holds parameter `old`; keeps ties."""
    for module in root.modules():
        for attr, p in list(module._parameters.items()):
            if p is not None and id(p) in new:
                replacement = new[id(p)]
                kept = {k: v for k, v in p.__dict__.items() if k not in replacement.__dict__}
                replacement.__dict__.update(kept)
                module._parameters[attr] = replacement


def materialize(root: nn.Module, source: Source, keep=None) -> nn.Module:
    """Replace the meta parameters of `root` (01's model, parallelised on shapes) by real ones holding this
    rank's values; with `keep` (parameters, e.g. a pipeline rank's stages), only those. A parameter shared
    by several modules (tied embeddings, kernels' norms) stays one Parameter. Returns root."""
    keep_ids = None if keep is None else {id(p) for p in keep}
    new = {}
    for p in root.parameters():
        if p.is_meta and (keep_ids is None or id(p) in keep_ids):
            new[id(p)] = nn.Parameter(source.values(p), requires_grad=p.requires_grad)   # one at a time
    swap_parameters(root, new)
    return root
