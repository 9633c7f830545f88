"""Held-out evaluation, the run's pictures and TensorBoard (01's loop, every trainer's eval_step).

The eval loss of a step is the mean loss of the same held-out global batches in every layout: each
trainer's eval_step runs forward only on this rank's part (its rows, its tokens, its stage, its shards)
and reduces it as its train_step reduces the training loss. One 2-rank spawn runs 02-07 (06 also V-wise,
where the last block, which holds the loss, is on rank 0) with `--eval-every 1` for 2 steps; training
and eval losses are compared with 01's (07's MoE with 07 on one device) in float64, where the layouts'
different summation orders stay near 1e-15 relative: 1e-10 is far below a wrong batch or a missing
shard (the loss moves in the 2nd digit). 08's layouts are checked in test_5d_combined.py (dp×tp×pp and
tp+sp×cp×interleaved pp), which also shows that evaluation's communication is not counted in the
per-step tables (the planner's bytes still match exactly).
"""
import json
import os
import tempfile
from importlib import import_module

import pytest
import torch

import common
from harness import layout_results, run_layouts

import data
import sampling

EVAL = ["--eval-every", 1, "--eval-batches", 2]
STEPS = 2
PLOTS = tempfile.mkdtemp(prefix="test_evaluation_")      # ZeRO-3's --plot: every rank's bytes gathered
LAYOUTS = {   # id: (module, flags, mbs, grad_acc): the global batch is 4 sequences everywhere
    "02-dp2": ("02_data_parallel.train", ["--dp", 2], 2, 1),
    "03-zero3-dp2": ("03_zero.train", ["--dp", 2, "--zero-stage", 3, "--plot", PLOTS], 2, 1),
    "04-tp2": ("04_tensor_parallel.train", ["--tp", 2], 4, 1),
    "05-cp2-zigzag": ("05_sequence_context_parallel.train", ["--cp", 2, "--cp-layout", "zigzag"], 4, 1),
    "06-pp2-1f1b": ("06_pipeline.train", ["--pp", 2, "--pp-schedule", "1f1b"], 2, 2),
    "06-pp2-zbv": ("06_pipeline.train", ["--pp", 2, "--pp-schedule", "zb-v", "--pp-chunks", 2], 1, 4),
    "07-dp2-ep2-moe": ("07_expert_parallel.train", ["--dp", 2, "--ep", 2, "--num-experts", 4], 2, 1),
}


def _argv(flags, mbs=4, grad_acc=1):
    return common.argv(*EVAL, *flags, steps=STEPS, mbs=mbs, grad_acc=grad_acc, dtype="float64")


def _run(layout):
    module, flags, mbs, grad_acc = layout
    records = import_module(module).main(_argv(flags, mbs, grad_acc))[0]
    return [(r["loss"], r["eval_loss"]) for r in records]


@pytest.fixture(scope="module")
def two_ranks():
    return run_layouts(_run, LAYOUTS, 2, timeout=240)


@pytest.fixture(scope="module")
def references():
    dense = import_module("01_single_gpu.train").main(_argv([]))[0]
    moe = import_module("07_expert_parallel.train").main(_argv(["--num-experts", 4]))[0]
    return {kind: [(r["loss"], r["eval_loss"]) for r in records] for kind, records in
            (("dense", dense), ("moe", moe))}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout_id", LAYOUTS)
def test_eval_loss_is_the_single_device_one(two_ranks, references, layout_id):
    expected = references["moe" if "moe" in layout_id else "dense"]
    for rank, losses in enumerate(layout_results(two_ranks, layout_id)):
        torch.testing.assert_close(losses, expected, rtol=1e-10, atol=0, msg=f"{layout_id} rank {rank}")
    if "--plot" in LAYOUTS[layout_id][1]:
        assert sorted(os.listdir(PLOTS)) == ["loss.png", "memory.png"]


def test_held_out_windows_are_never_trained_on_and_evaluation_changes_nothing(tmp_path):
    """The sampler of the training part never reads the last K·G windows; a run that evaluates every step
    trains exactly as one that evaluates only at the end (evaluation is forward only), and logs the
    eval loss on those steps only, in --json-log, the pictures and TensorBoard."""
    dataset = data.build_dataset("stdlib", data.ByteTokenizer(), common.SEQ_LEN)
    train, held_out = sampling.split_held_out(dataset, 8)
    assert len(held_out) == 8 and len(train) + 8 == len(dataset)
    sampler = sampling.GlobalBatchSampler(train, 1234, 4, 1)
    assert max(sampler._index(s) for s in range(3 * len(train))) == len(train) - 1    # three epochs
    assert held_out[0]["input_ids"].tolist() == dataset[len(train)]["input_ids"].tolist()

    single = import_module("01_single_gpu.train")
    every = single.main(common.argv(*EVAL, "--json-log", tmp_path / "run.jsonl", "--plot", tmp_path,
                                    "--tensorboard", tmp_path / "tb", steps=2))[0]
    at_end = single.main(common.argv("--eval-every", 5, "--eval-batches", 2, steps=2))[0]
    assert [r["loss"] for r in every] == [r["loss"] for r in at_end]
    assert "eval_loss" not in at_end[0] and at_end[1]["eval_loss"] == every[1]["eval_loss"]
    logged = [json.loads(line) for line in open(tmp_path / "run.jsonl")]
    assert [r["eval_loss"] for r in logged] == [r["eval_loss"] for r in every]
    for picture in ("loss.png", "memory.png"):
        assert (tmp_path / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss",
            "memory/peak_rss_gib"} <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx([r["eval_loss"] for r in every])


def test_bad_evaluation_flags_name_the_fix(capsys, tmp_path, monkeypatch):
    single = import_module("01_single_gpu.train")
    with pytest.raises(SystemExit):
        single.main(common.argv("--eval-every", 1, "--eval-batches", 10**6))
    assert "leaving none to train on: lower --eval-batches" in capsys.readouterr().err
    monkeypatch.setitem(__import__("sys").modules, "tensorboard", None)     # as if it were not installed
    with pytest.raises(SystemExit):
        single.main(common.argv("--tensorboard", tmp_path))
    assert "needs the tensorboard package: pip install tensorboard" in capsys.readouterr().err


def test_measured_state_counts_storages_once():
    """memory.png's bytes: parameters and gradients by the storages a rank holds (views of one flat buffer,
    as ZeRO's and the DP buckets' are, count once; a freed ZeRO-3 storage counts 0), AdamW's two moments."""
    import memory
    flat = torch.zeros(10)
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Parameter(flat[:4].view(2, 2)), torch.nn.Parameter(flat[4:])
    optimizer = torch.optim.AdamW(model.parameters())
    model.a.grad, model.b.grad = torch.ones(2, 2), torch.ones(6)
    optimizer.step()
    assert memory.measured_state(model, optimizer, 123) == dict(parameters=40, gradients=40, optimizer=80,
                                                               activations=123)
    flat.untyped_storage().resize_(0)                        # ZeRO-3 frees the gathered parameters
    assert memory.measured_state(model, optimizer, 0)["parameters"] == 0
