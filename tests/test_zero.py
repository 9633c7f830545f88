"""03_zero: ZeRO-1/2/3 against the single-device run, and their memory and communication formulas.

Compared: `--dp N --mbs 1 --zero-stage s` against 01's `--mbs N` (the same global batch): losses and
gradient norms per step, and the final parameters (stage 3 gathers its shards for that). The model
is the tiny Llama with hidden size 42 and intermediate size 63, so the layer and norm units hold a
number of elements that 4 does not divide: every stage pads. Then the bytes the meter saw and
the bytes of parameters, gradients and optimizer states this rank holds are checked, exactly,
against zero_layout.py's formulas (zero.py's docstring).
"""
from importlib import import_module

import pytest
import torch

import common
from harness import layout_results, run_layouts, run_ranks

import zero as zero_mod
import flat_unit
import offload
import zero_layout as layout_mod

ODD = ["--hidden-size", "42", "--num-heads", "3", "--num-kv-heads", "1", "--intermediate-size", "63"]
STAGES = (1, 2, 3)


def _zero_stage(stage, steps, grad_acc, extra=()):
    """One ZeRO stage on this rank (a spawn runs the stages in turn, in the same processes)."""
    zero_train = import_module("03_zero.train")
    records, zero, model, optimizer, meter, _ = zero_train.main(
        common.argv(*ODD, *extra, "--dp", world_size(), "--zero-stage", stage, steps=steps, mbs=1,
                    grad_acc=grad_acc))
    events = list(zero.events)                  # the last step's, before full_state_dict gathers
    return dict(losses=[r["loss"] for r in records], norms=[r["grad_norm"] for r in records],
                state={k: v.numpy().copy() for k, v in zero.full_state_dict(model).items()},  # numpy:
                # pickled by value (many tensors through the result queue exhaust shared-memory handles)
                wire=dict(meter.wire), calls=dict(meter.calls), events=events,
                held=zero.model_state_bytes(model, optimizer), padded_bytes=zero.padded_bytes,
                unpadded_bytes=sum(p.numel() * 4 for p in model.parameters()), units=len(zero.units),
                expected_held=layout_mod.expected_state_bytes(stage, world_size(), zero.padded_bytes))


def world_size():
    import torch.distributed as dist
    return dist.get_world_size()


def single_device(steps, mbs, grad_acc, extra=()):
    """01's losses, gradient norms and final parameters for the same flags."""
    records, model = import_module("01_single_gpu.train").main(
        common.argv(*ODD, *extra, steps=steps, mbs=mbs, grad_acc=grad_acc))
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], model.state_dict()


# fp32 after a few AdamW steps: m/√v turns a last-bit gradient difference at a near-zero gradient into a
# move of up to the learning rate (3e-3 a step here), so parameters are compared to 1e-4; measured: one
# element of 512 off by 1.3e-5, on one Xeon's GEMM blocking. In float64 the same runs agree to 2e-14
# (test_zero3_in_float64_is_the_single_device_run_to_rounding), so the fp32 gap is rounding, not a bug.
FP32 = dict(losses=dict(rtol=0, atol=1e-5), norms=dict(rtol=1e-5, atol=0), params=dict(rtol=1e-5, atol=1e-4))
FP64 = dict(losses=dict(rtol=0, atol=1e-12), norms=dict(rtol=1e-12, atol=0),
            params=dict(rtol=0, atol=1e-12))


def check_against_single(per_rank, stage, ref, tolerance=FP32):
    """One stage's numbers on every rank against 01's (losses, gradient norms, final parameters)."""
    ref_losses, ref_norms, ref_state = ref
    for rank, got in enumerate(per_rank):
        what = f"ZeRO-{stage} rank {rank}"
        torch.testing.assert_close(got["losses"], ref_losses, **tolerance["losses"], msg=what)
        torch.testing.assert_close(got["norms"], ref_norms, **tolerance["norms"], msg=what)
        for name, ref in ref_state.items():
            torch.testing.assert_close(torch.from_numpy(got["state"][name]), ref, **tolerance["params"],
                                       msg=f"{what} {name}")


def test_optimizer_offload_steps_the_host_masters_of_the_device_shards():
    """ZeRO-Offload's two copies around the step (exercise 03.4), without ranks (the CPU is both device and
    host): gradients_to_host puts each bf16 shard's gradient into its fp32 master's .grad (bf16-20's fp32
    `main_grad` where the shard has one), AdamW steps the masters, parameters_to_device writes them into the
    shards rounded to bf16 and clears device_stale. Compared exactly with the same AdamW on fp32 copies made
    by hand: the offload moves numbers, it computes nothing."""
    torch.manual_seed(0)
    shards = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in (5, 3)]
    shards[0].grad = torch.randn(5).to(torch.bfloat16)
    shards[1].grad, shards[1].main_grad = torch.zeros(3, dtype=torch.bfloat16), torch.randn(3)   # bf16-20
    host = offload.OptimizerOffload(shards, master_dtype=torch.float32)
    by_hand = [torch.nn.Parameter(s.detach().float()) for s in shards]
    for copy, grad in zip(by_hand, (shards[0].grad.float(), shards[1].main_grad)):
        copy.grad = grad.clone()
    assert host.device_stale
    host.gradients_to_host()
    for master, copy in zip(host.master, by_hand):
        assert master.grad is not None and master.grad.dtype == torch.float32, "no fp32 gradient on the host"
        assert torch.equal(master.grad, copy.grad)
    torch.optim.AdamW(host.master, lr=0.1).step()
    torch.optim.AdamW(by_hand, lr=0.1).step()
    host.parameters_to_device()
    for shard, master, copy in zip(shards, host.master, by_hand):
        assert torch.equal(master, copy) and shard.dtype == torch.bfloat16
        assert torch.equal(shard, copy.detach().to(torch.bfloat16)), "the shard is not the stepped master"
    assert not host.device_stale


STEPS, GRAD_ACC, N = 2, 2, 4


@pytest.fixture(scope="module")
def dp4_stages():
    """One 4-rank spawn runs stages 1, 2, 3 and ZeRO-3 with --offload param in turn (a spawn costs seconds;
    a layout that raises on the ranks is named, and the next ones still run unless a rank may be blocked
    in a collective with it)."""
    layouts = {**{f"zero{stage}": stage for stage in STAGES}, "offload-param": "param", "zero3-fp64": "fp64"}
    return run_layouts(_dp4_layout, layouts, N, args=(STEPS, GRAD_ACC))


def _dp4_layout(layout, steps, grad_acc):
    if layout == "fp64":
        return _zero_stage(3, steps, grad_acc, ("--dtype", "float64"))
    return _param_offload(steps, (), grad_acc) if layout == "param" else _zero_stage(layout, steps, grad_acc)


@pytest.fixture(scope="module")
def dp4_reference():
    """01 with mbs 4 × grad_acc 2, the reference of every stage."""
    return single_device(STEPS, N, GRAD_ACC)


def test_zero3_in_float64_is_the_single_device_run_to_rounding(dp4_stages):
    """ZeRO-3, dp 4 × mbs 1 × grad_acc 2 in float64, == 01's float64 run to 1e-12: losses, norms and every
    parameter. The fp32 runs' tolerance (FP32) is what fp32 rounding, amplified by AdamW, leaves."""
    reference = single_device(STEPS, N, GRAD_ACC, ("--dtype", "float64"))
    check_against_single(layout_results(dp4_stages, "zero3-fp64"), 3, reference, FP64)


@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: f"zero{stage}")
def test_zero_stages_dp4_grad_acc_match_single_device_and_formulas(dp4_stages, dp4_reference, stage):
    """dp 4 × mbs 1 × grad_acc 2, stages 1-3, == 01 with mbs 4 × grad_acc 2, and the formulas hold.

    Tolerances (fp32, FP32): losses 1e-5 absolute, parameters 1e-4 after 2 AdamW steps, norms 1e-5
    relative. The ranks sum four partial gradients in a different order than one device and the
    norm is a sum of shard squares, not a norm of per-tensor norms: last-bit differences (~1e-7)
    that AdamW's m/√v can amplify for near-zero gradients; a wrong 1/N, a lost micro-batch or a
    missing clip changes the loss in the 3rd digit. The gradient norms are above the clip of 1.0,
    so clipping is active and checked too.

    Bytes, exact, per rank: reduce-scatter + all-gather wire = 2, A+1, 3A × (N−1)/N · Ψ for stages
    1, 2, 3 with A = 2 micro-batches (Ψ = padded flat bytes), and the two fp32 scalar all-reduces
    (norm, loss). Held: parameters/gradients/optimizer = 4Ψ/4Ψ/8Ψ/N, 4Ψ/4Ψ/N/8Ψ/N, 4Ψ/N/4Ψ/N/8Ψ/N.
    Overlap: stage 2-3 reduce-scatters are issued from the gradient hooks, head first: within one
    micro-batch, the head's reduce-scatter comes before the embedding's gradient exists; stage 3 issues
    unit k+1's all-gather before unit k runs. Every rank is checked.
    """
    steps, grad_acc, n = STEPS, GRAD_ACC, N
    results = layout_results(dp4_stages, f"zero{stage}")
    check_against_single(results, stage, dp4_reference)
    scalar_wire = 2 * (n - 1) * 4 // n
    for rank, got in enumerate(results):
        what = f"ZeRO-{stage} rank {rank}"
        psi = got["padded_bytes"]
        assert psi > got["unpadded_bytes"] and psi % (4 * n) == 0, what     # padding really happened
        ring = (n - 1) * psi // n
        times = {1: 2, 2: grad_acc + 1, 3: 3 * grad_acc}[stage]
        assert (got["wire"][("reduce_scatter", "dp")] + got["wire"][("all_gather", "dp")]
                == steps * times * ring)
        assert got["wire"][("all_reduce", "dp")] == steps * 2 * scalar_wire, what
        assert got["calls"][("all_reduce", "dp")] == steps * 2, what
        assert got["held"] == got["expected_held"] == {
            1: (psi, psi, 2 * psi // n),
            2: (psi, psi // n, 2 * psi // n),
            3: (psi // n, psi // n, 2 * psi // n)}[stage]
        if stage > 1:   # the last step's events; its first micro-batch runs until the second's first gradient
            events, units = got["events"], got["units"]
            scatters = [u for kind, u in events if kind == "reduce_scatter"]
            assert scatters[-units:] == list(reversed(range(units))), what
            first = events[:events.index(("reduce_scatter", units - 1), events.index(("reduce_scatter", 0)))]
            assert first.index(("reduce_scatter", units - 1)) < max(
                i for i, e in enumerate(first) if e == ("grad", 0)), f"{what}: no overlap with backward"
    if stage == 3:
        events = results[0]["events"]
        units = results[0]["units"]
        # forward + backward
        assert sum(kind == "gather_issued" for kind, _ in events) == 2 * units * grad_acc
        # first micro-batch's forward
        forward = events[:next(i for i, e in enumerate(events) if e[0] == "backward")]
        for k in range(units - 1):
            assert forward.index(("gather_issued", k + 1)) < forward.index(("forward", k)), "no prefetch"


DP2_STEPS = 2


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory):
    """One 2-rank spawn for the dp 2 × mbs 1 tests below (ZeRO-3 under recompute, the offloaded stages, the
    offloaded parameters: a run, then a 1-step run that saves a checkpoint and its resume, and a run that
    skips a non-finite step 2), and 01's run of the same global batch (mbs 2). --recompute changes no
    number (test_single_gpu.py checks it), so 01 with full recompute is every layout's reference."""
    checkpoints = str(tmp_path_factory.mktemp("param_offload"))
    layouts = {"zero3-recompute": ("recompute", 3),
               **{f"offload-zero{stage}": ("offload", stage) for stage in STAGES},
               "offload-param": ("param", ()),
               "offload-param-save": ("param", ("--checkpoint-dir", checkpoints)),
               "offload-param-resume": ("param", ("--checkpoint-dir", checkpoints, "--resume")),
               "offload-param-skip": ("param", ("--on-nonfinite", "skip")),
               "offload-zero3-save": ("offload", (3, "--checkpoint-dir", checkpoints + "-optimizer")),
               "offload-zero3-resume": ("offload", (3, "--checkpoint-dir", checkpoints + "-optimizer",
                                                    "--resume"))}
    return run_layouts(_dp2_layout, layouts, 2), single_device(DP2_STEPS, 2, 1, extra=("--recompute", "full"))


def _dp2_layout(layout):
    kind, stage = layout
    if kind == "recompute":
        return _zero_stage(stage, DP2_STEPS, 1, extra=("--recompute", "full"))
    if kind == "param":            # `stage` is extra flags here: the save run stops after 1 step
        import torch.distributed as dist
        from test_mixed_precision import overflow_at_step_2
        save = "--checkpoint-dir" in stage and "--resume" not in stage
        with overflow_at_step_2(here="skip" in stage and dist.get_rank() == 1):   # step 2's loss × inf
            return _param_offload(1 if save else DP2_STEPS, stage)
    if isinstance(stage, tuple):   # (stage, checkpoint flags): the save run stops after 1 step
        stage, *extra = stage
        return _offload_stage(stage, 1 if "--resume" not in extra else DP2_STEPS, 1, extra)
    return _offload_stage(stage, DP2_STEPS, 1)


def test_zero3_dp2_with_full_recompute(dp2_runs):
    """dp 2 × mbs 1 == 01 with mbs 2 for ZeRO-3 under --recompute full (tolerances as above).

    Recomputation re-runs each layer's forward inside backward, after the backward pre-hook has
    gathered the layer again: the hooks must leave the parameters in place for it.
    """
    outcomes, reference = dp2_runs
    check_against_single(layout_results(outcomes, "zero3-recompute"), 3, reference)


def _offload_stage(stage, steps, grad_acc, extra=()):
    """ZeRO-s with --offload optimizer on this rank: its numbers, and where the optimizer's tensors live."""
    records, zero, model, optimizer, _, offload = import_module("03_zero.train").main(
        common.argv(*ODD, "--dp", world_size(), "--zero-stage", stage, "--offload", "optimizer", *extra,
                    steps=steps, mbs=1, grad_acc=grad_acc))
    stepped = [p for group in optimizer.param_groups for p in group["params"]]

    def storages(tensors):                           # the distinct buffers behind tensors (freed ones: none)
        return {t.untyped_storage().data_ptr() for t in tensors
                if t is not None and t.untyped_storage().nbytes()}
    device = storages([*model.parameters(), *(p.grad for p in model.parameters()), *zero.shards,
                       *(t for u in zero.units
                         for t in (u.full, u.shard, u.grad, u.grad_full, u.shard_grad))])
    states = [v for state in optimizer.state.values() for v in state.values()
              if torch.is_tensor(v) and v.dim()]
    return dict(losses=[r["loss"] for r in records], norms=[r["grad_norm"] for r in records],
                state={k: v.numpy().copy() for k, v in zero.full_state_dict(model).items()},
                held=zero.model_state_bytes(model, optimizer), host=offload.host_bytes(optimizer),
                expected=layout_mod.expected_offload_bytes("optimizer", stage, world_size(),
                                                           zero.padded_bytes),
                steps_masters=len(stepped) == len(offload.master) and
                              {id(p) for p in stepped} == {id(p) for p in optimizer.state}
                              == {id(m) for m in offload.master},
                disjoint=not device & storages([*offload.master, *offload.grads, *states]),
                adam_steps={float(state["step"]) for state in optimizer.state.values()},
                copied_back=all(torch.equal(m, s) for m, s in zip(offload.master, offload.shards)),
                # pinned on a GPU
                on_host=all(t.device.type == "cpu" and t.is_pinned() == zero.shards[0].is_cuda
                            for t in [*offload.master, *offload.grads, *states]))


@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: f"zero{stage}")
def test_offload_optimizer_matches_single_device_and_leaves_no_state_on_the_device(dp2_runs, stage):
    """ZeRO-Offload, dp 2 × mbs 1, stages 1-3, == 01 with mbs 2 (tolerances as above: the same AdamW on the
    same fp32 numbers, only on other tensors).

    Where things live, per rank: the optimizer steps exactly offload.master, and every tensor it holds
    (masters, host gradients, exp_avg, exp_avg_sq) is a buffer of its own, none shared with the model's
    parameters, gradients or ZeRO's flat buffers, and all are on the CPU (pinned when the shards are on a
    GPU; here both are the CPU, so separate buffers are what tells them apart). Bytes, exact, against
    offload.expected_bytes: device parameters/gradients as ZeRO-s with 0 optimizer states; host master Ψ/N,
    gradients Ψ/N, states 2Ψ/N.
    After the last step the device shards equal the masters (copied back), AdamW counted 2 steps.
    """
    outcomes, reference = dp2_runs
    results = layout_results(outcomes, f"offload-zero{stage}")
    check_against_single(results, stage, reference)
    for rank, got in enumerate(results):
        what = f"ZeRO-{stage} offload, rank {rank}"
        device, host = got["expected"]
        assert got["held"] == device and device[2] == 0 and got["host"] == host, what
        assert got["steps_masters"] and got["disjoint"] and got["copied_back"] and got["on_host"], what
        assert got["adam_steps"] == {float(DP2_STEPS)}, what


def _param_offload(steps, extra, grad_acc=1):
    """ZeRO-3 with --offload param on this rank: its numbers, what device and host hold, the copies."""
    records, zero, model, optimizer, _, _ = import_module("03_zero.train").main(
        common.argv(*ODD, *extra, "--dp", world_size(), "--zero-stage", 3, "--offload", "param", steps=steps,
                    mbs=1, grad_acc=grad_acc))
    host = [*(u.shard for u in zero.units), *(u.shard_grad for u in zero.units),
            *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())]
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    events = list(zero.events)
    return dict(losses=[r["loss"] for r in records], norms=[r["grad_norm"] for r in records],
                skipped=[r.get("skipped", False) for r in records],
                held=zero.model_state_bytes(model, optimizer), host=zero.host_bytes(optimizer),
                expected=layout_mod.expected_offload_bytes("param", 3, world_size(), zero.padded_bytes),
                peak=zero.peak_device_bytes, peak_formula=layout_mod.expected_peak_device_bytes(zero.units),
                h2d=zero.h2d_bytes, d2h=zero.d2h_bytes, padded_bytes=zero.padded_bytes, events=events,
                steps_host_shards={p.untyped_storage().data_ptr() for p in stepped} ==
                                  {u.shard.untyped_storage().data_ptr() for u in zero.units},
                on_host=all(t.device.type == "cpu" and t.is_pinned() == (zero.device.type == "cuda")
                            for t in host),
                state={k: v.numpy().copy() for k, v in zero.full_state_dict(model).items()})


def check_param_offload(results, plain, reference, n, grad_acc):
    """--offload param's numbers on every rank against ZeRO-3's (bitwise) and 01's, and its formulas."""
    check_against_single(results, 3, reference)
    for rank, (got, zero3) in enumerate(zip(results, plain)):
        what = f"ZeRO-3 --offload param, dp {n}, rank {rank}"
        assert got["losses"] == zero3["losses"] and got["norms"] == zero3["norms"], what
        for name, value in zero3["state"].items():
            assert (got["state"][name] == value).all(), f"{what} {name}"
        device, host = got["expected"]
        shard = got["padded_bytes"] // n
        assert got["held"] == device == (0, 0, 0) and got["host"] == host == (shard, shard, 2 * shard), what
        assert got["steps_host_shards"] and got["on_host"], what
        assert got["peak"] == got["peak_formula"], what
        assert got["h2d"] == 2 * grad_acc * shard and got["d2h"] == grad_acc * shard, what   # the last step's
        events = got["events"]
        gathers = [i for i, (kind, _) in enumerate(events) if kind == "gather_issued"]
        assert gathers and all(events[i - 1] == ("to_device", events[i][1]) for i in gathers), what


def test_offload_param_matches_zero3_and_single_device_holds_nothing_between_steps_and_resumes(
        dp2_runs, dp4_stages, dp4_reference):
    """ZeRO-3 with --offload param, dp 2 × mbs 1 and dp 4 × mbs 1 × grad_acc 2 (padded units), == ZeRO-3
    without offload bit for bit (the same sums and AdamW on the same fp32 values, in host tensors) and ==
    01 with the same global batch (tolerances as above).

    Per rank, exact: between steps the device holds no parameter, gradient or optimizer byte; the host the
    parameter shard Ψ/N, its gradient Ψ/N and AdamW's 2Ψ/N (layout.expected_offload_bytes), all CPU tensors
    (pinned on a GPU); AdamW steps the host shards themselves. During the step the device's peak of
    gathered units and shard copies is layout.expected_peak_device_bytes (two neighbouring units and the
    prefetched one's copy); each all-gather is preceded by its unit's host -> device copy, 2A·Ψ/N bytes
    per step for A micro-batches (forward and backward gathers) and A·Ψ/N back. A dp 2 run saving a
    checkpoint after step 1, resumed, gives step 2's loss and the final parameters of the uninterrupted
    run exactly: the checkpoint holds the host shards' values and AdamW's host states.
    """
    outcomes, reference = dp2_runs
    results = layout_results(outcomes, "offload-param")
    check_param_offload(results, layout_results(outcomes, "zero3-recompute"), reference, 2, 1)
    check_param_offload(layout_results(dp4_stages, "offload-param"), layout_results(dp4_stages, "zero3"),
                        dp4_reference, N, GRAD_ACC)
    for rank, (whole, resumed) in enumerate(zip(results, layout_results(outcomes, "offload-param-resume"))):
        assert resumed["losses"] == whole["losses"][1:], f"rank {rank}"
        for name, value in whole["state"].items():
            assert (resumed["state"][name] == value).all(), f"resumed rank {rank} {name}"


def test_offload_optimizer_zero3_resumes_exactly(dp2_runs):
    """ZeRO-3 with --offload optimizer, dp 2: a run that saves a checkpoint after step 1, resumed, gives step
    2's loss and the final parameters of the uninterrupted run exactly. The checkpoint restores the host
    masters (what the optimizer steps); ZeRO-3's device shards are not model parameters, so they are
    written from the masters before the first step."""
    outcomes, _ = dp2_runs
    whole = layout_results(outcomes, "offload-zero3")
    for rank, (run, resumed) in enumerate(zip(whole, layout_results(outcomes, "offload-zero3-resume"))):
        assert resumed["losses"] == run["losses"][1:], f"rank {rank}"
        for name, value in run["state"].items():
            assert (resumed["state"][name] == value).all(), f"resumed rank {rank} {name}"
        assert resumed["copied_back"], f"rank {rank}"


def test_offload_param_skips_a_nonfinite_step_on_every_rank(dp2_runs):
    """--on-nonfinite skip with --offload param, step 2's gradients made non-finite on rank 1 only (its loss
    × inf): both ranks skip step 2, and their final parameters are the 1-step run's bit for bit. The flag
    is computed from the host tensors AdamW steps and all-reduced on the collectives' device (--device:
    NCCL takes no host tensor); on this CPU machine that is the CPU, so the result is what is tested here,
    not the flag's device."""
    outcomes, _ = dp2_runs
    skipping = layout_results(outcomes, "offload-param-skip")
    for rank, (got, ref) in enumerate(zip(skipping, layout_results(outcomes, "offload-param-save"))):
        assert got["skipped"] == [False, True] and got["losses"][:1] == ref["losses"], f"rank {rank}"
        for name, value in ref["state"].items():
            assert (got["state"][name] == value).all(), f"rank {rank} {name}"


def _zero_against_adamw_rank(offload_param=False, stage=1):
    """2 ranks, each with 2 of 4 sequences: ZeRO-`stage` (or ZeRO-3 with --offload param) over a float64
    tiny Llama (odd sizes: the units pad) for 2 clipped AdamW steps, against 01's AdamW on all 4 sequences
    on this rank."""
    import copy
    from types import SimpleNamespace

    import torch.distributed as dist
    import model as modeling
    import optim
    torch.manual_seed(0)
    config = modeling.LlamaConfig(vocab_size=64, hidden_size=42, intermediate_size=63, num_hidden_layers=2,
                                  num_attention_heads=3, num_key_value_heads=1)
    dense = modeling.LlamaForCausalLM(config).double()
    model = copy.deepcopy(dense)
    for name, p in model.named_parameters():
        p.global_name = name                     # as 01's build_model names them (checkpoints need it)
    ids = torch.randint(0, config.vocab_size, (4, 17))
    mine = ids.chunk(dist.get_world_size())[dist.get_rank()]                      # (2, 17)
    if offload_param:
        zero = offload.ParameterOffload(flat_unit.llama_units(model), dist.group.WORLD)
    else:
        zero = zero_mod.ZeRO(flat_unit.llama_units(model), dist.group.WORLD, stage=stage)
    args = SimpleNamespace(lr=1e-2, weight_decay=0.1)
    optimizer = optim.make_optimizer(zero.shards, args)
    dense_optimizer = optim.make_optimizer(dense.parameters(), args)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        zero.zero_gradients()
        model(mine[:, :-1], labels=mine[:, 1:]).backward()
        zero.finish_gradients()                   # reduce-scatter: this rank's shard of the mean gradient
        norm = zero.clip_gradients(0.5)
        optimizer.step()
        zero.gather_shards()                      # all-gather: every rank's updated shard (ZeRO-3: none)
        dense_optimizer.zero_grad(set_to_none=True)
        dense(ids[:, :-1], labels=ids[:, 1:]).backward()
        dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)
        torch.testing.assert_close(norm, dense_norm, rtol=1e-12, atol=0)
        dense_optimizer.step()
    with torch.no_grad():                         # an evaluation: ZeRO-3's forward hooks free each unit
        model(mine[:, :-1], labels=mine[:, 1:])
    gathered = sum(u.full.untyped_storage().nbytes() for u in zero.units)
    # ZeRO-1 and 2 keep every unit whole
    assert gathered == 0 if offload_param or stage == 3 else gathered > 0, gathered
    with zero.gathered():                         # ZeRO-3: the host shards, gathered on the device
        for (name, p), q in zip(model.named_parameters(), dense.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=name)
    return True


def test_zero1_step_equals_adamw_on_the_whole_batch():
    """The ZeRO-1 step (reduce-scatter the gradient, clip by the norm over the shards, AdamW on the shard,
    all-gather the shards) gives every rank the parameters one device's step on the whole batch gives.
    float64: the sums of the reduce-scatter and of the norm run in other orders, ~1e-16 relative; AdamW's
    m/(√v + ε) can blow that up only for gradients near zero, still far below 1e-12."""
    assert run_ranks(_zero_against_adamw_rank, 2, timeout=120) == [True, True]


def test_zero2_step_equals_adamw_on_the_whole_batch():
    """The same for ZeRO-2: each unit's gradients reduce-scattered from the hooks of its backward."""
    assert run_ranks(_zero_against_adamw_rank, 2, args=(False, 2), timeout=120) == [True, True]


def test_zero3_step_equals_adamw_on_the_whole_batch():
    """The same for ZeRO-3: each unit all-gathered before its forward and its backward, freed after, the
    next one prefetched; after an evaluation no unit is left gathered."""
    assert run_ranks(_zero_against_adamw_rank, 2, args=(False, 3), timeout=120) == [True, True]


def test_offload_param_step_equals_adamw_on_the_whole_batch_in_float64():
    """The same for ZeRO-3 with its shards on the host (offload.ParameterOffload): each unit copied to the
    device and all-gathered around its use, the gradient slices summed into the host shards, AdamW on
    them there; the same float64 tolerance and reasons. After an evaluation (a forward under no_grad) no
    unit is left gathered: the forward hooks free each (08 frees its chunks in eval_step)."""
    assert run_ranks(_zero_against_adamw_rank, 2, args=(True,), timeout=120) == [True, True]


def test_bad_zero_layouts_fail_before_any_process_group(monkeypatch, capsys):
    """A wrong world size, ZeRO-3 with tied weights, or --offload param below stage 3 exits with the fix
    named and no group made."""
    import torch.distributed as dist
    zero_train = import_module("03_zero.train")
    monkeypatch.setenv("WORLD_SIZE", "4")
    for flags, message in ((("--dp", 2), "launch with --nproc_per_node 2"),
                           (("--dp", 4, "--zero-stage", 3, "--tie-embeddings"), "drop --tie-embeddings"),
                           (("--dp", 4, "--zero-stage", 2, "--offload", "param"), "add --zero-stage 3")):
        with pytest.raises(SystemExit):
            zero_train.main(common.argv(*flags))
        assert message in capsys.readouterr().err
    assert not dist.is_initialized()
