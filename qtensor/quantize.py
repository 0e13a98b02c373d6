"""quantize_ / dequantize_: give a stock model's nn.Linear layers their quantizers (API.md "Model entry point")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .formats.float8 import Float8Quantizer
from .formats.hybrid import HybridQuantizer
from .linear import DynamicWeight, LinearQuantizers, carries_quantizers
from .recipe import Recipe
from .tensor import QuantizedTensor

WEIGHT_MODES = ("dynamic", "quantized")


@dataclass
class QuantizeReport:
    """What quantize_ did: `quantized` (fqn → description) and `skipped` (fqn → reason)."""

    quantized: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        rows = [(name, "quantized", text) for name, text in self.quantized.items()]
        rows += [(name, "skipped", text) for name, text in self.skipped.items()]
        width = max([len("layer")] + [len(name) for name, _, _ in rows])
        lines = [f"{'layer':<{width}}  {'status':<9}  details"]
        lines += [f"{name:<{width}}  {status:<9}  {text}" for name, status, text in rows]
        lines.append(f"{len(self.quantized)} quantized, {len(self.skipped)} skipped")
        return "\n".join(lines)


def quantize_(
    model: nn.Module,
    recipe_or_factory: Recipe | Callable,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    weights: str = "dynamic",
    strict: bool = False,
) -> QuantizeReport:
    """Give every selected nn.Linear of `model` its quantizers, in place; the modules stay the same objects.

    `weights="dynamic"` keeps high-precision parameters, quantized at use; `weights="quantized"` makes
    each parameter the quantized tensor (train it through `qtensor.optim.MasterWeights`). A layer whose
    shapes a chosen quantizer cannot take is skipped and reported, or with `strict=True` nothing is
    changed and a ValueError names every such layer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"quantize_(model, ...) takes an nn.Module, got {type(model).__name__}. To quantize one tensor, "
            "call a quantizer: qtensor.MXFP8Quantizer().quantize(x)."
        )
    if filter_fn is not None and not _takes_module_and_name(filter_fn):
        raise TypeError(
            f"quantize_: filter_fn {getattr(filter_fn, '__name__', filter_fn)!r} must take (module, fqn) and "
            "return True to quantize that layer, e.g. filter_fn=lambda module, fqn: fqn != 'lm_head'."
        )
    recipe = recipe_or_factory if isinstance(recipe_or_factory, Recipe) else Recipe(recipe_or_factory)
    if weights not in WEIGHT_MODES:
        raise ValueError(f"quantize_: weights must be 'dynamic' or 'quantized', got {weights!r}.")
    report = QuantizeReport()
    plan: list[tuple[nn.Linear, LinearQuantizers]] = []
    unsupported: dict[str, str] = {}
    owners = _parameter_owners(model)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or (filter_fn is not None and not filter_fn(module, name)):
            continue
        if carries_quantizers(module.weight):
            raise ValueError(f"quantize_: layer {name!r} is already quantized. Call qtensor.dequantize_(model) first.")
        quantizers = recipe.quantizers_for("linear", name)
        if all(q is None for q in quantizers.values()):
            report.skipped[name] = "the factory keeps every tensor in high precision"
            continue
        reason = _unsupported_reason(module, quantizers) or _tied_reason(name, module, owners)
        if reason is not None:
            unsupported[name] = reason
            continue
        plan.append((module, LinearQuantizers(**quantizers, backward_override=recipe.backward_override, name=name)))
    _check_no_shared_running_state(plan)
    if strict and unsupported:
        details = "; ".join(f"{name}: {reason}" for name, reason in unsupported.items())
        raise ValueError(f"quantize_(strict=True): {len(unsupported)} layer(s) cannot take the chosen formats: {details}")
    report.skipped.update(unsupported)
    for module, linear in plan:
        _install(module, linear, weights)
        mode = "quantized" if isinstance(module.weight, QuantizedTensor) else "dynamic"
        report.quantized[linear.name] = f"{linear.describe()}; weights={mode}"
    return report


def _takes_module_and_name(function) -> bool:
    import inspect

    try:
        inspect.signature(function).bind(None, "")
    except TypeError:
        return False
    except ValueError:  # no signature to read: let the call decide
        return True
    return True


def _check_no_shared_running_state(plan) -> None:
    """A delayed-scaling quantizer keeps one amax history: it must serve one tensor of one layer."""
    seen: dict[int, str] = {}
    for _, linear in plan:
        for role, quantizer in linear.roles().items():
            children = [quantizer.rowwise, quantizer.columnwise] if isinstance(quantizer, HybridQuantizer) else [quantizer]
            for child in children:
                if isinstance(child, Float8Quantizer) and child.scaling == "delayed":
                    where = f"{linear.name or '<root>'} {role}"
                    if id(child) in seen:
                        raise ValueError(
                            f"The factory returned one delayed-scaling quantizer for {seen[id(child)]} and {where}; "
                            "its amax history would mix them. Return a new quantizer on every call."
                        )
                    seen[id(child)] = where


def _unsupported_reason(module: nn.Linear, quantizers: dict) -> str | None:
    shapes = {
        "input": torch.Size([1, module.in_features]),
        "weight": module.weight.shape,
        "grad_output": torch.Size([1, module.out_features]),
    }
    for role, quantizer in quantizers.items():
        if quantizer is not None:
            reason = quantizer.unsupported_shape_reason(shapes[role], role)
            if reason is not None:
                return f"{role}: {reason}"
    return None


def _parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) → every qualified name it is registered under (more than one when tied)."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    return owners


def _tied_reason(name: str, module: nn.Linear, owners: dict) -> str | None:
    others = [owner for owner in owners.get(id(module.weight), []) if owner != (f"{name}.weight" if name else "weight")]
    if others:
        return (
            f"its weight is tied to {', '.join(others)}; quantizing it would untie them. "
            "Untie the weights first, or keep this layer out with filter_fn."
        )
    return None


def _install(module: nn.Linear, linear: LinearQuantizers, weights: str) -> None:
    _install_weight(module, linear, weights)
    module._qtensor_layer = (linear, weights)
    module._qtensor_hooks = [
        # load_state_dict(assign=True) puts the loaded tensor in place of the weight: quantize it again.
        module.register_load_state_dict_post_hook(_reinstall_after_load),
        # A dynamic weight's entry is its plain values; running state (amax histories) is added.
        module.register_state_dict_post_hook(_save_layer_state),
        module.register_load_state_dict_pre_hook(_load_running_state),
    ]


def running_state(module: nn.Linear) -> dict[str, torch.Tensor]:
    """The live running-state tensors of a quantized layer's quantizers, by state_dict key suffix
    (`input_quantizer.amax_history`), on the weight's device as a module's buffers would be. A
    quantized weight's entry carries its own quantizer's state, so that role is left out when the
    weight is a QuantizedTensor."""
    linear, _ = module._qtensor_layer
    state = {}
    for role, quantizer in linear.roles().items():
        if quantizer is None or (role == "weight" and isinstance(module.weight, QuantizedTensor)):
            continue
        quantizer.move_state(module.weight.device)
        state.update({f"{role}_quantizer.{name}": buffer for name, buffer in quantizer.state_buffers().items()})
    return state


def plain_weight(value: torch.Tensor) -> torch.Tensor:
    """A dynamic weight's values as a plain tensor (sharded: a DTensor of plain shards), so that
    safetensors, save_pretrained and torch.distributed.checkpoint see an ordinary tensor."""
    if isinstance(value, DynamicWeight):
        return value.plain()
    local = getattr(value, "_local_tensor", None)
    if isinstance(local, DynamicWeight):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local.plain(), value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())
    return value


def _save_layer_state(module, state_dict, prefix, local_metadata) -> None:
    if prefix + "weight" in state_dict:
        state_dict[prefix + "weight"] = plain_weight(state_dict[prefix + "weight"])
    for suffix, buffer in running_state(module).items():
        state_dict[prefix + suffix] = buffer.detach()


def _load_running_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    for suffix, target in running_state(module).items():
        key = prefix + suffix
        if key not in state_dict:
            missing_keys.append(key)
            continue
        source = state_dict.pop(key)  # consumed here, so load_state_dict does not call it unexpected
        if not isinstance(source, torch.Tensor) or source.shape != target.shape:
            error_msgs.append(f"{key}: expected a tensor of shape {list(target.shape)}, got {getattr(source, 'shape', type(source).__name__)}.")
            continue
        with torch.no_grad():
            target.copy_(source)
    # A quantized weight's saved quantizer state travels inside its entry.
    weight, entry = module.weight, state_dict.get(prefix + "weight")
    if isinstance(weight, QuantizedTensor) and isinstance(entry, QuantizedTensor) and entry.quantizer == weight.quantizer:
        weight.quantizer.load_state_buffers(entry.quantizer.state_buffers(), f"{prefix}weight.quantizer.")


def _reinstall_after_load(module: nn.Linear, incompatible_keys) -> None:
    linear, weights = module._qtensor_layer
    weight = module.weight
    if isinstance(weight, QuantizedTensor) and not carries_quantizers(weight):
        weight.linear_quantizers = linear
    elif not carries_quantizers(weight):
        _install_weight(module, linear, weights)


def _install_weight(module: nn.Linear, linear: LinearQuantizers, weights: str) -> None:
    weight = module.weight
    requires_grad = weight.requires_grad
    # An optimizer built before this call would hold this object, which no longer trains anything.
    weight._qtensor_replaced = f"{linear.name}.weight" if linear.name else "weight"
    if weights == "quantized" and linear.weight is not None:
        # Both directions: fprop reads the rowwise copy, dgrad the columnwise one.
        quantized = linear.weight.quantize(weight.detach(), rowwise=True, columnwise=True)
        quantized.linear_quantizers = linear
        module.weight = nn.Parameter(quantized, requires_grad=requires_grad)
    else:
        module.weight = nn.Parameter(DynamicWeight(weight.detach(), linear), requires_grad=requires_grad)


def dequantize_(model: nn.Module) -> None:
    """Turn every quantized nn.Linear of `model` back into plain high-precision parameters."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and carries_quantizers(module.weight):
            weight = module.weight
            if isinstance(weight, QuantizedTensor):
                plain = weight.dequantize()
            else:
                plain = weight.plain().detach().clone()
            weight._qtensor_replaced = f"{weight.linear_quantizers.name or 'a layer'}.weight (by dequantize_)"
            module.weight = nn.Parameter(plain, requires_grad=weight.requires_grad)
            for hook in module._qtensor_hooks:
                hook.remove()
            del module._qtensor_hooks, module._qtensor_layer
