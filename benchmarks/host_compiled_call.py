"""The host time of one compiled call over frozen quantized weights against bf16 weights (CPU or GPU).

    python benchmarks/host_compiled_call.py [--recipe float8_current] [--layers 7] [--calls 2000] [--device cpu]

A chain of `--layers` bias-free 64×64 linear layers, frozen, in bf16 or held quantized by the recipe
(one copy where the format rebuilds the other), compiled (inductor) and called on a [4, 64] input:
the compute is negligible, so the median time a call takes is the compiled code's host work (its
guards, its wrapper's unwrapping of each quantized weight, its kernels' launches). Then the cost of
one flatten of a quantized weight, one comparison of its flatten context with a copy (what a guard
does), one read of an inner tensor, one of the guards' hasattr probes (five a weight a call) and
the size() and stride() the wrapper reads.
"""

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import qtensor


def chain(recipe: str | None, layers: int, device: str) -> nn.ModuleList:
    model = nn.ModuleList([nn.Linear(64, 64, bias=False) for _ in range(layers)]).to(device, torch.bfloat16)
    model.requires_grad_(False)
    if recipe is not None:
        qtensor.quantize_(model, getattr(qtensor.recipes, recipe)(), weights="quantized")
        qtensor.keep_forward_copies_(model)
    return model


def run(model, x):
    for layer in model:
        x = layer(x)
    return x


def per_call_us(fn, calls: int, sync) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="float8_current")
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=args.device)
    for recipe in (None, args.recipe):
        model = chain(recipe, args.layers, args.device)
        compiled = torch.compile(run)
        for _ in range(5):
            compiled(model, x)
        print(f"{recipe or 'bf16':<16} {per_call_us(lambda: compiled(model, x), args.calls, sync):8.1f} us a compiled call")
    weight = model[0].weight
    context = weight.__tensor_flatten__()[1]
    guarded = copy.deepcopy(context)
    name = weight.__tensor_flatten__()[0][0]
    for what, fn in [("flatten", weight.__tensor_flatten__), ("context == copy", lambda: context == guarded),
                     (f"read {name}", lambda: getattr(weight, name)),
                     ("hasattr probe", lambda: hasattr(weight, "_dynamo_dynamic_indices")),
                     ("size() and stride()", lambda: (weight.size(), weight.stride()))]:
        print(f"{what:<24} {per_call_us(fn, 20000, lambda: None):6.2f} us")


if __name__ == "__main__":
    main()
