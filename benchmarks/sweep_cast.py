"""Tile sizes of the Float8 cast kernel, and the bandwidth of each Float8 kernel alone.

    python benchmarks/sweep_cast.py [--mxfp8 | --nvfp4 (with the hybrid) | --float8-block]

Each kernel is launched back to back (its host-side launch is shorter than the kernel, so the GPU
never waits) and timed with CUDA events; bandwidth counts each input byte read once and each
output byte written once, against the measured device copy (bf16 tensor read and written).
"""

import sys

import torch

from qtensor_kernels import float8 as kernels
from timing import back_to_back_ms, copy_bandwidth, varied

SHAPE = (8192, 8192)
CONFIGS = [(bm, bn, w) for bm in (64, 128, 256) for bn in (32, 64, 128) for w in (4, 8) if bm * bn <= 16384]


def sweep_mxfp8(x, line):
    from qtensor_kernels import mxfp8

    n = x.numel()
    # (32, 64, 1) and (32, 32, 1): one warp holds 32 rows in 4 lanes, so both directions' block
    # amaxes stay within a warp (no shared memory); the others spread rows over warps.
    for config in [(32, 64, 1), (32, 32, 1), (32, 128, 2), (64, 64, 2), (64, 64, 4), (32, 128, 4), (64, 128, 4), (128, 64, 4)]:
        cast_ms = back_to_back_ms(lambda: mxfp8.cast(x, torch.float8_e4m3fn, "rceil", True, True, block=config))
        line(f"mxfp8 cast both directions, tile {config}", cast_ms, 4 * n + 2 * n // 32)
    row, col = mxfp8.cast(x, torch.float8_e4m3fn, "rceil", True, True)
    for config in [(64, 256, 8), (32, 256, 4)]:
        for along_rows, (data, codes) in ((True, row), (False, col)):
            ms = back_to_back_ms(lambda: mxfp8.dequantize(data, codes, along_rows, torch.bfloat16, block=config))
            line(f"mxfp8 dequantize {'rowwise' if along_rows else 'columnwise'} to bf16, tile {config}", ms, 3 * n + n // 32)


# (warps, bytes each thread loads from a row) of the NVFP4 and hybrid kernels' 16-row tiles.
NV_TILES = [(1, 8), (2, 8), (4, 8), (8, 8), (1, 16), (2, 16), (4, 16), (4, 4)]


def sweep_nvfp4(x, line):
    from qtensor_kernels import hybrid, nvfp4

    n = x.numel()
    amax = kernels.finite_amax(x)
    keys = torch.randint(0, 2**32, (4,), device="cuda")
    written = n + n // 8  # both directions: packed codes and E4M3 scales
    for tile in NV_TILES:
        line(f"nvfp4 amaxes (plain and transformed), tile {tile}", back_to_back_ms(lambda: nvfp4.amaxes(x, tile=tile)), 2 * n)
    variants = {
        "blocks": dict(keys=None, block_2d=False, rht=False),
        "tiles": dict(keys=None, block_2d=True, rht=False),
        "rht": dict(keys=None, block_2d=False, rht=True),
        "rht + stochastic": dict(keys=keys, block_2d=False, rht=True),
    }
    for name, options in variants.items():
        for tile in NV_TILES:
            ms = back_to_back_ms(lambda: nvfp4.cast(x, amax, amax, rowwise=True, columnwise=True, tile=tile, **options))
            line(f"nvfp4 cast both, {name}, tile {tile}", ms, 2 * n + written)
    for name, options in {"rht": dict(keys=None, block_2d=False, rht=True), "plain": dict(keys=None, block_2d=False, rht=False)}.items():
        for tile in NV_TILES:
            ms = back_to_back_ms(lambda: hybrid.cast(x, torch.float8_e4m3fn, "rceil", amax, tile=tile, **options))
            line(f"hybrid cast (mxfp8 rows, nvfp4 {name} columns), tile {tile}", ms, 2 * n + n + n // 32 + written // 2)
    row, col = nvfp4.cast(x, amax, amax, None, True, True, False, False)
    for config in [(64, 128, 4), (32, 256, 4), (64, 256, 8), (16, 512, 4)]:
        ms = back_to_back_ms(lambda: nvfp4.dequantize(row[0], row[1], x.shape[1], torch.bfloat16, block=config))
        line(f"nvfp4 dequantize to bf16 (no tensor scale), tile {config}", ms, 2 * n + written // 2)


def sweep_float8_block(x, line):
    from qtensor_kernels import float8_block

    n = x.numel()
    for source in (x, x.float()):  # bf16 activations, fp32 weights: float8_block.WARPS is by input bytes
        size = source.element_size()
        default = float8_block.WARPS[size]
        for name, (block_rows, block_cols) in [("1x128", (1, 128)), ("128x128", (128, 128)), ("row-wise", (1, None))]:
            for warps in (4, 8, 16):
                float8_block.WARPS[size] = warps
                cast = lambda: float8_block.cast(source, torch.float8_e4m3fn, block_rows, block_cols, block_cols is None, 0.0, True, True)
                ms = back_to_back_ms(cast)
                # Bytes: the input read once, both copies' codes written once (the scales are < 1%).
                line(f"float8 {name} cast both, {source.dtype}, {warps} warps", ms, (size + 2) * n)
        float8_block.WARPS[size] = default
    ms = back_to_back_ms(lambda: float8_block._row_and_column_amaxes(x, True, True))
    line("float8 row-wise amax pass alone (bf16; bytes: the input read)", ms, 2 * n)


def main():
    x = varied(*SHAPE)
    n = x.numel()
    copy_ms, copy_gbs = copy_bandwidth(x)
    print(f"{torch.cuda.get_device_name()}: device copy of a [{SHAPE[0]}, {SHAPE[1]}] bf16 tensor {copy_ms:.3f} ms, {copy_gbs:.0f} GB/s")
    amax = kernels.amax_partials(x)
    scale = torch.ones((), device="cuda")

    def line(name, ms, nbytes):
        gbs = nbytes / ms / 1e6
        print(f"{name:<52}{ms:>8.3f} ms {gbs:>7.0f} GB/s {gbs / copy_gbs:>7.1%}", flush=True)

    if "--mxfp8" in sys.argv:
        return sweep_mxfp8(x, line)
    if "--nvfp4" in sys.argv:
        return sweep_nvfp4(x, line)
    if "--float8-block" in sys.argv:
        return sweep_float8_block(x, line)
    for block, programs, warps in [(4096, 512, 8), (8192, 512, 8), (4096, 1024, 8), (2048, 1024, 4), (8192, 256, 8)]:
        kernels._AMAX_BLOCK = block
        partials = torch.empty(programs, device="cuda")
        launch = lambda: kernels._amax_partials_kernel[(programs,)](x, partials, n, BLOCK=block, PROGRAMS=programs, num_warps=warps)
        line(f"amax_partials, block {block}, {programs} programs, {warps} warps", back_to_back_ms(launch), 2 * n)
    kernels._AMAX_BLOCK = 4096
    results = []
    for rows_per_word in (4, 1):
        for config in CONFIGS:
            ms = back_to_back_ms(lambda: kernels.cast(x, torch.float8_e4m3fn, True, True, amax=amax, block=config, rows_per_word=rows_per_word))
            results.append((ms, config, rows_per_word))
            line(f"cast both directions, {rows_per_word} rows per word, tile {config[0]}x{config[1]}, {config[2]} warps", ms, 4 * n)
    for rows_per_word in (4, 1):
        print(f"best tile, {rows_per_word} rows per word: {min(r for r in results if r[2] == rows_per_word)[1]}")
    best_ms, best, best_rows = min(results)
    delayed = [(back_to_back_ms(lambda: kernels.cast(x, torch.float8_e4m3fn, True, True, scale=scale, amax_out=True, block=c, rows_per_word=r)), c, r) for _, c, r in sorted(results)[:4]]
    for ms, c, r in delayed:
        line(f"delayed (records amax), {r} rows per word, tile {c}", ms, 4 * n)
    line("cast rowwise only (best tile)", back_to_back_ms(lambda: kernels.cast(x, torch.float8_e4m3fn, True, False, amax=amax, block=best, rows_per_word=best_rows)), 3 * n)
    line("cast columnwise only (best tile)", back_to_back_ms(lambda: kernels.cast(x, torch.float8_e4m3fn, False, True, amax=amax, block=best, rows_per_word=best_rows)), 3 * n)
    row, _, scale_inv, _ = kernels.cast(x, torch.float8_e4m3fn, True, False, amax=amax)
    line("dequantize to bf16", back_to_back_ms(lambda: kernels.dequantize(row, scale_inv, torch.bfloat16)), 3 * n)


if __name__ == "__main__":
    main()
