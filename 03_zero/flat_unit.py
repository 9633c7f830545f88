"""ZeRO's flat units: one module's parameters as one padded buffer, and this rank's shard of it.

Playbook §2.2 "ZeRO", Rajbhandari et al. §5. The parameters are grouped into units, one per module (the
embedding, each decoder layer, the final norm, the head); each unit is one flat buffer of U elements
padded to a multiple of N, and data-parallel rank r owns the slice [r·U/N, (r+1)·U/N): its shard.

    full    (U,)     the module's parameters are views of it (stage 3: allocated only while gathered)
    shard   (U/N,)   a slice of full (stages 1-2) or a tensor of its own (stage 3: all that persists)
    pieces           the shard's decayed and non-decayed parts: the Parameters 01's AdamW steps

A rank never holds more than its shard and one full tensor while building stage 3's units from meta
parameters (01's materialize.py). zero.py shards a model with them; the command that runs it:

    torchrun --nproc_per_node 4 03_zero/train.py --dp 4 --zero-stage 3 --mbs 2

New compared with 02: the flat buffers that ZeRO's collectives read and write in place.
"""
import math

import torch

import global_state
import materialize
import mixed_precision
import optim


def llama_units(model):
    """The modules whose parameters form one unit each, in forward order."""
    return [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]


def build_units(modules, exclude, rank, size, stage, source=None, grad_dtype=None):
    """One FlatUnit per module, of its trainable parameters that are not in `exclude` and not in an earlier
    unit (a tied head's weight is the embedding's); meta parameters become views of their unit's buffer in
    every module holding them (a tied head too)."""
    exclude = set(exclude)                       # sets of tensors compare by identity (lists: by value)
    seen, units = set(exclude), []
    for module in modules:
        own = [p for p in module.parameters() if p.requires_grad and p not in exclude]
        params = [p for p in own if p not in seen]
        if stage == 3 and len(params) < len(own):
            raise ValueError("ZeRO-3 gathers each module's own parameters: shared (tied) weights are not "
                             "supported, train without --tie-embeddings or use --zero-stage 1 or 2")
        seen.update(params)
        if params:
            units.append(FlatUnit(len(units), module, params, rank, size, stage, source, grad_dtype))
    materialized = {k: v for unit in units for k, v in getattr(unit, "materialized", {}).items()}
    for module in modules:
        materialize.swap_parameters(module, materialized)
    return units


class FlatUnit:
    """One module's parameters as a flat buffer `full` (U,), U a multiple of N; `shard` is (U/N,).

    The parameters that weight decay applies to (01's `decays`: the matrices) come first, the norm gains
    after them, so the shard splits into at most two `pieces`, the Parameters AdamW steps: one decayed,
    one not (each marked with `decays`, which 01's make_optimizer reads).
    """

    def __init__(self, index, module, params, rank, size, stage, source=None, grad_dtype=None):
        params = sorted(params, key=lambda p: not optim.decays(p))            # stable: decayed first
        self.index, self.module, self.params = index, module, params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.padded = math.ceil(self.offsets[-1] / size) * size               # U
        self.lo, self.hi = rank * self.padded // size, (rank + 1) * self.padded // size
        if params[0].is_meta:       # 01's materialize.py: values from the source, this rank's range only
            self._materialize(source, stage)
        else:                       # real parameters (08's ZeRO-1): copied into the flat buffer
            self.full = params[0].new_zeros(self.padded)                      # (U,)
            with torch.no_grad():
                for p, view in zip(params, self.views(self.full)):
                    view.copy_(p)
                    p.data = view               # the module now computes with the flat buffer
            self.shard = self.full[self.lo:self.hi] if stage < 3 else self.full[self.lo:self.hi].clone()
        if stage == 3:              # the shard is all that persists; `full` is re-filled on demand
            self.free()
        decay_end = self.offsets[sum(optim.decays(p) for p in params)]        # where the norm gains start
        self.pieces = []                                                      # views of the shard
        for a, b, decayed in ((self.lo, min(self.hi, decay_end), True),
                              (max(self.lo, decay_end), self.hi, False)):
            if a < b:
                piece = torch.nn.Parameter(self.shard[a - self.lo:b - self.lo])
                piece.decays, piece.start = decayed, a - self.lo
                # which global parameters' elements it holds: checkpoints resume into any layout
                piece.segments = global_state.flat_segments(self.params, self.offsets, a, b)
                self.pieces.append(piece)
        self.grad = None                      # (U/N,) this rank's slice of the reduced gradient
        grad_dtype = grad_dtype or self.shard.dtype       # bf16-20: fp32 buffers under bf16 parameters
        self.grad_full = self.shard.new_zeros(self.padded, dtype=grad_dtype) if stage == 1 else None    # (U,)
        self.shard_grad = self.shard.new_zeros(self.hi - self.lo, dtype=grad_dtype) if stage > 1 else None
        self.grad_views = grad_dtype == self.shard.dtype  # stage 1: .grad can be a view of grad_full
        if not self.grad_views and stage == 1:
            self._point_main_grads()
        self.ready, self.gather_work, self.gathered = 0, None, stage < 3

    def zero_gradient(self, stage):
        """Before a step's first micro-batch: stage 1 zeroes grad_full and points each .grad at its view of
        it (autograd accumulates into it in place); stages 2-3 zero the shard's gradient."""
        if stage == 1:
            self.grad_full.zero_()
            for p, view in zip(self.params, self.views(self.grad_full)) if self.grad_views else []:
                p.grad = view
        else:
            self.shard_grad.zero_()

    def take_full_gradient(self):
        """Stages 2-3, at the unit's reduce-scatter: (U,) its parameters' gradients in the gradients' dtype,
        where they are computed (not the host); the parameters' full-size .grad are dropped."""
        if self.grad_views:
            flat = self.zeros_full_gradient()
            for p, view in zip(self.params, self.views(flat)):
                if p.grad is not None:
                    view.copy_(p.grad)
        else:
            # bf16-20: (U,) fp32, every backward since the last reduce-scatter added in
            # (08: all of a pipeline chunk's micro-batches)
            flat = self.release_main_grads()
        for p in self.params:
            p.grad = None
        return flat

    # bf16-20 (grad_views False): a bf16 .grad cannot be a view of an fp32 buffer, so each backward's bf16
    # .grad is added into the parameter's `main_grad`, a view of the unit's fp32 grad_full (U,) (Megatron's
    # main_grad; 01's hook), and what reduces, clips and sums over tp reads that (01's `main_grad`)
    def accumulate(self, p):
        """The post-accumulate-grad hook of p (bf16-20): its bf16 .grad added into its fp32 main_grad, zeroed.
        Stage 1 keeps grad_full for good; stages 2-3 allocate it at the unit's first gradient of the step (a
        pipeline chunk's micro-batches add up in it until its last backward, 08) and their reduce-scatter
        takes it (`release_main_grads`)."""
        if self.grad_full is None:
            self.grad_full = self.zeros_full_gradient()
            self._point_main_grads()
        mixed_precision.accumulate(p, p.main_grad)

    def zeros_full_gradient(self):
        """(U,) zeros in the gradients' dtype where the unit computes (the device, also when the shards are
        offloaded: NCCL reduce-scatters only device tensors). Stages 2-3."""
        return torch.zeros(self.padded, dtype=self.shard_grad.dtype, device=self.full.device)

    def _point_main_grads(self):
        for p, view in zip(self.params, self.views(self.grad_full)):
            p.main_grad = view

    def release_main_grads(self):
        """Stages 2-3 (bf16-20), at the unit's reduce-scatter: (U,) the fp32 sums of the step's micro-batches
        (zeros if no gradient reached the unit), which the unit and its parameters let go of."""
        flat = self.grad_full if self.grad_full is not None else self.zeros_full_gradient()
        for p in self.params:
            p.__dict__.pop("main_grad", None)
        self.grad_full = None
        return flat

    def views(self, flat):
        return [flat[a:b].view_as(p) for p, a, b in zip(self.params, self.offsets, self.offsets[1:])]

    @torch.no_grad()
    def _materialize(self, source, stage):
        """Stages 1-2 fill the whole flat buffer (every rank holds the parameters); stage 3 allocates only
        its shard and, one parameter at a time, generates those that overlap it: a rank never holds more
        than its shard and one full tensor. The meta parameters become views of `full`."""
        # (U,), never touched at stage 3
        self.full = torch.zeros(self.padded, dtype=source.dtype, device=source.device) if stage < 3 else \
            torch.empty(self.padded, dtype=source.dtype, device=source.device)
        self.shard = self.full[self.lo:self.hi] if stage < 3 else \
            torch.zeros(self.hi - self.lo, dtype=source.dtype, device=source.device)      # (U/N,)
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            lo, hi = max(a, self.lo), min(b, self.hi)           # p's elements inside this rank's shard
            if stage < 3:
                self.full[a:b] = source.values(p).flatten()
            elif lo < hi:
                self.shard[lo - self.lo:hi - self.lo] = source.values(p).flatten()[lo - a:hi - a]
        self.materialized = {}                                              # ZeRO swaps them in
        for p, view in zip(self.params, self.views(self.full)):
            new = torch.nn.Parameter(view.new_empty(0), requires_grad=p.requires_grad)
            new.__dict__.update(p.__dict__)                               # global_name, block, tp_sharded
            # a view's data with a version counter of its own (as the real path's p.data = view):
            # re-gathering `full` must not look like an edit
            new.data = view
            self.materialized[id(p)] = new
        self.params = [self.materialized[id(p)] for p in self.params]

    def free(self):
        self.full.untyped_storage().resize_(0)       # the parameters keep their shapes, not their bytes
        self.gathered = False
