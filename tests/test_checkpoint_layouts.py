"""Checkpoints move between layouts: a run saved by one parallel layout resumes in any other of the same
global batch with the losses of the uninterrupted single-device run, and exports as a Hugging Face Llama.

Each case trains 2 steps in layout A (saving at step 2), resumes in layout B to step 4, and compares
steps 3-4 with 01's uninterrupted 4 steps (global batch 4, `--lr-decay-steps 4` everywhere, so the
schedule is the same). float32: the layouts sum the same gradients in other orders (~1e-7 relative),
which AdamW's m/√v carries into the weights of the resumed run; 1e-5 relative on the losses is far
below a wrong piece (a swapped TP block, a missing moment: the loss moves in the 3rd digit).
The pairs cross every kind of state a layout holds: ZeRO-3's flat shards → one device; one device →
tp2 × pp2 (08); ZeRO-1 over a pipeline (08's distributed optimizer, pieces that cross parameters and
TP blocks) → tp2 × dp2 (04); 08's ZeRO-3 over a pipeline (shards drawn from meta stages) → 08's ZeRO-3
over tp2 × dp2; and 07's experts over ep2 → 07 on one device. Then the 04 checkpoint is
exported (export_hf.py) and transformers' Llama gives the project's logits (float32: 1e-5), and
generate.py decodes the same greedy tokens from the checkpoint and from its export.
"""
import json
import shutil
from importlib import import_module
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import common
import export_hf
import hf_io
import model as modeling
import optim
from harness import layout_results, run_layouts, run_ranks
from test_preemption import tensors

SCHEDULE = ["--lr-decay-steps", 4]


def flags_mbs(flags):
    return int(flags[flags.index("--mbs") + 1]) if "--mbs" in flags else 4


def flags_grad_acc(flags):
    return int(flags[flags.index("--grad-acc") + 1]) if "--grad-acc" in flags else 1


def strip(flags):
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in ("--mbs", "--grad-acc"):
            skip = True
        else:
            out.append(flag)
    return out


def _layout_run(module, flags, steps, checkpoint_dir, resume):
    extra = ["--checkpoint-dir", checkpoint_dir] + (["--resume"] if resume else [])
    import torch.distributed as dist
    records = import_module(module).main(common.argv(*strip(flags), *SCHEDULE, *extra, steps=steps,
                                                     mbs=flags_mbs(flags), grad_acc=flags_grad_acc(flags)))[0]
    dist.barrier()
    return [r["loss"] for r in records]


def _two_layouts(save, load, checkpoint_dir):
    """On every rank of one spawn: layout A's 2 steps, then layout B's resume to 4 (same world size)."""
    _layout_run(*save, 2, checkpoint_dir, resume=False)
    return _layout_run(*load, 4, checkpoint_dir, resume=True)


def run(module, flags, world, steps, checkpoint_dir, resume):
    if world == 1:
        extra = ["--checkpoint-dir", checkpoint_dir] + (["--resume"] if resume else [])
        records = import_module(module).main(common.argv(*strip(flags), *SCHEDULE, *extra, steps=steps,
                                                         mbs=flags_mbs(flags),
                                                         grad_acc=flags_grad_acc(flags)))[0]
        return [r["loss"] for r in records]
    per_rank = run_ranks(_layout_run, world, args=(module, flags, steps, checkpoint_dir, resume), timeout=300)
    assert all(losses == per_rank[0] for losses in per_rank)                # every rank logs the global loss
    return per_rank[0]


@pytest.fixture(scope="module")
def reference():
    """01's uninterrupted 4 steps of the global batch 4, and its final model."""
    records, model = import_module("01_single_gpu.train").main(common.argv(*SCHEDULE, steps=4, mbs=4))
    return [r["loss"] for r in records], model


@pytest.fixture(scope="module")
def moe_reference():
    records = import_module("07_expert_parallel.train").main(common.argv(*SCHEDULE, "--num-experts", 4,
                                                                         steps=4, mbs=4))[0]
    return [r["loss"] for r in records]


CASES = {   # id: ((module, flags, world) that saves, (module, flags, world) that resumes)
    "zero3-dp4-to-01": (("03_zero.train", ["--dp", 4, "--zero-stage", 3, "--mbs", 1], 4),
                        ("01_single_gpu.train", [], 1)),
    "01-to-tp2-pp2": (("01_single_gpu.train", [], 1),
                      ("08_5d_combined.train", ["--tp", 2, "--pp", 2, "--mbs", 2, "--grad-acc", 2], 4)),
    "zero1-dp2-pp2-to-tp2-dp2": (("08_5d_combined.train", ["--dp", 2, "--pp", 2, "--zero-stage", 1,
                                                           "--mbs", 1, "--grad-acc", 2], 4),
                                 ("04_tensor_parallel.train", ["--tp", 2, "--dp", 2, "--mbs", 2], 4)),
    "zero3-dp2-pp2-to-zero3-tp2-dp2": (("08_5d_combined.train", ["--dp", 2, "--pp", 2, "--zero-stage", 3,
                                                                 "--mbs", 1, "--grad-acc", 2], 4),
                                       ("08_5d_combined.train", ["--tp", 2, "--dp", 2, "--zero-stage", 3,
                                                                 "--mbs", 2], 4)),
}


@pytest.mark.parametrize("case", CASES)
def test_resume_in_another_layout_continues_the_run(tmp_path, reference, case):
    (save_module, save_flags, save_world), (load_module, load_flags, load_world) = CASES[case]
    ckpt = str(tmp_path / "ckpt")
    if save_world == load_world > 1:
        per_rank = run_ranks(_two_layouts, save_world,
                             args=((save_module, save_flags), (load_module, load_flags), ckpt), timeout=300)
        resumed = per_rank[0]
    else:
        run(save_module, save_flags, save_world, 2, ckpt, resume=False)
        resumed = run(load_module, load_flags, load_world, 4, ckpt, resume=True)
    assert resumed == pytest.approx(reference[0][2:], rel=1e-5), case
    if case == "zero1-dp2-pp2-to-tp2-dp2":      # its step-4 checkpoint, saved by tp2 × dp2, as a Llama
        export_and_compare(ckpt, tmp_path / "hf", reference[1])


def export_and_compare(ckpt, out, model):
    import transformers
    export_hf.main(["--checkpoint-dir", ckpt, "--out", str(out)])
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids), rtol=1e-5, atol=1e-5)
    # generate.py reads the checkpoint (saved by tp2 × dp2) and its export alike: the same greedy tokens
    import generate
    tokens = [generate.main([*source, "--prompt", "def f(", "--temperature", "0", "--max-new-tokens", "12"])
              for source in (["--checkpoint-dir", ckpt], ["--hf-dir", str(out)])]
    assert tokens[0].shape == (1, 6 + 12) and torch.equal(*tokens)


def _experts(ckpt):
    return _layout_run("07_expert_parallel.train", ["--num-experts", 4, "--dp", 2, "--ep", 2, "--mbs", 2], 2,
                       ckpt, resume=False)


def test_experts_move_from_ep2_to_one_device(tmp_path, moe_reference):
    """07's experts saved by dp 2 × ep 2 (each rank: 2 of the 4 experts of every layer) resume on one
    device, which holds all 4, with the single-device MoE run's losses. On disk every expert is its own
    (F, C) piece under 01's per-expert name, as before the experts were stored stacked, written by its
    owner: older checkpoints have the same pieces."""
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_experts, 2, args=(ckpt,), timeout=300)
    pieces = json.loads((tmp_path / "ckpt" / "step_000002" / "manifest.json").read_text())["pieces"]
    experts = {(p["name"], tuple(p["shape"]), p["file"]) for p in pieces if ".mlp.experts." in p["name"]}
    C, F = (int(common.TINY[common.TINY.index(f) + 1]) for f in ("--hidden-size", "--intermediate-size"))
    projections = (("gate_proj", (F, C)), ("up_proj", (F, C)), ("down_proj", (C, F)))
    assert experts == {(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", shape,
                        f"rank_{e // 2:05d}.safetensors")                                 # owner: e // 2
                       for layer in range(4) for e in range(4) for proj, shape in projections}
    resumed = run("07_expert_parallel.train", ["--num-experts", 4], 1, 4, ckpt, resume=True)
    assert resumed == pytest.approx(moe_reference[2:], rel=1e-5)


# A TP run begun from a Hugging Face directory resumes bit for bit, on fused AdamW. (Issue 32: a rank's slice
# of a row-parallel weight was read as a strided view, which the resume could not write into, a traceback,
# and on which AdamW fell back from its fused kernel.)
FROM_HF = {"04-tp2": ("04_tensor_parallel.train", ["--tp", 2], "untied"),
           "04-tp2-tied": ("04_tensor_parallel.train", ["--tp", 2], "tied"),
           "05-tp2-sp": ("05_sequence_context_parallel.train", ["--tp", 2, "--sp"], "untied"),
           "08-tp2-tied": ("08_5d_combined.train", ["--tp", 2], "tied")}


def _from_hf_then_resumed(case, tmp):
    """On both ranks: 3 steps from --init-from, saving steps 2 and 3 in folder a; then step 2 alone, copied
    into folder b, resumed there to step 3. Returns both runs' losses and whether every parameter of each
    was contiguous (optim.fused: AdamW's fused kernel)."""
    module, flags, ties = FROM_HF[case]
    a, b = Path(tmp) / case / "a", Path(tmp) / case / "b"

    def run(folder, *extra):
        out = import_module(module).main(common.argv(*flags, "--init-from", Path(tmp) / ties,
                                                     "--checkpoint-dir", folder, *extra, steps=3, mbs=2))
        return [r["loss"] for r in out[0]], optim.fused(list(out[1].parameters()))
    whole = run(a, "--checkpoint-every", 2)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.copytree(a / "step_000002", b / "step_000002")
    dist.barrier()
    return whole, run(b, "--resume")


@pytest.fixture(scope="module")
def from_hf(tmp_path_factory):
    """Both ranks' results for every FROM_HF case (one spawn), and the folder of their checkpoints."""
    tmp = tmp_path_factory.mktemp("from_hf")
    for ties in ("untied", "tied"):            # common.TINY's model
        torch.manual_seed(0)
        config = modeling.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=ties == "tied")
        hf_io.save_hf(modeling.LlamaForCausalLM(config), tmp / ties)
    return run_layouts(_from_hf_then_resumed, {case: case for case in FROM_HF}, 2, args=(str(tmp),),
                       timeout=300), tmp


@pytest.mark.parametrize("case", FROM_HF)
def test_a_tp_run_begun_from_hf_weights_resumes_bitwise_on_fused_adamw(from_hf, case):
    """Step 3 resumed from step 2 equals the uninterrupted run's, bit for bit, as does step 3's checkpoint
    (parameters and AdamW's moments), tensor for tensor; the parameters were contiguous in both runs, so
    AdamW ran its fused kernel."""
    outcomes, tmp = from_hf
    (whole, whole_fused), (resumed, resumed_fused) = layout_results(outcomes, case)[0]
    assert resumed == whole[2:] and len(whole) == 3
    assert whole_fused and resumed_fused
    mine, reference = (tensors(tmp / case / folder / "step_000003") for folder in ("b", "a"))
    assert mine.keys() == reference.keys() and len(mine) > 0
    for key, value in reference.items():
        assert torch.equal(mine[key], value), key


def init_from(folder) -> dict:
    """01's parameters as --init-from gives them values: each read from the folder's safetensors files."""
    import build
    import cli
    train01 = import_module("01_single_gpu.train")
    args = cli.parse_args(train01.build_parser(), common.argv("--init-from", folder), files=False)
    model = build.materialize(build.build_model(args, cli.model_config(args, 257)), args)
    return {name: p.detach() for name, p in model.named_parameters()}


def test_a_sharded_export_round_trips_and_overwrite_replaces_the_whole_model(tmp_path):
    """Step 2 exported in shards of at most 64 KiB (--max-shard-mb): an index and several shards, which
    transformers loads with the project's logits (1e-5) and --init-from reads back bit for bit. Step 1 then
    exported over it (--overwrite, one file) leaves that model alone in the folder, beside a file that is not
    the model (a tokenizer's): the index and the shards are gone, and --init-from reads step 1's weights.
    (Before, the stale index and shards stayed, and --init-from and generate.py --hf-dir read step 2's.)"""
    import transformers
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    common.single_device_run("--checkpoint-dir", ckpt, "--checkpoint-every", 1, steps=2)
    export_hf.main(["--checkpoint-dir", str(ckpt), "--out", str(out), "--step", "2",
                    "--max-shard-mb", "0.0625"])
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and sorted(p.name for p in out.iterdir()) == [
        "config.json", *shards, "model.safetensors.index.json"]
    _, config, step_2, _ = export_hf.read_checkpoint(ckpt, 2)
    assert init_from(out).keys() == step_2.keys()
    assert all(torch.equal(value, step_2[name]) for name, value in init_from(out).items())
    ours = modeling.LlamaForCausalLM(config)
    ours.load_state_dict(step_2)
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    (out / "tokenizer.json").write_text("{}")
    export_hf.main(["--checkpoint-dir", str(ckpt), "--out", str(out), "--step", "1", "--overwrite"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]              # no scratch folder left
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    step_1 = export_hf.read_checkpoint(ckpt, 1)[2]
    assert all(torch.equal(value, step_1[name]) for name, value in init_from(out).items())
