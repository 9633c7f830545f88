"""ZeRO stages 1, 2 and 3: data parallelism that shards the model states instead of replicating them.

Playbook §2.2 "ZeRO", Rajbhandari et al., ZeRO (§5 memory, §7 communication). The parameters are
grouped into flat_unit.py's units, one per module, each padded to a multiple of N; data-parallel rank r
owns slice r of every unit: its shard. AdamW (01's, unchanged) steps only the shards.

    stage 1  optimizer states   grads reduce-scattered after the last micro-batch; shards all-gathered
                                after the step
    stage 2  + gradients        each unit's grads reduce-scattered in backward as soon as complete
    stage 3  + parameters       a unit all-gathered before its forward and its backward, freed after;
                                the next unit's all-gather issued one unit ahead

Memory per rank: zero_layout.py's table (stage s divides one more of eΨ, eΨ, 2eΨ by N). Wire bytes per
step with A micro-batches and B = eΨ: 2·(N−1)/N·B (stage 1, DP's volume), (A+1)·(N−1)/N·B (stage 2),
3A·(N−1)/N·B (stage 3). Derivation: 03_zero/README.md.

    torchrun --nproc_per_node 4 03_zero/train.py --dp 4 --zero-stage 3 --mbs 2

New compared with 02: the flat units, the sharded optimizer, and where each collective happens.
08_5d_combined/distributed_optimizer.py runs it on the stages of a pipeline and the tp shards.
"""
import contextlib
import warnings

import torch
import torch.distributed as dist

import memory
import comm
import data_parallel
import flat_unit


class ZeRO(data_parallel.GradientSyncSwitch):
    """One stage's sharding of `modules`' parameters over `group`, and the calls of its step: zero_gradients,
    finish_gradients, clip_gradients, gather_shards (03's train.py shows their order). Stages 2-3: inside
    `no_sync()` (02's) the hooks leave the gradients to accumulate in .grad."""

    def __init__(self, modules, group, stage: int, exclude=(), divisor=None, source=None, grad_dtype=None,
                 pipelined=False, before_reduce=None):
        """`exclude`: parameters another ZeRO shards (08: the experts, over other ranks); `divisor`: the
        gradient is the sum over `group` divided by it (default: the group's size, the mean); `source`:
        where meta parameters get their values (01's materialize.Source; stage 3 never holds them all);
        `grad_dtype`: the dtype gradients are reduced and accumulated in (default: the parameters'; 01's
        bf16-20 layout: fp32 under bf16 parameters).
        `pipelined` (08, under a pipeline schedule): a unit's gradients accumulate over the step's
        backwards and are reduce-scattered in the one its caller leaves outside `no_sync`, units not
        reduced then at `finish_gradients`; stage 3 gathers what `gather` is given and keeps it until
        the unit's reduce-scatter (no module hooks: a pipeline chunk runs many times per step).
        `before_reduce(params)` runs on full gradients just before they are reduced (08: SP's and the kv
        heads' sums over tp)."""
        if stage not in (1, 2, 3):
            raise ValueError(f"--zero-stage {stage}: choose 1, 2 or 3")
        self.group, self.stage, self.pipelined = group, stage, pipelined
        self.before_reduce = before_reduce or (lambda params: None)
        self.size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.divisor = divisor or self.size
        self.units = flat_unit.build_units(modules, exclude, rank, self.size, stage, source, grad_dtype)
        self.in_flight, self.events, self.callback_queued = [], [], False
        self.gathered_bytes = self.peak_gathered_bytes = 0       # stage 3: full units held (measured)
        for unit in self.units:
            for p in unit.params:           # (hooks run in the order registered)
                if not unit.grad_views:     # bf16-20: each backward's bf16 .grad added into fp32, zeroed
                    p.register_post_accumulate_grad_hook(unit.accumulate)
                if stage > 1:
                    p.register_post_accumulate_grad_hook(lambda p, u=unit: self._grad_ready(u))
            if stage == 3 and not pipelined:
                # The embedding's input (token ids) needs no gradient, so its backward pre-hook fires on the
                # output gradient alone: exactly what stage 3 wants. torch warns about it; silenced here.
                warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are "
                                                          "computed with respect to module outputs")
                unit.module.register_forward_pre_hook(lambda m, args, u=unit: self._before(u, +1))
                unit.module.register_forward_hook(lambda m, args, out, u=unit: u.free())
                unit.module.register_full_backward_pre_hook(lambda m, grad, u=unit: self._before(u, -1))

    @property
    def shards(self):
        """The Parameters the optimizer steps: each unit's shard, in its decayed and non-decayed pieces."""
        return [piece for unit in self.units for piece in unit.pieces]

    @property
    def padded_numel(self):          # Ψ: the elements of all units, padding included
        return sum(unit.padded for unit in self.units)

    @property
    def padded_bytes(self):
        return sum(unit.padded * unit.shard.element_size() for unit in self.units)

    # ==================================================================================
    # the step: gradient buffers, gradient reduction, clipping
    # ==================================================================================
    def zero_gradients(self):
        """Before the first micro-batch: stage 1 points every .grad at its unit's zeroed flat buffer
        (autograd accumulates into it in place); stages 2-3 zero the shard gradients."""
        self.events.clear()
        for unit in self.units:
            unit.zero_gradient(self.stage)

    def finish_gradients(self):
        """unit.grad (U/N,), and its pieces' .grad: this rank's slice of the sum over ranks of the
        gradients, / divisor (the mean)."""
        if self.stage > 1 and self.pipelined:
            self.events.append(("finish", None))
            self._end_of_backward()               # the units no synchronising backward completed
        if self.stage == 1:     # one reduce-scatter per unit, in place: slice r of grad_full
            self.before_reduce([p for u in self.units for p in u.params])
            # exercise 03.1: ZeRO-1: reduce-scatter the gradients, all-gather the shards
            # hint: ZeRO §5.1 (03's README, "How it works"): a rank needs only its slice [lo, hi) of the
            #   summed gradient, then every rank's new slice; comm.py's flat collectives, all in flight.
            # test: tests/test_zero.py::test_zero1_step_equals_adamw_on_the_whole_batch
            works = [comm.reduce_scatter_flat(u.grad_full[u.lo:u.hi], u.grad_full, group=self.group,
                                              async_op=True) for u in self.units]           # (U,) -> (U/N,)
            for work in works:
                work.wait()
            # end exercise
        for unit in self.units:
            unit.grad = unit.grad_full[unit.lo:unit.hi] if self.stage == 1 else unit.shard_grad   # (U/N,)
            unit.grad.div_(self.divisor)
            for piece in unit.pieces:
                grad = unit.grad[piece.start:piece.start + piece.numel()]
                if grad.dtype == piece.dtype:
                    piece.grad = grad
                else:             # bf16-20: fp32, which a bf16 tensor's .grad cannot be (Megatron's name)
                    piece.main_grad = grad

    def clip_gradients(self, max_norm):
        """torch's clip_grad_norm_ on the global gradient: ‖g‖² = Σ over ranks of ‖shard‖²."""
        # () this rank's ‖shard‖² (offload.py: computed on the host), summed on the device
        squares = self.shard_squares().to(self.units[0].full.device if self.units else None)
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.group)
        norm = squares.sqrt()
        if max_norm > 0:
            self.scale_gradients((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def shard_squares(self, which=lambda p: True):
        """() Σ of the squares of this rank's shard gradients that belong to parameters p with which(p)
        (08 sums tp-sharded and replicated weights differently); the padding holds zeros."""
        dtype = torch.promote_types(self.units[0].shard.dtype, torch.float32) if self.units else torch.float32
        total = torch.zeros((), dtype=dtype, device=self.units[0].shard.device if self.units else None)
        for unit in self.units:
            for p, a, b in zip(unit.params, unit.offsets, unit.offsets[1:]):
                lo, hi = max(a, unit.lo), min(b, unit.hi)            # p's elements inside [lo, hi)
                if lo < hi and which(p):
                    squares = unit.grad[lo - unit.lo:hi - unit.lo].to(dtype).pow(2).sum()
                    # a kv head on r tp ranks (04's tp > kv heads) counts 1/r per copy
                    total += squares / getattr(p, "kv_replicas", 1)
        return total

    def scale_gradients(self, coef):
        for unit in self.units:
            unit.grad.mul_(coef.to(unit.grad.device, unit.grad.dtype))

    # ==================================================================================
    # stages 2-3: reduce-scatter each unit's gradients as soon as they are complete
    # ==================================================================================
    def _grad_ready(self, unit):
        if not self.require_backward_grad_sync:
            return
        if not self.callback_queued and not self.pipelined:   # once per backward: flush what is left
            # when it ends (as DDP does); pipelined, the step's other passes may still add to it
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.callback_queued = True
        self.events.append(("grad", unit.index))
        # exercise 03.2: ZeRO-2: reduce-scatter each unit's gradients in backward
        # hint: ZeRO §5.2 (03's README, "How it works"): a unit leaves once backward has produced all its
        #   parameters' gradients, while backward goes on, one reduce-scatter in flight; `_retire` adds the
        #   slice that comes back into the unit's shard gradient, where the micro-batches accumulate.
        # test: tests/test_zero.py::test_zero2_step_equals_adamw_on_the_whole_batch
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._reduce_scatter(unit)
        # end exercise

    def _reduce_scatter(self, unit):
        self.before_reduce(unit.params)       # on .grad, or bf16-20's fp32 main_grad (01's main_grad)
        flat = unit.take_full_gradient()      # (U,); the full-size .grad are freed right away
        if self.stage == 3:
            unit.free()                       # backward through this unit is over
        self._retire(keep=0)                  # at most one reduce-scatter in flight
        self.events.append(("reduce_scatter", unit.index))
        # exercise 03.2
        work = comm.reduce_scatter_flat(flat[unit.lo:unit.hi], flat, group=self.group, async_op=True)
        self.in_flight.append((work, unit, flat))                             # (U,) -> (U/N,)
        # end exercise

    def _retire(self, keep):
        while len(self.in_flight) > keep:
            work, unit, flat = self.in_flight.pop(0)
            work.wait()
            # (U/N,) summed over ranks; offload.py's ParameterOffload keeps it on the host: a d2h copy
            unit.shard_grad += flat[unit.lo:unit.hi].to(unit.shard_grad.device)

    def _end_of_backward(self):
        for unit in self.units:
            if unit.ready < len(unit.params):
                self._reduce_scatter(unit)    # parameters this backward did not reach count as zeros
            unit.ready = 0
        self._retire(keep=0)
        self.callback_queued = False

    # ==================================================================================
    # all-gathers: after the step (stages 1-2), around each unit's use (stage 3)
    # ==================================================================================
    def _gather(self, unit):
        """Issue the async all-gather of unit's parameters (stage 3), unless present or in flight."""
        if unit.gathered or unit.gather_work is not None:
            return
        # exercise 03.3: ZeRO-3: gather each unit before its use, prefetch the next
        # hint: ZeRO §5.3 (03's README, "How it works"): a unit's parameters exist from an all-gather before
        #   its forward and backward until freed (no storage); the neighbour's, one unit ahead, overlaps.
        # test: tests/test_zero.py::test_zero3_step_equals_adamw_on_the_whole_batch
        # level: 2
        unit.full.untyped_storage().resize_(unit.padded * unit.full.element_size())
        unit.gather_work = comm.all_gather_flat(unit.full, self._shard_on_device(unit), group=self.group,
                                                async_op=True)                 # (U/N,) -> (U,)
        # end exercise
        self.events.append(("gather_issued", unit.index))
        self.gathered_bytes = sum(u.padded * u.full.element_size() for u in self.units
                                  if u.gathered or u.gather_work is not None)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _shard_on_device(self, unit):
        return unit.shard             # offload.py's ParameterOffload: a copy of the host's, made now

    def gather(self, units):
        """Pipelined stage 3: have `units` (a pipeline chunk's) whole, issuing their all-gathers at once."""
        for unit in units:
            self._gather(unit)
        for unit in units:
            self._materialize(unit)

    def _materialize(self, unit):
        """Block until unit's full parameters are here (gathering them now if nobody prefetched)."""
        self._gather(unit)
        if unit.gather_work is not None:
            unit.gather_work.wait()
        unit.gather_work, unit.gathered = None, True

    def _before(self, unit, direction):
        """Forward (+1) / backward (−1) pre-hook: have this unit, prefetch the next one."""
        # exercise 03.3
        self._materialize(unit)
        neighbour = unit.index + direction
        if 0 <= neighbour < len(self.units):
            self._gather(self.units[neighbour])
        # end exercise
        self.events.append(("forward" if direction > 0 else "backward", unit.index))

    def gather_shards(self):
        """After the optimizer step (stages 1-2): every rank's updated shards, into every full buffer.
        Stage 3 keeps only the shards: its units are gathered before each use instead."""
        if self.stage == 3:
            return
        # exercise 03.1
        works = [comm.all_gather_flat(u.full, u.shard, group=self.group, async_op=True)
                 for u in self.units]         # in place: the shard is slice r of full
        for work in works:
            work.wait()
        # end exercise

    @contextlib.contextmanager
    def gathered(self):
        """Every unit's full parameters present inside (stage 3 gathers, then frees them; collective)."""
        for unit in self.units:
            self._materialize(unit)
        try:
            yield
        finally:
            for unit in self.units:
                if self.stage == 3:
                    unit.free()

    def full_state_dict(self, model):
        """name -> full tensor (a copy), gathering stage 3's shards (collective)."""
        with self.gathered():
            return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def model_state_bytes(self, model, optimizer):
        """(parameters, gradients, optimizer states) bytes this rank really holds (distinct storages) on the
        compute device: the states the optimizer keeps for the shards (none once offloaded), and a mixed-
        precision optimizer's fp32 masters of them with their states (optimizer states, as 08's planner
        counts them)."""
        params = memory.held_bytes([*model.parameters(), *self.shards])
        grads = memory.held_bytes([*(p.grad for p in model.parameters()), *(u.grad for u in self.units),
                               *(u.grad_full for u in self.units), *(u.shard_grad for u in self.units)])
        return params, grads, self.optimizer_bytes(optimizer)

    def optimizer_bytes(self, optimizer):
        """AdamW's states of the shards (none once offloaded) and bf16-16/20's fp32 masters with theirs."""
        stepped = list(self.shards)
        if getattr(optimizer, "masters", None) is not getattr(optimizer, "params", None):   # bf16-16/20
            stepped += optimizer.masters
        states = memory.tensor_bytes(v for p in stepped for v in optimizer.state.get(p, {}).values()
                                     if torch.is_tensor(v) and v.dim() > 0)
        return states + memory.held_bytes(stepped[len(self.shards):])

