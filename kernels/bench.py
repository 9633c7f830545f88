"""Time the Triton kernels against eager PyTorch, torch.compile and (for attention) SDPA on one GPU.

Playbook chapter 4: §4.0.2 "try torch.compile first", §4.0.7 fusion, §4.0.8 FlashAttention. Timing
follows App. 5.1.8: CUDA events around each call, after warm-up calls, with L2 evicted before every
timed call (a 256 MB buffer written), on Llama-sized bf16 shapes, forward only (under no_grad) and
forward + backward. It reports:
  memory-bound kernels (RMSNorm, SwiGLU, RoPE): effective bandwidth = the minimum bytes the operation
      must move / time (the per-kernel byte formulas: kernels/README.md), and the fraction of the
      device-to-device copy bandwidth measured in the same run;
  attention: TFLOP/s, forward 4·B·nh·T²·hd (halved when causal), backward 2.5× the forward, and the
      fraction of an 8192³ bf16 matmul measured in the same run;
  fused linear cross-entropy: TFLOP/s of its GEMMs (2·N·V·C forward, 6·N·V·C with backward), and the
      peak extra memory of forward + backward against eager (torch.cuda.max_memory_allocated).
Beside the event time each row has the GPU time (the events with the host's enqueue hidden behind a
sleep kernel) and the call's GPU launches: kernels/gpu_timer.py says how and why.

    python kernels/bench.py                    # every shape, with torch.compile (~10-20 min)
    python kernels/bench.py --quick --no-compile --plot
    python kernels/bench.py --largest --no-compile --only attention --results DIR --append   # gpu_run.py
    python kernels/bench.py --plot-from kernels/results/<device>.json     # redraw, no GPU needed
Writes kernels/results/<device>.md and <device>.json (device, torch / Triton / CUDA versions, every row),
rewritten as each row finishes, so a run cut short keeps its rows; --plot also <device>.png: one panel per
kernel (% of the measured peak per shape, pass and implementation) and one of the fused cross-entropy's
peak extra memory.
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu")]
from pathlib import Path

import argparse
import json
import statistics
import time

import torch

from kernels import bench_plot
from kernels.bench_results import RESULTS, earlier_results, format_row, gib_text, merged, write_results

DEVICE = "cuda"           # the one place the device is named
DTYPE = torch.bfloat16
# (tokens N = seq at batch 1, hidden C, intermediate F): Llama-3.2-1B and Llama-3-8B widths
ROW_SHAPES = [(2048, 2048, 8192), (8192, 2048, 8192), (2048, 4096, 14336), (8192, 4096, 14336)]
# B, nh, nkv, T, hd: Llama-3-8B's attention (hd 128) and Llama-3.2-1B's (hd 64); the last one is the
# largest, which report.py shows
ATTN_SHAPES = [(1, 32, 8, 2048, 128), (1, 32, 8, 2048, 64), (1, 32, 8, 8192, 64), (1, 32, 8, 8192, 128)]
CE_SHAPES = [(2048, 2048, 128256), (8192, 4096, 128256)]       # N tokens, C, V (Llama-3 vocabulary)
EAGER_ATTN_MAX_T = 4096   # beyond it, eager's (B, nh, T, T) float32 scores and their gradients exceed 30 GB
KERNELS = ("rmsnorm", "swiglu", "rope", "attention", "linear+cross-entropy")      # --only's names


class Timer:
    """Median milliseconds of fn() over `iters` calls, each timed by its own pair of CUDA events."""

    def __init__(self, warmup: int, iters: int):
        self.warmup, self.iters = warmup, iters
        self.l2_flush = torch.empty(256 * 2**20, dtype=torch.int8, device=DEVICE)

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):              # also triggers Triton JIT and torch.compile
            fn()
        events = []
        for _ in range(self.iters):
            self.l2_flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()                  # the CPU only queued the work; wait before reading events
        return statistics.median(s.elapsed_time(e) for s, e in events)


def measure_peaks(timer):
    """What this GPU reaches on the two things kernels can be bound by: bf16 GEMM and HBM copy."""
    n = 8192
    a, b = torch.randn(n, n, device=DEVICE, dtype=DTYPE), torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    mm_ms = timer(lambda: a @ b)
    x = torch.empty(2**29, device=DEVICE, dtype=DTYPE)                  # 1 GiB
    y = torch.empty_like(x)
    copy_ms = timer(lambda: y.copy_(x))
    return {"matmul_bf16_tflops": 2 * n**3 / mm_ms / 1e9, "copy_gbps": 2 * x.numel() * 2 / copy_ms / 1e6}


def forward_only(fn, inputs):
    def run():
        with torch.no_grad():
            fn(*inputs)
    return run


def forward_backward(fn, inputs, grad_out):
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    def run():   # autograd.grad, not backward(): no .grad accumulation kernels in the timing
        torch.autograd.grad(fn(*inputs), wrt, grad_out)
    return run


def bench(rows, timer, peaks, kernel, shape, impls, inputs, grad_out, unit, work_fwd, work_fwd_bwd,
          gpu=None, on_row=None):
    """One row per implementation and pass; gpu(run) -> {"gpu_ms", "launches"} (gpu_timer.GpuTime) adds
    the GPU time, its fraction of the peak and the launch count; on_row() after each row."""
    peak = peaks["copy_gbps"] if unit == "GB/s" else peaks["matmul_bf16_tflops"]
    to_rate = 1e6 if unit == "GB/s" else 1e9           # bytes/ms -> GB/s, FLOP/ms -> TFLOP/s
    for impl, fn in impls.items():
        for pass_name, run, work in (("fwd", forward_only(fn, inputs), work_fwd),
                                     ("fwd+bwd", forward_backward(fn, inputs, grad_out), work_fwd_bwd)):
            row = dict(kernel=kernel, shape=shape, impl=impl, pass_=pass_name, unit=unit)
            try:
                ms = timer(run)
                row.update(ms=ms, rate=work / ms / to_rate, of_peak=work / ms / to_rate / peak)
            except Exception as e:   # an OOM or a compile failure is a result too; keep going
                row.update(ms=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
                torch.cuda.empty_cache()
            if gpu is not None and row["ms"] is not None:
                try:
                    row.update(gpu(run))
                    row.update(gpu_of_peak=work / row["gpu_ms"] / to_rate / peak)
                except Exception as e:   # e.g. no profiler on this machine: the event time still stands
                    row.update(gpu_ms=None, launches=None, gpu_error=f"{type(e).__name__}: {str(e)[:120]}")
            rows.append(row)
            print(format_row(row), flush=True)
            if on_row:
                on_row()


def peak_extra_gib(fn, inputs):
    """Peak memory above what was allocated before one forward + backward, in GiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    forward_backward(fn, inputs, None)()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def run_all(args, timer, peaks, gpu=None, on_row=None):
    """Rows and memory entries of the kernels in args.only (all if None), at args.quick's first or
    args.largest's last shape of each (else all); on_row(rows, memory) after each one."""
    from kernels import rmsnorm as rms, swiglu as swi, rope as rot
    from kernels import fused_linear_cross_entropy as flce
    from kernels import flash_attention as fa
    import model as modeling
    import rope
    rows, memory = [], []
    wanted = set(args.only or KERNELS)
    done = on_row or (lambda rows, memory: None)

    def measure(kernel, *rest):     # one kernel's rows at one shape, each implementation and pass
        if kernel in wanted:
            bench(rows, timer, peaks, kernel, *rest, gpu=gpu, on_row=lambda: done(rows, memory))
    take = lambda shapes: shapes[:1] if args.quick else shapes[-1:] if args.largest else shapes  # noqa: E731
    randn = lambda *s, grad=True: (torch.randn(*s, device=DEVICE, dtype=DTYPE)  # noqa: E731
                                   .requires_grad_(grad))

    def impls(reference, triton_fn, **extra):
        torch._dynamo.reset()    # a fresh compile per shape: no silent fallback to eager at the recompile cap
        out = {"eager": reference}
        if args.compile:
            out["torch.compile"] = torch.compile(reference)
        return {**out, **extra, "triton": triton_fn}

    for n, c, f in take(ROW_SHAPES):
        b = 2
        x, w = randn(n, c), randn(c)
        measure("rmsnorm", f"N={n} C={c}",
                impls(lambda x, w: rms.rmsnorm_reference(x, w, 1e-5), lambda x, w: rms.rmsnorm(x, w, 1e-5)),
                (x, w), torch.randn_like(x), "GB/s", 2 * n * c * b, 5 * n * c * b)
        gate, up = randn(n, f), randn(n, f)
        measure("swiglu", f"N={n} F={f}", impls(swi.swiglu_reference, swi.swiglu),
                (gate, up), torch.randn_like(gate), "GB/s", 3 * n * f * b, 8 * n * f * b)
        q = randn(1, c // 128, n, 128)                                         # (B, nh, T, hd)
        head = modeling.LlamaConfig(hidden_size=128, num_attention_heads=1, num_key_value_heads=1,
                                    rope_theta=500000.0)                       # one Llama-3 head, hd 128
        cos, sin = rope.rotary_cos_sin(torch.arange(n, device=DEVICE), head, DTYPE)      # (T, hd)
        measure("rope", f"nh={c // 128} T={n} hd=128", impls(rot.rope_reference, rot.rope),
                (q, cos, sin), torch.randn_like(q), "GB/s", 2 * n * c * b, 4 * n * c * b)

    for B, nh, nkv, T, hd in take(ATTN_SHAPES) if "attention" in wanted else ():
        q, k, v = randn(B, nh, T, hd), randn(B, nkv, T, hd), randn(B, nkv, T, hd)
        sdpa = {"sdpa-flash": sdpa_flash(modeling.sdpa_attention)}
        variants = impls(lambda q, k, v: fa.attention_reference(q, k, v, True), fa.causal_flash_attention,
                         **sdpa)
        if T > EAGER_ATTN_MAX_T:
            variants = {k: fn for k, fn in variants.items() if k in ("sdpa-flash", "triton")}
        flops = 4 * B * nh * T * T * hd / 2                                   # causal: half the scores
        measure("attention", f"B={B} nh={nh} nkv={nkv} T={T} hd={hd}", variants,
                (q, k, v), torch.randn_like(q), "TFLOP/s", flops, 3.5 * flops)

    for n, c, vocab in take(CE_SHAPES) if "linear+cross-entropy" in wanted else ():
        h, w = randn(n, c), (torch.randn(vocab, c, device=DEVICE, dtype=DTYPE) * 0.02).requires_grad_()
        targets = torch.randint(0, vocab, (n,), device=DEVICE)
        variants = impls(flce.linear_cross_entropy_reference, flce.fused_linear_cross_entropy)
        measure("linear+cross-entropy", f"N={n} C={c} V={vocab}", variants,
                (h, w, targets), None, "TFLOP/s", 2 * n * vocab * c, 6 * n * vocab * c)
        for impl, fn in variants.items():
            try:
                gib = peak_extra_gib(fn, (h, w, targets))
            except Exception:   # OOM (the point of the comparison) or a compile failure
                gib = None
                torch.cuda.empty_cache()
            memory.append(dict(shape=f"N={n} C={c} V={vocab}", impl=impl, peak_extra_gib=gib,
                               logits_gib=n * vocab * 2 / 2**30))
            print(f"  peak extra memory of {impl}: {gib_text(gib)} GiB", flush=True)
            done(rows, memory)
    return rows, memory


def sdpa_flash(sdpa_attention):
    """01's sdpa_attention (GQA through enable_gqa, causal) with SDPA pinned to its FlashAttention backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa_attention(q, k, v)
    return run


def main(argv=None):
    p = argparse.ArgumentParser(description="Time the Triton kernels against eager, torch.compile and SDPA")
    p.add_argument("--quick", action="store_true", help="only the first shape of each kernel")
    p.add_argument("--largest", action="store_true", help="only the largest shape of each kernel")
    p.add_argument("--only", nargs="+", choices=KERNELS, help="only these kernels (default: all)")
    p.add_argument("--results", type=Path, default=RESULTS, help="the folder <device>.json and .md go to")
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in the folder's <device>.json (those measured again replaced)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--plot", action="store_true", help="also draw the tables: kernels/results/<device>.png")
    p.add_argument("--plot-from", metavar="JSON", help="only draw a saved result (no GPU needed) beside it")
    p.add_argument("--no-gpu-time", dest="gpu_time", action="store_false",
                   help="skip the GPU time and launch count (kernels/gpu_timer.py)")
    args = p.parse_args(argv)
    if args.plot_from:
        try:
            result = json.loads(Path(args.plot_from).read_text())
        except (OSError, json.JSONDecodeError) as error:
            p.error(f"--plot-from {args.plot_from}: {error}: pass a .json that kernels/bench.py wrote")
        print(f"wrote {bench_plot.plot_results(result, Path(args.plot_from).with_suffix('.png'))}")
        return
    if not torch.cuda.is_available():
        sys.exit("kernels/bench.py needs a CUDA GPU; none is visible. On CPU the kernels are tested, not "
                 "timed: TRITON_INTERPRET=1 pytest tests/test_kernels.py")
    import triton
    torch.manual_seed(0)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, date=time.strftime("%Y-%m-%d"))
    print(f"{meta['device']}: torch {meta['torch']}, Triton {meta['triton']}, CUDA {meta['cuda']}")
    timer = Timer(args.warmup, args.iters)
    peaks = measure_peaks(timer)
    print(f"peaks: {peaks['matmul_bf16_tflops']:.0f} TFLOP/s bf16 matmul, {peaks['copy_gbps']:.0f} GB/s copy")
    from kernels.gpu_timer import GpuTime
    gpu = GpuTime(timer) if args.gpu_time else None
    earlier = earlier_results(args.results, meta["device"]) if args.append else ([], [])

    def write(rows, memory, quiet=True):     # after each row: a run cut short keeps what it measured
        return write_results(meta, peaks, *merged(earlier, rows, memory), args.results, quiet)
    rows, memory = run_all(args, timer, peaks, gpu, on_row=write)
    stem = write(rows, memory, quiet=False)
    if args.plot:
        result = dict(meta, peaks=peaks, rows=rows, memory=memory)
        print(f"wrote {bench_plot.plot_results(result, stem.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
