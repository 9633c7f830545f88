"""ZeRO-Offload: the optimizer states and master shard in host memory (`--offload optimizer`), and with
ZeRO-3 the parameter shards and their gradients too (`--offload param`).

Playbook §2.2 "ZeRO"; Ren et al. 2021, ZeRO-Offload §4; Rajbhandari et al. 2021, ZeRO-Infinity (the
parameters). Per step, Ψ padded elements of e bytes, N ranks, A micro-batches:

    optimizer  after the reduce-scatter and the clip: the gradient shard to the host (`gradients_to_host`),
               AdamW there on the master shard, the updated shard back (`parameters_to_device`), eΨ/N
               each way; device: the stage's parameters and gradients, no optimizer state (bf16-16/20:
               the bf16 shard stays, the fp32 master goes; the copies convert)
    param      ZeRO-3's shard lives on the host and AdamW steps it there; each unit is copied to the
               device just before its all-gather and freed with it (2A·eΨ/N host -> device), each
               reduce-scatter's slice added into the host's gradient (A·eΨ/N back); the device keeps
               nothing between steps, at most two neighbouring units gathered and one shard copy during
               one (layout.expected_peak_device_bytes); bf16-16/20: the fp32 masters are host tensors too
    host       master or shard eΨ/N + gradient eΨ/N + AdamW's states 2eΨ/N (param: ZeRO-3's bytes)

The same AdamW on the same numbers: losses and parameters equal ZeRO-s's and 01's. Why (fp16 too), the
pinned copies on a GPU, and the measured numbers: 03_zero/README.md.

    torchrun --nproc_per_node 2 03_zero/train.py --dp 2 --zero-stage 3 --offload param

New compared with zero.py: `OptimizerOffload` with its two copies around the step in train.py, and
`ParameterOffload`, ZeRO-3 with host shards (the flags and the numbers: zero_layout.py).
"""

import torch

import memory
import zero


class OptimizerOffload:
    """Host copies of ZeRO's `shards` (its pieces): the optimizer steps `master`; the device keeps `shards`.
    `master_dtype`: the masters' and their gradients' dtype, if not the shards' (bf16-16/20: fp32 masters
    of the bf16 shards; the copies convert, as 01's MixedPrecisionOptimizer does on the device)."""

    def __init__(self, shards, master_dtype=None):
        self.shards = list(shards)                                     # on the compute device
        self.master, self.grads = [], []                               # on the host, same shapes (n,)
        for shard in self.shards:
            master = torch.nn.Parameter(host_copy(shard, master_dtype))
            master.__dict__.update(shard.__dict__)   # `decays` (the decay group), `segments` (checkpoints)
            self.master.append(master)
            self.grads.append(torch.empty_like(master, pin_memory=shard.is_cuda))
        # --resume restores the masters (what the optimizer steps), not ZeRO-3's shards (no model parameters):
        # the first step writes the device shards from the masters first (train.py)
        self.device_stale = True

    @torch.no_grad()
    def gradients_to_host(self):
        """Each shard's gradient (n,), reduced and clipped on the device, into its host buffer: .grad, or
        bf16-20's fp32 `main_grad` (zero.py's finish_gradients)."""
        # exercise 03.4: ZeRO-Offload's copies around the step
        # hint: ZeRO-Offload §4 (03's README, "ZeRO-Offload"; the module docstring's `optimizer` row): AdamW
        #   steps the host's `master` pieces, so each needs its shard's reduced gradient there, in the host
        #   buffer made for it (bf16-20 keeps that gradient in fp32 beside the bf16 shard: 01's main_grad);
        #   after the step the device shards take the stepped values. A copy into an existing tensor casts.
        # test: tests/test_zero.py::test_optimizer_offload_steps_the_host_masters_of_the_device_shards
        for shard, master, grad in zip(self.shards, self.master, self.grads):
            source = getattr(shard, "main_grad", None)
            grad.copy_(shard.grad if source is None else source, non_blocking=True)   # device -> host (DMA)
            master.grad = grad
        # end exercise
        if self.shards and self.shards[0].is_cuda:
            torch.cuda.synchronize(self.shards[0].device)              # the CPU step reads them next

    @torch.no_grad()
    def parameters_to_device(self):
        """The stepped master values into the device shards. Asynchronous on a GPU: the next
        gradients_to_host synchronizes before the host writes the masters again."""
        # exercise 03.4
        for shard, master in zip(self.shards, self.master):
            shard.copy_(master, non_blocking=True)                     # host -> device (bf16: rounded)
        # end exercise
        self.device_stale = False

    def host_bytes(self, optimizer):
        """(master parameters, gradients, optimizer states) bytes on the host."""
        nbytes = memory.tensor_bytes(self.master)                      # the gradients: the same shapes, dtype
        return nbytes, nbytes, memory.optimizer_state_bytes(optimizer)


class ParameterOffload(zero.ZeRO):
    """ZeRO-3 whose shards, and their gradients, live in host memory (ZeRO-Infinity's parameter offload).

    Each unit's `shard` (U/N,) is a host tensor, and so are the optimizer's pieces (views of it) and
    `shard_grad`: AdamW steps them on the host (bf16-16/20: 01's MixedPrecisionOptimizer steps its fp32
    masters of them, made on the host from the host pieces, and rounds them into the pieces; `grad_dtype`:
    bf16-20's fp32 gradient shard, as zero.ZeRO's). A unit is copied to the device just before its
    all-gather (`_shard_on_device`: the copy lives until the gather completes), and each reduce-scatter's
    slice is added into the host's `shard_grad` (zero.py's `_retire`). The device holds only the units
    gathered at the moment (and activations). Measured: `peak_device_bytes` (full units and shard copies),
    `h2d_bytes` and `d2h_bytes` (the copies of the current step)."""

    def __init__(self, modules, group, source=None, grad_dtype=None):
        super().__init__(modules, group, stage=3, source=source, grad_dtype=grad_dtype)
        self.device = self.units[0].full.device
        for unit in self.units:
            unit.shard = host_copy(unit.shard)       # the device's shard goes: nothing of it persists there
            for piece in unit.pieces:
                piece.data = unit.shard[piece.start:piece.start + piece.numel()]
            unit.shard_grad = host_copy(unit.shard_grad)
            unit.device_copy = None                  # (U/N,) on the device while its all-gather runs
        self.peak_device_bytes = self.h2d_bytes = self.d2h_bytes = 0

    def zero_gradients(self):
        super().zero_gradients()
        self.h2d_bytes = self.d2h_bytes = 0

    def _shard_on_device(self, unit):
        """host -> device: a copy of the shard (pinned source: an asynchronous DMA on a GPU). The host
        shard is written next by AdamW, after backward's last reduce-scatter slice was copied to the host
        (a synchronous copy, behind every copy issued before it on the stream)."""
        unit.device_copy = torch.empty(unit.shard.shape, dtype=unit.shard.dtype, device=self.device)
        unit.device_copy.copy_(unit.shard, non_blocking=True)
        self.h2d_bytes += unit.device_copy.numel() * unit.device_copy.element_size()
        self.events.append(("to_device", unit.index))
        return unit.device_copy

    def _gather(self, unit):
        super()._gather(unit)
        copies = sum(u.device_copy.numel() * u.device_copy.element_size() for u in self.units
                     if u.device_copy is not None)
        self.peak_device_bytes = max(self.peak_device_bytes, self.gathered_bytes + copies)

    def _materialize(self, unit):
        super()._materialize(unit)
        unit.device_copy = None                      # the gather has read it

    def _retire(self, keep):
        for _, unit, flat in self.in_flight[:max(0, len(self.in_flight) - keep)]:   # those retired now
            self.d2h_bytes += (unit.hi - unit.lo) * flat.element_size()
            self.events.append(("to_host", unit.index))
        super()._retire(keep)

    def model_state_bytes(self, model, optimizer):
        """(parameters, gradients, optimizer states) bytes held on the device between steps: the model's
        parameters (freed) and their .grad (none); everything else is `host_bytes`'."""
        return memory.held_bytes(model.parameters()), memory.held_bytes(p.grad for p in model.parameters()), 0

    def host_bytes(self, optimizer):
        """(parameter shards, gradient shards, optimizer states and bf16-16/20's fp32 masters) bytes on the
        host: what ZeRO-3 holds on the device without offload."""
        return (memory.held_bytes(u.shard for u in self.units),
                memory.held_bytes(u.shard_grad for u in self.units), self.optimizer_bytes(optimizer))


@torch.no_grad()
def host_copy(tensor, dtype=None):
    """A host tensor of its own with tensor's values (in `dtype`, if given): page-locked when the device is a
    GPU, so that copies to and from it are asynchronous DMA transfers (pinning needs CUDA)."""
    host = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, pin_memory=tensor.is_cuda)
    host.copy_(tensor)
    return host
