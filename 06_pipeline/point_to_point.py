"""Pipeline parallelism's messages: activations forward, gradients backward, point to point.

Playbook §2.6 (pipeline parallelism), Megatron-LM §2.2 (`p2p_communication.py` of its code). Between the
blocks of one pipeline (pipeline.py places them on the ranks) travel (mbs, T, C) tensors: block b sends
its output to block b+1 and receives the gradient of that output back. Per micro-batch and block
boundary one send of mbs·T·C elements forward and one backward ([PB] App. 5.3.4: 4·mbs·T·C per
micro-batch counting both ends); per rank and step, m micro-batches, V chunks per rank:
    sends = m·(2V − [first rank] − [last rank])  messages of mbs·T·C elements
(only the first block sends no gradient and only the last block no activation). Sends are asynchronous,
receives block, and every message is tagged with (micro-batch, boundary, direction), so a schedule that
received out of order fails loudly. Forward and backward messages, and the hops that go down to a
lower rank (the interleaved ring's wrap, the V's way back), each get a process group of their own
(`direction_groups`): NCCL runs one communicator's sends and receives between two ranks in issue order.

    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 4 --pp-schedule 1f1b --grad-acc 8

New compared with 02: messages between two ranks, not collectives over a group.
"""

import torch
import torch.distributed as dist

import process_grid
import pipeline


def direction_groups(grid, chunks: int):
    """{(direction, descends): process group} with this rank's pipeline in each (collective: every rank
    creates every pipeline's groups, in the same order). `descends`: the hops whose forward message goes
    down to a lower rank (the interleaved ring's wrap, the V's way back). NCCL runs one communicator's
    sends and receives between two ranks in issue order, so a send waiting for its receiver must never sit
    in front of a receive the receiver waits for: within one group every pair talks one way, both ends in
    the same micro-batch order."""
    layout = process_grid.grid_layout(grid.world_size, grid.dp_size, grid.pp_size, grid.cp_size, grid.tp_size)
    pipelines = layout.permute(0, 2, 3, 1).reshape(-1, grid.pp_size).tolist()       # (dp·cp·tp, pp)
    mine = {}
    for key in [("F", False), ("B", False)] + ([("F", True), ("B", True)] if chunks > 1 else []):
        for ranks in pipelines:
            group = process_grid.new_group(ranks)
            if grid.rank in ranks:
                mine[key] = group
    return mine


class P2P:
    """Sends (`dist.isend`, completed at the end of the step) and blocking receives of (mbs, T, C) tensors
    between neighbouring blocks of one pipeline, tagged and grouped as the module docstring says. V-wise
    (`v_shape`) the hop between rank p−1's two blocks stays on the rank: handed over in memory."""

    def __init__(self, pp_ranks, pp_rank: int, groups: dict, chunks: int, shape, dtype, device,
                 v_shape: bool = False):
        self.ranks, self.rank, self.groups = pp_ranks, pp_rank, groups
        self.p, self.chunks, self.shape, self.dtype, self.device = len(pp_ranks), chunks, shape, dtype, device
        self.v_shape = v_shape
        self.pending = []                                 # (work, tensor) of unfinished sends
        self.sent = []                                    # (to pp rank, micro-batch, "F"/"B") of this step
        self.local = {}                                   # (boundary, micro-batch, direction) -> tensor

    def _tag(self, micro: int, boundary: int, direction: int):    # boundary b: between blocks b and b+1
        return (micro * self.p * self.chunks + boundary) * 2 + direction

    def _block(self, chunk: int):
        return pipeline.block_index(self.rank, chunk, self.p, self.v_shape)

    def _rank_of(self, block: int):
        return pipeline.rank_of_block(block, self.p, self.v_shape)

    def send_forward(self, x, micro: int, chunk: int):
        """Activations (mbs, T, C) of block b to block b+1."""
        self._send(x, self._block(chunk), micro, 0)

    def recv_forward(self, micro: int, chunk: int):
        """Activations (mbs, T, C) from block b−1; a leaf that will collect their gradient."""
        return self._recv(self._block(chunk) - 1, micro, 0).requires_grad_()

    def send_backward(self, dx, micro: int, chunk: int):
        """Gradient (mbs, T, C) w.r.t. the input of block b, to block b−1."""
        self._send(dx, self._block(chunk) - 1, micro, 1)

    def recv_backward(self, micro: int, chunk: int):
        """Gradient (mbs, T, C) w.r.t. the output of block b, from block b+1."""
        return self._recv(self._block(chunk), micro, 1)

    def _peer(self, boundary: int):
        """(pp rank at the other end of `boundary` from this rank, whether its forward hop descends)."""
        source, target = self._rank_of(boundary), self._rank_of(boundary + 1)
        return (target if self.rank == source else source), target < source

    def _send(self, tensor, boundary: int, micro: int, direction: int):
        tensor = tensor.detach().to(self.dtype).contiguous()
        to, descends = self._peer(boundary)
        if to == self.rank:                               # the V's turn: rank p−1's chunk 0 <-> chunk 1
            self.local[boundary, micro, direction] = tensor
            return
        group, tag = self.groups["FB"[direction], descends], self._tag(micro, boundary, direction)
        self.pending.append((dist.isend(tensor, self.ranks[to], group=group, tag=tag), tensor))
        self.sent.append((to, micro, "FB"[direction]))

    def _recv(self, boundary: int, micro: int, direction: int):
        source, descends = self._peer(boundary)
        if source == self.rank:
            return self.local.pop((boundary, micro, direction))
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.irecv(buffer, self.ranks[source], group=self.groups["FB"[direction], descends],
                   tag=self._tag(micro, boundary, direction)).wait()
        return buffer

    def group_names(self) -> dict:
        """id(group) -> name, for the communication meter."""
        suffix = "_return" if self.v_shape else "_wrap"
        return {id(g): f"pp_{kind}" + (suffix if descends else "")
                for (kind, descends), g in self.groups.items()}

    def finish(self):
        """Wait for every send of the step (their buffers may be freed afterwards)."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
