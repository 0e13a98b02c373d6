"""Tile sizes of the Float8 cast kernel, and the bandwidth of each Float8 kernel alone.

    python benchmarks/sweep_cast.py

Each kernel is launched back to back (its host-side launch is shorter than the kernel, so the GPU
never waits) and timed with CUDA events; bandwidth counts each input byte read once and each
output byte written once, against the measured device copy (bf16 tensor read and written).
"""

import torch

from qtensor_kernels import float8 as kernels
from timing import varied

SHAPE = (8192, 8192)
CONFIGS = [(bm, bn, w) for bm in (32, 64, 128) for bn in (64, 128, 256) for w in (4, 8) if bm * bn <= 32768]


def kernel_ms(fn, launches=30):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / launches


def main():
    x = varied(*SHAPE)
    n = x.numel()
    copy_ms = kernel_ms(lambda: torch.empty_like(x).copy_(x))
    copy_gbs = 4 * n / copy_ms / 1e6
    print(f"{torch.cuda.get_device_name()}: device copy of a [{SHAPE[0]}, {SHAPE[1]}] bf16 tensor {copy_ms:.3f} ms, {copy_gbs:.0f} GB/s")
    amax = kernels.amax_partials(x)
    scale = torch.ones((), device="cuda")

    def line(name, ms, nbytes):
        gbs = nbytes / ms / 1e6
        print(f"{name:<52}{ms:>8.3f} ms {gbs:>7.0f} GB/s {gbs / copy_gbs:>7.1%}", flush=True)

    line("amax_partials", kernel_ms(lambda: kernels.amax_partials(x)), 2 * n)
    results = []
    for packed in (True, False):
        for config in CONFIGS:
            ms = kernel_ms(lambda: kernels.cast(x, torch.float8_e4m3fn, True, True, amax=amax, block=config, packed=packed))
            results.append((ms, config, packed))
            line(f"cast both directions, {'packed ' if packed else ''}tile {config[0]}x{config[1]}, {config[2]} warps", ms, 4 * n)
    best_ms, best, _ = min(r for r in results if r[2])
    print(f"best packed tile: {best}; best unpacked: {min(r for r in results if not r[2])[1]}")
    line("cast rowwise only (best tile)", kernel_ms(lambda: kernels.cast(x, torch.float8_e4m3fn, True, False, amax=amax, block=best)), 3 * n)
    line("cast columnwise only (best tile)", kernel_ms(lambda: kernels.cast(x, torch.float8_e4m3fn, False, True, amax=amax, block=best)), 3 * n)
    line("cast both, given scale, amax out (delayed)", kernel_ms(lambda: kernels.cast(x, torch.float8_e4m3fn, True, True, scale=scale, amax_out=True, block=best)), 4 * n)
    row, _, scale_inv, _ = kernels.cast(x, torch.float8_e4m3fn, True, False, amax=amax)
    line("dequantize to bf16", kernel_ms(lambda: kernels.dequantize(row, scale_inv, torch.bfloat16)), 3 * n)


if __name__ == "__main__":
    main()
