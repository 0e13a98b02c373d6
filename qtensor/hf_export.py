"""`qtensor.hf.export`: a quantized model written as a `transformers` checkpoint that loads without
qtensor, plain or in transformers' fine-grained FP8 layout (`quant_method="fp8"`, DeepSeek-V3's)."""

from __future__ import annotations

import copy

import torch

from .core.tensor import QuantizedTensor
from .hf_files import stack_placeholder
from .layers.experts import stack_orientation
from .layers.quantized_stack import QuantizedStack
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
      named in `modules_to_not_convert`. A Float8 expert stack ([experts, out, in]) is written
      expert by expert under the keys transformers stores its experts under (DeepSeek-V3's
      `experts.<e>.gate_proj.weight` and `.weight_scale_inv`, ...), which its FP8 loader reads back
      into the fused stack. Per-tensor and 128x128-block weights are written with 128x128 blocks,
      row-wise and 1x128 ones with 1x128 blocks, each block's scale the one its values were cast
      with: the FP8 values are exactly the quantized model's.
    """
    plain = copy.deepcopy(model)
    weights, block = _fine_grained_fp8(plain) if fp8 else ({}, None)
    expert_scales = _expert_scale_entries(plain, weights, block) if fp8 else {}
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
            if data.dim() == 2:  # a stack's scales go expert by expert (`expert_scales`)
                setattr(module, f"{attribute}_scale_inv", torch.nn.Parameter(scale_inv, requires_grad=False))
        converted = {name for name, _ in weights}
        kept = [
            name for name, module in plain.named_modules()
            if (isinstance(module, torch.nn.Linear) or name.endswith(".experts")) and name not in converted
        ]
        plain.config.quantization_config = FineGrainedFP8Config(weight_block_size=list(block), modules_to_not_convert=kept)
    if expert_scales:  # transformers splits each stack into its experts as it saves; their scales join them
        save_pretrained_kwargs["state_dict"] = {**plain.state_dict(), **expert_scales}
    plain.save_pretrained(directory, **save_pretrained_kwargs)


def _expert_scale_entries(model, weights: dict, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """{stored key: fp32 block scales} of every expert of the stacks in `weights`, under the
    expert's weight key with `_scale_inv` appended: each stack's scales expanded to its rows, split
    as transformers splits the stack into the experts' matrices when it saves it (its reverted
    weight conversion: gate_up into gate and up), then taken back to one row per block of each
    matrix. ValueError where a matrix's blocks would not each have one scale (a split inside a
    block of rows) or would be misread (neither whole blocks nor one partial block)."""
    from transformers.core_model_loading import revert_weight_conversion

    rows = {
        f"{name}.{attribute}": scale_inv.repeat_interleave(block[0], 1)[:, : data.shape[1]]
        for (name, attribute), (data, scale_inv) in weights.items() if data.dim() == 3
    }
    if not rows:
        return {}
    entries, refused = {}, []
    for key, per_row in revert_weight_conversion(model, rows).items():
        count = per_row.shape[0]
        scales = per_row[:: block[0]]
        if (count % block[0] and count > block[0]) or not torch.equal(scales.repeat_interleave(block[0], 0)[:count], per_row):
            refused.append(f"{key} [{count}, ...]")
        entries[f"{key}_scale_inv"] = scales.contiguous()
    if refused:
        raise ValueError(
            f"qtensor.hf.export(fp8=True): transformers stores these experts' matrices on their own, and their rows do not "
            f"fall on whole {block[0]}-row blocks of the stack (or a single partial one): {refused}. Their block scales "
            "cannot be written exactly; export with fp8=False, or use a row-wise Float8 recipe (1x128 blocks)."
        )
    return entries


def _fine_grained_fp8(model) -> tuple[dict, tuple[int, int]]:
    """{(module, "weight"): (E4M3 weight [out, in], fp32 scale_inv per block)} for every quantized
    nn.Linear, and the block size they share; ValueError naming every layer that the layout cannot
    hold exactly."""
    copies, refused = {}, []
    for name, module in model.named_modules():
        for attribute, (linear, _) in module.__dict__.get("_qtensor_layers", {}).items():
            layer = f"{name}.{attribute}" if name else attribute
            weight = getattr(module, attribute)
            reason = _module_refusal(model, module, name, attribute, weight)
            storages = None if reason else _forward_storages(weight, linear)
            reason = reason or next(filter(None, map(_fp8_layout_refusal, storages)), None)
            if reason:
                refused.append(f"{layer} ({reason})")
            else:
                copies[(name, attribute)] = storages
    if refused:
        raise ValueError(
            "qtensor.hf.export(fp8=True) writes Float8 E4M3 weights in transformers' fine-grained FP8 layout; "
            f"these cannot be written exactly: {'; '.join(refused)}. Export with fp8=False (dequantized values), "
            "or quantize those layers with a Float8 recipe."
        )
    rows = 1 if any(getattr(storage, "block_rows", 128) == 1 for storages in copies.values() for storage in storages) else 128
    block = (rows, 128)
    partial = [
        f"{name} [{storages[0].rows}, {storages[0].cols}]" for (name, _), storages in copies.items()
        if any(n % b and n > b for n, b in zip((storages[0].rows, storages[0].cols), block))
    ]
    if partial:
        raise ValueError(
            f"qtensor.hf.export(fp8=True): {partial} are not whole {block[0]}x{block[1]} blocks (or a single partial "
            "one), which transformers' FP8 loader cannot read back exactly. Export with fp8=False."
        )
    written = {}
    for (name, attribute), storages in copies.items():
        data, scales = [storage.data for storage in storages], [_block_scales(storage, block) for storage in storages]
        stack = getattr(model.get_submodule(name), attribute).dim() == 3  # [experts, ...]: each expert's stacked
        written[(name, attribute)] = (torch.stack(data), torch.stack(scales)) if stack else (data[0], scales[0])
    return written, block


def _module_refusal(model, module, name: str, attribute: str, weight) -> str | None:
    if weight.dim() == 3:
        return _stack_refusal(model, module, name, attribute, weight)
    if not isinstance(module, torch.nn.Linear) or attribute != "weight":
        return f"{type(module).__name__}: transformers' FP8 loader converts nn.Linear layers only"
    return None


def _stack_refusal(model, module, name: str, attribute: str, weight) -> str | None:
    """Why a stack cannot be written expert by expert in the layout: stored [experts, in, out], or
    kept fused by transformers when it saves (its FP8 loader reads experts' `weight` entries)."""
    from transformers.core_model_loading import revert_weight_conversion

    if stack_orientation(module):
        return "an expert stack stored [experts, in, out] (gpt-oss's layout), which the layout's [out, in] experts cannot hold"
    key = f"{name}.{attribute}"
    split = revert_weight_conversion(model, {key: stack_placeholder(weight)})
    if key in split or not all(stored.endswith(".weight") for stored in split):
        return "an expert stack that transformers stores fused, while its FP8 loader reads the experts' own `weight` entries"
    return None


def _forward_storages(weight, linear) -> list:
    """The rowwise storage the forward GEMM reads (a dynamic weight's cast now by its layer's weight
    quantizer); of a stack, each expert's."""
    if weight.dim() == 3:
        if isinstance(weight, QuantizedStack):
            return [weight.experts[expert].rowwise for expert in range(weight.shape[0])]
        values = weight.plain().detach()
        configs = linear.experts or (linear,) * values.shape[0]  # each expert's own quantizer (delayed scaling's state)
        return [config.weight.quantize(matrix, rowwise=True, columnwise=False).rowwise for config, matrix in zip(configs, values)]
    if isinstance(weight, QuantizedTensor):
        return [weight.rowwise]
    return [linear.weight.quantize(weight.plain().detach(), rowwise=True, columnwise=False).rowwise]


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
