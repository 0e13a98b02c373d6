"""Time the pure-torch quantizers and the emulated quantized linear on a GPU.

    python benchmarks/bench_quantize.py [--size 8192]

These are the reference implementations (many elementwise torch ops per format), timed so that
the fused kernels to come have a baseline to beat. Each figure is the median of CUDA-event timings
after warm-up, on fresh random bf16 data whose magnitude varies from block to block.
"""

import argparse

import torch
from torch import nn

import qtensor
import qtensor.demo.formats_table
from timing import median_ms, varied


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=8192)
    args = parser.parse_args()
    n = args.size
    x = varied(n, n)
    rows = []
    for name, quantizer in qtensor.demo.formats_table.example_quantizers().items():
        ms = median_ms(lambda: quantizer.quantize(x))
        # bytes the quantization must move at least: read bf16 once, write both directions' data
        out_bytes = quantizer.quantize(x).storage_nbytes()
        rows.append((f"quantize both dirs: {name}", ms, (x.numel() * 2 + out_bytes) / ms / 1e6))

    layer_shapes = (n // 2, n // 2, n // 2)  # M, K, N
    m, k, nn_out = layer_shapes
    inputs = varied(m, k).requires_grad_(True)
    grad = varied(m, nn_out)
    flops = 3 * 2 * m * k * nn_out
    for recipe in ("bf16", "mxfp8", "mxfp8_fwd_nvfp4_bwd"):
        layer = nn.Linear(k, nn_out, bias=False, device="cuda", dtype=torch.bfloat16)
        if recipe != "bf16":
            qtensor.quantize_(layer, getattr(qtensor.recipes, recipe)())

        def step():
            layer(inputs).backward(grad)

        ms = median_ms(step, repeats=10)
        rows.append((f"linear fwd+bwd {m}x{k}x{nn_out}: {recipe}", ms, flops / ms / 1e9))

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, tensor [{n}, {n}] bf16")
    print(f"{'what':<58}{'ms':>10}{'GB/s | TFLOP/s':>17}")
    for what, ms, rate in rows:
        print(f"{what:<58}{ms:>10.3f}{rate:>17.1f}")


if __name__ == "__main__":
    main()
