"""Mixed precision: the dtype of every model state, fp32 master weights, and fp16's dynamic loss scaling.

Playbook §2.1 "Mixed precision training"; Micikevicius et al. 2018 (fp16, master weights, loss scaling).
Bytes per parameter of each --precision-layout (`LAYOUTS`; memory.py measures them, 08's planner reads
the same table for its "mixed" rows):

    layout    weights   gradients         master   AdamW m, v   total   what the forward reads
    autocast  4 fp32    4 fp32            -        4 + 4        16      fp32 weights cast to bf16/fp16 per use
    bf16-16   2 bf16    2 bf16            4 fp32   4 + 4        16      the bf16 weights
    bf16-20   2 bf16    2 bf16 + 4 fp32   4 fp32   4 + 4        20      (fp32 gradient accumulation)
(--dtype float32/float64: everything in that type, 16/32 bytes.) bf16-16/20 step fp32 copies of the
weights (`MixedPrecisionOptimizer`: AdamW's update is ~1e-3 of a weight, below bf16's 8-bit mantissa)
and copy them back rounded; bf16-20 sums the micro-batches' bf16 gradients into an fp32 buffer.
--dtype float16 (autocast) scales the loss by S before backward so small gradients stay above fp16's
6e-8, divides the gradients by S, and on inf/NaN skips the step and halves S; S doubles after
--loss-scale-window finite steps (`LossScaler`; each step's S is in --json-log).

    python 01_single_gpu/train.py --dtype bfloat16 --precision-layout bf16-20 --grad-acc 4
    python 01_single_gpu/train.py --dtype float16 --json-log run.jsonl

New compared with autocast alone: 16-bit weights with fp32 masters, and the loss scale.
"""
import math
from dataclasses import dataclass

import torch

import optim

DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}     # --dtype's that run under autocast


@dataclass(frozen=True)
class Layout:
    name: str
    weights: torch.dtype                  # what the model holds; backward writes .grad in it too
    accumulation: torch.dtype | None      # the buffer micro-batch gradients are summed into, if not .grad's
    master: torch.dtype | None            # the copy AdamW steps, if not the weights themselves

    def bytes_per_parameter(self):
        """(weights, gradients, optimizer) bytes per parameter, split as ZeRO and 08's planner split them:
        gradients = .grad + the accumulation buffer, optimizer = master + AdamW's two moments."""
        size = lambda dtype: torch.empty(0, dtype=dtype).element_size() if dtype else 0   # noqa: E731
        stepped = self.master or self.weights
        return (size(self.weights), size(self.weights) + size(self.accumulation),
                size(self.master) + 2 * size(stepped))


LAYOUTS = {"autocast": Layout("autocast", torch.float32, None, None),
           "bf16-16": Layout("bf16-16", torch.bfloat16, None, torch.float32),
           "bf16-20": Layout("bf16-20", torch.bfloat16, torch.float32, torch.float32),
           "fp32": Layout("fp32", torch.float32, None, None),
           "fp64": Layout("fp64", torch.float64, None, None)}


def add_arguments(parser):
    g = parser.add_argument_group("mixed precision (01_single_gpu/mixed_precision.py)")
    g.add_argument("--precision-layout", choices=["autocast", "bf16-16", "bf16-20"], default="autocast",
                   help="with --dtype bfloat16: fp32 weights under bf16 autocast, or bf16 weights and "
                        "gradients with fp32 master weights (16 bytes/param), plus an fp32 gradient "
                        "accumulation buffer (20)")
    g.add_argument("--loss-scale-init", type=float, default=2.0 ** 16,
                   help="--dtype float16: the first loss scale")
    g.add_argument("--loss-scale-window", type=int, default=1000, metavar="N",
                   help="--dtype float16: double the loss scale after N steps without overflow")
    return g


def check_precision(args, config=None):
    """The flags' combinations that cannot work, as a ValueError naming the fix (before any process group)."""
    if args.precision_layout != "autocast" and args.dtype != "bfloat16":
        raise ValueError(f"--precision-layout {args.precision_layout} holds bf16 weights: pass --dtype "
                         f"bfloat16 (float16 trains under autocast with loss scaling)")
    if not (math.isfinite(args.loss_scale_init) and args.loss_scale_init > 0):
        raise ValueError(f"--loss-scale-init must be a positive finite number, got {args.loss_scale_init}")
    if args.loss_scale_window < 1:
        raise ValueError(f"--loss-scale-window must be at least 1, got {args.loss_scale_window}")


def autocast(args, device):
    """bf16/fp16 autocast for --dtype bfloat16/float16 (bf16 weights too: the softmax, norms and loss then run
    in fp32, as autocast's fp32 list says), else nothing."""
    return torch.autocast(device.type, dtype=AUTOCAST.get(args.dtype), enabled=args.dtype in AUTOCAST)


def layout_of(args) -> Layout:
    """The layout the flags select (a trainer without --precision-layout trains under autocast)."""
    if args.dtype in ("float32", "float64"):
        return LAYOUTS[{"float32": "fp32", "float64": "fp64"}[args.dtype]]
    return LAYOUTS[getattr(args, "precision_layout", "autocast")]


@torch.no_grad()
def accumulate(p, buffer):
    """A post-accumulate-grad hook's body (bf16-20), run after each micro-batch's backward wrote p's bf16
    .grad: `buffer` is p's fp32 accumulator (the playbook's 2 + 4 gradient bytes; .grad's storage stays)."""
    # exercise 01.7: gradient accumulation in fp32
    # hint: [PB] §2.1 "Gradient accumulation" and "Mixed precision training" (01's README, "Mixed
    #   precision"; bf16-20's row of the table above): the step's gradient is the sum over the micro-batches
    #   (train_step divides each loss by their number). Summed in bf16, 8 bits of mantissa, the small ones
    #   would be lost; and autograd adds the next micro-batch's gradient into whatever .grad holds.
    # test: tests/test_mixed_precision.py::test_bf16_20_sums_the_micro_batch_gradients_in_fp32
    # hides: "(bf16-20: hooks add each .grad into fp32, zero it)"
    buffer.add_(p.grad)                     # (*p.shape) fp32 += bf16
    p.grad.zero_()                          # kept, not freed: the next backward adds into it
    # end exercise


def main_grad(p):
    """The tensor holding p's gradient: its fp32 `main_grad` where ZeRO keeps one beside a bf16 parameter
    (bf16-20: a view of the unit's flat fp32 buffer), else .grad. Megatron-LM's name, read the same way by
    its finalize_model_grads (the tp sums of SP's norms and of replicated weights run on it)."""
    grad = getattr(p, "main_grad", None)
    return p.grad if grad is None else grad


class LossScaler:
    """Dynamic loss scaling (Micikevicius et al. §3.2, as torch.amp.GradScaler): S halves on an overflow
    (that step is skipped), doubles after `window` steps in a row without one."""

    def __init__(self, scale: float, window: int):
        self.scale, self.window, self.good_steps = scale, window, 0

    def state_dict(self) -> dict:       # saved in the checkpoint's manifest: an fp16 resume is bitwise
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict):
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])

    def update(self, overflow: bool):
        # exercise 01.5: fp16's dynamic loss scaling
        # hint: Micikevicius et al. §3.2 (01's README, "Mixed precision"): back off after an overflow, grow
        #   again after `window` good steps in a row, counting from the last change of S.
        # test: tests/test_mixed_precision.py::test_loss_scaler_backs_off_and_grows
        if overflow:
            self.scale, self.good_steps = self.scale / 2, 0
        else:
            self.good_steps += 1
            if self.good_steps == self.window:
                self.scale, self.good_steps = self.scale * 2, 0
        # end exercise


class MixedPrecisionOptimizer:
    """01's AdamW stepping the layout's master weights of `params` (01, 02, 04-07: the model's parameters; 03
    and 08's ZeRO: its shards), and fp16's loss scale. A trainer's step calls, in device order:

        zero_grad()                         .grad dropped; bf16-20's fp32 accumulators zeroed
        scale(micro_loss).backward()        × S under fp16 (bf16-20: hooks add each .grad into fp32, zero it)
        grad_owners = unscale_gradients()   ÷ S; the tensors whose .grad is the step's gradient (to clip)
        step(grad_norm)                     AdamW on the fp32 masters, copied back rounded; an fp16 overflow
                                            (a non-finite norm: every rank sees the same) skips it
    Everything else (param_groups, state, hooks) is AdamW's, so checkpoints store the fp32 masters.
    `hooks`: whether bf16-20's fp32 accumulation happens here (01) or in the caller's buffers (03's ZeRO).
    `layout`: the layout of `params`, if not the flags' (03's ZeRO-Offload: fp32 host masters of bf16 shards).
    """

    def __init__(self, params, args, hooks: bool = True, layout: Layout | None = None):
        self.layout, self.params = layout or layout_of(args), [p for p in params if p.requires_grad]
        self.masters = self.params if self.layout.master is None else [self._master(p) for p in self.params]
        self.optimizer = optim.make_optimizer(self.masters, args)
        self.scaler = (LossScaler(args.loss_scale_init, args.loss_scale_window) if args.dtype == "float16"
                       else None)
        self.hooked = hooks and self.layout.accumulation is not None
        if self.hooked:     # bf16-20: masters[i].grad is the fp32 accumulator of params[i] (zeroed each step)
            for p, m in zip(self.params, self.masters):
                m.grad = torch.zeros_like(m)
                p.register_post_accumulate_grad_hook(lambda p, m=m: accumulate(p, m.grad))
        self.skipped, self.step_scale = False, None

    def _master(self, p):
        master = torch.nn.Parameter(p.detach().to(self.layout.master, copy=True))
        master.__dict__.update(p.__dict__)     # global_name, block, ZeRO's decays/segments: checkpoints
        return master

    def __getattr__(self, name):                # param_groups, state, register_step_pre_hook: AdamW's
        if "optimizer" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["optimizer"], name)

    @property
    def grad_owners(self):
        """The tensors whose .grad is the step's gradient: bf16-20's fp32 masters, else the parameters."""
        return self.masters if self.hooked else self.params

    def grad_owners_of(self, params):
        """The tensor whose .grad holds each of `params`' step gradient: the parameter itself, or under
        bf16-20 its fp32 master, whose .grad is the accumulator. Later folders reduce these over dp, tp, ep
        and the stages (the fp32 buffer, the playbook's 20-byte layout); a master carries its parameter's
        attributes (tp_sharded, kv_replicas, ...), so the reductions treat it as they would the parameter."""
        if not self.hooked:
            return list(params)
        master = {id(p): m for p, m in zip(self.params, self.masters)}
        return [master[id(p)] for p in params]

    @property
    def accumulators(self):
        return [m.grad for m in self.masters] if self.hooked else []

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None
        for m in self.masters if self.hooked else []:
            if m.grad is None:                  # dropped by a skipped step (optim.SkipNonFinite)
                m.grad = torch.zeros_like(m)
            m.grad.zero_()

    def scale(self, loss):
        return loss * self.scaler.scale if self.scaler else loss

    @torch.no_grad()
    def unscale_gradients(self, grad_owners=None):
        """÷ S (fp16) in place; returns the tensors whose .grad to clip (the trainer's norm is the overflow
        check: inf or NaN anywhere makes it non-finite). `grad_owners`: those tensors, if not the
        optimizer's (03's --offload optimizer: ZeRO's device shards, whose gradients reach the host masters
        after the clip)."""
        grad_owners = self.grad_owners if grad_owners is None else grad_owners
        if self.scaler:
            for p in grad_owners:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self.scaler.scale)
        return grad_owners

    @torch.no_grad()
    def step(self, grad_norm=None):
        overflow = self.scaler is not None and not math.isfinite(float(grad_norm))
        self.skipped, self.step_scale = overflow, self.scaler.scale if self.scaler else None
        if not overflow:
            copies = self.masters is not self.params and not self.hooked
            # bf16-16: an fp32 copy of each gradient for the step; ZeRO's fp32 buffer (bf16-20): an alias
            for p, m in zip(self.params, self.masters) if copies else []:
                grad = main_grad(p)
                m.grad = None if grad is None else grad.to(m.dtype)
            self.optimizer.step()
            for p, m in zip(self.params, self.masters) if self.masters is not self.params else []:
                p.copy_(m)                                                  # rounded to the weights' dtype
            for m in self.masters if copies else []:
                m.grad = None                   # the transient copies go
        if self.scaler:
            self.scaler.update(overflow)

    def copy_masters_to_weights(self):
        """After a checkpoint was loaded into the masters (checkpoint.py fills what AdamW steps)."""
        with torch.no_grad():
            for p, m in zip(self.params, self.masters) if self.masters is not self.params else []:
                p.copy_(m)

    def log_fields(self) -> dict:
        """What --json-log adds per step: the loss scale this step used."""
        return {"loss_scale": self.step_scale} if self.scaler else {}
