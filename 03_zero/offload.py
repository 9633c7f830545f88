"""ZeRO-Offload: the optimizer states, and the master copy of the shard they update, in host memory.

Playbook §2.2 "ZeRO"; Ren et al. 2021, ZeRO-Offload §4 (the ZeRO paper's ZeRO-R family). ZeRO-1/2/3 leave
1/N of AdamW's states on each device; offloading moves them, with the master parameters they update, to
the CPU and runs the step there. Per step, after the reduce-scatter (and the clip, on the device):

    device -> host   this rank's gradient shard, each unit's (U/N,)        `gradients_to_host`
    host             AdamW on the master shard and its exp_avg, exp_avg_sq  (01's optimizer, unchanged)
    host -> device   the updated shard; stages 1-2 then all-gather it       `parameters_to_device`

Memory per rank, Ψ padded elements of e bytes, N ranks: device parameters eΨ (stage 3: eΨ/N), gradients as
the stage keeps them, optimizer states 0; host master eΨ/N + gradient eΨ/N + states 2eΨ/N. Traffic: eΨ/N
bytes each way per step. The step is the same AdamW on the same numbers, so losses and parameters equal
ZeRO-s's and 01's. On a GPU the host tensors are page-locked (pinned), so both copies are DMA transfers;
on this CPU-only machine "device" and "host" are both the CPU and the host copies are separate tensors
(written for GPUs, untested on one here). Worked numbers: 03_zero/README.md.

    torchrun --nproc_per_node 2 03_zero/train.py --dp 2 --zero-stage 2 --offload optimizer

New compared with zero.py: `OptimizerOffload`, and the two copies around the optimizer step in train.py
(the flag and the numbers: layout.py).
"""
import torch


class OptimizerOffload:
    """Host copies of ZeRO's `shards` (its pieces): the optimizer steps `master`; the device keeps `shards`."""

    def __init__(self, shards):
        self.shards = list(shards)                                     # on the compute device
        self.master, self.grads = [], []                               # on the host, same shapes (n,)
        for shard in self.shards:
            pin = shard.is_cuda          # page-locked memory: asynchronous copies (pinning needs CUDA)
            master = torch.nn.Parameter(torch.empty(shard.shape, dtype=shard.dtype, pin_memory=pin))
            with torch.no_grad():
                master.copy_(shard)
            master.__dict__.update(shard.__dict__)   # `decays` (the decay group), `segments` (checkpoints)
            self.master.append(master)
            self.grads.append(torch.empty(shard.shape, dtype=shard.dtype, pin_memory=pin))

    @torch.no_grad()
    def gradients_to_host(self):
        """Each shard's .grad (n,), reduced and clipped on the device, into its host buffer."""
        for shard, master, grad in zip(self.shards, self.master, self.grads):
            grad.copy_(shard.grad, non_blocking=True)                  # device -> host (pinned: DMA)
            master.grad = grad
        if self.shards and self.shards[0].is_cuda:
            torch.cuda.synchronize(self.shards[0].device)              # the CPU step reads them next

    @torch.no_grad()
    def parameters_to_device(self):
        """The stepped master values into the device shards. Asynchronous on a GPU: the next
        gradients_to_host synchronizes before the host writes the masters again."""
        for shard, master in zip(self.shards, self.master):
            shard.copy_(master, non_blocking=True)                     # host -> device

    def host_bytes(self, optimizer):
        """(master parameters, gradients, optimizer states) bytes on the host."""
        nbytes = sum(t.numel() * t.element_size() for t in self.master)
        states = sum(v.numel() * v.element_size() for state in optimizer.state.values()
                     for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return nbytes, nbytes, states
