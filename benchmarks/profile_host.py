"""Where the host time of one quantized linear step goes (the small shapes are bound by it).

    python benchmarks/profile_host.py [--recipe float8_current] [--shape 4096,2048,2048] [--compiled]

Prints the step's wall time against the GPU's busy time, then the top Python functions by own time.
"""

import argparse
import time

import torch
from torch import nn

import qtensor
from timing import print_host_profile, varied


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default="float8_current")
    parser.add_argument("--shape", default="4096,2048,2048")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--compiled", action="store_true", help="the layer under torch.compile (inductor)")
    parser.add_argument("--kernels", type=int, default=12, help="rows of the GPU kernel table")
    args = parser.parse_args()
    m, k, n = (int(v) for v in args.shape.split(","))
    layer = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    if args.recipe != "bf16":
        qtensor.quantize_(layer, getattr(qtensor.recipes, args.recipe)())
    x = varied(m, k).requires_grad_(True)
    grad = varied(m, n)
    forward = torch.compile(layer) if args.compiled else layer

    def step():
        if args.recipe != "bf16":  # as after an optimizer step: the weight is cast again
            torch.autograd.graph.increment_version(layer.weight)
        forward(x).backward(grad)
        x.grad = layer.weight.grad = None

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    steps = 50
    start = time.perf_counter()
    for _ in range(steps):
        step()
    host_ms = (time.perf_counter() - start) / steps * 1e3
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    gpu_ms = sum(e.device_time_total for e in profile.key_averages()) / 10 / 1e3
    print(f"{args.recipe} {m}x{k}x{n}: host {host_ms:.3f} ms/step, wall {wall_ms:.3f} ms/step, GPU busy {gpu_ms:.3f} ms/step")
    print(profile.key_averages().table(sort_by="device_time_total", row_limit=args.kernels))
    print_host_profile(step, steps, args.top)


if __name__ == "__main__":
    main()
