"""Timing helpers shared by the GPU benchmarks (run as `python benchmarks/<script>.py`)."""

import statistics

import torch


def median_ms(fn, repeats=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def varied(rows, cols):
    scale = torch.exp2(torch.randint(-6, 6, (rows, cols // 32), device="cuda").float()).repeat_interleave(32, 1)
    return (torch.randn(rows, cols, device="cuda") * scale).to(torch.bfloat16)
