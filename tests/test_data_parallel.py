"""02_data_parallel: the process grid, and data parallelism against the single-device run.

Compared: `--dp 4 --mbs 1 --grad-acc 2` in each --dp-mode against 01's `--mbs 4 --grad-acc 2` (the
same global batch), per-step losses and final parameters; the bytes the meter saw against the
docstring's 2(N−1)/N·Ψ; and the order of hook events, which shows the overlap is real. Without
torchrun, two runs at once on one machine each get a world of one (no shared rendezvous port).
"""
import os
from importlib import import_module

import pytest
import torch
import torch.multiprocessing as mp

import common
from harness import layout_results, run_layouts, run_ranks

import process_grid

MODES = ("naive", "overlap", "bucket")
BUCKET_MB = 0.002   # ~2 KB: the TINY model's 38 gradients fall into many buckets


def test_grid_layout_llama3_16_ranks():
    """Llama-3's layout with every degree 2: tp neighbours, then cp, pp, and dp farthest apart."""
    grid = process_grid.grid_layout(16, dp=2, pp=2, cp=2, tp=2)                 # (dp, pp, cp, tp)
    assert grid.shape == (2, 2, 2, 2)
    assert grid[0, 0, 0, :].tolist() == [0, 1]      # TP group of rank 0
    assert grid[0, 0, :, 0].tolist() == [0, 2]      # CP group
    assert grid[0, :, 0, 0].tolist() == [0, 4]      # PP group
    assert grid[:, 0, 0, 0].tolist() == [0, 8]      # DP group
    with pytest.raises(ValueError, match="does not equal the world size 16"):
        process_grid.grid_layout(16, dp=2, pp=2, cp=2, tp=1)
    with pytest.raises(ValueError, match="ep=3 does not divide dp=4"):
        process_grid.grid_layout(4, dp=4, ep=3)
    with pytest.raises(ValueError, match="--tp must be at least 1"):
        process_grid.grid_layout(4, dp=4, tp=0)


def test_bad_layout_fails_before_any_process_group(monkeypatch, capsys):
    """--dp 3 on 4 ranks exits with the fix named, before init_distributed is reached."""
    import torch.distributed as dist
    train02 = import_module("02_data_parallel.train")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit):
        train02.main(common.argv("--dp", 3))
    assert "launch with --nproc_per_node 3" in capsys.readouterr().err
    assert not dist.is_initialized()


def _hold_a_world_of_one(answers, release):
    """A plain run's start (no RANK in the environment): a world of one, held until the test lets go."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    try:
        grid = process_grid.init_distributed("cpu")
        answers.put(f"initialised a world of {grid.world_size}")
    except BaseException as error:                   # the test names it
        answers.put(f"{type(error).__name__}: {error}")
        raise
    release.wait(120)                                # hold the process group until the test lets go


def test_two_plain_runs_at_once_both_initialise():
    """Two plain runs on one machine, without torchrun: each builds a world of one, the second while the
    first still holds its process group, so they must not share a rendezvous port. (Two processes forked
    by the rank server: a fresh interpreter each would only add its imports.)"""
    context = mp.get_context("forkserver")
    answers, release, runs = context.Queue(), context.Event(), []
    try:
        for _ in range(2):
            runs.append(context.Process(target=_hold_a_world_of_one, args=(answers, release)))
            runs[-1].start()
            answer = answers.get(timeout=120)
            assert answer == "initialised a world of 1", f"run {len(runs)} did not initialise: {answer}"
    finally:
        release.set()
        for run in runs:
            run.join(timeout=60)
    assert [run.exitcode for run in runs] == [0, 0]


def test_a_plain_run_needs_no_port(monkeypatch):
    """A world of one rendezvouses in its own memory (a HashStore): no TCP port another process could take
    between its choice and its use (the old code asked the system for a free one, let it go, then bound
    it: a TCPStore)."""
    import torch.distributed as dist
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with process_grid.distributed("cpu") as grid:
        assert grid.world_size == 1 and dist.get_world_size() == 1
        store = dist.distributed_c10d._get_default_store()
        assert isinstance(getattr(store, "underlying_store", store), dist.HashStore), type(store)
    assert not dist.is_initialized()


def _average_gradients_rank():
    import torch.distributed as dist
    import data_parallel as dp
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.full((3,), float(dist.get_rank() + 1))
    dp.average_gradients([a, b], dist.group.WORLD)
    return a.grad.tolist(), b.grad


def test_average_gradients_two_ranks():
    """Each rank's gradient is rank+1: the average is 1.5 everywhere; a None gradient stays None."""
    for grad, none in run_ranks(_average_gradients_rank, 2):
        assert grad == [1.5, 1.5, 1.5] and none is None


def _hooked_rank(mode):
    """A small MLP (with biases) on this rank's own data, wrapped in `mode`: two micro-batches, the first
    inside no_sync. Returns each .grad after finish_gradients, every rank's local sums (computed here
    densely, the same on each rank), the hook events and the buckets' sizes."""
    import torch.distributed as dist
    import data_parallel as dp
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12),
                              torch.nn.Tanh(), torch.nn.Linear(12, 3))
    params = list(net.parameters())
    inputs = [torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(10 + r))
              for r in range(dist.get_world_size())]                      # rank r: 2 micro-batches (4, 6)
    local = []
    for x in inputs:                                                      # every rank's dense sum, here
        grads = [torch.autograd.grad(net(mb).square().sum(), params) for mb in x]
        local.append([a + b for a, b in zip(*grads)])
    ddp = dp.wrap(params, dist.group.WORLD, mode, bucket_mb=200 / 2**20)   # 200 bytes: 3 buckets
    mine = inputs[dist.get_rank()]
    with ddp.no_sync():
        net(mine[0]).square().sum().backward()
    net(mine[1]).square().sum().backward()
    ddp.finish_gradients()
    return ([p.grad.clone() for p in params], local, list(ddp.step_events),
            [len(b.params) for b in getattr(ddp, "buckets", [])])


def _check_hooked(mode):
    """Every rank's .grad is the mean over ranks of the two micro-batches' summed gradients (float32: one
    all-reduce adds two numbers, so 1e-6); the first all-reduce is launched before backward's last
    gradient, and only the synchronising micro-batch runs the hooks."""
    results = run_ranks(_hooked_rank, 2, args=(mode,))
    for grads, local, events, buckets in results:
        for k, grad in enumerate(grads):
            torch.testing.assert_close(grad, (local[0][k] + local[1][k]) / 2, rtol=1e-6, atol=1e-6)
        last_grad = max(i for i, e in enumerate(events) if e[0] == "grad")
        assert events.index(("launch", 0)) < last_grad, events
        assert sum(e[0] == "grad" for e in events) == len(grads)
    return results[0][3]


def test_overlap_launches_each_all_reduce_from_its_gradient_hook():
    """--dp-mode overlap on 2 ranks, layer level: the mean of the gradients, communication under backward."""
    _check_hooked("overlap")


def test_buckets_launch_when_full_and_average_every_gradient():
    """--dp-mode bucket on 2 ranks, layer level: the same, with several buckets each holding whole
    gradients, in reverse order (backward's), every parameter in one."""
    buckets = _check_hooked("bucket")
    assert len(buckets) > 2 and sum(buckets) == 6


def _mode_rank(mode, steps, grad_acc):
    """One --dp-mode on this rank (a spawn runs the three in turn, in the same 4 processes)."""
    train02 = import_module("02_data_parallel.train")
    records, model, ddp, meter = train02.main(common.argv("--dp", 4, "--dp-mode", mode,
                                                          "--bucket-mb", BUCKET_MB,
                                                         steps=steps, mbs=1, grad_acc=grad_acc))
    return dict(losses=[r["loss"] for r in records], norms=[r["grad_norm"] for r in records],
                state={k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()},  # numpy:
                # pickled by value (many tensors through the result queue exhaust shared-memory handles)
                wire=dict(meter.wire), calls=dict(meter.calls), events=list(ddp.step_events),
                grad_bytes=sum(p.numel() * p.element_size() for p in ddp.params),
                n_grads=len(ddp.params), n_buckets=len(getattr(ddp, "buckets", ddp.params)))


STEPS, GRAD_ACC, N = 2, 2, 4


@pytest.fixture(scope="module")
def every_mode():
    """One 4-rank spawn runs naive, overlap and bucket in turn (a spawn costs seconds; a mode that raises
    on the ranks is named, and the next ones still run unless a rank may be blocked in a collective with
    it), and 01's reference of the same global batch."""
    reference = common.single_device_reference(steps=STEPS, mbs=N, grad_acc=GRAD_ACC)
    return run_layouts(_mode_rank, {mode: mode for mode in MODES}, N, args=(STEPS, GRAD_ACC)), reference


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_matches_single_device_and_the_wire_formula(every_mode, mode):
    """dp 4 × mbs 1 × grad_acc 2 == 01 with mbs 4 × grad_acc 2, for naive, overlap and bucket.

    Losses to 1e-5, gradient norms to 1e-5 relative and parameters to 1e-5 after 2 steps (fp32): the
    ranks sum four partial gradients in a different order than one device does, which changes the last
    bits (~1e-7 relative); AdamW's m/√v can amplify that for gradients near zero, hence 1e-5, far below
    any real error. A missing 1/N shows in the norm only (×4): with the clip active, gradients scaled by
    a constant give the same AdamW update, so losses and parameters alone would not see it.

    Bytes: per rank per step the gradients cross the wire once as an all-reduce,
    2(N−1)/N·Ψ, plus the logged loss (one fp32 scalar); counted exactly. Calls: one per gradient
    (naive, overlap) or per bucket, and only once per step although grad_acc = 2 (no_sync).
    Overlap: a collective was launched before the last gradient of backward was produced.
    """
    steps, n = STEPS, N
    outcomes, (ref_losses, ref_norms, ref_state) = every_mode
    results = layout_results(outcomes, mode)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["losses"], ref_losses, rtol=0, atol=1e-5, msg=f"{mode} rank {rank}")
        torch.testing.assert_close(got["norms"], ref_norms, rtol=1e-5, atol=0,
                                   msg=f"{mode} rank {rank} norms")
        for name, ref in ref_state.items():
            torch.testing.assert_close(torch.from_numpy(got["state"][name]), ref, rtol=1e-5, atol=1e-5,
                                       msg=f"{mode} {name}")
        psi, loss_bytes = got["grad_bytes"], 4
        assert got["wire"] == {("all_reduce", "dp"): steps * (2 * (n - 1) * psi // n
                                                              + 2 * (n - 1) * loss_bytes // n)}
        per_step = got["n_buckets"] if mode == "bucket" else got["n_grads"]
        assert got["calls"] == {("all_reduce", "dp"): steps * (per_step + 1)}
        if mode != "naive":
            events = got["events"]
            first_launch = events.index(("launch", 0))
            last_grad = max(i for i, e in enumerate(events) if e[0] == "grad")
            assert first_launch < last_grad, f"{mode}: no communication before backward ended"
            # hooks only in the last micro-batch
            assert sum(e[0] == "grad" for e in events) == got["n_grads"]
    if mode == "bucket":
        assert results[0]["n_buckets"] > 4
