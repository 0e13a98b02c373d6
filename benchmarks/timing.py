"""Timing helpers shared by the GPU benchmarks (run as `python benchmarks/<script>.py`)."""

import cProfile
import pstats
import statistics
import time

import torch


def median_ms(fn, repeats=20, warmup=3, overlapped=False):
    """Median milliseconds of `fn` by CUDA events around each call. Each call waits for the GPU
    before the next, unless `overlapped`: then the calls run back to back and the host may enqueue
    one call while the GPU runs the previous, as in a training loop."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
        if not overlapped:
            end.synchronize()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def median_step_s(step, steps, warmup=3) -> tuple[float, float]:
    """(median seconds, peak GiB) of `steps` calls of a training `step` after `warmup` ones, each
    timed on the host from its start until the GPU is done with it."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def back_to_back_ms(fn, launches=30):
    """Mean milliseconds of `fn` launched `launches` times back to back (for kernels whose host-side
    launch is shorter than the kernel: the GPU never waits, so this is the kernel's own time)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / launches


def copy_bandwidth(x) -> tuple[float, float]:
    """(ms, GB/s) of a device copy of `x`, each byte read once and written once: the yardstick the
    kernel bandwidths are measured against."""
    ms = back_to_back_ms(lambda: torch.empty_like(x).copy_(x))
    return ms, 2 * x.numel() * x.element_size() / ms / 1e6


def varied(rows, cols):
    scale = torch.exp2(torch.randint(-6, 6, (rows, cols // 32), device="cuda").float()).repeat_interleave(32, 1)
    return (torch.randn(rows, cols, device="cuda") * scale).to(torch.bfloat16)


def print_host_profile(step, steps: int, top: int) -> None:
    """The Python functions of `steps` calls of `step` by their own host time, the `top` of them (a
    wait for the GPU shows as own time of the call that synchronises)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)
