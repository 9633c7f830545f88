"""Every Triton launch of the trainer and the bench, compiled on the CPU for an H100 (sm_90) and an A100.

Triton compiles ahead of time for a GPU it has not got: `triton.compile` with a `GPUTarget` lowers each
launch to PTX, and the ptxas its wheel ships turns that into a cubin, reporting (-v) the registers a
thread uses and the bytes it spills to local memory. A spill is a load and a store to memory per use
where a register would do; a block needing more shared memory than the GPU has cannot launch.

The launches are the code's own, recorded, not written down twice: each workload runs the kernels' Python
wrappers with Triton's launch replaced by a recorder, and an autotuned launch counts once for every
config its pruning keeps. Each launch is specialised as Triton's JIT would specialise it (dtypes, 16-byte
alignment, integers divisible by 16), so the cubin is the one the GPU would build.
  train   01's model (1 layer, seq 64, mbs 2, CPU) at both 1B shapes, under both precision layouts, with
          --kernels triton --attn triton: forward and backward
  bench   kernels/bench.py's run at its Llama shapes, bf16, on fake tensors (no memory, no arithmetic)
  tests   FlashAttention as the GPU runs of tests/test_kernels.py call it (fp32 and bf16, hd 16-128)
It prints, per kernel × config × architecture: registers, spills and shared memory, and exits 1 on a
compile error, on shared memory over the GPU's limit, or on a spill in a launch the kernels choose
(tiles fixed by a caller, the tests' small ones, may spill: shown, not fatal).

    python kernels/compile_check.py                   # everything, both GPUs (kernels/README.md: the cost)
    python kernels/compile_check.py --workload bench --arch 90 --kernel _attn_fwd_kernel
    python kernels/compile_check.py --list            # the launches recorded, compiled or not
"""
import os
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
# Folder names begin with digits, so each folder this one builds on goes on the path and its modules
# are imported by their plain names: `import model` is 01_single_gpu/model.py.
sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), os.path.join(ROOT, "01_single_gpu", "runtime")]

import argparse
import contextlib
import importlib
import io
import itertools
import re
import resource
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile, make_backend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, create_function_from_signature

import cli
import mixed_precision

SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}    # bytes a block may use: H100, A100 (CUDA's tuning guides)
# Launches whose tiles the caller chose (flash_attention(block_m=..., block_n=...)): the tests' small ones
CALLER_TILED = {"_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"}


class Pointer:
    """A tensor argument as Triton's specialisation sees it: its dtype and its address's alignment (the
    caching allocator's blocks start 512-byte aligned, so the offset into the storage decides)."""

    def __init__(self, tensor):
        self.dtype = tensor.dtype
        self.offset = tensor.storage_offset() * tensor.element_size()

    def data_ptr(self):
        return self.offset


@dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict
    tuned: bool                                       # a config of an autotune list
    workloads: set = field(default_factory=set)


def stand_ins(args) -> tuple:
    return tuple(Pointer(a) if isinstance(a, torch.Tensor) else a for a in args)


@contextlib.contextmanager
def recording(workload: str, launches: list):
    """Triton's launches inside the block are appended to `launches` instead of run (no GPU needed)."""
    def jit_run(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, stand_ins(args), kwargs, False, {workload}))

    def autotuned_run(self, *args, grid, warmup, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))          # what early_config_prune reads
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        self.nargs = None
        launches.extend(Launch(self.fn, stand_ins(args), {**kwargs, **c.all_kwargs()}, True, {workload})
                        for c in configs)
    saved = JITFunction.run, Autotuner.run
    JITFunction.run, Autotuner.run = jit_run, autotuned_run
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run = saved


def train_workload(launches):
    """01's forward and backward with every Triton kernel, 1 layer at each 1B shape, both layouts."""
    import build
    from kernels import gpu_matrix, patch
    train = importlib.import_module("01_single_gpu.train")
    for shape, layout in itertools.product(gpu_matrix.SHAPES, ("bf16-20", "autocast")):
        argv = [*gpu_matrix.SHAPES[shape], "--dtype", "bfloat16", "--precision-layout", layout,
                "--num-layers", "1", "--seq-len", "64", "--mbs", "2", "--dataset", "synthetic"]
        # Parsed with the torch kernels (this machine cannot run Triton's), then switched: the shapes count
        args = cli.with_values(cli.parse_args(train.build_parser(), argv, files=False), kernels="triton",
                               attn="triton")
        config = cli.model_config(args, 257)
        # apply_kernels checks that Triton can run here; nothing runs, the launches are recorded
        check, patch._check_triton_can_run = patch._check_triton_can_run, lambda: None
        try:
            model = build.build_model(args, config).to_empty(device="cpu").to(build.param_dtype(args))
        finally:
            patch._check_triton_can_run = check
        ids = torch.randint(0, config.vocab_size, (args.mbs, args.seq_len + 1))
        with recording(f"train {shape} {layout}", launches), mixed_precision.autocast(args, ids.device):
            loss = model(ids[:, :-1], labels=ids[:, 1:])
            loss.backward()


def bench_workload(launches):
    """kernels/bench.py's own run (every shape, no torch.compile) on fake tensors: each call once."""
    from kernels import bench
    bench.DEVICE = "cpu"
    with FakeTensorMode(), recording("bench", launches), contextlib.redirect_stdout(io.StringIO()):
        rows, _ = bench.run_all(argparse.Namespace(quick=False, compile=False, largest=False, only=None),
                                lambda fn: fn() or 1.0,
                                {"matmul_bf16_tflops": 1.0, "copy_gbps": 1.0})
    failed = [f"{r['kernel']} {r['shape']} {r['pass_']}: {r['error']}" for r in rows
              if r["impl"] == "triton" and r.get("error")]
    if failed:       # a launch not recorded would go unchecked
        raise RuntimeError(f"the bench's Triton calls failed on the meta device: {failed}")


def tests_workload(launches):
    """FlashAttention as the GPU runs of tests/test_kernels.py call it: dtype, (B, nh, nkv, T, hd), the
    tiles the test fixes (None: the default ones), causal."""
    from kernels import flash_attention as fa
    f32, bf16 = torch.float32, torch.bfloat16
    calls = [(dtype, (1, 4, 2, 37, 16), (16, 16), causal)                   # test_flash_attention_gqa
             for dtype in (f32, bf16) for causal in (True, False)]
    calls += [(f32, (1, 2, 2, 40, 24), (16, 32), True),                     # ..._padded_head_dim_unequal_...
              (bf16, (1, 4, 2, 100, 80), (64, 32), True),                   # ..._tutorial_tiling (GPU: bf16)
              (f32, (1, 4, 2, 70, 80), None, True)]                         # ..._default_tiles
    calls += [(dtype, (1, 8, 2, 1000, hd), None, True) for dtype in (f32, bf16) for hd in (64, 80, 128)]
    with FakeTensorMode(), recording("tests", launches):
        for dtype, (B, nh, nkv, T, hd), tiles, causal in calls:
            q, k, v = (torch.empty(B, h, T, hd, dtype=dtype, requires_grad=True) for h in (nh, nkv, nkv))
            o = fa.flash_attention(q, k, v, causal, None, *(tiles or (None, None)))
            torch.autograd.grad(o, (q, k, v), torch.empty_like(o))


WORKLOADS = {"train": train_workload, "bench": bench_workload, "tests": tests_workload}


def specialise(launch: Launch, arch: int):
    """(ASTSource, options) as JITFunction.run builds them for this launch on this GPU."""
    fn, backend = launch.kernel, make_backend(GPUTarget("cuda", arch, 32))
    kwargs = dict(launch.kwargs, debug=False)
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(
        *launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options


def distinct(launches):
    """One Launch per distinct compile (kernel, specialisation, options) on sm_90, workloads merged."""
    kept = {}
    for launch in launches:
        src, options = specialise(launch, 90)
        key = (launch.kernel.__name__, src.hash(), str(options))
        if key in kept:
            kept[key].workloads |= launch.workloads
            kept[key].tuned |= launch.tuned
        else:
            kept[key] = launch
    return list(kept.values())


def compile_for(launch: Launch, arch: int) -> dict:
    """Compile one launch for sm_<arch>: registers, spills and shared memory, or the error; the CPU-seconds
    it took here and in ptxas."""
    started = cpu_seconds()
    out = io.StringIO()
    try:
        src, options = specialise(launch, arch)
        with knobs.compilation.scope(), knobs.nvidia.scope(), knobs.cache.scope(), \
                tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(out):
            knobs.cache.dir = cache                    # a fresh cache: ptxas runs and prints its -v report
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton_compile(src, target=GPUTarget("cuda", arch, 32), options=options.__dict__)
        log = out.getvalue()
        registers = int(re.search(r"Used (\d+) registers", log).group(1))
        spilled = sum(map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups()))
        result = dict(registers=registers, spilled=spilled, shared=compiled.metadata.shared, error=None)
    except Exception as error:        # a compile error is this launch's result; the others still run
        result = dict(registers=None, spilled=None, shared=None,
                      error=f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}")
    return dict(result, seconds=cpu_seconds() - started)


def cpu_seconds() -> float:
    """This process's CPU time and that of its finished children (ptxas)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def describe(launch: Launch) -> str:
    dtypes = sorted({str(a.dtype).removeprefix("torch.") for a in launch.args if isinstance(a, Pointer)})
    constants = " ".join(f"{k}={v}" for k, v in launch.kwargs.items()
                         if k.isupper() and k not in ("PRECISION",) and not k.startswith("stride"))
    return (f"{'/'.join(dtypes)} {constants} w{launch.kwargs.get('num_warps', 4)}"
            f" s{launch.kwargs.get('num_stages', 3)}")


def verdict(launch: Launch, arch: int, result: dict) -> str:
    """'' if fine, else why this compile fails the check."""
    if result["error"]:
        return "compile error"
    if result["shared"] > SHARED_LIMIT[arch]:
        return f"shared memory {result['shared'] / 1024:.0f} KiB > {SHARED_LIMIT[arch] // 1024} KiB"
    caller_tiled = launch.kernel.__name__ in CALLER_TILED and not launch.tuned
    if result["spilled"] and not caller_tiled:
        return f"spills {result['spilled']} B"
    return ""


_LAUNCHES = []   # what the forked compile workers read (a JITFunction does not pickle)


def _compile_job(job):       # (index into _LAUNCHES, arch)
    return compile_for(_LAUNCHES[job[0]], job[1])


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), action="append",
                   help="record these (default: all)")
    p.add_argument("--arch", type=int, choices=sorted(SHARED_LIMIT), action="append",
                   help="compile for sm_<arch> (default: 90 and 80)")
    p.add_argument("--kernel", action="append", help="only kernels of this name (default: all)")
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiles in parallel")
    p.add_argument("--list", action="store_true", help="print the recorded launches; compile nothing")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if knobs.runtime.interpret:
        p.error("TRITON_INTERPRET is set: this compiles for a GPU; unset it")
    started = time.process_time()
    recorded = []
    for name in args.workload or sorted(WORKLOADS):
        WORKLOADS[name](recorded)
    launches = [x for x in distinct(recorded) if not args.kernel or x.kernel.__name__ in args.kernel]
    if args.list:
        for launch in launches:
            print(f"{launch.kernel.__name__:<26}{'autotuned' if launch.tuned else 'fixed':<10} "
                  f"{describe(launch)} ({', '.join(sorted(launch.workloads))})")
        return 0
    archs = args.arch or sorted(SHARED_LIMIT, reverse=True)
    _LAUNCHES[:] = launches
    jobs = [(i, arch) for i in range(len(launches)) for arch in archs]
    print(f"{'kernel':<26}{'arch':<7}{'registers':>10}{'spilled B':>10}{'shared KiB':>11}{'CPU-s':>7}  "
          f"config (workloads)", flush=True)
    failures, results = [], []
    pool = ProcessPoolExecutor(args.jobs, mp_context=get_context("fork")) if args.jobs > 1 else None
    with pool or contextlib.nullcontext():
        for (i, arch), result in zip(jobs, pool.map(_compile_job, jobs) if pool else map(_compile_job, jobs)):
            results.append(result)
            report(launches[i], arch, result, failures)
    print(f"{len(results)} compiles of {len(launches)} launches, {sum(r['seconds'] for r in results):.0f} "
          f"CPU-s compiling ({time.process_time() - started:.0f} CPU-s in this process); "
          f"{len(failures)} failed the check")
    for line in failures:
        print(f"FAILED {line}")
    return 1 if failures else 0


def report(launch: Launch, arch: int, result: dict, failures: list):
    """One line of the table; a failure also goes into `failures`."""
    why = verdict(launch, arch, result)
    if why:
        failures.append(f"{launch.kernel.__name__} sm_{arch} {describe(launch)}: {why}"
                        + (f" ({result['error']})" if result["error"] else ""))
    shared = "-" if result["shared"] is None else f"{result['shared'] / 1024:.0f}"
    print(f"{launch.kernel.__name__:<26}sm_{arch:<4}{result['registers'] or '-':>10}"
          f"{'-' if result['spilled'] is None else result['spilled']:>10}{shared:>11}"
          f"{result['seconds']:>7.1f}  {describe(launch)}{' autotuned' if launch.tuned else ''} "
          f"({', '.join(sorted(launch.workloads))}){'  <- ' + why if why else ''}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
