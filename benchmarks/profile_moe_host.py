"""Where the host time of one experts-layer step goes (bench_moe.py's layer and step): the step's wall
time against the GPU's busy time, the kernels launched per step, then the top Python functions by
own time over a few steps (a wait for the GPU shows as own time of the call that synchronises,
such as `tolist`).

    python benchmarks/profile_moe_host.py [--system "float8_rowwise quantized"] [--shape qwen3]
"""

import argparse
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe  # noqa: E402
from timing import median_step_s  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", default="float8_rowwise quantized")
    parser.add_argument("--shape", default="qwen3")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows, experts, hidden, width = bench_moe.SHAPES[args.shape]
    torch.manual_seed(0)
    model = bench_moe.Experts(experts, hidden, width).cuda()
    if args.system != "bf16":
        bench_moe.quantize_as(model, args.system)
    x, offs, grad = bench_moe.routed_rows(rows, experts, hidden)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x, offs)
        y.backward(grad)
        x.grad = None
        for p in model.parameters():
            p.grad = None

    seconds, _ = median_step_s(step, 10)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e3
    print(f"{args.system} at {args.shape}: step {seconds * 1e3:.2f} ms, GPU busy {busy:.2f} ms, {len(kernels)} kernels a step")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
