"""08_5d_combined/planner.py --search (search.py, search_report.py): what it prints, that every plan it keeps
is one the trainers accept and that fits, that its step time is the sum its docstring states, that the
shortcuts it takes (the least recomputation that fits; ties decided by the rules) lose nothing, and that
bad input is one error line.

Compared: the step-time terms against the formulas written out here from the planner's own bytes, ratios
and bubble (float arithmetic: 1e-12 relative); the search's best against the best of narrower searches
(exact: the same plans are evaluated). Small models and 8-64 GPUs: a search takes about a second.
"""
import re
from dataclasses import astuple
from pathlib import Path
from types import SimpleNamespace

import pytest

import forkrun
import measured_links
import plan_arithmetic
import planner
import search
import step_time
import memory

PLANNER = Path(__file__).resolve().parents[1] / "08_5d_combined" / "planner.py"
SMALL = ["--search", "--preset", "small", "--vocab-size", "32000", "--seq-len", "2048", "--gpus", "16",
         "--gpu", "h100", "--global-batch-tokens", str(64 * 2048), "--gpu-mem", "8"]


def run_search(argv):
    args = planner.cli.parse_args(planner.build_parser(), argv, files=False)
    config, cluster = search.model_config(args), step_time.cluster_of(args)
    batch = args.global_batch_tokens // args.seq_len
    return args, config, cluster, *search.search(args, config, cluster, batch)


def test_search_prints_the_three_steps_and_why(capsys):
    """The printed search: the model, the hardware with the assumed MFU, the three steps of the playbook's
    chapter 3 with the pruning rules counted, the table of the fastest layouts, and the reasons."""
    plans = planner.main(SMALL + ["--top", "3", "--train-tokens", "1e9"])
    out = capsys.readouterr().out
    for text in ("model: 0.1B parameters (llama)", "cluster: 16 × h100, 8 per node: 989 TFLOP/s",
                 "assumed MFU 45% of peak", "step 1, fit: the playbook (§3.1) advises", "Megatron rule #1",
                 "step 2, batch: every layout kept splits 64 sequences", "step 3, throughput", "why #1:",
                 "Megatron rule #3", "training on 1e+09 tokens:"):
        assert text in out, text
    table = out[out.index("step 3"):out.index("why #1:")].splitlines()[3:]
    assert len(table) == 3 and [int(line.split()[0]) for line in table] == [1, 2, 3]
    first = table[0].split()
    assert [int(v) for v in first[1:5]] == [plans[0].layout.dp, plans[0].layout.tp, plans[0].layout.pp,
                                            plans[0].layout.cp]


def test_every_plan_fits_passes_the_rules_and_splits_the_batch():
    """Each plan kept: its fullest stage fits in the usable memory, the trainers' rules accept its layout
    (layout.check_degrees in a world of dp·pp·cp·tp = --gpus), tp stays in a node, and dp·mbs·m is the
    global batch in sequences."""
    args, config, cluster, plans, pruned = run_search(SMALL)
    assert plans and pruned[search.RULE_1] > 0
    for plan in plans:
        lay = plan.layout
        memory = step_time.peak_memory(config, lay, args.seq_len, plan.mbs, plan.m)
        assert plan.memory == memory <= cluster.memory
        assert lay.dp * lay.tp * lay.pp * lay.cp == 16 and lay.tp <= 8
        assert lay.dp * plan.mbs * plan.m == 64
        search.check_rules(args, config, dp=lay.dp, tp=lay.tp, sp=lay.sp, cp=lay.cp, pp=lay.pp, ep=lay.ep,
                           pp_schedule=lay.schedule, pp_chunks=lay.chunks, grad_acc=plan.m)


def test_pruned_rules_are_counted_with_their_numbers():
    """The summary of what was pruned names the real degrees (pp·pp-chunks = 16·1 = 16 does not divide
    num_layers=8), one line per distinct case: not a template with every number replaced by N."""
    *_, pruned = run_search(["--preset", "tiny", "--num-layers", "6", *SMALL[3:]])
    divides = [rule for rule in pruned if rule.startswith("pp·pp-chunks")]
    assert divides and all(re.fullmatch(r"pp·pp-chunks = (\d+)·(\d+) = \d+ "
                                        r"does not divide num_layers=6", rule)
                           for rule in divides), divides
    assert not any(re.search(r"\bN\b", rule) for rule in pruned), list(pruned)


def test_step_time_is_the_sum_of_its_terms():
    """The module docstring's model, term by term, for a tp2 + SP × pp2 (interleaved, V = 2) × dp4 layout:
    compute = the last stage's FLOPs (its layers and the logits, / t) / (peak·MFU), slowed by the roofline
    (h = 512: the GEMMs' intensity is below the ridge point peak / HBM);
    tp exposed whole; the other dimensions' bytes / link bandwidth · max(0, 1 − 1/ratio); step =
    (compute + tp + cp + pp + ep)·(1 + bubble) + dp."""
    config = planner.cli.model_config(planner.cli.parse_args(planner.build_parser(), SMALL, files=False), 256)
    cluster = step_time.Cluster(16, 8, 989e12, 76e9, 3.35e12, 450e9, 50e9, 0.5)
    lay = plan_arithmetic.Layout(dp=4, tp=2, sp=True, pp=2, schedule="interleaved", chunks=2, zero_stage=1,
                         recompute="selective")
    plan = step_time.estimate(config, lay, 2048, 2, 8, cluster)
    dense, expert = step_time.layer_flops(config, 2048, "selective")
    flops = 8 * 2 * 2048 * (config.num_hidden_layers // 2 * dense / 2 + 6 * config.hidden_size * 32000 / 2)
    rows, k, n = 2 * 2048, 512, 512 // 2                     # a (b·s, h) × (h, h/t) GEMM in 2-byte elements
    assert plan.intensity == pytest.approx(2 * rows * k * n / (2 * (rows * k + k * n + rows * n)), rel=1e-12)
    slowdown = 989e12 / 3.35e12 / plan.intensity            # h = 512: below the ridge point, memory-bound
    assert slowdown > 1
    assert plan.times["compute"] == pytest.approx(flops / (989e12 * 0.5) * slowdown, rel=1e-12)
    sent = [plan_arithmetic.stage_communication(config, lay, 2048, 2, 8, s) for s in (0, 1)]
    bw = measured_links.bandwidths(lay, 8, 450e9, 50e9)
    ratios = plan_arithmetic.overlap_ratios(config, lay, 2048, 2, 989e12 * 0.5, bw)
    assert plan.times["tp"] == pytest.approx(max(s["tp"] for s in sent) / 450e9, rel=1e-12)
    for dim in ("pp", "dp"):
        exposed = max(s[dim] for s in sent) / bw[dim] * max(0.0, 1 - 1 / ratios[dim])
        assert plan.times[dim] == pytest.approx(exposed, rel=1e-12, abs=1e-15)
    bubble = (2 - 1) / (2 * 8)
    assert plan.bubble == bubble
    per_micro_batch = sum(plan.times[k] for k in ("compute", "tp", "cp", "pp", "ep"))
    assert plan.times["step"] == pytest.approx(per_micro_batch * (1 + bubble) + plan.times["dp"], rel=1e-12)


def test_shortcuts_lose_nothing():
    """The search keeps, per ZeRO stage and micro-batch, only the least recomputation that fits, and
    ranks ties (within 1%) by the rules. Searching one recomputation mode or one ZeRO stage at a time
    never finds a faster plan than the whole search; within 1% of the best, the first plan has the least
    model parallelism."""
    _, _, _, plans, _ = run_search(SMALL)
    best = min(plan.times["step"] for plan in plans)
    assert plans[0].times["step"] <= best * (1 + search.TIES)
    ties = [plan for plan in plans if plan.times["step"] <= best * (1 + search.TIES)]
    assert plans[0].model_parallel == min(plan.model_parallel for plan in ties)
    for flag, values in (("--search-recompute", ("none", "selective", "full")), ("--search-zero", "0123")):
        for value in values:
            narrow = run_search(SMALL + [flag, value])[3]
            assert not narrow or min(p.times["step"] for p in narrow) >= best * (1 - 1e-12), (flag, value)


def test_gpu_flags_override_the_datasheet():
    """--gpu picks the datasheet values; --peak-tflops, --gpu-mem, --hbm-tbps, --bw-intra and --bw-inter
    replace them, and --mem-reserve comes off the memory."""
    args = planner.cli.parse_args(planner.build_parser(), SMALL + ["--gpu", "a100"], files=False)
    expected = (16, 8, 312e12, 4e9, 2.039e12, 300e9, 25e9, 0.45)
    assert astuple(step_time.cluster_of(args)) == pytest.approx(expected)
    args = planner.cli.parse_args(planner.build_parser(), SMALL[:-2] + [
        "--peak-tflops", "500", "--hbm-tbps", "2", "--bw-intra", "100", "--bw-inter", "10",
        "--mem-reserve", "0", "--mfu", "0.3", "--gpus-per-node", "4"], files=False)
    assert astuple(step_time.cluster_of(args)) == pytest.approx((16, 4, 500e12, 80e9, 2e12, 100e9, 10e9, 0.3))


def test_plot_writes_the_memory_of_the_chosen_layout(tmp_path, capsys):
    """--plot writes a PNG of the chosen layout's memory per pipeline stage."""
    path = tmp_path / "memory.png"
    planner.main(SMALL + ["--top", "1", "--plot", str(path)])
    assert f"memory per stage of #1: {path}" in capsys.readouterr().out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_gpt_architecture_in_the_check_mode(capsys):
    """--arch gpt without --search plans one layout of Megatron's GPT: GPT-3 at t = 8, p = 8 is 174.6B
    parameters (174,615,846,912), and its tied embedding may span the stages (Megatron keeps a copy on the
    last one)."""
    planner.main(["--arch", "gpt", "--hidden-size", "12288", "--num-layers", "96", "--num-heads", "96",
                  "--seq-len", "2048", "--tp", "8", "--pp", "8", "--dp", "16", "--mbs", "1",
                  "--grad-acc", "96", "--recompute", "full", "--gpu-mem", "80"])
    out = capsys.readouterr().out
    assert "model: 174.616B parameters, h 12288, L 96, heads 96/96, ffn 49152, vocab 51200" in out


def test_fp32_gradient_copy_is_reduced_in_fp32():
    """--precision mixed-fp32-grads holds 2 + (2 + 4) + 12 bytes per parameter and all-reduces the fp32
    copy: its dp bytes are twice those of --precision mixed (2-byte gradients), its tp bytes the same."""
    config = planner.cli.model_config(planner.cli.parse_args(planner.build_parser(), SMALL, files=False), 256)
    mixed, fp32, scalars = (plan_arithmetic.stage_communication(
        config, plan_arithmetic.Layout(dp=4, tp=2, precision=p), 2048, 1, 4, 0)
        for p in ("mixed", "mixed-fp32-grads", "fp32"))
    assert fp32["tp"] == mixed["tp"] and fp32["dp"] == scalars["dp"]
    assert fp32["dp"] == pytest.approx(2 * mixed["dp"], rel=1e-6)
    assert sum(plan_arithmetic.model_states(1.0, 1, 0, "mixed-fp32-grads")) == 20


def test_nothing_fits_says_what_to_try(capsys):
    """A model that fits nowhere prints the pruning and what to try, not a table."""
    plans = planner.main(SMALL[:-1] + ["0.01", "--mem-reserve", "0"])
    out = capsys.readouterr().out
    assert plans == [] and "nothing fits: try --search-recompute full" in out and "do not fit" in out


BAD = {
    "no-gpus": (["--search", "--global-batch-tokens", "4096"], "--search needs --gpus N"),
    "batch": (["--search", "--gpus", "8", "--global-batch-tokens", "1000"], "a multiple of --seq-len 128"),
    "mfu": (["--search", "--gpus", "8", "--global-batch-tokens", "4096", "--mfu", "2"], "--mfu must be in"),
    "zero": (["--search", "--gpus", "8", "--global-batch-tokens", "4096", "--search-zero", "1,4"],
             "--search-zero 1,4: a comma-separated list of 0, 1, 2, 3"),
    "max-cp": (["--search", "--gpus", "8", "--global-batch-tokens", "4096", "--max-cp", "0"],
               "--max-cp must be at least 1"),
    "plot": (["--search", "--gpus", "8", "--global-batch-tokens", "4096", "--plot", "memory.pdf"],
             "the plot is a PNG"),
    "gpt-init": (["--arch", "gpt", "--init-from", "/nonexistent"], "--arch gpt takes its shapes"),
    "gpt-heads": (["--arch", "gpt", "--hidden-size", "100", "--num-heads", "3"],
                  "does not divide --hidden-size"),
}


@pytest.fixture(scope="module")
def bad_runs():
    """{case: {code, stdout, stderr, seconds}}: each case a process of its own, forked from one that
    imported the planner once (tests/forkrun.py; a fresh interpreter costs ~3 CPU-s a case)."""
    runs = [{"script": str(PLANNER), "argv": argv, "env": {}} for argv, _ in BAD.values()]
    return dict(zip(BAD, forkrun.run_in_fresh_process(runs, 120)))


@pytest.mark.parametrize("case", BAD)
def test_bad_search_input_is_one_error_line(bad_runs, case):
    """Run as a user runs it: a missing or impossible value ends in one argparse error line naming the
    fix, exit status 2, no traceback."""
    result, message = bad_runs[case], BAD[case][1]
    assert result["code"] == 2, result["stderr"]
    assert "Traceback" not in result["stderr"]
    assert message in result["stderr"].strip().splitlines()[-1]


def test_v_schedules_are_searched_with_two_chunks_and_their_formulas():
    """The default search tries ZB-V and DualPipeV (06's v_schedules.py) with their 2 chunks per rank, as
    the other schedules: every such plan passes the trainers' rules (in test_every_plan_fits...), DualPipeV
    only with m ≥ 2·pp micro-batches; its bubble is 06's (p−1)/(6m) for ZB-V once m ≥ 2p − 1 ((p−1)/(3m)
    DualPipeV), its memory the fullest stage's with v_schedules.peak_held micro-batch·chunks of one
    chunk's L/(2p) layers (ZB-V min(2p, 2m, m + 1 + r), DualPipeV 2p + 1), and its step the docstring's
    sum."""
    import v_schedules
    args, config, cluster, plans, pruned = run_search(SMALL)
    v_plans = [plan for plan in plans if plan.layout.schedule in ("zb-v", "dualpipev")]
    assert {plan.layout.schedule for plan in v_plans} == {"zb-v", "dualpipev"}
    assert pruned["DualPipeV needs at least 2·pp micro-batches (DeepSeek's DualPipeV)"] > 0
    for plan in v_plans:
        lay, m = plan.layout, plan.m
        p = lay.pp
        assert lay.chunks == 2 and p > 1
        bubble = (max(p - 1, 2 * (2 * p - 1 - m)) / (6 * m) if lay.schedule == "zb-v"
                  else (p - 1) / (3 * m))
        assert plan.bubble == pytest.approx(bubble, rel=1e-12)
        if lay.schedule == "dualpipev":
            assert m >= 2 * p
        chunk_layers = config.num_hidden_layers // (2 * p)
        for stage in (0, p - 1):
            held = v_schedules.peak_held(lay.schedule, p, stage, m)
            assert held == (min(2 * p, 2 * m, m + 1 + stage) if lay.schedule == "zb-v" else 2 * p + 1)
            # one micro-batch through one chunk
            chunk = SimpleNamespace(hidden_size=config.hidden_size,
                                    num_attention_heads=config.num_attention_heads,
                                    num_hidden_layers=chunk_layers)
            one = memory.activation_bytes_estimate(chunk, plan.mbs, args.seq_len, 2, lay.recompute, tp=lay.tp,
                                                   sp=lay.sp, cp=lay.cp)     # 2-byte activations (mixed)
            planned = plan_arithmetic.stage_memory(config, lay, args.seq_len, plan.mbs, m, stage)
            assert planned["activations"] == held * one, (lay, stage)
        per_micro_batch = sum(plan.times[k] for k in ("compute", "tp", "cp", "pp", "ep"))
        assert plan.times["step"] == pytest.approx(per_micro_batch * (1 + bubble) + plan.times["dp"],
                                                   rel=1e-12)
    narrow = run_search(SMALL + ["--search-schedules", "1f1b,interleaved,zb-h1"])[3]
    assert not [plan for plan in narrow if plan.layout.chunks == 2 and plan.layout.schedule != "interleaved"]
