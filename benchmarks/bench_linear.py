"""One linear layer's forward+backward on a GPU: bf16 nn.Linear against each qtensor recipe; and the
Float8 cast kernels' bandwidth against the device's copy bandwidth.

    python benchmarks/bench_linear.py [--recipes float8_current,float8_delayed,...]

bf16 parameters and inputs, no bias, dynamic weights (quantized at use, as in training). Each time is
the median of CUDA-event timings after warm-up, on fresh random bf16 data whose magnitude varies
from block to block. Speed-up is bf16 time / recipe time.
"""

import argparse

import torch
from torch import nn

import qtensor
from timing import median_ms, varied

SHAPES = [(16384, 8192, 8192), (16384, 4096, 4096), (8192, 4096, 14336), (4096, 2048, 2048)]


def linear_ms(recipe, m, k, n):
    torch.manual_seed(0)
    layer = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    if recipe != "bf16":
        qtensor.quantize_(layer, getattr(qtensor.recipes, recipe)())
    x = varied(m, k).requires_grad_(True)
    grad = varied(m, n)

    def step():
        layer(x).backward(grad)
        x.grad = layer.weight.grad = None

    return median_ms(step, repeats=10)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipes", default="float8_current,float8_delayed")
    args = parser.parse_args()
    recipes = args.recipes.split(",")
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    header = f"{'M x K x N':<22}{'bf16 ms':>10}" + "".join(f"{r + ' ms':>22}{'x bf16':>8}" for r in recipes)
    print(header)
    for m, k, n in SHAPES:
        base = linear_ms("bf16", m, k, n)
        line = f"{f'{m}x{k}x{n}':<22}{base:>10.3f}"
        for recipe in recipes:
            ms = linear_ms(recipe, m, k, n)
            line += f"{ms:>22.3f}{base / ms:>8.2f}"
        print(line, flush=True)

    x = varied(8192, 8192)
    copy_ms = median_ms(lambda: torch.empty_like(x).copy_(x))
    copy_gbs = 2 * x.numel() * x.element_size() / copy_ms / 1e6
    print(f"\ncast kernels on [8192, 8192] bf16 (device copy {copy_gbs:.0f} GB/s; each input byte read once, each output byte written once)")
    for name, quantizer in (("float8 current", qtensor.Float8Quantizer()), ("float8 delayed", qtensor.Float8Quantizer(scaling="delayed"))):
        quantizer.quantize(x)
        ms = median_ms(lambda: quantizer.quantize(x, rowwise=True, columnwise=True))
        gbs = (x.numel() * 2 + 2 * x.numel()) / ms / 1e6
        print(f"{name + ' quantize, both directions':<44}{ms:>8.3f} ms {gbs:>7.0f} GB/s {gbs / copy_gbs:>6.1%}")
    q = qtensor.Float8Quantizer().quantize(x, columnwise=False)
    ms = median_ms(lambda: q.dequantize(torch.bfloat16))
    gbs = (x.numel() + 2 * x.numel()) / ms / 1e6
    print(f"{'float8 dequantize to bf16':<44}{ms:>8.3f} ms {gbs:>7.0f} GB/s {gbs / copy_gbs:>6.1%}")


if __name__ == "__main__":
    main()
