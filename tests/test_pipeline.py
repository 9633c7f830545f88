"""06_pipeline: every schedule against the single-device run, and the schedules' own formulas.

Whole-model checks (real gloo ranks; one spawn per world runs several flag sets in sequence, each
checked in its own test):
losses of every step and the final parameters equal 01's for the same global batch
(dp·mbs·grad_acc), for pp 2 and 4, m from p to 2p+1, afab / 1f1b / interleaved (V = 1, 2) / zb-h1,
the V-shaped zb-v (pp 2 with m = 2p − 1 = 3, pp 4 with m 4 < 2p − 1) and dualpipev (pp 2, m 4), and
dp2 × pp2. float32: the pipeline runs the very same operations per micro-batch as 01, but the
gradient norm is summed per stage and then across stages, dp averages are summed in another order and
ZB-H1 computes dW in its own W pass (06's zero_bubble.py), so results differ by float32 rounding (~1e-7
relative); after 2 AdamW steps (whose update ~ lr·g/|g| amplifies rounding for tiny g) parameters
agree to 1e-5 absolute, losses to 1e-6 relative.

Schedule checks on what really ran: peak micro-batches held (m for AFAB, p − rank for 1F1B, p for
ZB-H1, Megatron's warm-up + 1 for interleaved, v_schedules.peak_held V-wise), the timeline is causally
consistent, each rank ran m·V F and m·V B (and m W for ZB-H1; V-wise exactly its schedule's order),
the recorded order replayed with ideal pass times gives exactly the theory bubble (DualPipeV: with its
F&B pairs as units, and (p−1)/(6m) as run, F before B), and the point-to-point bytes equal
m·(2V − [first] − [last])·mbs·T·C·4 (V-wise m·(4 − 2[first] − 2[last]): rank p−1 turns in memory).
"""
from importlib import import_module

import pytest
import torch

import common
import model as modeling
from harness import layout_results, run_layouts

import pipeline
import passes
import schedules
import timeline
import v_schedules

STEPS, MBS = 2, 2
TOLERANCE = {"float32": dict(loss=1e-6, param=1e-5), "float64": dict(loss=1e-12, param=1e-8)}


def _run(flag_set):
    """On every rank: train once for one flag set (the spawn's process group); what the parent checks."""
    train = import_module("06_pipeline.train")
    extra, grad_acc, dtype = flag_set
    records, stages, pipe, events, meter = train.main(
        common.argv(*extra, steps=STEPS, mbs=MBS, grad_acc=grad_acc, dtype=dtype))
    return dict(
        losses=[r["loss"] for r in records], norms=[r["grad_norm"] for r in records], pp_rank=pipe.rank,
        peak_held=pipe.peak_held, events=events, sends=len(pipe.p2p.sent),
        isend_bytes=meter.total_wire("isend"),
        # numpy, not tensors: a tensor crosses the result queue by shared memory, which a finished
        # rank may have released before the parent reads it
        state={pipeline.single_device_name(k): v.detach().numpy().copy()
               for k, v in stages.state_dict().items()})


def _check(flag_set, runs):
    """One flag set's runs (every rank's) against 01 and the schedule's formulas."""
    extra, m, dtype = flag_set
    flags = dict(zip(extra[::2], extra[1::2]))
    p, V, schedule = int(flags["--pp"]), int(flags.get("--pp-chunks", 1)), flags["--pp-schedule"]
    dp = int(flags["--dp"])
    v_shape, pairs = schedule in pipeline.V_SHAPED, schedule == "dualpipev"
    layers = [a for a in extra if a == "--num-layers"] and flags["--num-layers"]
    ref_extra = ["--num-layers", layers] if layers else []
    ref_losses, ref_norms, ref_state = common.single_device_reference(*ref_extra, steps=STEPS, mbs=MBS * dp,
                                                                      grad_acc=m, dtype=dtype)
    tolerance = TOLERANCE[dtype]
    what = f"{schedule} p={p} V={V} m={m} dp={dp}"
    state = {}
    for run in runs:
        assert run["losses"] == pytest.approx(ref_losses, rel=tolerance["loss"]), what
        assert run["norms"] == pytest.approx(ref_norms, rel=tolerance["loss"]), what
        for name, value in run["state"].items():
            torch.testing.assert_close(torch.from_numpy(value), ref_state[name], atol=tolerance["param"],
                                       rtol=0, msg=f"{what}: {name}")
            state[name] = value
        # --- memory: micro-batches whose activations a stage held at its peak ---
        assert run["peak_held"] == schedules.peak_held(schedule, p, run["pp_rank"], m, V), what
        assert run["peak_held"] <= {"afab": m, "1f1b": p - run["pp_rank"], "zb-h1": p, "zb-v": 2 * p,
                                    "dualpipev": 2 * p + 1}.get(schedule, m * V)
        # --- communication: activations forward, gradients backward, mbs·T·C float32 each ---
        first, last = run["pp_rank"] == 0, run["pp_rank"] == p - 1
        if v_shape:       # rank 0 holds the first and the last block; rank p−1 turns the V in memory
            assert run["sends"] == m * (4 - 2 * first - 2 * last), what
        else:
            assert run["sends"] == m * (2 * V - first - last), what
        element = 8 if dtype == "float64" else 4
        assert run["isend_bytes"] == STEPS * run["sends"] * MBS * common.SEQ_LEN * 32 * element, what
    assert state.keys() == ref_state.keys(), f"{what}: the stages do not cover the model exactly once"
    # --- the executed timeline (rank 0's pipeline) ---
    events = runs[0]["events"]
    assert timeline.timeline_violations(events, p, V, v_shape) == [], what
    for rank in range(p):
        ops = [e.op for e in events if e.rank == rank]
        assert (ops.count("F"), ops.count("B")) == (m * V, m * V), f"{what}, rank {rank}"
        if v_shape:       # what ran is the schedule's order (its I is a B whose W runs apart)
            order = v_schedules.ORDERS[schedule](p, rank, m)
            assert [(e.op, e.micro, e.chunk) for e in events if e.rank == rank] == \
                [("B" if op == "I" else op, i, chunk) for op, i, chunk in order], f"{what}, rank {rank}"
        else:
            assert ops.count("W") == (m if schedule == "zb-h1" else 0), f"{what}, rank {rank}"
    replayed = timeline.replayed_bubble(events, p, V, v_shape, pairs)
    assert replayed == pytest.approx(timeline.theory_bubble(schedule, p, m, V), abs=1e-9), what
    if pairs:             # as it ran here, each F before its paired B: the F need not wait, half the idle
        assert timeline.replayed_bubble(events, p, V, v_shape) == pytest.approx((p - 1) / (6 * m), abs=1e-9)
    print(f"{what}: bubble measured {timeline.measured_bubble(events):.0%} (CPU wall clock, noisy), "
          f"replayed {replayed:.1%}, theory {timeline.theory_bubble(schedule, p, m, V):.1%}")


def _flags(pp, schedule, m, chunks=1, layers=None, dp=1, dtype="float32"):
    """(id, flag set): the id names the world, the schedule, V, m and what differs from the defaults."""
    extra = ["--pp", str(pp), "--pp-schedule", schedule, "--pp-chunks", str(chunks), "--dp", str(dp)]
    name = "-".join([f"dp{dp}"] * (dp > 1) + [f"pp{pp}", schedule] + [f"v{chunks}"] * (chunks > 1) + [f"m{m}"]
                    + [f"{layers}layers"] * bool(layers) + ["fp64"] * (dtype == "float64"))
    return name, (extra + (["--num-layers", str(layers)] if layers else []), m, dtype)


PP4 = dict([_flags(4, "afab", 4), _flags(4, "1f1b", 9), _flags(4, "zb-h1", 6),
            _flags(4, "interleaved", 8, chunks=2, layers=8),           # the command of 06's README
            _flags(4, "zb-v", 4, chunks=2, layers=8)])     # V-wise: ranks 1, 2 talk both ways on both legs
PP2 = dict([_flags(2, "afab", 5), _flags(2, "1f1b", 3), _flags(2, "zb-h1", 2),
            _flags(2, "interleaved", 2, chunks=2), _flags(2, "interleaved", 4, chunks=2),
            _flags(2, "zb-v", 3, chunks=2), _flags(2, "dualpipev", 4, chunks=2)])
DP2_PP2 = dict(_flags(2, schedule, m, chunks, dp=2, dtype="float64")
               for schedule, m, chunks in (("1f1b", 3, 1), ("zb-h1", 4, 1), ("interleaved", 2, 2)))


@pytest.fixture(scope="module")
def four_ranks():
    """One spawn of 4 ranks runs PP4's flag sets, then DP2_PP2's, in turn (a spawn costs seconds; the
    harness names a layout that raises on the ranks, and runs the next ones unless a rank may be blocked
    in a collective with the failed one)."""
    return run_layouts(_run, {**PP4, **DP2_PP2}, 4)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One spawn of 2 ranks for PP2, as four_ranks; zb-h1 also draws its timeline (a PNG, --timeline)."""
    picture = tmp_path_factory.mktemp("timeline") / "zb.png"
    flag_sets = {name: (extra + (["--timeline", str(picture)] if "zb-h1" in extra else []), m, dtype)
                 for name, (extra, m, dtype) in PP2.items()}
    return run_layouts(_run, flag_sets, 2), picture


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout_id", PP4)
def test_pp4_every_schedule_matches_single_device(four_ranks, layout_id):
    _check(PP4[layout_id], layout_results(four_ranks, layout_id))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout_id", PP2)
def test_pp2_every_schedule_matches_single_device(two_ranks, layout_id):
    """zb-h1 also draws one timeline: --timeline writes a PNG (matplotlib) of the last step."""
    outcomes, picture = two_ranks
    _check(PP2[layout_id], layout_results(outcomes, layout_id))
    if "zb-h1" in PP2[layout_id][0]:
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout_id", DP2_PP2)
def test_dp2_pp2_matches_single_device(four_ranks, layout_id):
    """Each pipeline reads its half of every micro-batch: 01 runs with mbs·dp. float64: the dp average
    sums the two halves' gradients in another order than 01's one batch, and AdamW's first steps
    (update ≈ lr·g/|g|) turn float32 rounding of near-zero gradients into ~1e-4 parameter differences;
    in float64 the same rounding stays below 1e-9."""
    _check(DP2_PP2[layout_id], layout_results(four_ranks, layout_id))


def test_layer_partition_and_stage_modules():
    """Chunk c of rank r holds block c·p + r (V-wise r and 2p−1−r); embedding on the first block,
    norm/head/loss on the last."""
    assert [list(b) for b in pipeline.layer_blocks(8, 4, 2, 1)] == [[1], [5]]
    assert [list(b) for b in pipeline.layer_blocks(16, 4, 2, 1)] == [[2, 3], [10, 11]]
    assert [list(b) for b in pipeline.layer_blocks(4, 2, 1, 1)] == [[2, 3]]
    config = modeling.LlamaConfig(num_hidden_layers=8, hidden_size=32, intermediate_size=64, vocab_size=64)
    full = modeling.LlamaForCausalLM(config)
    names = []
    for rank in range(4):
        stages = pipeline.build_stages(full, rank, 4, chunks=2)
        assert [s.is_first for s in stages] == [rank == 0, False]
        assert [s.is_last for s in stages] == [False, rank == 3]
        names += [pipeline.single_device_name(n) for n, _ in stages.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())
    # V-wise (zb-v, dualpipev): rank r holds blocks r and 2p−1−r; rank 0 the embedding and the loss
    assert [list(b) for b in pipeline.layer_blocks(8, 4, 2, 1, v_shape=True)] == [[1], [6]]
    assert [pipeline.rank_of_block(b, 4, v_shape=True) for b in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    names = []
    for rank in range(4):
        stages = pipeline.build_stages(full, rank, 4, chunks=2, v_shape=True)
        assert [(s.is_first, s.is_last) for s in stages] == [(rank == 0, False), (False, rank == 0)]
        names += [pipeline.single_device_name(n) for n, _ in stages.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())


def test_schedule_formulas():
    """Theory bubbles and peaks, and the replay of ideal pass orders reproduces them."""
    # erratum E16
    assert timeline.theory_bubble("afab", 4, 8) == timeline.theory_bubble("1f1b", 4, 8) == 3 / 8
    assert timeline.theory_bubble("interleaved", 4, 8, chunks=2) == 3 / 16
    assert timeline.theory_bubble("zb-h1", 4, 8) == 3 / 24
    assert [schedules.peak_held("1f1b", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [schedules.peak_held("zb-h1", 4, r, 8) for r in range(4)] == [4, 4, 4, 4]
    assert schedules.peak_held("afab", 4, 0, 8) == 8
    # Megatron's interleaved order: micro-batches 0..p−1 through chunk 0, then chunk 1, then 4..7 …
    order = [schedules.interleaved_order(k, 4, 2, forward=True) for k in range(16)]
    assert order[:9] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1), (4, 0)]
    assert schedules.interleaved_order(0, 4, 2, forward=False) == (0, 1)


class RecordingPipe:
    """What a schedule sees of `Pipeline` (p, rank, m; begin, forward, backward, finish), recording the order
    of the passes and the micro-batches held instead of running them."""

    def __init__(self, p, rank, chunks=1):
        self.p, self.rank, self.chunks, self.passes, self.held, self.peak_held = p, rank, chunks, [], 0, 0

    def begin(self, micro_batches):
        self.m = len(micro_batches)

    def forward(self, micro, chunk=0):
        self.passes.append(("F", micro) if self.chunks == 1 else ("F", micro, chunk))
        self.held += 1
        self.peak_held = max(self.peak_held, self.held)

    def backward(self, micro, chunk=0):
        self.passes.append(("B", micro) if self.chunks == 1 else ("B", micro, chunk))
        self.held -= 1

    def finish(self):
        return 0.0


@pytest.mark.parametrize("p, m", [(4, 4), (4, 9), (2, 3)])
def test_afab_order_holds_every_micro_batch_and_replays_to_the_theory_bubble(p, m):
    """AFAB's order of passes on every rank, without ranks: every forward before any backward, each
    micro-batch's F and B once, all m micro-batches held at the turn, and the orders of all ranks replayed
    with ideal pass times and the stages' data dependencies to exactly the theory bubble (p−1)/m."""
    events = []
    for rank in range(p):
        pipe = RecordingPipe(p, rank)
        schedules.train_step_afab(pipe, [None] * m)
        assert pipe.passes == [("F", i) for i in range(m)] + [("B", i) for i in range(m)], rank
        assert pipe.peak_held == m == schedules.peak_held("afab", p, rank, m), rank
        events += [passes.Event(rank, op, micro, 0, t, t + 0.5) for t, (op, micro) in enumerate(pipe.passes)]
    assert timeline.replayed_bubble(events, p) == pytest.approx((p - 1) / m, abs=1e-12)


@pytest.mark.parametrize("p, m", [(4, 4), (4, 9), (2, 3)])
def test_1f1b_order_replays_to_the_theory_bubble_holding_p_minus_rank(p, m):
    """1F1B's order of passes on every rank, without ranks: each micro-batch's F and B once, at most
    p − rank micro-batches held (AFAB holds m), and the orders of all ranks replayed with ideal pass times
    and the stages' data dependencies run without deadlock to exactly the theory bubble (p−1)/m."""
    events = []
    for rank in range(p):
        pipe = RecordingPipe(p, rank)
        schedules.train_step_1f1b(pipe, [None] * m)
        assert sorted(pipe.passes) == sorted([(op, i) for op in "FB" for i in range(m)]), rank
        assert pipe.peak_held == min(m, p - rank), rank
        events += [passes.Event(rank, op, micro, 0, t, t + 0.5)          # one pass per time unit
                   for t, (op, micro) in enumerate(pipe.passes)]
    assert timeline.replayed_bubble(events, p) == pytest.approx((p - 1) / m, abs=1e-12)


@pytest.mark.parametrize("p, m, V", [(4, 8, 2), (2, 4, 2), (2, 6, 3)])
def test_interleaved_order_replays_to_the_theory_bubble(p, m, V):
    """The interleaved schedule's order on every rank, without ranks: each (micro-batch, chunk) F and B
    once, Megatron's peak held, and the orders of all ranks replayed with ideal pass times (a chunk's pass
    1/V of a stage's) to exactly the theory bubble (p−1)/(V·m)."""
    events = []
    for rank in range(p):
        pipe = RecordingPipe(p, rank, chunks=V)
        schedules.train_step_interleaved(pipe, [None] * m)
        assert sorted(pipe.passes) == sorted((op, i, c) for op in "FB" for i in range(m) for c in range(V))
        assert pipe.peak_held == schedules.peak_held("interleaved", p, rank, m, V), rank
        events += [passes.Event(rank, op, micro, chunk, t, t + 0.5)
                   for t, (op, micro, chunk) in enumerate(pipe.passes)]
    assert timeline.replayed_bubble(events, p, V) == pytest.approx((p - 1) / (V * m), abs=1e-12)


def test_bad_layouts_fail_before_any_process_group(capsys):
    """Clear errors from the validation, raised before init_distributed."""
    check = pipeline.check_pipeline
    with pytest.raises(ValueError, match=r"pp·pp-chunks = 3·1 = 3 does not divide num_layers=4"):
        check(4, 3, 1, "1f1b", 8, False)
    with pytest.raises(ValueError, match=r"pp·pp-chunks = 4·2 = 8 does not divide num_layers=4"):
        check(4, 4, 2, "interleaved", 8, False)
    with pytest.raises(ValueError, match=r"multiple of pp=4, got 6 .*use --grad-acc 8"):
        check(8, 4, 2, "interleaved", 6, False)
    with pytest.raises(ValueError, match=r"multiple of pp=4, got 2"):      # fewer micro-batches than stages
        check(8, 4, 2, "interleaved", 2, False)
    with pytest.raises(ValueError, match=r"--pp-chunks 2 needs --pp-schedule interleaved"):
        check(8, 2, 2, "1f1b", 4, False)
    with pytest.raises(ValueError, match=r"zb-v places two chunks per rank V-wise: pass --pp-chunks 2"):
        check(8, 2, 1, "zb-v", 4, False)
    with pytest.raises(ValueError, match=r"dualpipev schedule needs --grad-acc .* at least 2·pp = 8, got 6"):
        check(8, 4, 2, "dualpipev", 6, False)
    with pytest.raises(ValueError, match=r"--tie-embeddings with --pp > 1 is not supported"):
        check(4, 2, 1, "1f1b", 4, True)
    import torch.distributed as dist
    train = import_module("06_pipeline.train")
    with pytest.raises(SystemExit):
        train.main(common.argv("--pp", "3"))
    assert "does not divide num_layers=4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(common.argv("--pp", "4"))         # world size 1 here
    assert "does not equal the world size 1" in capsys.readouterr().err
    assert not dist.is_initialized()
