"""GPU time and launch count of one call, reported by bench.py beside its CUDA-event time.

bench.py's Timer records a CUDA event, enqueues the call, records another. When the call's GPU work is
shorter than the host's time to enqueue it (the Python wrapper, autograd's bookkeeping, each launch),
the GPU waits for the host between kernels and the events time the host. On the H200 RMSNorm's and
RoPE's forward + backward took a fixed 0.2-0.4 ms at every shape that way (kernels/README.md).

GPU time here: hold the stream first. A sleep kernel (torch.cuda._sleep) keeps the GPU busy while the
host enqueues the start event, the call and the end event, so the GPU then runs them back to back and
the events measure only its work. The sleep lasts twice the host's enqueue time of the call (measured
just before) plus 0.5 ms. Why this method: it keeps Timer's events and L2 flush, so gpu_ms and ms
compare directly and their difference is the host's overhead; a CUDA graph would also hide the host
but cannot capture every call (autotuning, allocations, host syncs), and the profiler's sum of kernel
durations would drop the GPU's own gaps between kernels. torch.cuda._sleep exists in torch 2.11 and 2.13.

Launches: the GPU operations (kernels, memsets, copies) of one call, counted by torch.profiler's CUDA
activity. Only a GPU can run this file; tests/test_kernels.py checks it there.
"""
import statistics
import time

import torch

SLEEP_MARGIN_MS = 0.5


def count_launches(fn) -> int:
    """GPU operations one call of fn runs (its kernels, memsets and copies), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


class GpuTime:
    """gpu(fn) -> {"gpu_ms": median GPU milliseconds with the host's enqueue hidden, "launches": count},
    over timer.iters calls, each after timer's L2 flush. fn must be warm (Timer ran it)."""

    def __init__(self, timer):
        self.timer = timer
        self.cycles_per_ms = self._calibrate()

    @staticmethod
    def _calibrate(cycles: int = 20_000_000) -> float:
        """Sleep-kernel cycles per millisecond at the GPU's current clock."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles // 10)                       # first launch out of the way
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        return cycles / start.elapsed_time(end)

    def host_ms(self, fn) -> float:
        """The host's time to enqueue one call (the GPU idle at the start, as in the timed calls)."""
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        return max(times)

    def __call__(self, fn) -> dict:
        sleep_cycles = int(self.cycles_per_ms * (2 * self.host_ms(fn) + SLEEP_MARGIN_MS))
        times = []
        for _ in range(self.timer.iters):
            self.timer.l2_flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()                # the GPU idle, so the sleep starts as it is enqueued
            torch.cuda._sleep(sleep_cycles)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return {"gpu_ms": statistics.median(times), "launches": count_launches(fn)}
