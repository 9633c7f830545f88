"""06_pipeline/v_schedules.py without ranks: ZB-V's and DualPipeV's orders against PyTorch's, and their
bubbles and peaks against the papers' formulas.

torch.distributed.pipelining builds the same two schedules (ScheduleZBVZeroBubble, ScheduleDualPipeV:
the per-rank compute actions of `pipeline_order`, built at construction without running anything; the
stages here are stand-ins carrying the attributes the constructor reads). Every rank's order of passes
must be ours, for p = 2..4 and every m from 1 (ZB-V; DualPipeV needs m ≥ 2p) to 4p + 1, with the two
differences of representation asserted rather than ignored: PyTorch pads ZB-V's order with empty slots
(None) where a rank waits at the start, and writes DualPipeV's paired passes as one OVERLAP_F_B action
(F first, then the full backward: overlapped on a GPU, one after the other here).

The replay (timeline.py) of each order with one unit per chunk pass (t_F = t_B = t_W = t, a whole
backward 2t) gives, exactly, for p = 2..5 and 8: ZB-V no idle inside any rank's span when m ≥ 2p − 1 (the ZB
paper's "zero bubble" at equal times, §6) and (p − 1)·t in the step with its staggered start and end;
DualPipeV, with its F&B pairs replayed as units, DeepSeek-V3 Table 2's (PP/2 − 1)(F&B + B − 3W) = 2(p − 1)t.
The peaks (micro-batch·chunks held, W pending included) of a walk through each order: ZB-V 2p (p whole
stages, 1F1B's rank 0), DualPipeV 2p + 1 (Table 2's PP + 1). test_pipeline.py runs both on real ranks.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.pipelining.schedules as pipelining

import passes
import schedules
import timeline
import v_schedules

TORCH_SCHEDULES = {"zb-v": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def _torch_orders(schedule, p, m):
    """{rank: [(op, micro-batch, chunk)]} of PyTorch's schedule; also its raw actions."""
    stages = [SimpleNamespace(group_size=p, group_rank=0, num_stages=2 * p, stage_index=index,
                              submod=torch.nn.Module()) for index in (0, 2 * p - 1)]
    built = getattr(pipelining, TORCH_SCHEDULES[schedule])(stages, m)
    orders = {}
    for rank, actions in built.pipeline_order.items():
        order = []
        for action in filter(None, actions):
            for sub in action.sub_actions or (action,):
                op = sub.computation_type.value                           # F, I, W, or B (full backward)
                order.append((op, sub.microbatch_index, 0 if sub.stage_index < p else 1))   # stage -> chunk
        orders[rank] = order
    return orders, built.pipeline_order


@pytest.mark.parametrize("schedule", TORCH_SCHEDULES)
def test_orders_match_torch_pipelining(schedule):
    for p in (2, 3, 4):
        for m in range(2 * p if schedule == "dualpipev" else 1, 4 * p + 2):
            orders, raw = _torch_orders(schedule, p, m)
            for rank in range(p):
                assert v_schedules.ORDERS[schedule](p, rank, m) == orders[rank], (schedule, p, m, rank)
                overlapped = [a for a in raw[rank] if a is not None and a.sub_actions]
                for action in overlapped:                                  # F&B: F, then the full backward
                    assert [s.computation_type.value for s in action.sub_actions] == ["F", "B"]
                if schedule == "zb-v":
                    assert raw[rank][:rank] == [None] * rank and not overlapped   # its idle start slots
                else:
                    assert None not in raw[rank] and overlapped


def _events(schedule, p, m):
    """The order of every rank as timeline Events in order (I recorded as a B whose W runs apart)."""
    return [passes.Event(rank, "B" if op == "I" else op, micro, chunk, k, k + 1) for rank in range(p)
            for k, (op, micro, chunk) in enumerate(v_schedules.ORDERS[schedule](p, rank, m))]


def _idle(replayed, p, own_span=False):
    """Idle time of every rank: in the step, or inside the rank's own first-to-last pass."""
    start, end = min(e.start for e in replayed), max(e.end for e in replayed)
    idle = []
    for rank in range(p):
        mine = [e for e in replayed if e.rank == rank]
        span = (max(e.end for e in mine) - min(e.start for e in mine)) if own_span else end - start
        idle.append(span - sum(e.end - e.start for e in mine))
    return idle


def _peak(order):
    held, deferred, peak = set(), set(), 0
    for op, micro, chunk in order:
        if op == "F":
            held.add((micro, chunk))
        else:
            held.discard((micro, chunk))
            (deferred.add if op == "I" else deferred.discard)((micro, chunk))
        peak = max(peak, len(held) + len(deferred))
    return peak


def test_replayed_bubbles_and_peaks_match_the_papers():
    t = 1 / 2                                        # one chunk pass in the replay (t_F = 1 per stage, /V)
    for p in (2, 3, 4, 5, 8):
        for m in range(1, 3 * p + 2):
            zb_v = timeline.replay(_events("zb-v", p, m), p, 2, v_shape=True)
            assert timeline.timeline_violations(zb_v, p, 2, v_shape=True) == []
            if m >= 2 * p - 1:
                assert _idle(zb_v, p, own_span=True) == [0] * p, (p, m)   # ZB paper §6: zero bubble
            assert _idle(zb_v, p) == [max(p - 1, 2 * (2 * p - 1 - m)) * t] * p, (p, m)
            assert timeline.measured_bubble(zb_v) == pytest.approx(timeline.theory_bubble("zb-v", p, m, 2))
            for rank in range(p):
                assert _peak(v_schedules.zb_v_order(p, rank, m)) == schedules.peak_held("zb-v", p, rank, m, 2)
            if m < 2 * p:
                continue
            events = _events("dualpipev", p, m)
            paired = timeline.replay(events, p, 2, v_shape=True, pairs=True)
            f_and_b, b, w = 3 * t, 2 * t, t                # the pair F + B, a whole backward, a W
            assert _idle(paired, p) == [(p - 1) * (f_and_b + b - 3 * w)] * p, (p, m)   # DeepSeek-V3 Table 2
            theory = timeline.theory_bubble("dualpipev", p, m, 2)
            assert timeline.measured_bubble(paired) == pytest.approx(theory)
            assert _idle(timeline.replay(events, p, 2, v_shape=True), p) == [(p - 1) * t] * p   # unpaired
            for rank in range(p):
                assert _peak(v_schedules.dualpipev_order(p, rank, m)) == 2 * p + 1 == \
                    schedules.peak_held("dualpipev", p, rank, m, 2)
    assert timeline.theory_bubble("zb-v", 4, 8, 2) == 3 / 48
    assert timeline.theory_bubble("dualpipev", 4, 8, 2) == 3 / 24
