"""Tensor parallelism beyond the key/value heads: at tp > kv heads each kv head lives on tp/kv ranks.

Llama-3 70B has 8 kv heads; tp 16 would otherwise be refused. Here the tiny Llama (4 query heads, 2 kv
heads) at tp 4: ranks 0-1 hold kv head 0, ranks 2-3 kv head 1, each rank one query head of that head's
group. The copies of a head see different query heads, so their gradients are partial: the step sums
them over the ranks holding the head, and the norm counts each head once. Whole runs against 01, float32
(tolerances of tests/test_tensor_parallel.py: losses 1e-5 relative, parameters 2e-5): 04 tp 4, 05 tp 4 +
sp, and 08 tp 2 × pp 2 with one kv head and ZeRO-1 over dp... (the 4 ranks there: tp 2 × pp 2); a
checkpoint saved at tp 4 resumes on one device with 01's losses (each head written once).
"""
from importlib import import_module

import pytest
import torch

import common
from harness import run_ranks
from test_tensor_parallel import LOSS, PARAMS, reference, shard_like, train_layout

LAYOUTS = [("04_tensor_parallel.train", ["--tp", "4", "--dp-mode", "naive"]),
           ("05_sequence_context_parallel.train", ["--tp", "4", "--sp"]),
           ("08_5d_combined.train", ["--tp", "2", "--pp", "2", "--num-kv-heads", "1", "--grad-acc", "2",
                                     "--mbs", "2"])]


def _runs(checkpoint_dir):
    results = [train_layout(layout) for layout in LAYOUTS[:2]]
    stages = import_module("08_5d_combined.train").main(common.argv(*LAYOUTS[2][1], steps=3))
    import pipeline
    records = stages[0]
    results.append(([r["loss"] for r in records], [r["grad_norm"] for r in records],
                    {pipeline.single_device_name(k): v.detach().numpy().copy()
                     for k, v in stages[1].state_dict().items()}))
    import_module("04_tensor_parallel.train").main(common.argv("--tp", "4",
                                                               "--checkpoint-dir", checkpoint_dir,
                                                               "--lr-decay-steps", 4, steps=2))
    return results


def expected_block(full, local, name, tp_rank, tp, kv_heads):
    """k/v at tp > kv heads: the whole kv head tp_rank // (tp/kv); every other weight: its TP shard."""
    if name.endswith(("k_proj.weight", "v_proj.weight")) and tp > kv_heads:
        return full.chunk(kv_heads, dim=0)[tp_rank // (tp // kv_heads)]
    return shard_like(full, local, tp_rank, tp)


def check(per_rank, ref, tp, kv_heads, tp_rank_of=lambda rank: rank):
    ref_losses, ref_norms, ref_state = ref
    for rank, (losses, norms, state) in enumerate(per_rank):
        torch.testing.assert_close(losses, ref_losses, **LOSS)
        torch.testing.assert_close(norms, ref_norms, **LOSS)
        for name, local in state.items():
            local = torch.from_numpy(local)
            expected = expected_block(ref_state[name], local, name, tp_rank_of(rank), tp, kv_heads)
            torch.testing.assert_close(local, expected, **PARAMS, msg=lambda m: f"rank {rank} {name}: {m}")


def test_tp_beyond_kv_heads_matches_single_device(tmp_path):
    per_rank = run_ranks(_runs, 4, args=(str(tmp_path / "ckpt"),), timeout=300)
    check([r[0] for r in per_rank], reference(), tp=4, kv_heads=2)
    check([r[1] for r in per_rank], reference(), tp=4, kv_heads=2)
    check([r[2] for r in per_rank], reference("--num-kv-heads", "1", mbs=2, grad_acc=2), tp=2, kv_heads=1,
          tp_rank_of=lambda rank: rank % 2)                       # 08's grid: tp fastest
    full = import_module("01_single_gpu.train").main(common.argv("--lr-decay-steps", 4, steps=4))[0]
    resumed = import_module("01_single_gpu.train").main(common.argv(
        "--lr-decay-steps", 4, "--checkpoint-dir", tmp_path / "ckpt", "--resume", steps=4))[0]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in full[2:]], rel=1e-5)
