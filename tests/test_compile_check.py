"""kernels/compile_check.py: the Triton launches compiled for real GPUs on this CPU, and its verdicts.

The suite compiles a share of what `python kernels/compile_check.py` compiles in full (kernels/README.md
has that command and its cost): FlashAttention's launches in the bench, forward and both backward kernels
at head dims 64 and 128 with every config their autotune lists keep, for an H100 (sm_90) through Triton's
own compiler and the ptxas its wheel ships. Each must compile, fit 227 KiB of shared memory and spill
nothing. Then FlashAttention's launches as the GPU tests make them, recorded only: caller-fixed tiles run
one config, autotune keeps each dtype's own. Both run in a fresh interpreter: another test of this
process may have switched Triton to its CPU interpreter (tests/test_kernels.py), and this compiles for a
GPU. The verdict rules (what fails the check, what is only shown) are checked on their own.
"""
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
ATTENTION = ("_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel")


@pytest.mark.timeout(300)
def test_flash_attention_launches_of_the_bench_compile_for_an_h100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = ["--workload", "bench", "--arch", "90", "--jobs", "1", *(f"--kernel={k}" for k in ATTENTION)]
    done = subprocess.run([sys.executable, "kernels/compile_check.py", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(ATTENTION)]
    assert {r[0] for r in rows} == set(ATTENTION) and all(r[1] == "sm_90" for r in rows)
    assert {re.search(r"HEAD_DIM=(\d+)", " ".join(r)).group(1) for r in rows} == {"64", "128"}
    for kernel, _, registers, spilled, shared, *_ in rows:
        assert int(registers) <= 255 and spilled == "0" and int(shared) <= 227, (kernel, registers, spilled)
    assert re.search(rf"{len(rows)} compiles of {len(rows)} launches, .* 0 failed the check", done.stdout)


def test_caller_tiles_launch_once_and_autotune_keeps_each_dtypes_own_tiles():
    """FlashAttention as the GPU tests call it (`--list`: recorded, not compiled): tiles a test fixes are
    one launch per kernel (4 warps; the backward autotuned 4 configs each before), and autotune keeps a
    launch's own tiles: float32's 32 × 16 alone, bf16 at hd 128 FORWARD_TILES' two."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "kernels/compile_check.py", "--workload", "tests", "--list",
                           *(f"--kernel={k}" for k in ATTENTION)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    launches = [line.split(" (")[0].split() for line in done.stdout.splitlines()]
    fixed = [x for x in launches if x[1] == "fixed"]
    gqa = [x for x in fixed if "HEAD_DIM=16" in x and x[2] == "float32" and "CAUSAL=True" in x]
    assert sorted(x[0] for x in gqa) == sorted(ATTENTION)       # one launch of each kernel
    assert all(x[-2:] == (["w4", "s2"] if x[0] == ATTENTION[0] else ["w4", "s1"]) for x in fixed)
    tuned = [x for x in launches if x[1] == "autotuned"]
    assert {tuple(x[-4:]) for x in tuned if x[0] == ATTENTION[0] and x[2] == "float32"} == {
        ("BLOCK_M=32", "BLOCK_N=16", "w8", "s1")}
    assert all(x[-2:] == ["w8", "s1"] for x in tuned if x[2] == "float32")
    bf16_hd128 = {tuple(x[-4:]) for x in tuned if x[0] == ATTENTION[0] and "HEAD_DIM=128" in x
                  and x[2] != "float32"}
    assert bf16_hd128 == {("BLOCK_M=128", "BLOCK_N=64", "w8", "s3"), ("BLOCK_M=64", "BLOCK_N=32", "w4", "s4")}


def test_verdicts():
    """A compile error, shared memory over the GPU's limit, or a spill in a config the kernels choose
    fails the check; a spill in tiles a caller fixed (the tests' small ones) is only shown."""
    from kernels import compile_check as cc

    attention, rmsnorm = (SimpleNamespace(__name__=n) for n in ("_attn_fwd_kernel", "_rmsnorm_fwd_kernel"))
    fine = dict(error=None, registers=200, spilled=0, shared=100 * 1024)
    tuned, fixed = cc.Launch(attention, (), {}, tuned=True), cc.Launch(attention, (), {}, tuned=False)
    assert cc.verdict(tuned, 90, fine) == "" and cc.verdict(fixed, 80, fine) == ""
    assert cc.verdict(tuned, 90, dict(fine, error="PTXASError: ...")) == "compile error"
    assert cc.verdict(tuned, 90, dict(fine, shared=228 * 1024)) == "shared memory 228 KiB > 227 KiB"
    assert cc.verdict(tuned, 80, dict(fine, shared=164 * 1024)) == "shared memory 164 KiB > 163 KiB"
    assert cc.verdict(tuned, 90, dict(fine, spilled=8)) == "spills 8 B"
    assert cc.verdict(fixed, 90, dict(fine, spilled=8)) == ""
    # a launch whose config the kernel's own wrapper fixes: its choice, so its spill fails
    assert cc.verdict(cc.Launch(rmsnorm, (), {}, tuned=False), 90, dict(fine, spilled=8)) == "spills 8 B"
