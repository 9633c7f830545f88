"""A rank's training state in global coordinates, so a checkpoint moves between parallel layouts.

Playbook §2.2-2.6 (every technique shards the same model differently). What a rank trains are its
optimizer's tensors: whole parameters (01, DP), TP blocks of them (04: `materialize.Block`), stacks of
whole ones (07's experts, (E, F, C): a `segments` list) or flat ranges of ZeRO's units that cross
parameter boundaries (03, 08). Each such tensor is described by its
`Segment`s: which global parameter (its name in 01's model, its full shape), which block of it (the TP
slice along `dim`), which range of that block's flattened elements, and where that range sits in the
local tensor. A checkpoint stores every distinct segment once (written by the lowest rank holding it,
with AdamW's exp_avg and exp_avg_sq beside the values); loading into any other layout rebuilds one global
parameter at a time from the segments that cover it and copies out what this rank holds:

    save:  rank r writes the segments it is the first to hold          ≈ model + 2 optimizer states in all
    load:  for each global name: full = Σ its pieces;  local[offset:…] = full[block].flat[range]

so a rank never holds more than its own state plus one full tensor. `export_hf.py` uses the same pieces
to write a Hugging Face directory from a checkpoint of any layout.

    python 01_single_gpu/train.py --checkpoint-dir ckpt --steps 2 && \\
    torchrun --nproc_per_node 4 04_tensor_parallel/train.py --tp 2 --dp 2 --mbs 4 --checkpoint-dir ckpt \
        --resume --steps 4
"""
from dataclasses import asdict, dataclass, replace

import torch

import materialize

QUANTITIES = ("value", "exp_avg", "exp_avg_sq")           # a parameter and AdamW's two moments


@dataclass(frozen=True)
class Segment:
    name: str            # the global parameter (01's name)
    shape: tuple         # its full shape
    dim: int             # the block of it the local tensor belongs to: [start, stop) along dim (TP)
    start: int
    stop: int
    flat_start: int      # the range of that block's flattened (row-major) elements
    flat_stop: int
    offset: int          # where the range starts in the local tensor's flattened elements

    @property
    def key(self):       # the same piece held by several ranks (DP replicas, TP-replicated norms)
        return (self.name, self.dim, self.start, self.stop, self.flat_start, self.flat_stop)

    def block_shape(self):
        return tuple(self.stop - self.start if d == self.dim else n for d, n in enumerate(self.shape))


def global_name(p) -> str:
    name = getattr(p, "global_name", None)
    if name is None:
        raise ValueError("a parameter without its global name: build the model with 01's build.build_model")
    return name


def segments_of(t) -> list:
    """The segments of a tensor an optimizer steps: ZeRO's pieces list theirs, a parameter is one block."""
    if hasattr(t, "segments"):
        return t.segments
    block = materialize.block_of(t)
    return [Segment(global_name(t), tuple(block.shape), block.dim, block.start, block.stop, 0, t.numel(), 0)]


def flat_segments(params, offsets, lo: int, hi: int) -> list:
    """The segments of the range [lo, hi) of a flat buffer holding `params` at `offsets` (ZeRO's units)."""
    segments = []
    for p, a in zip(params, offsets):
        for s in segments_of(p):                      # s: p's elements [a + s.offset, a + s.offset + size)
            first = a + s.offset
            start, stop = max(first, lo), min(first + s.flat_stop - s.flat_start, hi)
            if start < stop:
                segments.append(replace(s, flat_start=s.flat_start + start - first,
                                        flat_stop=s.flat_start + stop - first, offset=start - lo))
    return segments


def pieces(optimizer) -> list:
    """(segment, {quantity: the local flat data}) for every segment of every tensor this rank steps."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            flats = {"value": p.detach().reshape(-1)}
            flats.update({q: state[q].reshape(-1) for q in QUANTITIES[1:] if q in state})
            for s in segments_of(p):
                n = s.flat_stop - s.flat_start
                out.append((s, {q: data[s.offset:s.offset + n] for q, data in flats.items()}))
    return out


def optimizer_step(optimizer) -> float:
    """AdamW's step count (every tensor is stepped together; skipped steps do not count)."""
    counts = {float(state["step"]) for state in optimizer.state.values() if "step" in state}
    if len(counts) > 1:
        raise ValueError(f"the optimizer's tensors have different step counts {sorted(counts)}")
    return counts.pop() if counts else 0.0


class Assembler:
    """Rebuilds one global tensor at a time from the pieces a checkpoint lists (`read(piece, quantity)`)."""

    def __init__(self, listed, read):
        self.by_name, self.read = {}, read
        for piece in listed:
            self.by_name.setdefault(piece["name"], []).append(piece)

    def names(self):
        return set(self.by_name)

    def full(self, name: str, quantity: str, dtype) -> torch.Tensor:
        listed = self.by_name.get(name)
        if not listed:
            raise ValueError(f"the checkpoint holds no {name}: it was saved from another model")
        full = torch.zeros(listed[0]["shape"], dtype=dtype)
        covered = torch.zeros(listed[0]["shape"], dtype=torch.bool)
        for piece in listed:
            s = Segment(**{k: tuple(v) if k == "shape" else v for k, v in piece.items()
                           if k in Segment.__dataclass_fields__})
            block = torch.zeros(s.block_shape(), dtype=dtype)           # a contiguous copy of the block
            block.view(-1)[s.flat_start:s.flat_stop] = self.read(piece, quantity).to(dtype)
            mask = torch.zeros(s.block_shape(), dtype=torch.bool)
            mask.view(-1)[s.flat_start:s.flat_stop] = True
            full.narrow(s.dim, s.start, s.stop - s.start)[mask] = block[mask]
            covered.narrow(s.dim, s.start, s.stop - s.start).logical_or_(mask)
        if not covered.all():
            raise ValueError(f"the checkpoint covers {int(covered.sum())} of {covered.numel()} elements of "
                             f"{name}: a rank's file is missing from it")
        return full


def load(assembler, optimizer, model, step: float):
    """Fill every tensor this rank steps (values and AdamW's moments) and every other parameter it holds
    (ZeRO-1/2's full replicas) from the checkpoint, one global tensor at a time."""
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    stepped_ids = {id(p) for p in stepped}
    others = [p for p in model.parameters() if id(p) not in stepped_ids and p.untyped_storage().nbytes() > 0]
    # Saved before AdamW's first step (fp16: every step so far overflowed), a checkpoint holds no moments:
    # the state stays empty, and AdamW creates it at its first step, as in the run that saved it.
    moments = step > 0
    groups = optimizer.param_groups
    on_device = {id(p) for g in groups if g.get("fused") or g.get("capturable") for p in g["params"]}
    for p in stepped if moments else []:
        # a fused AdamW reads its step count on the tensors' device, the others on the host
        where = p.device if id(p) in on_device else None
        optimizer.state[p] = {"step": torch.tensor(step, dtype=torch.float32, device=where),
                              "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    wanted = {}                                          # name -> [(local flat tensor, segment, quantity)]
    for p in stepped + others:
        for s in segments_of(p):
            quantities = QUANTITIES if id(p) in stepped_ids and moments else QUANTITIES[:1]
            for q in quantities:
                local = p.detach() if q == "value" else optimizer.state[p][q]
                wanted.setdefault(s.name, []).append((local, s, q))
    missing = set(wanted) - assembler.names()
    if missing:
        raise ValueError(f"the checkpoint lacks {sorted(missing)[:3]}: it was saved from another model")
    with torch.no_grad():
        for name, targets in wanted.items():
            for q in QUANTITIES:
                mine = [(local, s) for local, s, quantity in targets if quantity == q]
                if not mine:
                    continue
                full = assembler.full(name, q, mine[0][0].dtype)
                for local, s in mine:
                    block = full.narrow(s.dim, s.start, s.stop - s.start).reshape(-1)
                    n = s.flat_stop - s.flat_start
                    local.view(-1)[s.offset:s.offset + n] = block[s.flat_start:s.flat_stop].to(local.device)


def model_config(model) -> dict:
    """The LlamaConfig of `model` (01's model, or a pipeline rank's stages), as a dict for the manifest."""
    config = next(m.config for m in model.modules() if hasattr(m, "config"))
    return asdict(config)
