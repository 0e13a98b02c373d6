"""Host time of one linear forward+backward with the kernels launched directly (their compiled
kernels kept, qtensor_kernels/launch.py) against launches through Triton's `kernel[grid]`, the two
alternating in one process so that the host's drift hits both alike.

    python benchmarks/host_launches.py [--shape 4096,2048,2048] [--recipes bf16,float8_current,mxfp8,nvfp4]

Prints, per recipe, the median over --rounds blocks of --steps steps of each kind (microseconds of
host time a step; the step does not wait for the GPU, whose work at this shape is far shorter).
"""

import argparse
import statistics
import time
from unittest import mock

import torch
from torch import nn

import qtensor
from qtensor_kernels import launch


def host_us(step, steps):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / steps * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="4096,2048,2048", help="M,K,N")
    parser.add_argument("--recipes", default="bf16,float8_current,mxfp8,nvfp4")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    m, k, n = (int(v) for v in args.shape.split(","))
    print(f"{'recipe':16} {'kernel[grid] us':>16} {'direct us':>10}")
    for recipe in args.recipes.split(","):
        layer = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        if recipe != "bf16":
            qtensor.quantize_(layer, getattr(qtensor.recipes, recipe)())
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

        def step():
            torch.autograd.graph.increment_version(layer.weight)  # as after an optimizer step: cast again
            layer(x).backward(grad)
            x.grad = layer.weight.grad = None

        for _ in range(20):
            step()
        direct, through_triton = [], []
        for _ in range(args.rounds):
            direct.append(host_us(step, args.steps))
            with mock.patch.object(launch, "_hooked", lambda: True):  # as with a launch hook set
                through_triton.append(host_us(step, args.steps))
        print(f"{recipe:16} {statistics.median(through_triton):16.0f} {statistics.median(direct):10.0f}")


if __name__ == "__main__":
    main()
