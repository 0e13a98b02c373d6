"""Which base to fine-tune on: for each format a frozen base can be held in, the bytes a parameter
takes and the error it brings (runs on the CPU; docs/fine-tuning.md has the table).

    python benchmarks/lora_bases.py [--shape 2048,2048] [--tokens 256]

For one weight (a Llama-like initialisation, normal with std 0.02, and one row in 64 scaled by 8
for outliers) and one input (normal), each format's held base (`weights="quantized"`: both copies a
frozen layer keeps, the forward's and dgrad's) gives:

- bytes per parameter of the held weight (every buffer, scales included), and of the frozen weight
  keeping the forward's copy only (`update_usage(columnwise=False)`), where its format rebuilds
  dgrad's copy from it;
- the relative error of the base's weights, ||deq(W) - W|| / ||W|| (the rowwise copy's values);
- the relative error of a layer's output, ||layer(x) - x·Wᵀ|| / ||x·Wᵀ|| against float64, with the
  input cast as the recipe casts it (bf16 autocast for the plain and NF4 layers).

NF4 (torchao's `to_nf4`, blocks of 64, double-quantized scales) where torchao imports, and
bitsandbytes' NF4 (`Params4bit`, as transformers' `BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)` holds a QLoRA base) where bitsandbytes
imports (0.50 quantizes on the CPU too).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import qtensor

RECIPES = {
    "float8_current": qtensor.recipes.float8_current,
    "float8_rowwise": qtensor.recipes.float8_rowwise,
    "float8_blockwise": qtensor.recipes.float8_blockwise,
    "mxfp8": qtensor.recipes.mxfp8,
    "nvfp4 (16x16 weight tiles, the recipe's default)": qtensor.recipes.nvfp4,
    "nvfp4 (1x16 weight blocks)": lambda: qtensor.recipes.nvfp4(weight_block_2d=False),
    "nvfp4, weight only (16x16 tiles; bf16 inputs)": lambda: qtensor.recipes.nvfp4(weight_only=True),
}


def weight_and_input(rows: int, cols: int, tokens: int):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=generator) * 0.02
    weight[::64] *= 8  # outlier rows, as trained models have
    return weight, torch.randn(tokens, cols, generator=generator)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def qtensor_row(recipe, weight: torch.Tensor, x: torch.Tensor) -> tuple[float, float | None, float, float]:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    qtensor.quantize_(layer, recipe(), weights="quantized")
    held = layer.weight
    nbytes = held.storage_nbytes()
    # A weight-only recipe multiplies the input in the autocast dtype, as LoRA under bf16 autocast runs it.
    weight_only = all(isinstance(q, qtensor.IdentityQuantizer) for q in (held.linear_quantizers.input, held.linear_quantizers.grad_output))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=weight_only):
        y = layer(x)
    # Frozen, the weight keeps the forward's copy only where its format rebuilds dgrad's from it.
    one_copy = None
    if held.quantizer.rebuild_direction(held.rowwise, "columnwise") is not None:
        held.requires_grad_(False)
        held.update_usage(columnwise=False)
        one_copy = held.storage_nbytes() / weight.numel()
    return nbytes / weight.numel(), one_copy, relative(held.dequantize(torch.float32), weight), relative(y, x.double() @ weight.double().t())


def nf4_row(weight: torch.Tensor, x: torch.Tensor):
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4
    except ImportError:
        return None
    nf4 = to_nf4(weight.to(torch.bfloat16))
    inner, _ = nf4.__tensor_flatten__()
    nbytes = sum(getattr(nf4, name).numel() * getattr(nf4, name).element_size() for name in inner)
    y = linear_nf4(x.to(torch.bfloat16), nf4)
    return nbytes / weight.numel(), None, relative(nf4.get_original_weight(), weight), relative(y, x.double() @ weight.double().t())


def bnb_nf4_row(weight: torch.Tensor, x: torch.Tensor):
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnb_functional
    except ImportError:
        return None
    held = bnb.nn.Params4bit(weight.to(torch.bfloat16), requires_grad=False, quant_type="nf4", compress_statistics=True, blocksize=64).to(weight.device)
    state = held.quant_state  # per 64 elements a uint8 absmax code, per 256 of those an fp32 scale; the code tables
    nested = [state.absmax, state.code, state.state2.absmax, state.state2.code, state.offset]
    nbytes = held.data.numel() * held.data.element_size() + sum(t.numel() * t.element_size() for t in nested)
    y = bnb.matmul_4bit(x.to(torch.bfloat16), held.t(), quant_state=state)
    values = bnb_functional.dequantize_4bit(held.data, state)
    return nbytes / weight.numel(), None, relative(values, weight), relative(y, x.double() @ weight.double().t())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2048,2048")
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    rows, cols = (int(n) for n in args.shape.split(","))
    weight, x = weight_and_input(rows, cols, args.tokens)
    table = {"bf16": (2.0, None, relative(weight.to(torch.bfloat16), weight), relative(x.bfloat16() @ weight.bfloat16().t(), x.double() @ weight.double().t()))}
    table.update({name: qtensor_row(recipe, weight, x) for name, recipe in RECIPES.items()})
    nf4 = nf4_row(weight, x)
    if nf4 is not None:
        table["NF4 (torchao)"] = nf4
    bnb_nf4 = bnb_nf4_row(weight, x)
    if bnb_nf4 is not None:
        table["NF4 (bitsandbytes, double quantization)"] = bnb_nf4
    print(f"weight [{rows}, {cols}], input [{args.tokens}, {cols}]; torch {torch.__version__}")
    print("| base | bytes per parameter | frozen, one copy | weight error | layer output error |")
    print("| --- | --- | --- | --- | --- |")
    for name, (per_parameter, one_copy, weight_error, output_error) in table.items():
        one = f"{one_copy:.3f}" if one_copy is not None else "–"
        print(f"| {name} | {per_parameter:.3f} | {one} | {weight_error:.2e} | {output_error:.2e} |")


if __name__ == "__main__":
    main()
