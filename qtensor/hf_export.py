"""`qtensor.hf.export`: a quantized model written as a `transformers` checkpoint that loads without
qtensor, plain or in transformers' fine-grained FP8 layout (`quant_method="fp8"`, DeepSeek-V3's)."""

from __future__ import annotations

import copy

import torch

from .core.tensor import QuantizedTensor
from .quantize import dequantize_


def export(model, directory, dtype: torch.dtype = torch.bfloat16, *, fp8: bool = False, **save_pretrained_kwargs) -> None:
    """Write `model` as a `transformers` checkpoint that loads without qtensor. The model itself is
    left as it is (a copy is exported).

    - `fp8=False`: a plain checkpoint, every weight its dequantized values (a dynamic weight its own
      values) in `dtype`, no quantization config, no running state.
    - `fp8=True`: every Float8-quantized linear layer's forward weight in the fine-grained FP8
      layout that `transformers`' own FP8 loader reads (`quant_method="fp8"`, DeepSeek-V3's):
      `weight` (E4M3, the bytes the layer's forward GEMM reads) and `weight_scale_inv` (fp32, one
      per `weight_block_size` block), everything else in `dtype`, the linear layers qtensor left
      in high precision (and the experts modules of a mixture of experts whose stacks it left so)
      named in `modules_to_not_convert`. Quantized expert stacks are refused: transformers' FP8
      loader reads a fused stack's FP8 bytes without their scales where it dequantizes (on a
      CPU). Per-tensor and 128x128-block
      weights are written with 128x128 blocks, row-wise and 1x128 ones with 1x128 blocks, each
      block's scale the one its values were cast with: the FP8 values are exactly the quantized
      model's.
    """
    plain = copy.deepcopy(model)
    weights, block = _fine_grained_fp8(plain) if fp8 else ({}, None)
    dequantize_(plain)
    for attribute in ("hf_quantizer", "quantization_method", "qtensor_report"):
        if hasattr(plain, attribute):
            delattr(plain, attribute)
    plain.is_quantized = False
    if hasattr(plain.config, "quantization_config"):
        del plain.config.quantization_config
    plain.to(dtype)
    if fp8:
        from transformers import FineGrainedFP8Config

        for (name, attribute), (data, scale_inv) in weights.items():
            module = plain.get_submodule(name)
            setattr(module, attribute, torch.nn.Parameter(data, requires_grad=False))
            setattr(module, f"{attribute}_scale_inv", torch.nn.Parameter(scale_inv, requires_grad=False))
        converted = {name for name, _ in weights}
        kept = [
            name for name, module in plain.named_modules()
            if (isinstance(module, torch.nn.Linear) or name.endswith(".experts")) and name not in converted
        ]
        plain.config.quantization_config = FineGrainedFP8Config(weight_block_size=list(block), modules_to_not_convert=kept)
    plain.save_pretrained(directory, **save_pretrained_kwargs)


def _fine_grained_fp8(model) -> tuple[dict, tuple[int, int]]:
    """{(module, "weight"): (E4M3 weight [out, in], fp32 scale_inv per block)} for every quantized
    nn.Linear, and the block size they share; ValueError naming every layer that the layout cannot
    hold exactly."""
    copies, refused = {}, []
    for name, module in model.named_modules():
        for attribute, (linear, _) in module.__dict__.get("_qtensor_layers", {}).items():
            layer = f"{name}.{attribute}" if name else attribute
            weight = getattr(module, attribute)
            reason = _module_refusal(module, attribute, weight)
            storage = None if reason else _forward_storage(weight, linear)
            reason = reason or _fp8_layout_refusal(storage)
            if reason:
                refused.append(f"{layer} ({reason})")
            else:
                copies[(name, attribute)] = storage
    if refused:
        raise ValueError(
            "qtensor.hf.export(fp8=True) writes Float8 E4M3 weights in transformers' fine-grained FP8 layout; "
            f"these cannot be written exactly: {'; '.join(refused)}. Export with fp8=False (dequantized values), "
            "or quantize those layers with a Float8 recipe."
        )
    rows = 1 if any(getattr(storage, "block_rows", 128) == 1 for storage in copies.values()) else 128
    block = (rows, 128)
    partial = [
        f"{name} [{storage.rows}, {storage.cols}]" for (name, _), storage in copies.items()
        if any(n % b and n > b for n, b in zip((storage.rows, storage.cols), block))
    ]
    if partial:
        raise ValueError(
            f"qtensor.hf.export(fp8=True): {partial} are not whole {block[0]}x{block[1]} blocks (or a single partial "
            "one), which transformers' FP8 loader cannot read back exactly. Export with fp8=False."
        )
    return {key: (storage.data, _block_scales(storage, block)) for key, storage in copies.items()}, block


def _module_refusal(module, attribute: str, weight) -> str | None:
    if weight.dim() == 3:
        return (
            "an expert stack: transformers' FP8 loader dequantizes (on a CPU) only `weight` / `weight_scale_inv` pairs and "
            "would read a fused stack's FP8 bytes without their scales; keep the experts in high precision for this "
            "export (quantize_ with exclude=['*.experts'])"
        )
    if not isinstance(module, torch.nn.Linear) or attribute != "weight":
        return f"{type(module).__name__}: transformers' FP8 loader converts nn.Linear layers only"
    return None


def _forward_storage(weight, linear):
    """The rowwise storage the forward GEMM reads (a dynamic weight's cast now by its layer's weight quantizer)."""
    if isinstance(weight, QuantizedTensor):
        return weight.rowwise
    return linear.weight.quantize(weight.plain().detach(), rowwise=True, columnwise=False).rowwise


def _fp8_layout_refusal(storage) -> str | None:
    if storage.format_name not in ("float8", "float8_block"):
        return f"its forward weight is {storage.format_name}, not Float8"
    if storage.fp8_dtype != torch.float8_e4m3fn:
        return f"its weight is {storage.fp8_dtype}; the layout holds float8_e4m3fn"
    return None


def _block_scales(storage, block: tuple[int, int]) -> torch.Tensor:
    """The fp32 decode scale of each `block` of the weight: the scale each block's values were cast
    with (each block lies inside one of the storage's own scale blocks)."""
    rows, cols = storage.rows, storage.cols
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale_inv = storage.scale_inv.float()
    if storage.format_name == "float8":  # one scale for the tensor
        return scale_inv.reshape(1, 1).expand(grid).contiguous()
    if storage.block_rows != block[0]:  # 128-row blocks written as rows
        scale_inv = scale_inv.repeat_interleave(storage.block_rows, dim=0)[:rows]
    if storage.block_cols is None:  # one scale per row
        scale_inv = scale_inv.expand(rows, grid[1])
    return scale_inv.contiguous()
