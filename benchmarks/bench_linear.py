"""Training speed of every recipe on one GPU, in one run: a linear layer, the cast kernels, a stack of
Llama-3-8B-shaped decoder blocks.

    python benchmarks/bench_linear.py [--recipes ...] [--blocks N] [--skip-stack] [--compiled]

1. One linear layer's forward+backward, (M, K, N) from the issue: bf16 `nn.Linear` (eager and
   compiled), each qtensor recipe (eager; with --compiled also under torch.compile), and
   torchao's `Float8Linear` (tensorwise and rowwise, eager and compiled) where torchao is
   importable. bf16 parameters and inputs, no bias. qtensor's dynamic weight is marked written
   before every step, so each step casts it, as a training step
   without gradient accumulation does. Time: the median step of 10 run back to back (the host may
   run ahead, as in training; CUDA events around each step) after warm-up.
2. The Float8 kernels alone, launched back to back, as a fraction of the device copy bandwidth
   (each input byte read once, each output byte written once).
3. A training step (forward, backward, AdamW) of a stack of decoder blocks shaped like Llama 3 8B,
   built from stock modules: hidden 4096, 32 query and 8 key/value heads, SwiGLU MLP 14336,
   nn.RMSNorm, SDPA causal attention (no rotary embedding: it does not touch the linear layers),
   sequence 4096, fp32 parameters under bf16 autocast. Tokens per second and peak memory.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import qtensor
from timing import back_to_back_ms, copy_bandwidth, median_ms, median_step_s, varied

SHAPES = [(16384, 8192, 8192), (16384, 4096, 4096), (8192, 4096, 14336), (4096, 2048, 2048)]
QTENSOR_RECIPES = "float8_current,float8_delayed,mxfp8,nvfp4,mxfp8_fwd_nvfp4_bwd"


def torchao_float8():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    return Float8LinearConfig, convert_to_float8_training


def make_linear(system: str, k: int, n: int):
    """(module, after-step hook) for one system's linear layer."""
    torch.manual_seed(0)
    layer = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    compiled = system.endswith(" compiled")
    name = system.removesuffix(" compiled")
    if name.startswith("torchao "):
        config_class, convert = torchao_float8()
        layer = convert(nn.Sequential(layer), config=config_class.from_recipe_name(name.removeprefix("torchao ")))
    elif name != "bf16":
        qtensor.quantize_(layer, getattr(qtensor.recipes, name)())
        weight = layer.weight
        # A write into the weight (what an optimizer step does): the next forward casts it again.
        # (A compiled layer casts at every forward.)
        return (torch.compile(layer) if compiled else layer), lambda: torch.autograd.graph.increment_version(weight)
    return (torch.compile(layer) if compiled else layer), lambda: None


def linear_ms(system, m, k, n):
    torch._dynamo.reset()  # each compiled layer compiles afresh (no recompilation limit across layers)
    layer, written = make_linear(system, k, n)
    x = varied(m, k).requires_grad_(True)
    grad = varied(m, n)
    params = list(layer.parameters())

    def step():
        written()
        layer(x).backward(grad)
        x.grad = None
        for p in params:
            p.grad = None

    return median_ms(step, repeats=10, overlapped=True)


def linear_table(systems, shapes):
    print(f"\n1. One linear layer, forward+backward (ms; speed-up = bf16 eager ms / ms)")
    header = f"{'M x K x N':<20}" + "".join(f"{s:>{max(len(s), 10) + 2}}" for s in systems)
    print(header)
    for m, k, n in shapes:
        times = {system: linear_ms(system, m, k, n) for system in systems}
        base = times["bf16"]
        line = f"{f'{m}x{k}x{n}':<20}"
        speed = f"{'  x bf16':<20}"
        for system in systems:
            width = max(len(system), 10) + 2
            line += f"{times[system]:>{width}.3f}"
            speed += f"{base / times[system]:>{width}.2f}"
        print(line)
        print(speed, flush=True)


def kernel_table():
    from qtensor_kernels import float8 as kernels

    x = varied(8192, 8192)
    n = x.numel()
    _, copy_gbs = copy_bandwidth(x)
    print(f"\n2. Float8 kernels on a [8192, 8192] bf16 tensor, launched back to back (device copy {copy_gbs:.0f} GB/s)")
    amax = kernels.amax_partials(x)
    scale = torch.ones((), device="cuda")
    row, _, scale_inv, _ = kernels.cast(x, torch.float8_e4m3fn, True, False, amax=amax)
    rows = [
        ("amax (current scaling's first pass)", lambda: kernels.amax_partials(x), 2 * n),
        ("cast, both directions, scale from the amax", lambda: kernels.cast(x, torch.float8_e4m3fn, True, True, amax=amax), 4 * n),
        ("cast, both directions, delayed (records amax)", lambda: kernels.cast(x, torch.float8_e4m3fn, True, True, scale=scale, amax_out=True), 4 * n),
        ("cast, rowwise only", lambda: kernels.cast(x, torch.float8_e4m3fn, True, False, amax=amax), 3 * n),
        ("dequantize to bf16", lambda: kernels.dequantize(row, scale_inv, torch.bfloat16), 3 * n),
    ]
    for name, fn, nbytes in rows:
        ms = back_to_back_ms(fn)
        gbs = nbytes / ms / 1e6
        print(f"{name:<50}{ms:>8.3f} ms {gbs:>7.0f} GB/s {gbs / copy_gbs:>7.1%}")
    for name, quantizer in (("float8 current", qtensor.Float8Quantizer()), ("float8 delayed", qtensor.Float8Quantizer(scaling="delayed"))):
        ms = median_ms(lambda: quantizer.quantize(x, rowwise=True, columnwise=True))
        gbs = 4 * n / ms / 1e6
        print(f"{'Float8Quantizer.quantize, ' + name + ', both (host incl.)':<50}{ms:>8.3f} ms {gbs:>7.0f} GB/s {gbs / copy_gbs:>7.1%}")


# ---- the Llama-3-8B-shaped block stack -------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, dim=4096, heads=32, kv_heads=8):
        super().__init__()
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # -1 heads: a column-parallel projection (benchmarks/bench_tp.py) holds its rank's heads only.
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim=4096, hidden=14336):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim)
        self.mlp_norm = nn.RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def stack_step_stats(recipe, blocks, sequence, steps):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = nn.Sequential(*[Block() for _ in range(blocks)])
    if recipe != "bf16":
        qtensor.quantize_(model, getattr(qtensor.recipes, recipe)())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randn(1, sequence, 4096, device="cuda")

    held = []

    def step():
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        held.append(torch.cuda.memory_allocated() - before)  # what the forward left for backward
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds, peak = median_step_s(step, steps, warmup=2)
    del model, optimizer
    torch.cuda.empty_cache()
    return sequence / seconds, peak, held[-1] / 2**30


def stack_table(recipes, blocks, sequence, steps=6):
    print(f"\n3. Training step of {blocks} Llama-3-8B-shaped blocks, 1 x {sequence} tokens, bf16 autocast, AdamW (fused)")
    print("   (held after forward: what the forward leaves allocated for backward, the weight casts included)")
    print(f"{'recipe':<22}{'tokens/s':>12}{'x bf16':>9}{'peak GiB':>11}{'held after forward GiB':>25}")
    base = None
    for recipe in ["bf16", *recipes]:
        tokens, peak, held = stack_step_stats(recipe, blocks, sequence, steps)
        base = base or tokens
        print(f"{recipe:<22}{tokens:>12.0f}{tokens / base:>9.2f}{peak:>11.1f}{held:>25.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default=QTENSOR_RECIPES, help="qtensor recipes (comma-separated)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6, help="timed steps of the block stack (the median is reported)")
    parser.add_argument("--skip-stack", action="store_true")
    parser.add_argument("--skip-linear", action="store_true")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="run the first N layer shapes")
    parser.add_argument("--compiled", action="store_true", help="also each qtensor recipe under torch.compile")
    args = parser.parse_args()
    recipes = args.recipes.split(",")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", end="")
    systems = ["bf16", "bf16 compiled", *recipes, *([f"{r} compiled" for r in recipes] if args.compiled else [])]
    if torchao_float8() is not None:
        import torchao

        print(f", torchao {torchao.__version__}")
        systems += ["torchao tensorwise", "torchao tensorwise compiled", "torchao rowwise", "torchao rowwise compiled"]
    else:
        print(" (torchao not installed: its columns are left out)")
    if not args.skip_linear:
        linear_table(systems, SHAPES[: args.shapes])
    kernel_table()
    if not args.skip_stack:
        stack_table(recipes, args.blocks, args.sequence, args.steps)


if __name__ == "__main__":
    main()
