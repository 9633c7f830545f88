"""08_5d_combined/planner.py on the inputs a user gives it: ZeRO-3 with the overlap flags, a real
Llama-3.1-8B config.json as --init-from, and config.json files it cannot plan from.

Compared: the printed overlap row against the module docstring's formula, the planned parameters against
the published 8,030,261,248 of Llama-3.1-8B, and every config problem against one argparse error line
(exit status 2, no traceback). Pure arithmetic on integers and a few floats: no tolerance but print rounding.
"""
import json

import pytest

import plan_arithmetic
import planner


# meta-llama/Llama-3.1-8B's config.json as published (the keys the planner or the loader could read).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False,
    "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1, "initializer_range": 0.02,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16", "use_cache": True,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
OVERLAP = ["--peak-tflops", "989", "--bw-intra", "450", "--bw-inter", "50"]


def write_config(directory, config):
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return directory


def test_zero3_prints_the_overlap_table(capsys):
    """--zero-stage 3 with the bandwidth and peak flags prints the zero3 row: e·(N−1)/N/(2·b·s_r)·peak/bw
    with N = dp = 4 and bw = --bw-inter, since the dp group spans tp·pp·dp = 16 ranks > 8 per node."""
    planner.main(["--preset", "1b", "--seq-len", "4096", "--mbs", "1", "--grad-acc", "16", "--dp", "4",
                  "--tp", "2", "--pp", "2", "--zero-stage", "3", *OVERLAP])
    out = capsys.readouterr().out
    expected = 2 * (4 - 1) / 4 / (2 * 1 * 4096) * 989e12 / 50e9                # mixed precision: e = 2
    rows = [line.split() for line in out.splitlines()]
    assert ["zero3", f"{expected:.3f}", "(inter-node)", "EXPOSED"] in rows
    assert any(row[:1] == ["tp"] and "(intra-node)" in row for row in rows)


def test_llama31_8b_config_plans_from_its_shapes(tmp_path, capsys):
    """A directory holding only Llama-3.1-8B's config.json (llama3 RoPE scaling, no weights) is planned:
    the planner reads its shapes, and its per-rank parameters over tp 8 × pp 4 add up to the published
    count: every matrix split 8 ways by tp, the 2L + 1 norms replicated on every tp rank."""
    directory = write_config(tmp_path / "llama31", LLAMA_31_8B)
    planner.main(["--init-from", str(directory), "--tp", "8", "--pp", "4", "--dp", "2", "--seq-len", "8192",
                  "--mbs", "1", "--grad-acc", "8", "--zero-stage", "1", "--recompute", "selective",
                  "--gpu-mem", "80", *OVERLAP])
    out = capsys.readouterr().out
    assert "model: 8.030B parameters, h 4096, L 32, heads 32/8, ffn 14336, vocab 128256" in out
    assert "overlap t_comm/t_compute" in out
    args = planner.cli.parse_args(planner.build_parser(), ["--init-from", str(directory), "--tp", "8",
                                                           "--pp", "4"], files=False)   # no weights here
    config, layout = planner.cli.model_config(args, 257), planner.layout_of(args)
    assert (config.rope_theta, config.rope_scaling["rope_type"], config.head_dim) == (500000.0, "llama3", 128)
    per_tp_rank = sum(sum(plan_arithmetic.stage_parameters(config, layout, s)) for s in range(4))
    norms = 2 * 4096 * 32 + 4096
    assert 8 * (per_tp_rank - norms) + norms == 8_030_261_248


CONFIG_PROBLEMS = {
    "yarn-scaling": ({**LLAMA_31_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    "no-hidden-size": ({k: v for k, v in LLAMA_31_8B.items() if k != "hidden_size"}, "hidden_size"),
    "not-json": ("{hidden_size: 4096", "not valid JSON"),
    "biases": ({**LLAMA_31_8B, "attention_bias": True}, "biases"),
}


@pytest.mark.parametrize("case", CONFIG_PROBLEMS)
def test_config_problems_are_one_parser_error(tmp_path, capsys, case):
    """A config.json the model cannot take is argparse's error (exit 2) naming the problem."""
    config, message = CONFIG_PROBLEMS[case]
    directory = write_config(tmp_path / case, config)
    with pytest.raises(SystemExit) as exit_info:
        planner.main(["--init-from", str(directory), "--tp", "8"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0] and str(directory) in errors[0]


PREFLIGHT_LAYOUTS = [["--dp", "4", "--zero-stage", "1"], ["--dp", "2", "--zero-stage", "3", "--tp", "2"],
                     ["--tp", "4", "--sp", "--pp", "2", "--recompute", "selective"],
                     ["--cp", "2", "--pp", "4", "--pp-schedule", "afab", "--recompute", "full"],
                     ["--dp", "4", "--ep", "4", "--num-experts", "8", "--pp", "2"]]


@pytest.mark.parametrize("layout", PREFLIGHT_LAYOUTS, ids=lambda flags: "-".join(f.strip("-") for f in flags))
def test_the_memory_preflight_is_a_lower_bound_of_the_planners_ranks(layout):
    """The trainers' preflight (memory.rank_lower_bound, from the flags alone) against the planner's bytes of
    every pipeline stage's ranks, which tests/test_5d_combined.py checks against what 08's ranks hold: its
    model states are at most those of the busiest stage's rank, its activations at most that rank's (the
    planner counts the held micro-batches and Korthikanti's attention scores; --precision mixed is
    --dtype bfloat16 --precision-layout bf16-16)."""
    import build
    import memory
    flags = ["--preset", "1b", "--seq-len", "4096", "--mbs", "1", "--grad-acc", "8", "--dtype", "bfloat16",
             "--precision-layout", "bf16-16", *layout]
    args = planner.cli.parse_args(planner.build_parser(), flags, files=False)
    config, plan = planner.cli.model_config(args, 257), planner.layout_of(args)
    bound = memory.rank_lower_bound(config, args, build.activation_element_bytes(args))
    stages = [plan_arithmetic.stage_memory(config, plan, args.seq_len, args.mbs, args.grad_acc, stage)
              for stage in range(args.pp)]
    states = max(sum(s[k] for k in ("parameters", "gradients", "optimizer")) for s in stages)
    assert 0 < bound["parameters"] + bound["gradients"] + bound["optimizer states"] <= states
    assert 0 < bound["activations"] <= max(s["activations"] for s in stages)


@pytest.mark.parametrize("offload, on_the_gpu", [("optimizer", ("parameters", "gradients")), ("param", ())])
def test_the_preflight_leaves_zero_offloads_states_to_the_host(offload, on_the_gpu):
    """03 --zero-stage 3 --offload on a GPU: the preflight counts on the device only what stays there (the
    host holds the optimizer's shard, and with `param` every model state), so it refuses no run that fits
    thanks to the offload."""
    import build
    import cli
    import memory
    from importlib import import_module
    args = cli.parse_args(import_module("03_zero.train").build_parser(),
                          ["--zero-stage", "3", "--offload", offload, "--dp", "1"], files=False)
    args = cli.with_values(args, device="cuda")
    bound = memory.rank_lower_bound(cli.model_config(args, 257), args, build.activation_element_bytes(args))
    assert {part for part, size in bound.items() if size > 0} == {*on_the_gpu, "activations"}
