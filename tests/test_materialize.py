"""Shard before you materialise: every layout holds 01's values, and a sharded rank never holds the model.

In-process (float32, exact): a meta model sliced by TP (any rank of tp 4), by EP (07's experts) or read
from an HF directory holds, once materialised, exactly the slices of 01's materialised model: a value
depends only on (seed, name) or on the file, never on the layout (materialize.py).

Measured (RSS, one step of a ~114M-parameter Llama: 12 layers of 768, 12 heads, FFN 3072): each rank's
peak RSS grows, while it builds and trains, by less than half of what one full fp32 replica and its AdamW
states need (12 bytes per parameter: 4 + 8, so the bound is 6Ψ), for ZeRO-3 over dp 4 and for tp 4; 01 on
the same model grows by more. And while building, a rank holds its own parameters plus about one full
tensor (slack 16 MB). The growth is counted from the start of the trainer's `run` (tests/peak_memory.py),
after Python, torch, the data and the process group exist. glibc raises its mmap threshold after big
frees and then keeps freed tensors in its heap, which RSS would count; MALLOC_MMAP_THRESHOLD_ fixes the
threshold at 1 MiB so that freed tensors go back to the system and RSS shows what the run holds.
"""
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import common
import model as modeling
import global_state
import materialize
import hf_io
import tensor_parallel
import moe


ROOT = Path(__file__).resolve().parents[1]
CONFIG = modeling.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4)


def materialised(model, init_from=None, seed=7):
    return materialize.materialize(model, materialize.Source(model, materialize.Initializer(seed, init_from),
                                                             torch.float32, "cpu"))


def meta_model():
    with torch.device("meta"):
        return modeling.LlamaForCausalLM(CONFIG)


def check_slices(local, full):
    """Every parameter of `local` (a sliced model) equals its block of the same-named one of `full`."""
    reference = dict(full.named_parameters())
    for name, p in local.named_parameters():
        block = materialize.block_of(p)
        assert not p.is_meta and block.shape == tuple(reference[name].shape), name
        expected = reference[name].narrow(block.dim, block.start, block.stop - block.start)
        assert torch.equal(p.detach(), expected), name


@pytest.mark.parametrize("init_from", [False, True], ids=["seeded", "init-from"])
def test_tensor_parallel_ranks_materialise_slices_of_01(tmp_path, init_from):
    directory = None
    if init_from:
        source_model = modeling.LlamaForCausalLM(CONFIG)                # any weights: the file decides
        hf_io.save_hf(source_model, tmp_path)
        directory = tmp_path
    full = materialised(meta_model(), directory)
    if init_from:
        for name, p in full.named_parameters():
            assert torch.equal(p, source_model.get_parameter(name)), name
    for rank in range(4):
        model = meta_model()
        tensor_parallel.apply_tensor_parallel(model, SimpleNamespace(tp_rank=rank, tp_size=4, tp_group=None))
        check_slices(materialised(model, directory), full)


def test_experts_materialise_by_name():
    """07's experts on a meta model equal those apply_moe draws on a real one; keeping a slice (EP) keeps
    the same values for the kept experts; upcycling from a dense checkpoint copies its MLP."""
    real = materialised(meta_model())
    moe.apply_moe(real, 4, 2, 0.01, seed=7)
    meta = meta_model()
    moe.apply_moe(meta, 4, 2, 0.01, seed=7)
    for block in moe.moe_blocks(meta):                                   # keep experts 2 and 3 (ep rank 1)
        block.experts.keep(2, 4)
    kept, full = materialised(meta).state_dict(), real.state_dict()         # 01's per-expert names
    assert set(kept) < set(full) and "model.layers.0.mlp.experts.2.up_proj.weight" in kept
    assert "model.layers.0.mlp.experts.1.up_proj.weight" not in kept
    for name, value in kept.items():
        assert torch.equal(value, full[name]), name
    # A flat range across the stacks (a ZeRO unit's shard, 03/08) names each expert's elements it holds.
    experts = moe.moe_blocks(meta)[0].experts                           # experts 2, 3 of layer 0
    params, flat = [experts.gate_proj, experts.down_proj], torch.cat([experts.gate_proj.flatten(),
                                                                      experts.down_proj.flatten()])
    lo, hi, size = experts.gate_proj[0].numel() // 2, flat.numel() - 7, experts.gate_proj[0].numel()
    segments = global_state.flat_segments(params, [0, 2 * size, 4 * size], lo, hi)
    assert [s.name.split("experts.")[1] for s in segments] == ["2.gate_proj.weight", "3.gate_proj.weight",
                                                               "2.down_proj.weight", "3.down_proj.weight"]
    assert sum(s.flat_stop - s.flat_start for s in segments) == hi - lo
    for s in segments:
        piece = flat[lo + s.offset:lo + s.offset + s.flat_stop - s.flat_start]
        assert torch.equal(piece, full[s.name].flatten()[s.flat_start:s.flat_stop]), s


def test_upcycling_reads_the_dense_mlp(tmp_path):
    dense = modeling.LlamaForCausalLM(CONFIG)
    hf_io.save_hf(dense, tmp_path)
    model = meta_model()
    moe.apply_moe(model, 4, 2, 0.01, seed=7)
    materialised(model, tmp_path)
    for layer, dense_layer in zip(model.model.layers, dense.model.layers, strict=True):
        for name, p in layer.mlp.experts.named_parameters():             # (E, F, C): E copies of (F, C)
            assert torch.equal(p, dense_layer.mlp.get_parameter(f"{name}.weight").expand_as(p)), name


BIG = ["--hidden-size", 768, "--intermediate-size", 3072, "--num-layers", 12, "--num-heads", 12,
       "--num-kv-heads", 12, "--seq-len", 8, "--mbs", 1, "--steps", 1, "--warmup-steps", 1, "--no-progress"]


def peak_memory(tmp_path, runs):
    """{module: each rank's {"growth", "built", "parameters"} (bytes)} for one step of the big model, for
    each (module, ranks, flags) of `runs`."""
    text = tmp_path / "fox.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 2000)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(MALLOC_MMAP_THRESHOLD_=str(2**20), OMP_NUM_THREADS="1", PEAK_MEMORY_DIR=str(tmp_path))
    # Ranks forked after the imports, one run after the other, from one launcher (tests/exit_launcher.py,
    # torchrun's environment): torchrun would start an interpreter per rank and one for its agent, ~5 CPU-s
    # each, before the baseline is even taken.
    groups = [(1, ranks, "tests/peak_memory.py", [module, *BIG, *flags, "--dataset", text])
              for module, ranks, flags in runs]
    done = subprocess.run(common.exit_launcher(groups), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = {module: [json.loads(path.read_text())
                        for path in sorted(tmp_path.glob(f"{module}.rank*.json"))] for module, _, _ in runs}
    assert [len(results[module]) for module, _, _ in runs] == [ranks for _, ranks, _ in runs]
    return results


@pytest.mark.timeout(900)
def test_sharded_ranks_hold_a_fraction_of_the_model(tmp_path):
    psi = 12 * (4 * 768 * 768 + 3 * 768 * 3072 + 2 * 768) + 2 * 320 * 768 + 768         # parameters
    bound = 6 * psi                                  # half of an fp32 replica (4Ψ) and its AdamW states (8Ψ)
    largest = 3072 * 768 * 4                         # bytes of the biggest full tensor (gate/up/down)
    measured = peak_memory(tmp_path, [("03_zero.train", 4, ("--dp", 4, "--zero-stage", 3)),
                                      ("04_tensor_parallel.train", 4, ("--tp", 4, "--dp-mode", "naive")),
                                      ("01_single_gpu.train", 1, ())])
    for what, module in (("zero-3 dp 4", "03_zero.train"), ("tp 4", "04_tensor_parallel.train")):
        for run in measured[module]:
            assert run["growth"] < bound, (what, run, bound)
            assert psi <= run["parameters"] < 1.02 * psi, (what, run)   # Ψ/4 × 4 bytes, + norms and padding
            # ZeRO-3 also allocates its gradient shard (as large as its parameter shard) when it builds
            held = run["parameters"] * (2 if what.startswith("zero") else 1)
            assert run["built"] < held + largest + 16 * 2**20, (what, run)
    single, = measured["01_single_gpu.train"]
    assert single["parameters"] == 4 * psi and single["growth"] > bound, single
