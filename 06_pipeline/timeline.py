"""The executed pipeline timeline: bubble fractions (measured, replayed, theory), checks, a picture.

Playbook §2.6 (the AFAB / 1F1B / interleaved / ZB figures). Every schedule records the passes a
rank really ran (`passes.Event`: rank, op F/B/W, micro-batch, chunk, start and end in host-clock
seconds: timed by the host on the CPU, by CUDA events on a GPU, where the host only queues the work);
this file turns the events of all ranks of one pipeline into

  * the measured bubble: span of the step T, rank r busy for busy_r, bubble_r = (T − busy_r)/busy_r
    (idle / useful, the playbook's t_pb / t_id), averaged over the ranks: noisy on a shared CPU;
  * the replayed bubble: the recorded order of passes re-timed with ideal durations (t_F = 1,
    t_B = 2 for a fused backward, t_B = t_W = 1 when split, each /V with V chunks) and only the data
    dependencies between stages; it equals the theory (`theory_bubble`: schedules.py's and
    v_schedules.py's tables; DualPipeV's F&B pairs replayed as one unit) when a schedule is what it claims;
  * `timeline_violations`: every pass starts after the passes it depends on ended (F of block b
    after F of block b−1, B after the B of block b+1, W after its B) and a rank runs one pass at a time;
  * `render_png`: one row per rank (a lane per chunk), boxes coloured and labelled by micro-batch,
    B lighter, W hatched; the executed timeline above, its ideal replay below.

    torchrun --nproc_per_node 4 06_pipeline/train.py --pp 4 --grad-acc 8 --pp-schedule 1f1b \\
        --timeline 1f1b.png
New compared with 02: a step is an order of passes on several ranks, so its idle time can be measured.
"""

import torch.distributed as dist

import pipeline
from passes import Event


def theory_bubble(schedule: str, p: int, m: int, chunks: int = 1) -> float:
    """Idle / useful time per rank with equal per-stage times (t_F = t_B = t_W for the ZB schedules).

    V-wise a rank runs 2m chunk passes of each kind, 6m·t of work with t one chunk pass. ZB-V: no idle
    inside a rank's span (ZB paper §6), only the staggered start and end, (p−1)·t; each micro-batch
    short of the 2p−1 its pattern fills leaves 2t more. DualPipeV: DeepSeek-V3 Table 2's
    (PP/2−1)(F&B + B − 3W) with PP = 2p chunks, F&B = t + 2t (the pair, one after the other), B = 2t
    (whole backward), W = t: 2(p−1)·t."""
    if schedule == "zb-v":
        return max(p - 1, 2 * (2 * p - 1 - m)) / (6 * m)
    if schedule == "dualpipev":
        return (p - 1) * ((1 + 2) + 2 - 3 * 1) / (6 * m)
    if schedule == "interleaved":
        return (p - 1) / (chunks * m)
    if schedule == "zb-h1":
        return (p - 1) / (3 * m)
    return (p - 1) / m


def _block(event, p, v_shape=False):     # chunk c of rank r holds block c·p + r, or V-wise r / 2p−1−r
    return pipeline.block_index(event.rank, event.chunk, p, v_shape)


def measured_bubble(events) -> float:
    start, end = min(e.start for e in events), max(e.end for e in events)
    ranks = sorted({e.rank for e in events})
    busy = [sum(e.end - e.start for e in events if e.rank == r) for r in ranks]
    return sum((end - start - b) / b for b in busy) / len(ranks)


def replay(events, p: int, chunks: int = 1, v_shape: bool = False, pairs: bool = False) -> list:
    """The recorded order of passes of every rank, re-timed with ideal durations (see the docstring):
    each pass starts when its rank is free and the passes it depends on have ended. A B whose W ran
    separately is the input gradient only (t_B = 1), else the whole backward (2). `pairs` (DualPipe's
    F&B): an F followed on its rank by a whole B runs with it as one unit, which starts when both
    inputs are there and hands both outputs on at its end (overlapped on a GPU, DeepSeek-V3 §3.2.1)."""
    split = {(e.rank, e.micro, e.chunk) for e in events if e.op == "W"}
    length = {e: (2 if e.op == "B" and (e.rank, e.micro, e.chunk) not in split else 1) / chunks
              for e in events}
    queues = {r: sorted((e for e in events if e.rank == r), key=lambda e: e.start) for r in range(p)}
    done, free, replayed = {}, [0.0] * p, []
    while any(queues.values()):
        progressed = False
        for r, queue in queues.items():
            while queue:
                paired = pairs and queue[0].op == "F" and len(queue) > 1 and length[queue[1]] * chunks == 2
                unit = queue[:1 + paired]
                needs = [n for e in unit for n in _needs(e, p, chunks, v_shape)
                         if n not in {(u.op, u.micro, _block(u, p, v_shape)) for u in unit}]
                if not all(n in done for n in needs):
                    break
                del queue[:len(unit)]
                end = max([free[r]] + [done[n] for n in needs])
                for e in unit:
                    replayed.append(Event(e.rank, e.op, e.micro, e.chunk, end, end + length[e]))
                    end += length[e]
                for e in unit:
                    done[e.op, e.micro, _block(e, p, v_shape)] = end
                free[r] = end
                progressed = True
        if not progressed:
            raise RuntimeError("the recorded order of passes deadlocks under its own dependencies")
    return replayed


def replayed_bubble(events, p: int, chunks: int = 1, v_shape: bool = False, pairs: bool = False) -> float:
    return measured_bubble(replay(events, p, chunks, v_shape, pairs))


def _needs(e, p: int, chunks: int, v_shape: bool = False):
    """(op, micro-batch, block) of the passes that must end before pass e starts."""
    b, last = _block(e, p, v_shape), p * chunks - 1
    return {"F": [("F", e.micro, b - 1)] if b > 0 else [],
            "B": [("F", e.micro, b)] + ([("B", e.micro, b + 1)] if b < last else []),
            "W": [("B", e.micro, b)]}[e.op]


def timeline_violations(events, p: int, chunks: int = 1, v_shape: bool = False) -> list:
    """Human-readable list of broken dependencies or overlapping passes (empty when consistent)."""
    at = {(e.op, e.micro, _block(e, p, v_shape)): e for e in events}
    problems = []
    for e in events:
        b = _block(e, p, v_shape)
        for n in _needs(e, p, chunks, v_shape):
            if n not in at:
                problems.append(f"{e.op}{e.micro} on block {b} ran, but {n} never did")
            elif at[n].end > e.start:
                problems.append(f"{e.op}{e.micro} on block {b} started before {n} ended")
    for r in range(p):
        mine = sorted((e for e in events if e.rank == r), key=lambda e: e.start)
        problems += [f"rank {r}: {a.op}{a.micro} and {b.op}{b.micro} overlap" for a, b in zip(mine, mine[1:])
                     if b.start < a.end]
    return problems


def render_png(events, path: str, title: str, p: int, chunks: int = 1, v_shape: bool = False,
               pairs: bool = False):
    """Two panels: the executed timeline (wall clock) and the same order replayed with ideal pass
    times. With V chunks each rank's row has one lane per chunk (chunk 0 on top); a box is labelled with
    its micro-batch only where the label fits inside it. matplotlib is imported here: only --timeline
    needs it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colours = plt.get_cmap("tab10" if max(e.micro for e in events) < 10 else "tab20")
    passes = max(sum(e.rank == r for e in events) for r in range(p))      # V schedules: 6m boxes a row
    width_in, lane = max(10.0, 0.22 * passes), 0.8 / chunks
    fig, axes = plt.subplots(2, 1, figsize=(width_in, (0.8 + 0.25 * (chunks - 1)) * p + 2.4), dpi=80)
    ideal = "the same order replayed with ideal times (t_F = 1)" + (", F&B pairs as units" if pairs else "")
    panels = ((axes[0], events, 1e3, "executed: wall-clock time (ms)"),
              (axes[1], replay(events, p, chunks, v_shape, pairs), 1, ideal))
    for ax, panel, scale, xlabel in panels:
        t0, t1 = min(e.start for e in panel), max(e.end for e in panel)
        ax.set_xlim(0, (t1 - t0) * scale * 1.01)
        points_per_unit = 0.9 * width_in * 72 / ((t1 - t0) * scale * 1.01)      # axes: ~90% of the width
        for e in panel:
            colour = colours(e.micro % colours.N)
            style = {"F": dict(facecolor=colour, alpha=1.0),
                     "B": dict(facecolor=colour, alpha=0.45),                      # lighter shade
                     "W": dict(facecolor=colour, alpha=0.8, hatch="///")}[e.op]     # hatched
            left, width = (e.start - t0) * scale, (e.end - e.start) * scale
            y = p - 1 - e.rank + 0.4 - lane * (e.chunk + 0.5)                     # the chunk's lane
            ax.barh(y, width, left=left, height=lane, edgecolor="black", linewidth=0.4, **style)
            label = str(e.micro)
            if width * points_per_unit >= 0.65 * 6 * len(label) + 2:              # 6-point digits fit inside
                ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=6, clip_on=True)
        if chunks > 1:
            ax.set_yticks([p - 1 - r + 0.4 - lane * (c + 0.5) for r in range(p) for c in range(chunks)],
                          [f"rank {r} · chunk {c}" for r in range(p) for c in range(chunks)], fontsize=7)
        else:
            ax.set_yticks(range(p), [f"rank {r}" for r in reversed(range(p))])
        ax.set_xlabel(xlabel, fontsize=8)
    grey = (0.5, 0.5, 0.5)
    fig.legend(handles=[Patch(facecolor=grey, label="F"), Patch(facecolor=grey, alpha=0.45, label="B"),
                        Patch(facecolor=grey, alpha=0.8, hatch="///", label="W")],
               loc="upper right", fontsize=7, ncol=3)
    fig.suptitle(title + " | box label: micro-batch", fontsize=9, x=0.4)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(args, grid, events):
    """Gather the last step's events of this rank's pipeline (collective over pp); rank 0 prints the
    bubble (measured, replayed, theory) and draws --timeline. Returns the pipeline's events."""
    gathered = [None] * grid.pp_size
    dist.all_gather_object(gathered, events, group=grid.pp_group)
    events = [e for rank_events in gathered for e in rank_events]
    if not events:                          # no step ran (a resume at the last step)
        return events
    p, m, V = grid.pp_size, args.grad_acc, args.pp_chunks
    v_shape, pairs = args.pp_schedule in pipeline.V_SHAPED, args.pp_schedule == "dualpipev"
    theory = theory_bubble(args.pp_schedule, p, m, V)
    measured, replayed = measured_bubble(events), replayed_bubble(events, p, V, v_shape, pairs)
    if grid.rank == 0:
        print(f"bubble ({args.pp_schedule}, p={p}, m={m}, V={V}): measured {measured:.1%} (wall clock), "
              f"replayed {replayed:.1%} (ideal pass times), theory {theory:.1%}")
        if args.timeline:
            title = (f"{args.pp_schedule}: p={p}, m={m}" + (f", V={V}" if V > 1 else "") +
                     f" | bubble: measured {measured:.0%}, replayed {replayed:.1%}, theory {theory:.1%}")
            render_png(events, args.timeline, title, p, V, v_shape, pairs)
            print(f"timeline written to {args.timeline}")
    return events
