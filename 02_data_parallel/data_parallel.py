"""Data parallelism: every rank holds the whole model and averages its gradients with the others.

Playbook §2.2 (data parallelism: naive, overlap, bucketing, no_sync), PyTorch DDP (Li et al., 2020).
Each of N ranks runs forward/backward on its own 1/N of the global batch; before the optimizer
step the gradients are averaged, so every rank takes the step one device would take on the whole
batch. Three ways to average, each one step closer to DDP:

    naive    after backward, one blocking all-reduce per gradient            average_gradients
    overlap  a hook per parameter launches an async all-reduce as soon as its
             gradient is accumulated: communication runs while backward
             continues on earlier layers                                    OverlapDataParallel
    bucket   gradients are copied into flat buckets of ~bucket_mb, filled in
             reverse parameter order (the order backward produces them); a
             full bucket is all-reduced at once: fewer, larger messages     BucketDataParallel

Communication per rank per step (ring all-reduce, comm.py), Ψ = bytes of all gradients:
    wire bytes = 2(N−1)/N · Ψ        in every mode: overlap hides it, bucketing batches it.
With gradient accumulation only the last micro-batch synchronises (`no_sync`, DDP's
`require_backward_grad_sync`): the local gradients are summed first and averaged once.

    torchrun --nproc_per_node 4 02_data_parallel/train.py --dp 4 --dp-mode bucket --bucket-mb 0.05

New compared with 01: the gradient synchronisation; model, loop and optimizer are unchanged.
"""
import contextlib
import math

import torch
import torch.distributed as dist

import loop


# ======================================================================================
# naive: one blocking all-reduce per gradient, after backward
# ======================================================================================
def average_gradients(params, group):
    """grad <- mean over the ranks of `group` of grad (all-reduce SUM, then divide by N).

    Parameters without a gradient are skipped. Blocking: nothing overlaps with backward.
    """
    size = dist.get_world_size(group)
    if size == 1:                           # nothing to average (e.g. 08 with cp = dp = 1)
        return
    # exercise 02.2: averaging the gradients
    # hint: the gradient of the global batch's mean loss is the mean of the ranks' gradients ([PB] §2.2; 02's
    #   README, "Three ways to average"); gloo's all-reduce has no AVG; a parameter may have no gradient.
    # test: tests/test_data_parallel.py::test_average_gradients_two_ranks
    # hides: "(all-reduce SUM, then divide by N)"
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)   # (*p.shape) summed over ranks
            p.grad.div_(size)
    # end exercise


class GradientSyncSwitch:
    """DDP's `no_sync` and `require_backward_grad_sync`, for any object whose gradient hooks communicate:
    inside `no_sync()` the hooks leave each backward's gradients to accumulate locally (every micro-batch
    but the last). 02's DataParallel and 03's ZeRO share it."""

    require_backward_grad_sync = True      # False inside no_sync(): the hooks do not communicate

    @contextlib.contextmanager
    def no_sync(self, enabled: bool = True):
        """Accumulate local gradients without communicating (DDP's no_sync)."""
        self.require_backward_grad_sync = not enabled
        try:
            yield
        finally:
            self.require_backward_grad_sync = True


class DataParallel(GradientSyncSwitch):
    """Naive data parallelism: `finish_gradients` all-reduces every gradient after backward.

    The step (02's train.py) runs every micro-batch's backward but the last inside `no_sync()`, then
    calls `finish_gradients`. `events` records ("grad", i) when parameter i's gradient is complete,
    ("launch", k) when collective k is issued and ("finish", None) when finish_gradients begins;
    `step_events` keeps the last finished step's, so a test can see whether communication started
    before backward ended.
    """

    def __init__(self, params, group, grad_owners=None):
        self.sources = [p for p in params if p.requires_grad]      # whose backward fires the hooks
        self.params = self.sources if grad_owners is None else list(grad_owners)  # whose .grad is averaged
        self.group, self.size = group, dist.get_world_size(group)
        self.events, self.step_events = [], []

    def finish_gradients(self):
        average_gradients(self.params, self.group)
        self._end_step()

    def _end_step(self):
        self.step_events, self.events = self.events, []


# ======================================================================================
# overlap: an async all-reduce per parameter, launched from its gradient hook
# ======================================================================================
class OverlapDataParallel(DataParallel):
    def __init__(self, params, group, grad_owners=None):
        super().__init__(params, group, grad_owners)
        self.pending = []                           # (work handle, param) in launch order
        for i, (source, p) in enumerate(zip(self.sources, self.params)):
            source.register_post_accumulate_grad_hook(lambda _, p=p, i=i: self._grad_ready(p, i))

    def _grad_ready(self, p, i):
        """Runs inside backward once p.grad holds this backward's full contribution."""
        # autograd runs the hook on no gradient too
        if not self.require_backward_grad_sync or p.grad is None:
            return
        self.events += [("grad", i), ("launch", len(self.pending))]
        # exercise 02.3: the overlapped all-reduce
        # hint: [PB] §2.2, "overlap gradient synchronization with backward": this hook runs as soon as p's
        #   gradient is complete, while backward goes on; a collective issued asynchronously
        #   returns a handle to wait on later (02's README, "Three ways to average"); finish_gradients waits
        #   for every one, then makes the sums means.
        # test: tests/test_data_parallel.py::test_overlap_launches_each_all_reduce_from_its_gradient_hook
        work = dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.group, async_op=True)  # (*p.shape)
        self.pending.append((work, p))
        # end exercise

    def finish_gradients(self):
        self.events.append(("finish", None))
        launched = {id(p) for _, p in self.pending}
        for i, p in enumerate(self.params):         # a gradient its hook did not see in the synchronising
            if p.grad is not None and id(p) not in launched:   # backward (08: accumulated earlier)
                self._grad_ready(p, i)
        for work, p in self.pending:                # the last launches may still be in flight
            # exercise 02.3
            work.wait()
            p.grad.div_(self.size)
            # end exercise
        self.pending.clear()
        self._end_step()


# ======================================================================================
# bucket: flat buffers of ~bucket_mb, all-reduced as soon as every gradient in them is ready
# ======================================================================================
class Bucket:
    """A flat gradient buffer for a few parameters; their .grad become views into it."""

    def __init__(self, params, indices):
        self.params, self.indices = params, indices
        self.flat = params[0].new_zeros(sum(p.numel() for p in params))   # (Σ numel,)
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.copied, self.work = set(), None        # which params' gradients are in `flat` this step

    def view_of(self, j):
        return self.flat[self.offsets[j]:self.offsets[j + 1]].view_as(self.params[j])


def make_buckets(params, bucket_bytes):
    """Consecutive parameters in reverse order, cut when a bucket reaches bucket_bytes."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(params))):
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= bucket_bytes:
            buckets.append(Bucket([params[j] for j in current], current))
            current, size = [], 0
    if current:
        buckets.append(Bucket([params[j] for j in current], current))
    return buckets


class BucketDataParallel(DataParallel):
    def __init__(self, params, group, bucket_mb: float, grad_owners=None):
        super().__init__(params, group, grad_owners)
        self.buckets = make_buckets(self.params, bucket_mb * 2**20)  # in the grad owners' dtype
        self.launched = 0
        for bucket in self.buckets:
            for j, i in enumerate(bucket.indices):
                self.sources[i].register_post_accumulate_grad_hook(
                    lambda _, b=bucket, j=j, i=i: self._grad_ready(b, j, i))

    def _grad_ready(self, bucket, j, i):
        p = bucket.params[j]
        # autograd runs the hook on no gradient too
        if not self.require_backward_grad_sync or p.grad is None:
            return
        self.events.append(("grad", i))
        # exercise 02.4: the bucketed all-reduce
        # hint: [PB] §2.2, "Second optimization: bucketing gradients": one collective per bucket, not per
        #   gradient; p's gradient goes into its place in the bucket's flat buffer, which .grad then is (the
        #   optimizer reads the mean there), and the bucket leaves when its last gradient has arrived.
        # test: tests/test_data_parallel.py::test_buckets_launch_when_full_and_average_every_gradient
        # level: 2
        bucket.view_of(j).copy_(p.grad)
        p.grad = bucket.view_of(j)                  # the optimizer reads the averaged bucket
        bucket.copied.add(j)
        if len(bucket.copied) == len(bucket.params):
            self._launch(bucket)
        # end exercise

    def _launch(self, bucket):
        self.events.append(("launch", self.launched))
        self.launched += 1
        # exercise 02.4
        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        # end exercise

    def finish_gradients(self):
        self.events.append(("finish", None))
        for bucket in self.buckets:
            if bucket.work is None:                 # a parameter that got no gradient: send zeros
                for j, p in enumerate(bucket.params):
                    if j in bucket.copied:
                        continue
                    # exercise 02.4
                    if p.grad is None:
                        bucket.view_of(j).zero_()
                    else:                           # 08: accumulated before the synchronising pass
                        bucket.view_of(j).copy_(p.grad)
                    p.grad = bucket.view_of(j)
                    # end exercise
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.flat.div_(self.size)             # (Σ numel,): every .grad in it is now the mean
            bucket.copied, bucket.work = set(), None
        self.launched = 0
        self._end_step()


def global_mean(loss, group) -> float:
    """This rank's mean loss -> the mean over the ranks of `group`: the global batch's loss (for the log)."""
    loss = torch.as_tensor(loss).detach().clone()                       # () on every rank
    dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=group)            # gloo has no ReduceOp.AVG
    return float(loss / dist.get_world_size(group))


def eval_step(model, micro_batches, group, args) -> float:
    """A held-out global batch's loss, forward only: this rank's rows (ZeRO-3 gathers each unit in its
    forward), then the mean over the ranks of `group` (02-04's and 07's trainers evaluate with it)."""
    return global_mean(loop.mean_loss(model, micro_batches, args), group)


def add_arguments(parser):
    """--dp-mode, --bucket-mb (the degree --dp is process_grid's)."""
    g = parser.add_argument_group("data parallelism (02)")
    g.add_argument("--dp-mode", choices=["naive", "overlap", "bucket"], default="bucket",
                   help="all-reduce after backward, per-parameter async hooks, or flat buckets")
    g.add_argument("--bucket-mb", type=float, default=25.0,
                   help="bucket size for --dp-mode bucket (DDP's 25 MB)")
    return g


def check_data_parallel(bucket_mb: float):
    if not (math.isfinite(bucket_mb) and bucket_mb > 0):
        raise ValueError(f"--bucket-mb must be positive (a finite number), got {bucket_mb}")


def wrap(params, group, mode: str, bucket_mb: float = 25.0, grad_owners=None) -> DataParallel:
    """The DataParallel object over `params` for --dp-mode naive | overlap | bucket. `grad_owners`: the
    tensors whose .grad is each parameter's step gradient, when not the parameter itself (01's bf16-20: the
    fp32 masters, `MixedPrecisionOptimizer.grad_owners_of`); the hooks still fire on the parameters'
    backward, after the optimizer's (registered first), which have added the micro-batch's bf16 .grad into
    fp32."""
    if mode == "naive":
        return DataParallel(params, group, grad_owners)
    if mode == "overlap":
        return OverlapDataParallel(params, group, grad_owners)
    if mode == "bucket":
        return BucketDataParallel(params, group, bucket_mb, grad_owners)
    raise ValueError(f"--dp-mode {mode!r}: choose naive, overlap or bucket")
