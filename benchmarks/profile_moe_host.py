"""Where the host time of one experts-layer step goes (bench_moe.py's layer and step): the step's wall
time against the GPU's busy time, the kernels launched per step, then the top Python functions by
own time over a few steps (a wait for the GPU shows as own time of the call that synchronises,
such as `tolist`).

    python benchmarks/profile_moe_host.py [--system "float8_rowwise quantized"] [--shape qwen3] [--kernels 15]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe  # noqa: E402
from timing import median_step_s, print_host_profile  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", default="float8_rowwise quantized")
    parser.add_argument("--shape", default="qwen3")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--kernels", type=int, default=0, help="also the step's top kernels by GPU time")
    args = parser.parse_args()
    step = bench_moe.layer_step(args.system, args.shape)
    seconds, _ = median_step_s(step, 10)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e3
    print(f"{args.system} at {args.shape}: step {seconds * 1e3:.2f} ms, GPU busy {busy:.2f} ms, {len(kernels)} kernels a step")
    if args.kernels:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.kernels, max_name_column_width=50))
    print_host_profile(step, 5, args.top)


if __name__ == "__main__":
    main()
