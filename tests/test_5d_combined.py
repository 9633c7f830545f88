"""08_5d_combined: whole 4D runs against 01, the planner against the papers' numbers and the code's.

Whole runs (real gloo ranks, tiny model, 2 AdamW steps, float32): the losses and gradient norms of every
step and every rank's final parameters (its tp shard of its stage's layers) equal 01's for the same
global batch dp·mbs·grad_acc. Layouts, grouped per spawn:
    8 ranks  dp2 × tp2 × pp2 (1f1b, full recomputation with P_a); tp2+sp × cp2 zig-zag × pp2 with zb-h1
             and with interleaved V = 2;
             dp2 (ep2) × tp2 × pp2 with 4 experts, top-2, capacity factor 1, full recomputation (against
             07's single-device MoE, and its logged dropped rows);
             ZeRO-1: dp2 × tp2+sp × pp2 with zb-h1; ZeRO-3: dp2 × tp2+sp × pp2 with 1f1b over one kv head
             (SP's and 04's kv-replica sums before each unit's reduce-scatter), saving a checkpoint every
             step, then resumed from step 1 under ZeRO-2 (its one step must give 01's second)
    4 ranks  cp2 (contiguous) × pp2 with grad-acc 3 and selective recompute; cp2 (Ulysses) × pp2 afab;
             tp2+sp × pp2 with the Triton kernels and flash attention (Triton's CPU interpreter); ZeRO-3
             and ZeRO-2 over dp2 × pp2 with the Triton kernels (08 gathers a chunk before its forward, so
             the fused loss finds the head whole, which 03's hooks cannot promise);
             dp2 (ep2) × pp2 with zb-h1 and 4 experts, capacity factor 1 (07's dropped rows); experts under
             CP, 4 each: cp2 zig-zag × pp2 with full recomputation (the statistics' all-reduces run again) and
             cp2 × dp2 (ep2) (the load-balancing statistics summed over cp, experts' gradients over cp·dp/ep
             ranks / (cp·dp): an identity backward for P's sums, no sum, or 07's /dp each fail these);
             ZeRO-1: cp2 × dp2 (N = 4 shards), saving a checkpoint every step, then resumed from step 1 (its
             one step must give 01's second); dp2 × pp2 interleaved (V = 2) with grad-acc 4; V-wise, tp2 × pp2
             with DualPipeV and with ZB-V (grad-acc 4: their B, I and W passes under TP's collectives), both
             with full recomputation and P_a (its checkpoint bytes counted, _check_partitioned_checkpoints);
             dp4 (ep2) with 4 experts (expert states sharded over the 2 ranks holding the same experts,
             07's /dp); cp2 × dp2 (ep2) contiguous with 4 experts (expert states over the cp × dp/ep = 2
             ranks, / (cp·dp));
             every reduction under a schedule, grad-acc 4 (gradient_sync.py: each path once): DP overlap with
             zb-h1 (hooks in W), DP bucket with interleaved V = 2 (buckets across chunks), ZeRO-2 with zb-h1
             and with DualPipeV (whole backwards count as B and W), ZeRO-3 with interleaved (a gather per
             chunk) and dp2 (ep2) × pp2 zb-h1 with 4 experts (expert units reduced after the schedule); each
             also shows its reduction ran inside the schedule (`_check_in_backward`), and each ZeRO-3 run that
             it held, while building, at most one unit's values at full size, never its stage
             (`_values_held`); the interleaved one evaluates after each step, and after that last evaluation
             no full unit is left (`resident`)
Tolerances: losses 1e-5 relative, parameters 2e-5 absolute, those of test_tensor_parallel.py (04/05),
for the same reasons: TP splits every matmul's sum, ring attention merges blocks by log-sum-exp, the
gradient norm is summed per shard, stage and replica, so results differ from 01 by float32 rounding
(~1e-7 relative: the first step's norms agree to 1e-7), which AdamW's first updates (≈ lr·g/|g|,
lr 3e-3) amplify for near-zero gradients. The gradient norms of the later steps are computed on those
parameters and are the most sensitive number (1.1e-5 relative at step 2 of a float32 cp2 × pp2 run): 5e-5.
The Triton layouts are compared with 01's PyTorch path, with test_kernels.py's 1e-4 (losses, norms) and
1e-3 (parameters): the kernels reorder float32 reductions themselves. They train on 8-token windows of
synthetic tokens and 2 layers (mbs 1; 01's reference reads the same): the interpreter's cost is per row.
The cp2 × pp2 layout with 3 micro-batches runs in float64, as test_pipeline.py's dp2 × pp2 does: in a 3-step
float32 run one of the 1024 o_proj weights of layer 2 ended 1.4e-4 from 01's (a near-zero gradient whose
rounding AdamW turned into a visible step); in float64 everything agrees to 1e-8. ZeRO-1 takes the same
tolerances: its gradients are those of plain DP reduce-scattered instead of all-reduced, its norm a sum of
shard squares (one more rounding order), and AdamW steps the same elements (a cp2 × dp2 run with grad-acc 3
showed the amplified outlier too, 2.6e-5 on one v_proj weight of 512; in float64 it agrees to 1e-8). The norms
(1.4, then 2.2) are above --grad-clip 1, so clipping by the ZeRO-1 norm is exercised.

Layout: Llama 3's 16-rank grid (playbook §4.1) from 02's pure layout function and 06's pipelines;
every bad layout stops with the earlier folders' messages before any process group exists.

Planner: (a) the published anchors (ZeRO's 7.5B example, the Korthikanti activations of
GPT-3, the bubble table for p = 8) and the E6 identity; (b) what the combined runs really held and sent:
each rank's parameter, gradient and AdamW-state bytes from its tensors (ZeRO-2/3 under pp: the full
gradients beside the measured shards, ZeRO-3 the measured gathered stage beside its shards: held through
the step, as 08 reduces once per step) and its bytes per process group from 02's CommMeter equal the
planner's numbers for its stage, exactly (except the all-to-alls of the MoE layouts,
which follow the routing: the planner assumes balanced routing, 07's tests check the real bytes); for
ZeRO-1, 03's formulas too (AdamW states 2eΨ/N, 1/N of plain DP's; reduce-scatter and all-gather
(N−1)/N·eΨ each; only scalars all-reduced over dp).
"""
import dataclasses
import functools
import io
import json
import os
import shutil
import tempfile
import weakref
from contextlib import contextmanager, redirect_stdout
from importlib import import_module

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # before kernels/ is imported, here and in the spawned ranks

import common
from harness import layout_results, run_layouts
from test_tensor_parallel import LOSS, PARAMS, shard_like

import model as modeling
import memory
import measured_links
import materialize
import recompute
import schedules
import process_grid
import pipeline
import timeline
import cli
import layout_5d as layout_rules
import plan_arithmetic
import planner
import experts
import build
import context_parallel
import moe
combined = import_module("08_5d_combined.train")

STEPS = 2
GROUPS = {"tp": {"tp"}, "cp": {"cp"},
          "pp": {"pp", "pp_F", "pp_B", "pp_F_wrap", "pp_B_wrap", "pp_F_return", "pp_B_return"},
          "dp": {"cp_dp", "dp", "expert_dp"}, "ep": {"ep"}}


NORMS = dict(rtol=5e-5, atol=0)


FLOAT64 = (dict(rtol=1e-10, atol=0), dict(rtol=1e-10, atol=0), dict(rtol=0, atol=1e-8))


# Triton's CPU interpreter runs each kernel program in Python (~20 ms for one RMSNorm row): the Triton
# layouts train on 8-token windows of synthetic tokens, a quarter of the rows of the others' 32, and on
# 2 layers, one per stage: what they add is the kernels under a layout, not a deeper stage
SHORT = ("--seq-len", 8, "--dataset", "synthetic", "--num-layers", 2)


def _flags(*extra, mbs=2, grad_acc=2, dtype="float32"):
    tolerance = FLOAT64 if dtype == "float64" else (LOSS, NORMS, PARAMS)
    if "triton" in extra:
        tolerance = (dict(rtol=0, atol=1e-4), dict(rtol=0, atol=1e-4), dict(rtol=0, atol=1e-3))
    return (list(map(str, extra)), mbs, grad_acc, dtype, tolerance)


@process_grid.keep_groups()   # until the measures are taken: _checkpoint_peaks steps the pipeline again
def _train(flag_set):
    """On every rank: 08's run() for one flag set; losses, norms, its parameters, its measured bytes."""
    extra, mbs, grad_acc, dtype, _ = flag_set
    if "--resume" in extra:   # from step 1 of the run before: its last checkpoint (step 2) is removed
        if torch.distributed.get_rank() == 0:
            checkpoint_dir = extra[extra.index("--checkpoint-dir") + 1]
            shutil.rmtree(os.path.join(checkpoint_dir, f"step_{STEPS:06d}"))
        torch.distributed.barrier()
    logged, log_dropped = [], experts.log_dropped                  # the dropped rows 08 logs (MoE, capacity)
    experts.log_dropped = lambda *args: logged.append(log_dropped(*args)) or logged[-1]
    try:
        with _values_held() as built:
            records, stages, pipe, everyone = combined.main(
                common.argv(*extra, steps=STEPS, mbs=mbs, grad_acc=grad_acc, dtype=dtype))
    finally:
        experts.log_dropped = log_dropped
    zeros = getattr(pipe.grad_sync, "zeros", [])
    units = [u for z in zeros for u in z.units]
    # ZeRO-3's full units still allocated when the run is over (before full_state_dict gathers them)
    resident = memory.held_bytes(u.full for z in zeros if z.stage == 3 for u in z.units)
    mine = everyone[torch.distributed.get_rank()]
    sent = {dim: sum(wire for (_, group), (_, _, wire) in mine["comm"].items() if group in groups)
            for dim, groups in GROUPS.items()}
    return dict(losses=[r["loss"] for r in records], norms=[r["grad_norm"] for r in records],
                eval_losses=[r.get("eval_loss") for r in records], dropped=logged,
                coords=mine["coords"], states=mine["states"], sent=sent, comm=mine["comm"],
                events=list(pipe.grad_sync.events), gathered=mine["gathered"], built=built["peak"],
                resident=resident,
                unit=max((u.padded * u.full.element_size() for u in units), default=0),   # the largest
                shard_grads=memory.held_bytes(u.shard_grad for u in units),        # ZeRO-2/3's (U/N,) each
                state={pipeline.single_device_name(k): v.numpy()   # numpy: pickled by value; ZeRO-3 gathers
                       for k, v in pipe.grad_sync.full_state_dict(stages).items()},
                checkpoints=_checkpoint_peaks(extra, stages, pipe, mbs, grad_acc))


@contextmanager
def _values_held():
    """While building (and training): the most bytes of parameter values that 01's Source.values returned
    (each one parameter's block at its full size: every rank's parameters get their values through it)
    held alive at once, in `peak`; a value counts until its storage is freed."""
    held, values = dict(live=0, peak=0), materialize.Source.values

    def freed(nbytes):
        held["live"] -= nbytes

    def counted(source, p):
        out = values(source, p)
        storage = out.untyped_storage()
        held["live"] += storage.nbytes()
        held["peak"] = max(held["peak"], held["live"])
        weakref.finalize(storage, freed, storage.nbytes())
        return out
    materialize.Source.values = counted
    try:
        yield held
    finally:
        materialize.Source.values = values


def _checkpoint_peaks(extra, stages, pipe, mbs, grad_acc):
    """Under P_a (after the run's state is taken): the saved-for-backward peaks of one more schedule step,
    with P_a's checkpoints and then with 01's on the same layers, and the most chunk micro-batches that
    were between their F and their B (or I) in that step's passes (the checkpoints held at once)."""
    if "--partition-activations" not in extra:
        return None
    ids = torch.randint(0, 257, (grad_acc, mbs, common.SEQ_LEN + 1),
                        generator=torch.Generator().manual_seed(0))
    positions = pipe.stages[0].position_ids                        # (T/cp,)
    micro_batches = [(x[:, :-1][:, positions], x[:, 1:][:, positions]) for x in ids]   # (mbs, T/cp) each
    step, peaks = schedules.SCHEDULE_STEPS[extra[extra.index("--pp-schedule") + 1]], []
    for plain in (False, True):
        if plain:
            for stage in stages:
                for layer in stage.model.layers.values():
                    layer.forward = recompute.checkpointed(layer.forward.__wrapped__)
        with memory.saved_activation_bytes(exclude=stages.parameters()) as saved:
            step(pipe, micro_batches)
        peaks.append(saved.peak)
    held = most = 0
    for event in pipe.events:                                      # this rank's passes, in the order they ran
        held += {"F": 1, "B": -1, "I": -1}.get(event.op, 0)
        most = max(most, held)
    return peaks, most


@functools.cache
def _single_device(folder, argv):
    """(records, final state, logged rows dropped over capacity) of 01's or 07's single-device run for
    argv: 31 layouts need 13 different ones."""
    trainer, dropped = import_module(f"{folder}.train"), []
    log_dropped = getattr(trainer, "log_dropped", None)          # 07's: the rows dropped over capacity
    if log_dropped:
        trainer.log_dropped = lambda *args: dropped.append(log_dropped(*args))
    try:
        records, model = trainer.main(list(argv))[:2]
    finally:
        if log_dropped:
            trainer.log_dropped = log_dropped
    return records, {k: v.detach().clone() for k, v in model.state_dict().items()}, dropped


def _check(flag_set, per_rank):
    """One flag set's runs on every rank against 01 (07 with experts) and against the planner."""
    extra, mbs, grad_acc, dtype, (loss_tol, norm_tol, param_tol) = flag_set
    precision = {"float32": "fp32", "float64": "fp64"}[dtype]
    args = cli.parse_args(planner.build_parser(), common.argv(*extra, "--precision", precision),
                          files=False)   # the planner's view: the checkpoints are not read
    # the reference reads the same windows with the same depth: a layout's own --seq-len, --dataset and
    # --num-layers (the Triton layouts')
    data = [f for flag in ("--seq-len", "--dataset", "--num-layers") if flag in extra
            for f in extra[extra.index(flag):][:2]]
    layout, config = planner.layout_of(args), cli.model_config(args, 257)   # the byte tokenizer's vocabulary
    if layout.num_experts:   # 07's single-device MoE (a world of one: RANK is not set here)
        capacity = extra[extra.index("--capacity-factor"):][:2] if "--capacity-factor" in extra else []
        records, ref_state, ref_dropped = _single_device("07_expert_parallel", tuple(common.argv(
            "--num-experts", layout.num_experts, *capacity, *data, steps=STEPS, mbs=mbs * layout.dp,
            grad_acc=grad_acc, dtype=dtype)))
    else:
        evaluation = extra[extra.index("--eval-every"):][:4] if "--eval-every" in extra else []
        # the model's own flag (tp > kv heads: 04's replicas), which 01 takes too
        kv_heads = extra[extra.index("--num-kv-heads"):][:2] if "--num-kv-heads" in extra else []
        records, ref_state, ref_dropped = _single_device("01_single_gpu", tuple(common.argv(
            *evaluation, *kv_heads, *data, steps=STEPS, mbs=mbs * layout.dp, grad_acc=grad_acc, dtype=dtype)))
        for rank, run in enumerate(per_rank if evaluation else []):   # the same held-out batches everywhere
            torch.testing.assert_close(run["eval_losses"], [r["eval_loss"] for r in records], **loss_tol,
                                       msg=f"{extra} rank {rank}")
    ref_losses, ref_norms = [r["loss"] for r in records], [r["grad_norm"] for r in records]
    covered = set()
    for rank, run in enumerate(per_rank):
        what = f"{' '.join(extra)}, rank {rank}"
        steps = len(run["losses"])                         # the last `steps` of 01's (1 after --resume)
        assert steps == (1 if "--resume" in extra else STEPS), what
        assert run["dropped"] == ref_dropped, what       # the whole model's, on every rank: 07's number
        torch.testing.assert_close(run["losses"], ref_losses[-steps:], **loss_tol, msg=what)
        torch.testing.assert_close(run["norms"], ref_norms[-steps:], **norm_tol, msg=what)
        _, pp_rank, _, tp_rank = run["coords"]
        for name, local in run["state"].items():
            local = torch.from_numpy(local)
            torch.testing.assert_close(local, shard_like(ref_state[name], local, tp_rank, layout.tp),
                                       **param_tol, msg=lambda m: f"{what} {name}: {m}")
            covered.add(name)
        # an evaluation (the last thing a run with --eval-every does) releases what ZeRO-3's forwards gathered
        assert run["resident"] == 0, (what, run["resident"])
        # --- (b) the planner's bytes for this rank's stage, against its tensors and the meter ---
        planned = plan_arithmetic.stage_memory(config, layout, args.seq_len, mbs, grad_acc, pp_rank)
        params, grads, optimizer = run["states"]       # after the step: ZeRO-3's full units are freed
        if layout.pp > 1 and layout.zero_stage == 3:    # its peak: the shards and the stage gathered
            params += run["gathered"]
        # full-size gradients (every parameter's, held until the chunk's last B/W), and ZeRO-2/3's shards
        grads += run["shard_grads"] if layout.pp > 1 else 0
        assert (params, grads, optimizer) == (planned["parameters"], planned["gradients"],
                                              planned["optimizer"]), what
        # under a schedule 08's ZeRO-2/3 reduce once per step and stage 3 gathers once (gradient_sync.py)
        sent = plan_arithmetic.stage_communication(config, layout, args.seq_len, mbs, grad_acc, pp_rank)
        # all-to-all bytes follow the routing; the planner's are for balanced routing (07 tests the real ones)
        exact = [dim for dim in GROUPS if not (dim == "ep" and layout.num_experts)]
        assert {d: run["sent"][d] for d in exact} == {d: steps * sent[d] for d in exact}, what
        if layout.zero_stage:
            _check_zero1(run, layout, config, mbs, grad_acc, pp_rank,
                         plan_arithmetic.STATE_BYTES[precision][1], steps, what)
        if layout.zero_stage > 1 or "overlap" in extra or "bucket" in extra:
            whole = plan_arithmetic.stage_memory(config, dataclasses.replace(layout, zero_stage=0),
                                                 args.seq_len, mbs, grad_acc, pp_rank)["parameters"]
            _check_in_backward(run, layout, extra, whole, what)
    assert covered == ref_state.keys(), f"{extra}: the stages do not cover the model exactly once"
    if "--partition-activations" in extra:
        _check_partitioned_checkpoints(per_rank, layout, config, mbs)
    if "--json-log" in extra:   # the global batch's loss, from rank 0 (a first-stage rank)
        logged = [json.loads(line)["loss"] for line in open(extra[extra.index("--json-log") + 1])]
        torch.testing.assert_close(logged, ref_losses, **loss_tol)


def _check_partitioned_checkpoints(per_rank, layout, config, mbs):
    """04's P_a under a pipeline: a chunk micro-batch holds L_c = L/(pp·V) layer inputs of (mbs, T/cp, C)
    replicated over tp, of which P_a keeps (mbs, T/cp, C/tp). At the saved-for-backward peak of a step a
    rank holds `most` of them (counted from its passes), so the peak with 01's checkpoints exceeds P_a's by
    exactly most·L_c·mbs·(T/cp)·C·4·(1 − 1/tp) bytes, in every schedule (the I of ZB-H1, ZB-V and
    DualPipeV reruns the layer, and its all-gather, as a whole backward does)."""
    layers = config.num_hidden_layers // (layout.pp * layout.chunks)
    checkpoint = mbs * common.SEQ_LEN // layout.cp * config.hidden_size * 4
    for rank, run in enumerate(per_rank):
        (partitioned, plain), most = run["checkpoints"]
        saved = most * layers * checkpoint * (layout.tp - 1) // layout.tp
        assert most > 0 and plain - partitioned == saved, (rank, plain, partitioned, most)


def _check_zero1(run, layout, config, mbs, grad_acc, pp_rank, e, steps, what):
    """ZeRO-1 (03's formulas on 08's grid, e bytes per element): the AdamW states are 2eΨ/N, N = cp·dp (N/ep
    for the experts): 1/N of plain DP's; in the dp groups, reduce-scatter and all-gather each move (N−1)/N of
    this rank's parameter bytes (nothing is padded at these sizes) and the all-reduces only scalars: the
    logged loss (float64) and the norm squares (two, and the experts' one)."""
    n = layout.dp * layout.cp
    n_expert = n // layout.ep
    dense, expert = plan_arithmetic.stage_parameters(config, layout, pp_rank)
    assert run["states"][2] == 2 * e * (dense // n + expert // n_expert), what
    if not expert:
        plain_dp = plan_arithmetic.stage_memory(config, dataclasses.replace(layout, zero_stage=0),
                                                common.SEQ_LEN, mbs, grad_acc, pp_rank)["optimizer"]
        assert run["states"][2] * n == plain_dp, what
    wire = {key: w for key, (_, _, w) in run["comm"].items()}
    for op in ("reduce_scatter", "all_gather"):
        assert wire[(op, "cp_dp")] == steps * (n - 1) * dense * e // n, (what, op)
        assert wire.get((op, "expert_dp"), 0) == steps * (n_expert - 1) * expert * e // n_expert, (what, op)
    scalars = wire[("all_reduce", "cp_dp")] + wire.get(("all_reduce", "dp"), 0)
    assert scalars == steps * 2 * (n - 1) * (8 + 2 * e) // n, what
    assert (wire.get(("all_reduce", "expert_dp"), 0)
            == (expert > 0) * steps * 2 * (n_expert - 1) * e // n_expert), what


def _check_in_backward(run, layout, extra, whole, what):
    """Composed under a schedule (gradient_sync.py), the reduction really runs inside the schedule: every
    dense gradient (overlap), bucket (bucket) or unit (ZeRO-2/3) is sent from a hook in its chunk's last
    B or W, none left for finish_gradients (a sync on every pass or none differs from 01, a sync before
    the last pass loses gradients); ZeRO-3 holds its whole stage gathered at its peak: the units stay
    from a chunk's first forward to its last backward. But while building, before any gather, a ZeRO-3
    rank held at most one unit's values at full size (03's flat units drawn from meta parameters, one
    parameter at a time): less than its stage, which it never materialises whole."""
    events = run["events"]
    finish = events.index(("finish", None))
    sent = "launch" if "overlap" in extra or "bucket" in extra else "reduce_scatter"
    before, after = ([e for e in part if e[0] == sent] for part in (events[:finish], events[finish:]))
    assert before and not after, (what, events)
    if "overlap" in extra:        # one all-reduce per parameter of the stage
        assert len(before) == sum(1 for e in events if e[0] == "grad"), what
    if layout.zero_stage == 3:
        assert run["gathered"] == whole, what        # the stage's parameter bytes (no padding at these sizes)
        # while building, a rank held its shards and at most one unit's values at full size, never its stage
        assert 0 < run["built"] <= run["unit"] < whole, (what, run["built"], run["unit"], whole)


JSON_LOG = os.path.join(tempfile.mkdtemp(prefix="test_5d_"), "dp2_tp2_pp2.jsonl")    # rank 0 writes it
ZERO1_CHECKPOINTS = os.path.join(os.path.dirname(JSON_LOG), "zero1")
ZERO3_CHECKPOINTS = os.path.join(os.path.dirname(JSON_LOG), "zero3")
EIGHT_RANKS = {
    "dp2-tp2-pp2-1f1b-eval-pa": _flags("--dp", 2, "--tp", 2, "--pp", 2, "--pp-schedule", "1f1b", "--json-log",
                                       JSON_LOG, "--eval-every", 1, "--eval-batches", 1,
                                       "--recompute", "full", "--partition-activations"),
    "tp2sp-cp2zigzag-pp2-zbh1": _flags("--tp", 2, "--sp", "--cp", 2, "--cp-layout", "zigzag", "--pp", 2,
                                       "--pp-schedule", "zb-h1", mbs=4),
    "tp2sp-cp2zigzag-pp2-interleaved-eval": _flags("--tp", 2, "--sp", "--cp", 2, "--cp-layout", "zigzag",
                                                   "--pp", 2, "--pp-schedule", "interleaved",
                                                   "--pp-chunks", 2,
                                                   "--eval-every", 1, "--eval-batches", 1, mbs=4),
    "dp2ep2-tp2-pp2-moe-capacity": _flags("--dp", 2, "--ep", 2, "--tp", 2, "--pp", 2, "--num-experts", 4,
                                          "--capacity-factor", 1, "--recompute", "full"),
    "zero1-dp2-tp2sp-pp2-zbh1": _flags("--dp", 2, "--tp", 2, "--sp", "--pp", 2, "--pp-schedule", "zb-h1",
                                       "--zero-stage", 1),
    "zero3-dp2-tp2sp-kv1-pp2-checkpoints": _flags("--dp", 2, "--tp", 2, "--sp", "--num-kv-heads", 1,
                                                  "--pp", 2, "--zero-stage", 3, "--checkpoint-dir",
                                                  ZERO3_CHECKPOINTS, "--checkpoint-every", 1, grad_acc=4),
    "zero2-dp2-tp2sp-kv1-pp2-resumed": _flags("--dp", 2, "--tp", 2, "--sp", "--num-kv-heads", 1, "--pp", 2,
                                              "--zero-stage", 2, "--checkpoint-dir", ZERO3_CHECKPOINTS,
                                              "--resume", grad_acc=4)}
FOUR_RANKS = {
    "cp2contiguous-pp2-selective-fp64": _flags("--cp", 2, "--cp-layout", "contiguous", "--pp", 2,
                                               "--recompute", "selective",
                                               mbs=4, grad_acc=3, dtype="float64"),
    "cp2ulysses-pp2-afab": _flags("--cp", 2, "--cp-attn", "ulysses", "--attn", "eager", "--pp", 2,
                                  "--pp-schedule", "afab", mbs=4),
    "tp2sp-pp2-triton": _flags("--tp", 2, "--sp", "--pp", 2, "--kernels", "triton", "--attn", "triton",
                               *SHORT, mbs=1),
    "dp2ep2-pp2-zbh1-moe-capacity": _flags("--dp", 2, "--ep", 2, "--pp", 2, "--pp-schedule", "zb-h1",
                                           "--num-experts", 4, "--capacity-factor", 1),
    "cp2zigzag-pp2-full-moe": _flags("--cp", 2, "--cp-layout", "zigzag", "--pp", 2, "--num-experts", 4,
                                     "--recompute", "full"),
    "cp2allgather-dp2ep2-moe": _flags("--cp", 2, "--cp-attn", "allgather", "--dp", 2, "--ep", 2,
                                      "--num-experts", 4),
    "zero1-cp2-dp2-checkpoints": _flags("--cp", 2, "--dp", 2, "--zero-stage", 1, "--checkpoint-dir",
                                        ZERO1_CHECKPOINTS, "--checkpoint-every", 1, mbs=2, grad_acc=2),
    "zero1-cp2-dp2-resumed": _flags("--cp", 2, "--dp", 2, "--zero-stage", 1, "--checkpoint-dir",
                                    ZERO1_CHECKPOINTS, "--resume", mbs=2, grad_acc=2),
    "tp2-pp2-dualpipev-pa": _flags("--tp", 2, "--pp", 2, "--pp-schedule", "dualpipev", "--pp-chunks", 2,
                                   "--recompute", "full", "--partition-activations", grad_acc=4),
    "tp2-pp2-zbv-pa": _flags("--tp", 2, "--pp", 2, "--pp-schedule", "zb-v", "--pp-chunks", 2, "--recompute",
                             "full", "--partition-activations", grad_acc=4),
    "tp2-pp2-zbh1-pa": _flags("--tp", 2, "--pp", 2, "--pp-schedule", "zb-h1", "--recompute", "full",
                              "--partition-activations", grad_acc=4),
    "tp2-pp2-interleaved-pa": _flags("--tp", 2, "--pp", 2, "--pp-schedule", "interleaved", "--pp-chunks", 2,
                                     "--recompute", "full", "--partition-activations", grad_acc=4),
    "tp2-pp2-afab-pa": _flags("--tp", 2, "--pp", 2, "--pp-schedule", "afab", "--recompute", "full",
                              "--partition-activations", grad_acc=2),
    "zero1-dp2-pp2-interleaved": _flags("--dp", 2, "--pp", 2, "--pp-schedule", "interleaved",
                                        "--pp-chunks", 2, "--zero-stage", 1, grad_acc=4),
    "zero1-dp4ep2-moe": _flags("--dp", 4, "--ep", 2, "--num-experts", 4, "--zero-stage", 1, mbs=1),
    "zero1-cp2contiguous-dp2ep2-moe": _flags("--cp", 2, "--cp-layout", "contiguous", "--dp", 2, "--ep", 2,
                                             "--num-experts", 4, "--zero-stage", 1),
    "overlap-dp2-pp2-zbh1": _flags("--dp", 2, "--pp", 2, "--pp-schedule", "zb-h1", "--dp-mode", "overlap",
                                   grad_acc=4),
    "bucket-dp2-pp2-interleaved": _flags("--dp", 2, "--pp", 2, "--pp-schedule", "interleaved",
                                         "--pp-chunks", 2, "--dp-mode", "bucket", "--bucket-mb", 0.02,
                                         grad_acc=4),
    "zero2-dp2-pp2-zbh1": _flags("--dp", 2, "--pp", 2, "--pp-schedule", "zb-h1", "--zero-stage", 2,
                                 grad_acc=4),
    "zero2-dp2-pp2-dualpipev": _flags("--dp", 2, "--pp", 2, "--pp-schedule", "dualpipev", "--pp-chunks", 2,
                                      "--zero-stage", 2, grad_acc=4),
    "zero3-dp2-pp2-interleaved-eval": _flags("--dp", 2, "--pp", 2, "--pp-schedule", "interleaved",
                                             "--pp-chunks", 2, "--zero-stage", 3, "--eval-every", 1,
                                             "--eval-batches", 1, grad_acc=4),
    "zero3-dp2-pp2-triton": _flags("--dp", 2, "--pp", 2, "--kernels", "triton", *SHORT,
                                   "--zero-stage", 3, mbs=1),
    "zero2-dp2-pp2-triton": _flags("--dp", 2, "--pp", 2, "--kernels", "triton", *SHORT,
                                   "--zero-stage", 2, mbs=1),
    "zero3-dp2ep2-pp2-zbh1-moe": _flags("--dp", 2, "--ep", 2, "--pp", 2, "--pp-schedule", "zb-h1",
                                        "--num-experts", 4, "--zero-stage", 3)}


@pytest.fixture(scope="module")
def eight_ranks():
    """One spawn of 8 ranks runs every layout of EIGHT_RANKS in turn (a spawn costs seconds; a layout
    that raises on the ranks is named by the harness, and the next ones still run unless a rank may be
    blocked in a collective with the failed one: run_layouts says when)."""
    return run_layouts(_train, EIGHT_RANKS, 8, timeout=280)


@pytest.fixture(scope="module")
def four_ranks():
    """One spawn of 4 ranks for FOUR_RANKS, as eight_ranks. zero1-cp2-dp2-resumed resumes from the
    checkpoints zero1-cp2-dp2-checkpoints wrote: if that one failed, this one fails too."""
    return run_layouts(_train, FOUR_RANKS, 4, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout_id", EIGHT_RANKS)
def test_eight_rank_layouts_match_single_device_and_planner(eight_ranks, layout_id):
    _check(EIGHT_RANKS[layout_id], layout_results(eight_ranks, layout_id))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout_id", FOUR_RANKS)
def test_four_rank_layouts_match_single_device_and_planner(four_ranks, layout_id):
    _check(FOUR_RANKS[layout_id], layout_results(four_ranks, layout_id))


# ======================================================================================
# The grid and the errors, without processes
# ======================================================================================
def _grid(world, rank, dp=1, pp=1, cp=1, tp=1, ep=1):
    """A ProcessGrid without processes: the coordinates of `rank` in arange(world).view(dp, pp, cp, tp),
    and a distinct stand-in for each group (a transform only stores them on shapes)."""
    coords = process_grid.grid_layout(world, dp, pp, cp, tp, ep)
    d, p, c, t = (int(i) for i in (coords == rank).nonzero()[0])
    groups = {f"{name}_group": object() for name in ("dp", "pp", "cp", "tp", "cp_dp", "ep", "expert_dp")}
    return process_grid.ProcessGrid(world, rank, dp, pp, cp, tp, ep, d, p, c, t, d % ep, **groups,
                                    pp_ranks=tuple(int(r) for r in coords[d, :, c, t]))


@pytest.mark.parametrize("flags, world, rank", [
    (("--tp", 2, "--cp", 2, "--pp", 2, "--recompute", "selective"), 8, 7),
    (("--dp", 2, "--cp", 2, "--ep", 2, "--pp", 2, "--num-experts", 4, "--recompute", "full"), 8, 7),
    (("--tp", 2, "--pp", 2, "--pp-schedule", "interleaved", "--pp-chunks", 2, "--recompute", "full",
      "--partition-activations"), 4, 2)],
    ids=["tp2-cp2-pp2-selective", "dp2ep2-cp2-pp2-moe-full", "tp2-pp2x2-pa"])
def test_parallelize_composes_every_folders_transform_on_shapes(monkeypatch, flags, world, rank):
    """08's composition on the meta model, without processes (exercise 08.4): the last rank's stage chunks
    hold its pipeline stage's layers (06's blocks, interleaved too), each sliced 1/tp (04: q and the MLP's
    rows), its attention core the ring (05) with this rank's RoPE positions (05's layout) on the stage, the
    MLP a MoE block keeping E/ep experts whose load statistics sum over cp (07), and --recompute wrapping
    what the stage holds after all that (01: the ring's core, selective; the layer, full; 04's P_a)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args, config, _ = cli.setup(layout_rules.build_parser("t"), common.argv(*flags, grad_acc=2),
                                layout_rules.check_layout)
    grid = _grid(world, rank, dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp, ep=args.ep)
    full = build.build_model(args, config)
    dense = build.build_model(args, config)                              # the same shapes, untouched
    stages = layout_rules.parallelize(full, args, grid, torch.device("cpu"))
    blocks = pipeline.layer_blocks(config.num_hidden_layers, args.pp, args.pp_chunks, grid.pp_rank)
    assert [list(stage.model.layers) for stage in stages] == [[str(i) for i in b] for b in blocks]
    layout = context_parallel.CPLayout(args.cp_layout, args.cp)
    positions = layout.positions(grid.cp_rank, args.seq_len, torch.device("cpu"))      # (T/cp,)
    for stage in stages:
        assert torch.equal(stage.position_ids, positions)
        for index, layer in stage.model.layers.items():
            twin = dense.model.layers[int(index)]
            rows = layer.self_attn.q_proj.weight.shape[0]                  # (nh·hd/tp, C)
            assert rows * args.tp == twin.self_attn.q_proj.weight.shape[0], f"layer {index}: q_proj"
            core = layer.self_attn.attn_fn
            if args.recompute == "selective":
                assert hasattr(core, "__wrapped__"), f"layer {index}: the attention core is not recomputed"
                core = core.__wrapped__
            assert isinstance(core, context_parallel.RingAttention) == (args.cp > 1), f"layer {index}: {core}"
            assert ("forward" in vars(layer)) == (args.recompute == "full"), f"layer {index}: recompute"
            if args.num_experts:
                assert isinstance(layer.mlp, moe.MoE) and layer.mlp.stats_group is grid.cp_group
                kept = layer.mlp.experts.gate_proj.shape[0]                # (E/ep, F, C)
                assert kept * args.ep == args.num_experts, f"layer {index}: experts"
            else:
                assert layer.mlp.gate_proj.weight.shape[0] * args.tp == twin.mlp.gate_proj.weight.shape[0]


def test_llama3_sixteen_rank_groups():
    """[PB] §4.1, Llama 3 Fig. 5: 16 GPUs, every degree 2: GPU 0 shares TP with 1, CP with 2, PP with 4,
    DP with 8 (02's grid, the groups build_process_grid creates, and 06's pipelines for p2p)."""
    grid = process_grid.grid_layout(16, dp=2, pp=2, cp=2, tp=2)
    groups = {name: process_grid._groups_along(grid, dims) for name, dims in
              (("dp", (0,)), ("pp", (1,)), ("cp", (2,)), ("tp", (3,)), ("cp_dp", (0, 2)))}
    assert ([0, 1] in groups["tp"] and [0, 2] in groups["cp"] and [0, 4] in groups["pp"]
            and [0, 8] in groups["dp"])
    assert [0, 2, 8, 10] in groups["cp_dp"]           # the ranks whose dense gradients are averaged
    for name, lists in groups.items():                # each dimension partitions the 16 ranks
        assert sorted(r for ranks in lists for r in ranks) == list(range(16)), name
    pipelines = grid.permute(0, 2, 3, 1).reshape(-1, 2).tolist()     # what pipeline.direction_groups builds
    assert sorted(pipelines) == sorted(groups["pp"])
    assert measured_links.bandwidths(plan_arithmetic.Layout(dp=2, pp=2, cp=2, tp=2), 8, "intra", "inter") == \
        dict(tp="intra", cp="intra", pp="intra", dp="inter", zero3="inter", ep="intra")   # only dp crosses


def _check_layout(*flags, world):
    args = cli.parse_args(layout_rules.build_parser("test"), common.argv(*flags))
    os.environ["WORLD_SIZE"] = str(world)
    try:
        layout_rules.check_layout(args, cli.model_config(args, 257))
    finally:
        del os.environ["WORLD_SIZE"]


@pytest.mark.parametrize("flags, world, message", [
    (("--dp", 2, "--tp", 2, "--pp", 2), 4, r"dp·pp·cp·tp = 2·2·1·2 = 8 does not equal the world size 4"),
    (("--pp", 3), 3, r"pp·pp-chunks = 3·1 = 3 does not divide num_layers=4"),
    (("--pp", 2, "--pp-schedule", "interleaved", "--pp-chunks", 2, "--grad-acc", 3), 2,
     r"multiple of pp=2, got 3"),
    (("--pp", 2, "--tie-embeddings"), 2, r"--tie-embeddings with --pp > 1"),
    (("--tp", 3, "--pp", 2), 6, r"tp=3 does not divide num_attention_heads=4"),
    (("--tp", 2, "--pp", 2, "--hidden-size", 48, "--num-heads", 6, "--num-kv-heads", 3), 4,
     r"tp=2 and num_key_value_heads=3: .*one must divide the other"),
    (("--sp", "--pp", 2), 2, r"--sp .* needs --tp 2 or more"),
    (("--cp", 4, "--seq-len", 36, "--pp", 2), 8, r"seq_len=36 is not divisible by 8 \(2·cp chunks"),
    (("--tp", 2, "--sp", "--cp", 4, "--cp-layout", "contiguous", "--seq-len", 12, "--pp", 2), 16,
     r"tp=2 does not divide the sequence each rank holds \(3 tokens"),
    (("--cp", 2, "--attn", "triton", "--pp", 2), 4, r"--cp-attn ring .* --attn triton would be ignored"),
    (("--tp", 2, "--sp", "--recompute", "full", "--partition-activations"), 2,
     r"--partition-activations with --sp"),
    (("--dp", 2, "--ep", 2), 2, r"--ep 2 splits experts: it needs --num-experts"),
    (("--dp", 3, "--ep", 3, "--num-experts", 4), 3, r"ep=3 does not divide num_experts=4"),
    (("--dp", 2, "--ep", 4, "--num-experts", 4), 2, r"ep=4 does not divide dp=2"),
    (("--tp", 2, "--sp", "--num-experts", 4), 2, r"--num-experts with --sp is not supported: .* drop --sp"),
    (("--tp", 2, "--sp", "--cp", 2, "--num-experts", 4), 4, r"--num-experts with --sp is not supported"),
    (("--cp", 2, "--num-experts", 4, "--capacity-factor", 1), 2,
     r"--capacity-factor with --cp > 1 is not supported"),
    (("--dp", 2, "--pp", 2, "--zero-stage", 2, "--dp-mode", "bucket"), 4,
     r"--dp-mode bucket is data parallelism's all-reduce \(--zero-stage 0\); .* drop --dp-mode"),
    (("--dp", 2, "--zero-stage", 3, "--tie-embeddings"), 2,
     r"--zero-stage 3 gathers .* drop --tie-embeddings"),
    (("--dp", 2, "--dp-mode", "bucket", "--bucket-mb", 0), 2, r"--bucket-mb must be positive"),
])
def test_bad_layouts_fail_before_any_process_group(flags, world, message):
    with pytest.raises(ValueError, match=message):
        _check_layout(*flags, world=world)


def test_upcycling_under_tp_fails_before_any_process_group(tmp_path):
    """--init-from a dense checkpoint copies its MLPs into the experts, which TP would already have split."""
    import hf_io
    args = cli.parse_args(layout_rules.build_parser("test"), common.argv())
    import build
    hf_io.save_hf(build.materialize(build.build_model(args, cli.model_config(args, 257)), args), tmp_path)
    with pytest.raises(ValueError,
                       match=r"--init-from with --num-experts and --tp > 1: .* upcycle with --tp 1"):
        _check_layout("--tp", 2, "--num-experts", 4, "--init-from", tmp_path, world=2)


def test_experts_with_context_parallelism_are_accepted():
    _check_layout("--cp", 2, "--num-experts", 4, world=2)                 # no longer refused
    _check_layout("--cp", 2, "--dp", 2, "--ep", 2, "--tp", 2, "--num-experts", 4, world=8)


def test_main_exits_with_the_message_and_no_process_group(capsys):
    with pytest.raises(SystemExit):
        combined.main(common.argv("--dp", 2, "--tp", 2, "--pp", 2))       # world size 1 here
    assert "does not equal the world size 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        planner.main(common.argv("--tp", 3))                               # the planner uses the same rules
    assert "tp=3 does not divide num_attention_heads=4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        combined.main(common.argv("--zero-stage", 2, "--dp-mode", "overlap"))   # ZeRO reduces its own units
    assert "drop --dp-mode" in capsys.readouterr().err
    planner.main(common.argv("--dp", 2, "--zero-stage", 3))                # the planner plans every stage
    assert "zero-3" in capsys.readouterr().out
    assert not torch.distributed.is_initialized()


# ======================================================================================
# The planner against the published numbers
# ======================================================================================
def test_planner_zero_paper_example():
    """ZeRO §5.1: Ψ = 7.5B, N_d = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB."""
    gb = [sum(plan_arithmetic.model_states(7.5e9, 64, stage)) / 1e9 for stage in range(4)]
    assert gb == pytest.approx([120.0, 31.41, 16.64, 1.875], abs=0.01)
    assert sum(plan_arithmetic.model_states(7.5e9, 64, 0, "fp32")) == 16 * 7.5e9   # 4 + 4 + 8: our fp32


def gpt3_layer_activations(tp=1, sp=False, recompute="none"):
    """One GPT-3 layer (s 2048, h 12288, a 96, b 1) through the planner, in bytes (16-bit)."""
    config = modeling.LlamaConfig(vocab_size=51200, hidden_size=12288, intermediate_size=4 * 12288,
                                  num_hidden_layers=1, num_attention_heads=96, num_key_value_heads=96)
    layout = plan_arithmetic.Layout(tp=tp, sp=sp, recompute=recompute, precision="mixed")
    return plan_arithmetic.stage_memory(config, layout, seq_len=2048, mbs=1, grad_acc=1,
                                        stage=0)["activations"]


def test_planner_korthikanti_activations():
    """Korthikanti et al. for GPT-3 (s 2048, b 1, h 12288, a 96): sbh(34 + 5as/h) = 2.869 GB; with t = 8:
    TP 579 MB, TP+SP 359 MB, TP+SP+selective 34·sbh/t = 106.95 MB; full recomputation 2sbh = 50.3 MB (the
    GPT-175B talk's "2.86 GB → 106 MB per layer")."""
    assert gpt3_layer_activations() / 1e9 == pytest.approx(2.869, abs=5e-4)
    assert gpt3_layer_activations(tp=8) / 1e6 == pytest.approx(579, abs=0.5)
    assert gpt3_layer_activations(tp=8, sp=True) / 1e6 == pytest.approx(359, abs=0.5)
    assert (gpt3_layer_activations(tp=8, sp=True, recompute="selective") / 1e6
            == pytest.approx(106.95, abs=0.01))
    assert gpt3_layer_activations(recompute="full") / 1e6 == pytest.approx(50.3, abs=0.05)


def test_planner_bubble_table_p8():
    """Megatron-LM §2.2: the bubble (p−1)/(m·v) for p = 8, and the planner prints it."""
    table = {(1, 1): 7.0, (8, 1): 0.875, (8, 2): 0.4375, (16, 1): 0.4375, (32, 1): 0.219, (32, 2): 0.109,
             (32, 4): 0.0547, (64, 1): 0.109}
    for (m, v), bubble in table.items():
        schedule = "interleaved" if v > 1 else "1f1b"
        assert timeline.theory_bubble(schedule, 8, m, v) == pytest.approx(bubble, abs=5e-4), (m, v)
    out = io.StringIO()
    with redirect_stdout(out):
        planner.main(common.argv("--pp", 8, "--num-layers", 16, "--pp-schedule", "interleaved",
                                 "--pp-chunks", 2, "--grad-acc", 32))
    assert "pipeline bubble (interleaved, p=8, m=32, V=2): 10.94% of useful time" in out.getvalue()


def test_planner_overlap_ratios_follow_their_derivations():
    """E6: the DP ratio is t_comm/t_compute with the whole gradient (2Ψe(N−1)/N over bw) against the
    backward of one micro-batch (4·tokens·Ψ FLOPs): Ψ cancels. E9: TP uses the appendix's (t−1)/(2h)."""
    config = modeling.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                  num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4)
    layout = plan_arithmetic.Layout(dp=4, tp=2, pp=2, cp=2, precision="mixed")
    peak, bw = 1e15, dict(dp=5e10, tp=4e11, pp=5e10, cp=4e11)
    ratios = plan_arithmetic.overlap_ratios(config, layout, seq_len=4096, mbs=1, peak_flops=peak, bw=bw)
    psi, n, tokens = 1.0e9, 8, 4096 // 2
    t_comm, t_compute = 2 * psi * 2 * (n - 1) / n / bw["dp"], 4 * tokens * psi / peak
    assert ratios["dp"] == pytest.approx(t_comm / t_compute)
    assert ratios["tp"] == pytest.approx(2 * (2 - 1) / (2 * 2048) * peak / bw["tp"])
    assert ratios["pp"] == pytest.approx(2 * peak / (32 * 2048 * 11 * bw["pp"]))
    out = io.StringIO()
    with redirect_stdout(out):
        planner.main(["--preset", "1b", "--seq-len", "4096", "--mbs", "1", "--grad-acc", "16", "--dp", "64",
                      "--tp", "2", "--gpu-mem", "1", "--peak-tflops", "1000",
                      "--bw-intra", "400", "--bw-inter", "50"])
    text = out.getvalue()
    assert "DOES NOT FIT" in text and "EXPOSED" in text
