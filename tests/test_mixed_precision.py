"""Mixed precision (01's mixed_precision.py, and 02-08 over it): loss scaling, the layouts' bytes.

Compared: fp16's dynamic loss scaling against its rule (an overflowing step changes nothing and halves S,
--loss-scale-window good steps double it, the log says so); the bf16 layouts' model states, tensor by
tensor, against the memory table printed before training and the playbook's 16 and 20 bytes per parameter
(08's planner's "mixed" rows are the same numbers); bf16 training against fp32 (close: bf16 rounding);
ZeRO dp 2 of a bf16 layout against 01's run of the same layout (equal: see that test's docstring), offloaded
too, and fp16 with --offload optimizer and --offload param against ZeRO without offload (equal) and 01; and
02, 04, 05, 06, 07, 08 on 2 ranks under bf16-16, bf16-20 and fp16 against 01 (07 for the MoE), an fp16
overflow forced on one rank skipped by all, 08's memory rows against the planner's mixed rows.
"""
import contextlib
import json
from importlib import import_module

import pytest
import torch

import common

import build
import sampling
import cli
import memory
import pipeline
import mixed_precision
import plan_arithmetic
import planner
train = import_module("01_single_gpu.train")

LAYOUTS = {"autocast": ("bfloat16", "autocast"), "bf16-16": ("bfloat16", "bf16-16"),
           "bf16-20": ("bfloat16", "bf16-20"), "fp32": ("float32", "autocast")}


def test_loss_scaler_backs_off_and_grows():
    scaler = mixed_precision.LossScaler(1024.0, window=3)
    seen = []
    for overflow in (True, False, False, False, False, True, False):
        scaler.update(overflow)
        seen.append(scaler.scale)
    assert seen == [512, 512, 512, 1024, 1024, 512, 512]


def test_bf16_20_sums_the_micro_batch_gradients_in_fp32():
    """bf16-20's gradient accumulation (exercise 01.7): after four micro-batches' backwards each fp32
    accumulator holds the sum of their bf16 gradients (against the float64 sum of the same bf16 values: fp32
    rounding of four terms, 1e-6 relative) and .grad is zero, its storage kept for the next backward. The
    micro-batches' inputs differ in scale by 2^9, so a sum in bf16 (8 bits of mantissa) is visibly off
    (checked: by more than 1e-3 relative), as the playbook's reason for the fp32 buffer says."""
    from types import SimpleNamespace
    args = SimpleNamespace(dtype="bfloat16", precision_layout="bf16-20", loss_scale_init=1.0,
                           loss_scale_window=1, lr=0.1, weight_decay=0.0)
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    optimizer = mixed_precision.MixedPrecisionOptimizer(layer.parameters(), args)
    optimizer.zero_grad()
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in layer.parameters()]
    in_bf16 = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in layer.parameters()]
    storages = None
    for scale in (1.0, 2.0 ** -3, 2.0 ** -6, 2.0 ** -9):
        x = (scale * torch.randn(4, 16)).to(torch.bfloat16)
        grads = torch.autograd.grad(layer(x).float().pow(2).sum(), list(layer.parameters()))
        for total, low, g in zip(exact, in_bf16, grads):
            total += g.double()
            low += g
        layer(x).float().pow(2).sum().backward()
        assert all(p.grad is not None and not p.grad.any() for p in layer.parameters()), "a .grad not zeroed"
        pointers = [p.grad.data_ptr() for p in layer.parameters()]
        assert storages in (None, pointers), ".grad reallocated: its storage must stay"
        storages = pointers
    for accumulator, total, low in zip(optimizer.accumulators, exact, in_bf16):
        assert accumulator.dtype == torch.float32
        torch.testing.assert_close(accumulator.double(), total, rtol=1e-6, atol=1e-9)
        assert (low.double() - total).abs().max() > 1e-3 * total.abs().max()


def test_fp16_overflow_step_changes_nothing_and_halves_the_scale():
    """An overflowing step (an inf gradient, so a non-finite norm) leaves the weights, AdamW's moments and
    its step count as they were, and halves S; the next finite step runs."""
    from types import SimpleNamespace
    args = SimpleNamespace(dtype="float16", precision_layout="autocast", loss_scale_init=8.0,
                           loss_scale_window=10, lr=0.1, weight_decay=0.0)
    layer = torch.nn.Linear(4, 3)
    optimizer = mixed_precision.MixedPrecisionOptimizer(layer.parameters(), args)
    for overflow in (False, True, False):
        optimizer.zero_grad()
        optimizer.scale(layer(torch.ones(2, 4)).sum()).backward()
        if overflow:
            layer.weight.grad[0, 0] = float("inf")
        grad_owners = optimizer.unscale_gradients()
        norm = torch.nn.utils.clip_grad_norm_(grad_owners, float("inf"))
        before = ([p.clone() for p in layer.parameters()],
                  [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()])
        scale = optimizer.scaler.scale
        optimizer.step(norm)
        assert optimizer.skipped == overflow and optimizer.log_fields() == {"loss_scale": scale}
        assert optimizer.scaler.scale == (scale / 2 if overflow else scale)
        moved = [not torch.equal(p, q) for p, q in zip(layer.parameters(), before[0])]
        assert not any(moved) if overflow else all(moved)
        if overflow:
            for state, old in zip(optimizer.state.values(), before[1]):
                assert all(torch.equal(state[k], v) for k, v in old.items())


def test_fp16_training_logs_its_loss_scale_and_skipped_steps(tmp_path):
    """--dtype float16 from S = 2^17 with --loss-scale-window 1: step 1 is finite, so S doubles; at 2^18
    step 2's backward overflows fp16 (found by running it), is skipped (logged, its norm inf: null) and
    S halves; step 3 runs at 2^17."""
    log = tmp_path / "fp16.jsonl"
    train.main(common.argv("--loss-scale-init", 2.0 ** 17, "--loss-scale-window", 1, "--json-log", log,
                           steps=3, dtype="float16"))
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["loss_scale"] for r in logged] == [2.0 ** 17, 2.0 ** 18, 2.0 ** 17]
    assert [r.get("skipped", False) for r in logged] == [False, True, False]
    assert [r["grad_norm"] is None for r in logged] == [False, True, False]


def test_bf16_16_gradient_norm_is_taken_in_fp32():
    """bf16-16's gradients are bf16; the norm that is logged and clips them is summed in fp32, as 04's and
    06's norms of the same gradients (torch's clip_grad_norm_ would return bf16: 3 significant digits). 01's
    step with --grad-clip 0 leaves the gradients as they were: the norm must match their float64 norm to fp32
    rounding (the bf16 norm is off by up to 2^-9)."""
    argv = common.argv("--precision-layout", "bf16-16", "--grad-clip", 0, steps=1, dtype="bfloat16")
    args, config, dataset = cli.setup(train.build_parser(), argv, mixed_precision.check_precision)
    model = build.materialize(build.build_model(args, config), args)
    optimizer = mixed_precision.MixedPrecisionOptimizer(model.parameters(), args)
    sampler = sampling.GlobalBatchSampler(dataset, args.seed, args.mbs, 1)
    _, norm = train.train_step(model, optimizer, [sampler.micro_batch(0, 0)], args)
    grads = [p.grad for p in model.parameters()]
    assert all(g.dtype == torch.bfloat16 for g in grads) and norm.dtype == torch.float32
    exact = sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5
    assert abs(float(norm) - exact) <= 1e-6 * exact, (float(norm), exact)


@pytest.mark.parametrize("init, saved_at", [(2.0 ** 17, 1), (1e30, 1)], ids=["scale-grown", "no-real-step"])
def test_fp16_resume_is_bitwise(tmp_path, init, saved_at):
    """--dtype float16, --loss-scale-window 1: k steps, save, --resume to 4 equals 4 steps, bit for bit, in
    losses, parameters and the loss scale each step used. From 2^17 step 1 runs and S doubles: a resume at
    --loss-scale-init would not overflow in step 2, as the uninterrupted run does. From 1e30 step 1
    overflows: the checkpoint holds no AdamW moments (there was no real step), and the resume must not
    expect them."""
    flags = ("--loss-scale-init", init, "--loss-scale-window", 1, "--lr-decay-steps", 4)   # one schedule
    whole, model = train.main(common.argv(*flags, steps=4, dtype="float16"))
    ckpt = ("--checkpoint-dir", tmp_path / "ckpt")
    train.main(common.argv(*flags, *ckpt, steps=saved_at, dtype="float16"))
    resumed, resumed_model = train.main(common.argv(*flags, *ckpt, "--resume", steps=4, dtype="float16"))
    assert any(r.get("skipped") for r in whole)                     # overflowed steps are involved
    for key in ("loss", "loss_scale", "skipped"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in whole[saved_at:]], key
    for name, p in resumed_model.state_dict().items():
        assert torch.equal(p, model.state_dict()[name]), name


def _layout_states(layout):
    """The memory table's numbers before training, what the rank holds after one step of two micro-batches,
    the trained and the initial parameters (fp32 copies), the preflight's bound and the step's measured
    activation peak."""
    dtype, precision = LAYOUTS[layout]
    argv = common.argv("--precision-layout", precision, steps=1, grad_acc=2, dtype=dtype)
    args, config, dataset = cli.setup(train.build_parser(), argv, mixed_precision.check_precision)
    model = build.materialize(build.build_model(args, config), args)
    initial = {k: v.float().clone() for k, v in model.state_dict().items()}
    optimizer = mixed_precision.MixedPrecisionOptimizer(model.parameters(), args)
    report = memory.memory_report(model.parameters(), optimizer, activations=0)
    sampler = sampling.GlobalBatchSampler(dataset, args.seed, args.mbs, args.grad_acc)
    with memory.saved_activation_bytes(exclude=model.parameters()) as meter:
        train.train_step(model, optimizer, [sampler.micro_batch(0, m) for m in range(2)], args)   # lr 3e-3
    trained = {k: v.float().clone() for k, v in model.state_dict().items()}
    bound = memory.rank_lower_bound(config, args, build.activation_element_bytes(args))
    return report, memory.held_state_bytes(model.parameters(), optimizer), trained, initial, bound, meter.peak


@pytest.fixture(scope="module")
def layout_states():
    return {layout: _layout_states(layout) for layout in LAYOUTS}


@pytest.mark.parametrize("layout,total,planned", [("autocast", 16, "fp32"), ("bf16-16", 16, "mixed"),
                                                   ("bf16-20", 20, "mixed-fp32-grads"), ("fp32", 16, "fp32")])
def test_memory_table_is_what_the_rank_holds(layout_states, layout, total, planned):
    """The table printed before the first step (parameters, gradients, fp32 accumulators, fp32 masters,
    AdamW's moments) equals, byte for byte, the tensors held after a step of grad_acc 2; per parameter
    that is the playbook's 16 (bf16 2 + 2 + master 4 + Adam 8; fp32 4 + 4 + 8) or 20 (+ the fp32
    accumulation buffer 4), split exactly as 08's planner's row for the same precision. The memory preflight's
    bound (memory.rank_lower_bound, known before the model exists) holds the same model states, and at most
    the activations the step measured."""
    report, held, _, _, bound, activations = layout_states[layout]
    assert held == dict(parameters=report.parameters, gradients=report.gradients, master=report.master,
                        accumulation=report.accumulation, optimizer=report.optimizer)
    assert sum(report.per_parameter()) == total
    assert report.per_parameter() == plan_arithmetic.model_states(1, 1, 0, planned)
    assert bound == {"parameters": report.parameters, "gradients": report.gradients + report.accumulation,
                     "optimizer states": report.master + report.optimizer,
                     "activations": bound["activations"]}
    assert 0 < bound["activations"] <= activations


@pytest.mark.parametrize("layout", ["autocast", "bf16-16", "bf16-20"])
def test_bf16_layouts_train_close_to_fp32(layout_states, layout):
    """After an AdamW step the weights' distance to fp32's run is a small part of how far fp32 moved
    them (measured on a 2-core CPU: autocast 0.067, bf16-16 and bf16-20 0.097; bound 0.25), and nonzero
    (the layout is not ignored; after one step bf16-16 and bf16-20 agree, since AdamW's first update is
    ±lr whatever the gradient's rounding). AdamW's m/√v is about ±lr
    whatever the gradient's size, so bf16 rounding of a gradient near zero can flip an update's sign:
    elementwise bounds would be ±2·lr; the norm of the difference is the meaningful measure."""
    _, _, fp32, initial, _, _ = layout_states["fp32"]
    _, _, trained, _, _, _ = layout_states[layout]
    moved = sum((fp32[k] - initial[k]).norm() ** 2 for k in fp32) ** 0.5
    apart = sum((trained[k] - fp32[k]).norm() ** 2 for k in fp32) ** 0.5
    assert 0 < apart < 0.25 * moved


# ======================================================================================
# ZeRO (03) over the bf16 layouts: dp 2 against 01's run of the same layout
# ======================================================================================
# every stage once, both layouts, and both ways ZeRO holds gradients: in the weights' bf16 (bf16-16), or in
# fp32 buffers beside them (bf16-20: stage 1 through accumulation hooks, stage 3 in its reduce-scatters)
# (--offload optimizer: the fp32 masters, their gradients and AdamW's states on the host; bf16 shards stay;
# --offload param: ZeRO-3's bf16 shards, their gradients, fp32 masters and AdamW's states, all on the host)
ZERO_RUNS = {"bf16-16-zero2": ("bf16-16", 2), "bf16-20-zero1": ("bf16-20", 1),
             "bf16-20-zero3": ("bf16-20", 3), "bf16-16-zero2-offload": ("bf16-16", 2, "optimizer"),
             "bf16-20-zero3-offload": ("bf16-20", 3, "optimizer"),
             "bf16-16-zero3-offload-param": ("bf16-16", 3, "param"),
             "bf16-20-zero3-offload-param": ("bf16-20", 3, "param")}
# fp16's loss scaling through both offloads, against ZeRO-2 without offload (the overflow of
# `overflow_at_step_2`, forced on rank 1)
FP16_ZERO_RUNS = {"fp16-zero2": ("fp16", 2), "fp16-zero2-offload": ("fp16", 2, "optimizer"),
                  "fp16-zero3-offload-param": ("fp16", 3, "param")}


def _zero_layout(run):
    """On every rank: 03 at dp 2 under one precision (fp16: step 2 overflows on rank 1), its numbers, and the
    bytes it holds (offloaded: on the device and on the host) with zero_layout.py's formula for them."""
    precision, stage, offload = (*run, "none")[:3]
    import torch.distributed as dist
    import zero_layout as layout_mod
    dtype, flags = PRECISIONS[precision]
    with overflow_at_step_2(here=precision == "fp16" and dist.get_rank() == 1):
        records, zero, model, optimizer, _, offloaded = import_module("03_zero.train").main(common.argv(
            *flags, "--grad-clip", 0, "--dp", dist.get_world_size(), "--zero-stage", stage,
            "--offload", offload, steps=2, mbs=1, dtype=dtype))
    host = offloaded or (zero if offload == "param" else None)             # what holds the host's bytes
    numel, n = sum(p.numel() for p in model.parameters()), dist.get_world_size()
    layout = mixed_precision.LAYOUTS["autocast" if precision == "fp16" else precision]
    expected = layout_mod.expected_state_bytes(stage, n, zero.padded_bytes, layout, numel)
    if host:
        expected = layout_mod.expected_offload_bytes(offload, stage, n, zero.padded_bytes, layout, numel)
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return dict(_numbers(records, zero.full_state_dict(model)), expected=expected,
                held=(zero.model_state_bytes(model, optimizer), host.host_bytes(optimizer)) if host else
                zero.model_state_bytes(model, optimizer),
                fp32_on_host=host is None or all(t.dtype == torch.float32 and t.device.type == "cpu"
                                                 for t in [*stepped, *states]))


@pytest.fixture(scope="module")
def zero_dp2():
    from harness import run_layouts
    return run_layouts(_zero_layout, {**ZERO_RUNS, **FP16_ZERO_RUNS}, 2)


@pytest.fixture(scope="module")
def single_device_layouts():
    """01 with mbs 1 × grad_acc 2 in each layout: (losses, final state)."""
    out = {}
    for layout in ("bf16-16", "bf16-20"):
        records, model = train.main(common.argv("--precision-layout", layout, "--grad-clip", 0, steps=2,
                                                mbs=1, grad_acc=2, dtype="bfloat16"))
        out[layout] = [r["loss"] for r in records], model.state_dict()
    return out


@pytest.mark.parametrize("run", ZERO_RUNS)
def test_zero_dp2_of_a_bf16_layout_equals_its_single_device_run(zero_dp2, single_device_layouts, run):
    """ZeRO-1/2/3, dp 2 × mbs 1, bf16-16 and bf16-20, == 01 with mbs 1 × grad_acc 2 in the same layout:
    losses and final bf16 parameters bitwise. Why equal, not close: each rank's micro-batch gradient is
    computed exactly as 01 computes that micro-batch's (the same rows, mbs 1; 01's 1/grad_acc is a power
    of two, which commutes with rounding); two addends sum to the same correctly rounded number in any
    order (bf16-16: bf16, in autograd or in the reduce-scatter; bf16-20: fp32); AdamW is elementwise on
    the fp32 masters. --grad-clip 0 because the norms are summed in different orders (the ZeRO tests
    bound that). The memory held per rank is zero_layout.py's formula for the layout, exactly. Offloaded
    (--offload optimizer): the same fp32 AdamW on the same values, converted by the copies instead of on
    the device, so equal too; the device holds the layout's weights and gradients and no optimizer byte,
    the host the fp32 master, gradient and AdamW states (layout.expected_offload_bytes). --offload param:
    ZeRO-3's code on host tensors (the bf16 shard the device gathers is the fp32 master rounded), so equal;
    the device holds nothing between steps, the host what ZeRO-3 holds of the layout."""
    from harness import layout_results
    layout = ZERO_RUNS[run][0]
    results = layout_results(zero_dp2, run)
    losses, state = single_device_layouts[layout]
    for rank, got in enumerate(results):
        assert got["losses"] == losses, f"rank {rank}"
        for name, p in state.items():
            assert got["state"][name].dtype == torch.bfloat16 and torch.equal(got["state"][name], p), name
        assert got["held"] == got["expected"] and got["fp32_on_host"], f"rank {rank}"


@pytest.mark.parametrize("run", [r for r in FP16_ZERO_RUNS if "offload" in r])
def test_zero_dp2_fp16_with_offload_equals_zero_without_it_and_the_single_device_run(
        zero_dp2, single_device_precisions, run):
    """--dtype float16 with --offload optimizer (ZeRO-2) and --offload param (ZeRO-3), dp 2 × mbs 1, step 2's
    overflow forced on rank 1: both ranks skip step 2 and log 01's loss scales (1024, then 2048 for the
    skipped step), as 01 and ZeRO-2 without offload do. Equal to ZeRO-2 without offload bit for bit (losses,
    final parameters): the gradients are unscaled where ZeRO's shards hold them, before the clip, as without
    offload, and AdamW steps the same fp32 values on host tensors (ZeRO-2 and -3 reduce the same gradients
    in the same reduce-scatters). Against 01 within LOSS_APART and PARAMS_APART, as the data-parallel fp16
    runs below (a rank's fp16 backward of its own rows rounds apart from 01's). Memory: zero_layout.py's
    formula."""
    from harness import layout_results
    ref, plain_runs = single_device_precisions["fp16", ()], layout_results(zero_dp2, "fp16-zero2")
    for rank, (got, plain) in enumerate(zip(layout_results(zero_dp2, run), plain_runs)):
        assert got["skipped"] == plain["skipped"] == ref["skipped"] == [False, True], f"rank {rank}"
        assert got["scales"] == plain["scales"] == ref["scales"] == [1024, 2048], f"rank {rank}"
        assert got["losses"] == plain["losses"], f"rank {rank}"
        apart = 0.0
        for name, p in plain["state"].items():
            assert torch.equal(got["state"][name], p), f"{run} rank {rank}: {name}"
            apart += float((p.float() - ref["state"][name]).norm() ** 2)
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= LOSS_APART, f"rank {rank}"
        assert apart ** 0.5 <= PARAMS_APART * ref["moved"], f"rank {rank}"
        assert got["held"] == got["expected"] and got["fp32_on_host"], f"rank {rank}"


def test_bf16_20_resumes_bitwise_from_its_fp32_masters(single_device_layouts, tmp_path):
    """A checkpoint stores what AdamW steps, the fp32 masters (and their moments); --resume fills them and
    rounds them into the bf16 weights, so 1 step + resume + 1 step == 2 steps, bit for bit."""
    flags = ("--precision-layout", "bf16-20", "--grad-clip", 0, "--checkpoint-dir", tmp_path)
    train.main(common.argv(*flags, steps=1, mbs=1, grad_acc=2, dtype="bfloat16"))
    records, model = train.main(common.argv(*flags, "--resume", steps=2, mbs=1, grad_acc=2, dtype="bfloat16"))
    losses, state = single_device_layouts["bf16-20"]
    assert [r["loss"] for r in records] == losses[1:]
    for name, p in model.state_dict().items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, state[name]), name


# ======================================================================================
# Every parallel trainer (02, 04-08) under each layout: 2 ranks against the single-device run
# ======================================================================================
MOE = ["--num-experts", 4, "--top-k", 2, "--aux-loss-coef", 0.1]
PRECISIONS = {"bf16-16": ("bfloat16", ["--precision-layout", "bf16-16"]),
              "bf16-20": ("bfloat16", ["--precision-layout", "bf16-20"]),
              "fp16": ("float16", ["--loss-scale-init", 1024, "--loss-scale-window", 1])}
# trainer -> {layout id: (precision, flags)}, each run the global batch of 2 sequences that 01 trains as mbs 1
# × grad_acc 2: every --dp-mode and 08's ZeRO-1/2/3 over bf16-20's fp32 buffers (a pp2 chunk's two
# micro-batches added in fp32 under 1F1B and ZB-H1; SP's and a replicated kv head's sums over tp on them),
# TP's and SP's collectives on bf16 activations, the pipeline's zero-bubble W passes, the experts'
# reductions over dp and ep (08: their ZeRO-2 units over the ep ranks' dp group of one, ZeRO-3's over dp 2)
TRAINERS = {
    "02": {"dp2-bucket": ("bf16-20", ["--dp", 2, "--dp-mode", "bucket", "--bucket-mb", 0.002]),
           "dp2-overlap": ("bf16-16", ["--dp", 2, "--dp-mode", "overlap"]),
           "dp2-naive": ("fp16", ["--dp", 2, "--dp-mode", "naive"])},
    "04": {"tp2": ("bf16-20", ["--tp", 2]), "tp2-bf16-16": ("bf16-16", ["--tp", 2]),
           "tp2-fp16": ("fp16", ["--tp", 2])},
    "05": {"cp2": ("bf16-20", ["--cp", 2]), "tp2-sp": ("bf16-16", ["--tp", 2, "--sp"]),
           "cp2-fp16": ("fp16", ["--cp", 2])},
    "06": {"pp2-zb-h1": ("bf16-20", ["--pp", 2, "--pp-schedule", "zb-h1"]),
           "pp2-1f1b": ("bf16-16", ["--pp", 2]), "pp2-fp16": ("fp16", ["--pp", 2])},
    "07": {"dp2-ep2": ("bf16-20", ["--dp", 2, "--ep", 2]),
           "dp2-ep2-bf16-16": ("bf16-16", ["--dp", 2, "--ep", 2]),
           "dp2-ep2-fp16": ("fp16", ["--dp", 2, "--ep", 2])},
    "08": {"dp2-overlap": ("bf16-20", ["--dp", 2, "--dp-mode", "overlap"]),
           "dp2-zero1": ("bf16-20", ["--dp", 2, "--zero-stage", 1]),
           "dp2-zero2": ("bf16-16", ["--dp", 2, "--zero-stage", 2]),
           "dp2-zero3-bf16-20": ("bf16-20", ["--dp", 2, "--zero-stage", 3]),
           "pp2-1f1b-zero2-bf16-20": ("bf16-20", ["--pp", 2, "--zero-stage", 2]),
           "pp2-zb-h1-zero3-bf16-20": ("bf16-20", ["--pp", 2, "--pp-schedule", "zb-h1", "--zero-stage", 3]),
           "tp2-sp-zero1-bf16-20": ("bf16-20", ["--tp", 2, "--sp", "--zero-stage", 1]),
           "tp2-sp-zero2-bf16-20": ("bf16-20", ["--tp", 2, "--sp", "--zero-stage", 2]),
           "tp2-kv1-zero1-bf16-20": ("bf16-20", ["--tp", 2, "--num-kv-heads", 1, "--zero-stage", 1]),
           "dp2-ep2-moe-zero2-bf16-20": ("bf16-20", ["--dp", 2, "--ep", 2, *MOE, "--zero-stage", 2]),
           "dp2-moe-zero3-bf16-20": ("bf16-20", ["--dp", 2, *MOE, "--zero-stage", 3]),
           "pp2-fp16": ("fp16", ["--pp", 2])}}
RUNS = {f"{trainer}-{name}": (trainer, precision, flags)
        for trainer, runs in TRAINERS.items() for name, (precision, flags) in runs.items()}
# measured on a 2-core CPU (gloo), the largest over the runs: losses 5.6e-4 apart (08 tp2 over one kv head,
# bf16-20), parameters 0.046 of how far they moved (cp2 under bf16-20; TP's, CP's and EP's split sums round
# differently in bf16)
LOSS_APART, PARAMS_APART = 1e-3, 0.1
PLANNED = {"bf16-16": "mixed", "bf16-20": "mixed-fp32-grads", "fp16": "fp32"}   # 08's planner's rows


@contextlib.contextmanager
def overflow_at_step_2(here: bool):
    """fp16's overflow, forced where it starts: step 2's backward, on this rank only (`here`), starts from
    S·inf. Every rank must then skip step 2 and halve S, as one device does: its gradients reach the
    others through the collectives of backward and of the gradient reduction, and the norm that decides
    the skip is reduced over every group holding different gradients."""
    cls = mixed_precision.MixedPrecisionOptimizer
    scale, step = cls.scale, cls.step

    def scaled(self, loss):
        return scale(self, loss) * (float("inf") if here and getattr(self, "steps_taken", 0) == 1 else 1.0)

    def counted(self, grad_norm=None):
        step(self, grad_norm)
        self.steps_taken = getattr(self, "steps_taken", 0) + 1
    cls.scale, cls.step = scaled, counted
    try:
        yield
    finally:
        cls.scale, cls.step = scale, step


def _numbers(records, state):
    return dict(losses=[r["loss"] for r in records], scales=[r.get("loss_scale") for r in records],
                skipped=[r.get("skipped", False) for r in records], state=state)


def _trainer_run(run):
    """On every rank: one trainer under one layout; losses, S and skips per step, its (named) parameters."""
    import torch.distributed as dist
    trainer, precision, flags = run
    dtype, precision_flags = PRECISIONS[precision]
    dp = flags[flags.index("--dp") + 1] if "--dp" in flags else 1
    argv = common.argv(*flags, *precision_flags, *(MOE if trainer == "07" else []), "--grad-clip", 0, steps=2,
                       mbs=1, grad_acc=2 // dp, dtype=dtype)
    module = import_module({"02": "02_data_parallel", "04": "04_tensor_parallel", "06": "06_pipeline",
                            "05": "05_sequence_context_parallel", "07": "07_expert_parallel",
                            "08": "08_5d_combined"}[trainer] + ".train")
    with overflow_at_step_2(here=precision == "fp16" and dist.get_rank() == 1):
        records, model, *rest = module.main(argv)
    state = (rest[0].grad_sync.full_state_dict(model) if trainer == "08" else model.state_dict())
    if trainer in ("06", "08"):
        state = {pipeline.single_device_name(k): v for k, v in state.items()}
    return dict(_numbers(records, {k: v.float().numpy() for k, v in state.items()}),
                dtype=str(next(model.parameters()).dtype),
                tp=(dist.get_rank(), 2) if "--tp" in flags else (0, 1),
                states=rest[-1][dist.get_rank()]["states"] if trainer == "08" else None,   # 08's memory rows
                gathered=rest[-1][dist.get_rank()]["gathered"] if trainer == "08" else 0,  # ZeRO-3's peak
                pp_rank=rest[-1][dist.get_rank()]["coords"][1] if trainer == "08" else None,
                shard_grads=memory.held_bytes(      # ZeRO-2/3's (U/N,) each
                    u.shard_grad for z in getattr(rest[0].grad_sync, "zeros", []) for u in z.units)
                if trainer == "08" else 0)


@pytest.fixture(scope="module")
def trainer_runs():
    from harness import run_layouts
    return run_layouts(_trainer_run, RUNS, 2, timeout=300)


def _model_flags(trainer, flags):
    """The flags that change the model itself, which the single-device reference takes too: 07's experts, or
    fewer kv heads (one: tp 2 holds each kv head twice, 04's replicas)."""
    if trainer == "07" or "--num-experts" in flags:
        return tuple(MOE)
    return tuple(flags[flags.index("--num-kv-heads"):][:2]) if "--num-kv-heads" in flags else ()


def _initial_state(model_flags):
    """The seeded initial parameters (fp32) of 01's model, or 07's MoE model, before any step."""
    moe = model_flags == tuple(MOE)
    trainer = import_module("07_expert_parallel.train" if moe else "01_single_gpu.train")
    args, config, _ = cli.setup(trainer.build_parser(), common.argv(*model_flags), lambda *_: None)
    model = build.build_model(args, config)
    if moe:
        import moe as moe_module
        moe_module.apply_moe(model, args.num_experts, args.top_k, args.aux_loss_coef, args.seed,
                             **moe_module.extras(args))
    return {k: v.detach().float() for k, v in build.materialize(model, args).state_dict().items()}


@pytest.fixture(scope="module")
def single_device_precisions(single_device_layouts):
    """(precision, model flags) -> 01's (07's for the MoE) numbers for mbs 1 × grad_acc 2 (the bf16 dense
    ones are `single_device_layouts`'), and how far its parameters moved from their initial values."""
    out = {}
    needed = {(precision, _model_flags(trainer, flags)) for trainer, precision, flags in RUNS.values()}
    for model_flags in {m for _, m in needed}:
        initial, moe = _initial_state(model_flags), model_flags == tuple(MOE)
        for precision, (dtype, flags) in PRECISIONS.items():
            if (precision, model_flags) not in needed:
                continue
            if precision != "fp16" and not model_flags:
                losses, state = single_device_layouts[precision]
                numbers = dict(losses=losses, scales=[None, None], skipped=[False, False], state=state)
            else:
                trainer = import_module("07_expert_parallel.train" if moe else "01_single_gpu.train")
                with overflow_at_step_2(here=precision == "fp16"):
                    records, model = trainer.main(common.argv(*flags, *model_flags, "--grad-clip", 0,
                                                              steps=2, mbs=1, grad_acc=2, dtype=dtype))[:2]
                numbers = _numbers(records, model.state_dict())
            numbers["state"] = {k: v.detach().float() for k, v in numbers["state"].items()}
            numbers["moved"] = sum(float((v - initial[k]).norm() ** 2)
                                   for k, v in numbers["state"].items()) ** 0.5
            out[precision, model_flags] = numbers
    return out


@pytest.mark.parametrize("run", RUNS)
def test_parallel_trainers_under_each_precision_equal_the_single_device_run(trainer_runs,
                                                                            single_device_precisions, run):
    """02, 04-08 on 2 ranks under bf16-16, bf16-20 and fp16 against 01 (07 for the MoE) under the same
    layout and global batch. fp16: the overflow forced on rank 1 in step 2 (`overflow_at_step_2`) is skipped
    on both ranks, and both log 01's loss scales (1024, then 2048 for the skipped step). Data-parallel runs
    and pipelines compute each micro-batch as 01 does and sum two addends (see the ZeRO test above): their
    parameters are 01's bitwise. TP, CP and EP split the matmuls and attention, so bf16's rounding differs:
    losses within LOSS_APART, the parameters' distance to 01's within PARAMS_APART of how far 01's moved (the
    measure of test_bf16_layouts_train_close_to_fp32; measured values beside the constants); fp16 under
    data parallelism too (a rank's fp16 backward of its own rows rounds apart from 01's). The weights
    are held in bf16 under bf16-16/20 (fp32 under fp16's autocast), on every rank. Under TP a weight both
    ranks hold whole (the norm gains, a kv head at tp > kv heads) gets one gradient, summed over tp where
    each rank saw part of it (SP, 04's replicas), so it stays bitwise equal on both: a sum left out moves
    AdamW's ±lr updates too little to leave the tolerances, but splits the copies."""
    from harness import layout_results
    from test_tensor_parallel import shard_like
    trainer, precision, flags = RUNS[run]
    ref = single_device_precisions[precision, _model_flags(trainer, flags)]
    exact = not {"--tp", "--cp", "--ep"} & set(flags) and not (precision == "fp16" and "--dp" in flags)
    results = layout_results(trainer_runs, run)
    for name, local in results[0]["state"].items() if "--tp" in flags else ():
        if local.shape == tuple(ref["state"][name].shape):          # not split over tp
            assert (local == results[1]["state"][name]).all(), f"{run}: {name} differs between the tp ranks"
    for rank, got in enumerate(results):
        assert got["dtype"] == ("torch.float32" if precision == "fp16" else "torch.bfloat16"), rank
        assert got["skipped"] == ref["skipped"] and got["scales"] == ref["scales"], f"rank {rank}"
        if precision == "fp16":
            assert got["skipped"] == [False, True] and got["scales"] == [1024, 2048]
        apart = 0.0
        for name, local in got["state"].items():
            local = torch.from_numpy(local)
            want = shard_like(ref["state"][name], local, *got["tp"])
            assert not exact or torch.equal(local, want), f"{run} rank {rank}: {name}"
            apart += float((local - want).norm() ** 2)
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= LOSS_APART, f"rank {rank}"
        assert apart ** 0.5 <= PARAMS_APART * ref["moved"], f"rank {rank}"
        if trainer == "08":      # the memory report's (weights, gradients, optimizer) == the planner's row
            args = cli.parse_args(planner.build_parser(), common.argv(
                *flags, "--precision", PLANNED[precision], mbs=1, grad_acc=1 if "--dp" in flags else 2),
                files=False)
            memory = plan_arithmetic.stage_memory(cli.model_config(args, 257), planner.layout_of(args),
                                          common.SEQ_LEN, args.mbs, args.grad_acc, got["pp_rank"])
            planned = [memory["parameters"], memory["gradients"], memory["optimizer"]]
            held = list(got["states"])
            if "--zero-stage" in flags and flags[flags.index("--zero-stage") + 1] > 1:
                # ZeRO-2/3: the gradient shards (bf16-20: fp32, 4 bytes); under PP 08 reduces once per step,
                # so the full gradients (its report's row) and ZeRO-3's gathered stage are held beside them.
                # At pp 1 the planner's row is 03's, what 08 holds after the step (the shards)
                pipelined = "--pp" in flags
                held[1] = got["shard_grads"] + (held[1] if pipelined else 0)
                held[0] += got["gathered"] if pipelined else 0
            assert held == planned, rank
