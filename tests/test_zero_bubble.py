"""06_pipeline/zero_bubble.py and the pass clock: ZB-H1's split backward and the timeline's times.

Whole-step checks (real gloo ranks; 08's trainer cuts and parallelises the seeded model from outside,
so without --tp these are 06's stages): one step's schedule on the same micro-batches, zb-h1 against
1f1b, on the same rank and model, and every parameter's gradient compared:
    pp2 with --kernels torch, with --recompute full, and with --kernels triton (Triton's CPU
    interpreter, at one 8-token window a micro-batch and one layer a stage: its cost is per row block and
    per layer; the fused loss computes lm_head's gradient inside its forward, which the split B/W passes
    must still deliver), in float64;
    tp2 + sp × pp2 (4 ranks), where the W passes, wrapped in 02's CommMeter, must issue no collective
    and no point-to-point message at all (and the B passes, metered alike, do: the meter is live).
ZB-H1's W runs exactly 1F1B's dW matmuls (dYᵀ·X on the same tensors, accumulated in the same
micro-batch order); only where dW lands differs (queued, then added in place, against autograd's
accumulation), so the gradients agree to float64 rounding: 1e-12 relative, 1e-15 absolute for
entries that are zero. The Triton run reorders nothing between the two schedules either.

Layer checks (no ranks): the split linear under bf16 autocast computes what F.linear computes there
(bf16 matmuls, dW accumulated into the fp32 .grad), W adds into an existing .grad in place (ZeRO-1's
views into a flat buffer); the CUDA pass clock, driven by a fake event class on the CPU, turns events
into times on the host clock of the step's start and waits for the device once per step end.
"""
import contextlib
import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # before kernels/ is imported, here and in the spawned ranks

import common
from harness import layout_results, run_layouts

import build
import cli
import sampling
import process_grid
import comm
import pipeline
import point_to_point
import passes
import schedules
import layout_5d as layout                                 # 08's flags, rules and order of transforms
import timeline

M = 4                                       # micro-batches: rank 0 defers 0, rank 1 defers 1 W (ZB-H1)
GRADIENTS = dict(rtol=1e-12, atol=1e-15)


def _pipeline(args, grid, stages):
    shape = pipeline.boundary_shape(args.mbs, args.seq_len, stages[0].config.hidden_size,
                                    args.cp, args.tp, args.sp)
    groups = point_to_point.direction_groups(grid, args.pp_chunks)
    p2p = point_to_point.P2P(grid.pp_ranks, grid.pp_rank, groups, args.pp_chunks,
                             shape, build.param_dtype(args), build.device_of(args))
    return passes.Pipeline(stages, p2p, passes.pass_clock(build.device_of(args)),
                              split_backward=args.pp_schedule == "zb-h1")


def _metered(pipe, method, meter, calls):
    """Run pipe.<method> inside `meter`; count its calls."""
    inner = getattr(pipe, method)

    def run(*args, **kwargs):
        calls.append(method)
        with meter:
            return inner(*args, **kwargs)
    setattr(pipe, method, run)


def _step_gradients(extra):
    """On every rank, for one flag set: the seeded model parallelised by 08, one step's schedule; this
    rank's gradients (by 01's names) and the communication its B and W passes issued (zb-h1)."""
    args, config, dataset = cli.setup(layout.build_parser("test"), common.argv(
        *extra, steps=1, mbs=2, grad_acc=M, dtype="float64"), layout.check_layout)
    grid = process_grid.init_distributed(args.device, dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp)
    full = build.build_model(args, config)
    stages = layout.parallelize(full, args, grid, build.device_of(args))
    build.materialize(full, args, keep=stages.parameters())
    pipe = _pipeline(args, grid, stages)
    meters, calls = {op: comm.CommMeter(grid.group_names()) for op in ("B", "W")}, []
    if args.pp_schedule == "zb-h1":
        _metered(pipe, "backward_input", meters["B"], calls)
        _metered(pipe, "backward_weight", meters["W"], calls)
    sampler = sampling.GlobalBatchSampler(dataset, args.seed, args.mbs, args.grad_acc, grid.dp_size)
    micro_batches = [sampler.micro_batch(0, i, grid.dp_rank) for i in range(args.grad_acc)]
    schedules.SCHEDULE_STEPS[args.pp_schedule](pipe, micro_batches)
    return dict(grads={pipeline.single_device_name(n): None if p.grad is None else p.grad.numpy().copy()
                       for n, p in stages.named_parameters()},
                w_passes=calls.count("backward_weight"),
                comm={op: dict(m.calls) for op, m in meters.items()})


def _pair_gradients(pair):
    """On every rank: one step of each flag set of the pair (1f1b, then zb-h1)."""
    return [_step_gradients(extra) for extra in pair]


def _check_same_gradients(pair, per_rank):
    """A pair's runs (1f1b, zb-h1) on every rank; returns the zb-h1 run of every rank."""
    zb_runs = []
    for rank, (reference_run, split_run) in enumerate(per_rank):
        reference, split = reference_run["grads"], split_run["grads"]
        what = f"{' '.join(pair[1])}, rank {rank}"
        assert split.keys() == reference.keys(), what
        for name, expected in reference.items():
            assert expected is not None, f"{what}: 1f1b left {name} without a gradient"
            assert split[name] is not None, f"{what}: zb-h1 left {name} without a gradient"
            torch.testing.assert_close(torch.from_numpy(split[name]), torch.from_numpy(expected), **GRADIENTS,
                                       msg=lambda m: f"{what} {name}: {m}")
        zb_runs.append((what, split_run))
    return zb_runs


def _pairs(*extra):
    return [["--pp", "2", "--pp-schedule", schedule, *map(str, extra)] for schedule in ("1f1b", "zb-h1")]


PP2 = {"pp2": _pairs(), "pp2-recompute-full": _pairs("--recompute", "full"),
       # the interpreter's cost is per row block and per layer: 8 tokens, one layer per stage
       "pp2-triton": _pairs("--kernels", "triton", "--seq-len", 8, "--mbs", 1, "--num-layers", 2)}
TP2_SP_PP2 = {"tp2sp-pp2": _pairs("--tp", 2, "--sp")}


@pytest.fixture(scope="module")
def two_ranks():
    """One 2-rank spawn runs PP2's pairs in turn (a spawn costs seconds; a pair that raises on the ranks
    is named, and the next ones still run unless a rank may be blocked in a collective with it)."""
    return run_layouts(_pair_gradients, PP2, 2, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pair", PP2)
def test_zb_h1_gradients_equal_1f1b_pp2(two_ranks, pair):
    """Every parameter, lm_head's included (--kernels triton: the fused loss), gets 1F1B's gradient;
    with --recompute full too (the split sits in the recomputed linears, W needs only their X, dY)."""
    _check_same_gradients(PP2[pair], layout_results(two_ranks, pair))


@pytest.mark.timeout(300)
def test_zb_h1_weight_passes_issue_no_communication_under_sp():
    """tp2 + sp × pp2: W is matmuls only. The all-gather of o_proj's and down_proj's ḡ backward runs
    once, in B; the meter around the B passes sees the tp collectives (it is live)."""
    per_rank = layout_results(run_layouts(_pair_gradients, TP2_SP_PP2, 4, timeout=280), "tp2sp-pp2")
    for what, run in _check_same_gradients(TP2_SP_PP2["tp2sp-pp2"], per_rank):
        assert run["w_passes"] == M, what
        assert run["comm"]["W"] == {}, f"{what}: the W passes communicated: {run['comm']['W']}"
        assert run["comm"]["B"].get(("all_gather", "tp"), 0) > 0, what


# ======================================================================================
# Without ranks: the split linear, the store, the clock
# ======================================================================================
def test_split_linear_under_bf16_autocast_matches_f_linear():
    """fp32 master weight, bf16 autocast on the CPU: the output, dX and the weight's fp32 .grad equal
    F.linear's exactly (the same bf16 matmuls, the same cast of dW), immediate and deferred alike."""
    import zero_bubble
    torch.manual_seed(0)
    x0, w0, dy = torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(2, 5, 6)
    outcomes = []
    for mode in ("F.linear", "split", "deferred"):
        x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
        store = zero_bubble.WeightGradStore()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = (torch.nn.functional.linear(x, w) if mode == "F.linear"
                 else zero_bubble.split_linear(x, w, store))
        key = (0, 0)
        with store.collect(key) if mode == "deferred" else contextlib.nullcontext():
            y.backward(dy.to(y.dtype))
        if mode == "deferred":
            assert w.grad is None                          # B left dW queued
            store.run(key)
        outcomes.append((y.dtype, y, x.grad, w.grad))
    for dtype, y, dx, dw in outcomes[1:]:
        assert dtype == torch.bfloat16 and dw.dtype == torch.float32
        for got, expected in zip((y, dx, dw), outcomes[0][1:]):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_weight_pass_accumulates_into_an_existing_grad_in_place():
    """ZeRO-1 makes .grad a view into a flat buffer: W must add into it, not replace it."""
    import zero_bubble
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    flat = torch.ones(20, dtype=torch.float64)
    w.grad = flat[4:16].view(3, 4)
    store = zero_bubble.WeightGradStore()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, 3, dtype=torch.float64)
    with store.collect((1, 0)):
        zero_bubble.split_linear(x, w, store).backward(dy)
    assert store.pending() == 1
    store.run((1, 0))
    assert store.pending() == 0
    assert w.grad.data_ptr() == flat[4:].data_ptr()
    torch.testing.assert_close(flat[4:16].view(3, 4), 1 + dy.t() @ x.detach(), rtol=1e-15, atol=0)
    assert (flat[:4] == 1).all() and (flat[16:] == 1).all()


def test_gradient_hooks_fire_once_per_real_contribution():
    """08's data parallelism reduces a gradient from its post-accumulate-grad hook: a B that defers dW must
    not run the weight's hooks (autograd runs them even for an input given no gradient, which would
    reduce what earlier Ws accumulated), and W must run them, once per weight, with .grad complete."""
    import zero_bubble
    torch.manual_seed(0)
    w, g = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.ones(4))
    fired = []
    for name, p in (("w", w), ("g", g)):
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append((name, p.grad)))
    store, x, dy = zero_bubble.WeightGradStore(), torch.randn(5, 4), torch.randn(5, 3)
    for micro in range(2):
        with store.collect(micro):
            zero_bubble.split_linear(x * g, w, store).backward(dy)
        assert [name for name, _ in fired] == ["g"], fired                     # B: g's hook only
        fired.clear()
        store.run(micro)
        assert [name for name, _ in fired] == ["w"]                            # W: w's, with its dW in
        # both micro-batches
        torch.testing.assert_close(fired[0][1], (micro + 1) * dy.t() @ (x * g).detach())
        fired.clear()


class FakeCudaEvent:
    """torch.cuda.Event's interface on a fake device whose stream runs 1 s of work before each recorded
    event, whatever the host does: the device lags the host as a GPU behind a non-blocking irecv does."""
    device_clock, done_through, synchronizations = 1000.0, 0.0, 0

    def __init__(self, enable_timing=False):
        assert enable_timing, "elapsed_time needs enable_timing=True"
        self.at = None

    def record(self):
        FakeCudaEvent.device_clock += 1.0
        self.at = FakeCudaEvent.device_clock

    def synchronize(self):            # waits until this event (and all before it on the stream) has run
        FakeCudaEvent.synchronizations += 1
        FakeCudaEvent.done_through = max(FakeCudaEvent.done_through, self.at)

    def elapsed_time(self, end):      # milliseconds; CUDA refuses it before both events have completed
        assert max(self.at, end.at) <= FakeCudaEvent.done_through, "elapsed_time before the events completed"
        return (end.at - self.at) * 1e3


def test_cuda_pass_clock_with_fake_events():
    """A one-stage pipeline (no messages) runs a 1F1B step timed by the CUDA clock: every pass's start
    and end are the step's host time t0 plus the device time elapsed since the reference event (1 s per
    event here), resolved by one wait at the end of the step (and one at its start), never per pass."""
    import model as modeling
    torch.manual_seed(0)
    config = modeling.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    stages = pipeline.build_stages(modeling.LlamaForCausalLM(config), 0, 1)
    p2p = point_to_point.P2P([0], 0, {}, 1, (2, 8, 32), torch.float32, torch.device("cpu"))
    clock = passes.DeviceClock(FakeCudaEvent)
    pipe = passes.Pipeline(stages, p2p, clock)
    micro_batches = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(3)]
    FakeCudaEvent.synchronizations = 0
    schedules.train_step_1f1b(pipe, micro_batches)
    assert FakeCudaEvent.synchronizations == 2
    # the reference event ran 1 s before the first pass's start
    t0 = pipe.events[0].start - 1.0
    assert [(e.op, e.micro, e.start - t0, e.end - t0) for e in pipe.events] == \
        [("F", 0, 1.0, 2.0), ("B", 0, 3.0, 4.0), ("F", 1, 5.0, 6.0), ("B", 1, 7.0, 8.0),
         ("F", 2, 9.0, 10.0), ("B", 2, 11.0, 12.0)]
    assert timeline.timeline_violations(pipe.events, 1) == []
    assert abs(t0 - time.time()) < 60                 # host seconds, comparable across ranks, not device ones
