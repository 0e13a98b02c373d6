"""Which GEMM of which layer a recipe disturbs most: relative errors measured on a trained model.

For every linear layer of a bf16 model, one batch of training data's operands are captured as autocast gives
them to the layer: the input X and weight W (bf16) and the gradient dY of the output (bf16). Each
recipe's quantizers for that layer then make the operands of its three GEMMs, as a quantized linear
layer runs them:

    fprop   Y  = X  Wᵀ    input rowwise,  weight rowwise
    dgrad   dX = dY W     gradient rowwise, weight columnwise
    wgrad   dW = dYᵀ X    gradient columnwise, input columnwise

(with `backward_override="dequantized"`: dY unquantized, W and X the dequantized rowwise copies;
with `"high_precision"`: the original operands). Each product is taken in fp64 from the dequantized
operands and compared with the fp64 product of the original ones: the error is the quantization's
alone, ‖approx − exact‖ / ‖exact‖ (Frobenius). Delayed scaling is left out: its scale comes from a
history that a single batch does not have.
"""

from __future__ import annotations

import csv
from collections import defaultdict

import torch
from torch import nn

from ..recipes import Recipe

GEMMS = ("fprop", "dgrad", "wgrad")


def capture_operands(model: nn.Module, tokens: torch.Tensor, loss_fn, skip=("head",)) -> dict[str, dict[str, torch.Tensor]]:
    """name -> {"x", "w", "dy"} for every nn.Linear of `model` (but `skip`), from one forward and
    backward of `loss_fn(model, tokens)` under bf16 autocast (as the training step runs)."""
    operands, handles = defaultdict(dict), []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name in skip:
            continue

        def forward_hook(module, args, output, name=name):
            operands[name]["x"] = args[0].detach().to(torch.bfloat16).reshape(-1, args[0].shape[-1])
            operands[name]["w"] = module.weight.detach().to(torch.bfloat16)

        def backward_hook(module, grad_input, grad_output, name=name):
            operands[name]["dy"] = grad_output[0].detach().to(torch.bfloat16).reshape(-1, grad_output[0].shape[-1])

        handles += [module.register_forward_hook(forward_hook), module.register_full_backward_hook(backward_hook)]
    try:
        loss_fn(model, tokens).backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    return dict(operands)


def _rowwise(quantizer, t: torch.Tensor) -> torch.Tensor:
    return t if quantizer is None else quantizer.quantize(t, rowwise=True, columnwise=False).dequantize(direction="rowwise")


def _columnwise(quantizer, t: torch.Tensor) -> torch.Tensor:
    return t if quantizer is None else quantizer.quantize(t, rowwise=False, columnwise=True).dequantize(direction="columnwise")


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float(torch.linalg.norm(approx - exact) / torch.linalg.norm(exact))


def gemm_errors(name: str, operands: dict[str, torch.Tensor], recipe: Recipe) -> dict[str, float]:
    """{gemm: relative error} for one layer under one recipe."""
    chosen = recipe.quantizers_for("linear", name)
    qx, qw, qdy = chosen["input"], chosen["weight"], chosen["grad_output"]
    x, w, dy = (operands[key] for key in ("x", "w", "dy"))
    f64 = torch.float64
    x_row, w_row = _rowwise(qx, x).to(f64), _rowwise(qw, w).to(f64)
    if recipe.backward_override == "high_precision":
        dy_row = dy_col = dy.to(f64)
        w_col, x_col = w.to(f64), x.to(f64)
    elif recipe.backward_override == "dequantized":
        dy_row = dy_col = dy.to(f64)
        w_col, x_col = w_row, x_row
    else:
        dy_row, dy_col = _rowwise(qdy, dy).to(f64), _columnwise(qdy, dy).to(f64)
        w_col, x_col = _columnwise(qw, w).to(f64), _columnwise(qx, x).to(f64)
    x64, w64, dy64 = x.to(f64), w.to(f64), dy.to(f64)
    return {
        "fprop": _relative_error(x_row @ w_row.T, x64 @ w64.T),
        "dgrad": _relative_error(dy_row @ w_col, dy64 @ w64),
        "wgrad": _relative_error(dy_col.T @ x_col, dy64.T @ x64),
    }


def diagnose(operands: dict[str, dict[str, torch.Tensor]], recipes: dict[str, Recipe], path: str | None = None) -> list[dict]:
    """Rows of (recipe, layer, gemm, relative_error) for every recipe and captured layer; written as
    CSV to `path` when given."""
    rows = []
    for recipe_name, recipe in recipes.items():
        if any(q is not None and q.state_buffers() for q in recipe.quantizers_for("linear", "probe").values()):
            continue  # delayed scaling: no history to scale from
        for layer, layer_operands in operands.items():
            for gemm, error in gemm_errors(layer, layer_operands, recipe).items():
                rows.append({"recipe": recipe_name, "layer": layer, "gemm": gemm, "relative_error": error})
    if path is not None:
        with open(path, "w", newline="") as file:
            writer = csv.DictWriter(file, ["recipe", "layer", "gemm", "relative_error"])
            writer.writeheader()
            writer.writerows({**row, "relative_error": f"{row['relative_error']:.6g}"} for row in rows)
    return rows
