"""quantize_ / dequantize_: give a stock model's nn.Linear layers their quantizers (README, "Quantize a model")."""

from __future__ import annotations

import fnmatch
from typing import Callable

import torch
from torch import nn

from .layers import experts
from .layers.dynamic_weight import DynamicWeight
from .layers.config import LayerRunning, LinearQuantizers, carries_quantizers
from .recipes import Recipe
from .core.tensor import QuantizedTensor
from .distributed import tensor_parallel  # noqa: F401 (installs the hook that gives tensor-parallel layers their forward hooks)
from .layers.weight import QuantizedWeight, quantized_weight
from .layers.quantized_stack import QuantizedStack, quantized_stack
from .layers.stack_ops import assembled_entry, expanded_entries, is_stack, state_entry
from .report import QuantizeReport
from .sites import EMBEDDINGS, LinearSite, linear_sites
from .sites import join as _join

WEIGHT_MODES = ("dynamic", "quantized")
_SUPPORTED = "qtensor quantizes nn.Linear, Hugging Face Conv1D and nn.MultiheadAttention projections"


def quantize_(
    model: nn.Module,
    recipe_or_factory: Recipe | Callable,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    weights: str = "dynamic",
    strict: bool = False,
    exclude=(),
    amax_reduction_group=None,
) -> QuantizeReport:
    """Give every selected linear layer of `model` its quantizers, in place; the modules stay the same objects.

    Linear layers are nn.Linear (subclasses included), Hugging Face Conv1D (GPT-2 and its family),
    the input projections of nn.MultiheadAttention, and each matrix of a mixture of experts' stacks
    (3-D parameters; layers/experts.py, role "experts"). `weights="dynamic"` keeps high-precision
    parameters, quantized at use; `weights="quantized"` makes each parameter the quantized tensor
    (train it through `qtensor.optim.MasterWeights`).

    The report names every parameter of two or more dimensions: quantized, or skipped with the
    reason (filtered out, the factory chose high precision, shapes a format cannot take, tied
    weights, an embedding table, a router, a layer type qtensor does not quantize, an expert stack
    in a mode it does not take yet, a parameter that is not a layer's weight). With `strict=True`
    nothing is changed and a ValueError names every layer that cannot be quantized (shapes, tied
    weights, such stacks) and every `weight` matrix of a layer type qtensor does not know. It also
    counts the model's parameters and its weight matrices' multiply-accumulates per token in and
    out of low precision (report.py); `report.mostly_high_precision()` warns when most stay high.

    `exclude`: names or glob patterns of layers, or of modules whose layers all stay, to keep in high
    precision (`"lm_head"`, `"layers.*.attention"`), as `filter_fn` returning False would; one that
    matches no linear layer raises ValueError (a misspelt name would quantize the layer it meant to keep).

    `amax_reduction_group`: the process group over which delayed scaling's amaxes are reduced before they
    are recorded, so that every data-parallel rank holds the same histories. None (the default): under
    FSDP2 the mesh's group; otherwise, while torch.distributed is initialised with more than one rank,
    every rank (the default group: DistributedDataParallel needs nothing more), settled at each
    backward, so quantizing before init_process_group is fine. "local": no reduction, each rank keeps
    its own histories (as a group of one rank does). Every rank of the group must run the same layers'
    backwards in the same order (pipeline stages: pass the group of each stage's replicas;
    docs/running-state.md).
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
    exclude = _patterns(exclude)
    if weights not in WEIGHT_MODES:
        raise ValueError(f"quantize_: weights must be 'dynamic' or 'quantized', got {weights!r}.")
    report = QuantizeReport()
    plan: list[tuple[LinearSite, LinearQuantizers]] = []
    cannot: dict[str, str] = {}  # layers that stay in high precision other than by the user's choice
    seen: set[tuple[int, str]] = set()  # (id(module), attribute) of every weight a site accounts for
    owners = _parameter_owners(model)
    matched: set[str] = set()
    for name, module in model.named_modules():
        for site in linear_sites(module, name):
            seen.add((id(module), site.attribute))
            report.output_head = site.layer
            excluded_by = [pattern for pattern in exclude if _matches(pattern, site.layer, name)]
            matched.update(excluded_by)
            if excluded_by:
                report.skipped[site.layer] = f"kept in high precision by exclude={excluded_by[0]!r}"
                continue
            if filter_fn is not None and not filter_fn(module, name):
                report.skipped[site.layer] = "filtered out by filter_fn"
                continue
            if carries_quantizers(getattr(module, site.attribute)):  # a layer left out above may be
                raise ValueError(f"quantize_: layer {site.layer!r} is already quantized. Call qtensor.dequantize_(model) first.")
            quantizers = recipe.quantizers_for("experts" if site.experts else "linear", site.layer)
            if all(q is None for q in quantizers.values()):
                report.skipped[site.layer] = "the factory keeps every tensor in high precision"
                continue
            reason = _unsupported_reason(site, quantizers) or _tied_reason(site, owners)
            if reason is not None:
                cannot[site.layer] = reason
                continue
            linear = LinearQuantizers(
                **quantizers,
                backward_override=recipe.backward_override,
                fprop_fast_accumulation=recipe.fprop_fast_accumulation,
                backward_fast_accumulation=recipe.backward_fast_accumulation,
                name=site.layer,
                parameter="" if site.attribute == "weight" else site.parameter,
                transposed=site.transposed,
                running=LayerRunning(amax_reduction_group),
            )
            if site.experts and linear.records_amaxes:  # running state: each expert its own
                linear = experts.with_expert_configs(linear, site.experts, lambda: recipe.quantizers_for("experts", site.layer))
            plan.append((site, linear))
    unmatched = [pattern for pattern in exclude if pattern not in matched]
    if unmatched:
        raise ValueError(
            f"quantize_: exclude={unmatched} matches no linear layer of the model; nothing was changed. "
            f"Layer names look like {sorted(report.skipped | dict.fromkeys(site.layer for site, _ in plan))[:4]}."
        )
    _check_no_shared_running_state(plan)
    others = _other_weight_matrices(model, seen)
    harmless = {layer: reason for layer, (reason, ok) in others.items() if ok}
    cannot.update({layer: reason for layer, (reason, ok) in others.items() if not ok})
    if strict and cannot:
        details = "; ".join(f"{name}: {reason}" for name, reason in cannot.items())
        raise ValueError(
            f"quantize_(strict=True): {len(cannot)} weight matri{'x' if len(cannot) == 1 else 'ces'} would stay in "
            f"high precision: {details}. Fix them, or keep them out with filter_fn to accept that."
        )
    report.skipped.update(cannot)
    report.skipped.update(harmless)
    for site, linear in plan:
        _install(site, linear, weights)
        mode = "dynamic" if getattr(site.module, site.attribute).quantized_at_use else "quantized"
        stack = f"a stack of {site.experts} experts, each " if site.experts else ""
        report.quantized[site.layer] = f"{stack}{linear.describe()}; weights={mode}"
    return report.count(model)  # parameters and multiply-accumulates per token, in and out of low precision


def _patterns(exclude) -> tuple[str, ...]:
    if isinstance(exclude, str):
        return (exclude,)
    patterns = tuple(exclude)
    if not all(isinstance(pattern, str) for pattern in patterns):
        raise TypeError(f"quantize_: exclude takes layer names or glob patterns (strings), got {exclude!r}.")
    return patterns


def _matches(pattern: str, layer: str, module_name: str) -> bool:
    """Whether `pattern` names the layer, its module (an attention projection's), or a module that
    contains it, exactly or as a glob over names."""
    return any(fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*") for name in (layer, module_name))


def _other_weight_matrices(model: nn.Module, seen: set) -> dict[str, tuple[str, bool]]:
    """Every parameter of two or more dimensions that no linear site accounts for: layer → (why it
    stays in high precision, whether that is certain to be harmless). A `weight` matrix of a module
    type qtensor does not know is most likely multiplied (a linear layer under another name), and a
    stack of matrices (a mixture of experts' fused weights) is multiplied by a grouped GEMM: neither
    is harmless. An embedding table is looked up, and another 2-D parameter (a learned position
    table) cannot be told apart from data that is added rather than multiplied."""
    found = {}
    for module_name, module in model.named_modules():
        for attribute, param in module.named_parameters(recurse=False):
            if param.dim() < 2 or (id(module), attribute) in seen:
                continue
            if isinstance(module, nn.modules.conv._ConvNd):
                found[_join(module_name, attribute)] = (
                    f"a convolution ({type(module).__name__}): its weight {list(param.shape)} stays in high precision ({_SUPPORTED})", False,
                )
            elif param.dim() > 2:  # more than one dimension of experts, or an integer stack
                found[_join(module_name, attribute)] = (experts.unquantized_stack_reason(module, param), False)
            elif isinstance(module, EMBEDDINGS):
                found[module_name] = ("an embedding table: a lookup, not a matrix multiplication", True)
            elif experts.is_router(module):
                found[module_name] = (f"a mixture of experts' router ({type(module).__name__}): routing stays in high precision", True)
            elif attribute == "weight":
                found[module_name] = (
                    f"unsupported layer type {type(module).__name__}: its weight matrix {list(param.shape)} stays in "
                    f"high precision ({_SUPPORTED})",
                    False,
                )
            else:
                found[_join(module_name, attribute)] = (
                    f"a {list(param.shape)} parameter of {type(module).__name__}, not a layer's weight: "
                    "qtensor leaves it in high precision",
                    True,
                )
    return found


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
    """A quantizer with running state (a delayed-scaling amax history, a hybrid child's too) must
    serve one tensor of one layer."""
    seen: dict[int, str] = {}
    for linear in (layer for _, stack_or_layer in plan for layer in stack_or_layer.layers()):
        for role, quantizer in linear.roles().items():
            for buffer in (quantizer.state_buffers().values() if quantizer is not None else ()):
                where = f"{linear.name or '<root>'} {role}"
                if id(buffer) in seen and seen[id(buffer)] != where:
                    raise ValueError(
                        f"The factory returned one delayed-scaling quantizer for {seen[id(buffer)]} and {where}; "
                        "its amax history would mix them. Return a new quantizer on every call."
                    )
                seen[id(buffer)] = where


def _unsupported_reason(site: LinearSite, quantizers: dict) -> str | None:
    shapes = {
        "input": torch.Size([1, site.in_features]),
        "weight": torch.Size([site.out_features, site.in_features]),
        "grad_output": torch.Size([1, site.out_features]),
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


def _tied_reason(site: LinearSite, owners: dict) -> str | None:
    others = [owner for owner in owners.get(id(getattr(site.module, site.attribute)), []) if owner != site.parameter]
    if others:
        return (
            f"its weight is tied to {', '.join(others)}; quantizing it would untie them. "
            "Untie the weights first, or keep this layer out with filter_fn."
        )
    return None


def _install(site: LinearSite, linear: LinearQuantizers, weights: str) -> None:
    module = site.module
    _install_weight(module, site.attribute, linear, weights)
    layers = module.__dict__.setdefault("_qtensor_layers", {})
    layers[site.attribute] = (linear, weights)
    if "_qtensor_hooks" not in module.__dict__:
        module._qtensor_hooks = [
            # load_state_dict(assign=True) puts the loaded tensor in place of the weight: quantize it again.
            module.register_load_state_dict_post_hook(_reinstall_after_load),
            # A dynamic weight's entry is its plain values; running state (amax histories) is added.
            module.register_state_dict_post_hook(_save_layer_state),
            module.register_load_state_dict_pre_hook(_load_running_state),
        ]
    # Tensor parallelism's forward hooks go only on modules whose weight is a DTensor, installed when parallelize_module
    # registers one (tensor_parallel.py): other modules carry no hook, which keeps one compiled graph for all layers.


def _state_prefix(attribute: str) -> str:
    """Running-state keys of a layer: `input_quantizer.amax_history` for a module's `weight`,
    `in_proj_input_quantizer.amax_history` for nn.MultiheadAttention's `in_proj_weight`."""
    return attribute.removesuffix("weight")


def running_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The live running-state tensors of a quantized module's quantizers, by state_dict key suffix
    (`input_quantizer.amax_history`), on the weight's device as a module's buffers would be. A
    quantized weight's entry carries its own quantizer's state, so that role is left out when the
    weight is a QuantizedTensor (or a sharded one: a DTensor over a QuantizedTensor)."""
    state = {}
    for attribute, (stack_or_layer, _) in module._qtensor_layers.items():
        weight = getattr(module, attribute)
        quantized = not getattr(weight, "_local_tensor", weight).quantized_at_use  # a quantized weight or stack
        for layer_prefix, linear in experts.state_prefixes(_state_prefix(attribute), attribute, stack_or_layer):
            for role, quantizer in linear.roles().items():
                if quantizer is None or (role == "weight" and quantized):
                    continue
                quantizer.move_state(weight.device)
                prefix = f"{layer_prefix}{role}_quantizer."
                state.update({prefix + name: buffer for name, buffer in quantizer.state_buffers().items()})
    return state


def _save_layer_state(module, state_dict, prefix, local_metadata) -> None:
    for attribute in module._qtensor_layers:
        if prefix + attribute in state_dict:
            state_dict[prefix + attribute] = _load_target(state_entry(state_dict[prefix + attribute]))
            if is_stack(state_dict[prefix + attribute]):  # one entry per expert
                expanded_entries(state_dict, prefix, attribute)
    if not module.__dict__.get("_qtensor_running_state_saved", True):
        return
    for suffix, buffer in running_state(module).items():
        state_dict[prefix + suffix] = buffer.detach()


def _load_target(entry: torch.Tensor) -> torch.Tensor:
    """A quantized weight's state_dict entry: an alias of its data marked as a load target, which
    in-place loaders (torch.distributed.checkpoint) fill row range by row range from one checkpoint
    (tensor.py, `fills_from_checkpoint`; docs/checkpoints.md)."""
    local = getattr(entry, "_local_tensor", entry)
    if isinstance(local, QuantizedTensor) and not isinstance(entry, nn.Parameter):  # keep_vars: the parameter itself
        local.fills_from_checkpoint = True
    return entry


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
    for attribute, (linear, _) in module._qtensor_layers.items():
        weight, key = getattr(module, attribute), prefix + attribute
        if is_stack(weight):
            assembled_entry(state_dict, prefix, attribute, weight)
        entry = state_dict.get(key)
        if not isinstance(weight, QuantizedTensor):
            continue
        if isinstance(entry, QuantizedTensor) and entry.quantizer == weight.quantizer:
            # A quantized weight's saved quantizer state travels inside its entry.
            weight.quantizer.load_state_buffers(entry.quantizer.state_buffers(), f"{key}.quantizer.")
        elif linear.transposed and isinstance(entry, torch.Tensor) and not isinstance(entry, QuantizedTensor) and entry.dim() == 2:
            # A plain Conv1D entry (a Hugging Face checkpoint, a dynamic or dequantized model) is
            # [in, out]; the quantized weight is held as [out, in].
            state_dict[key] = weight.quantizer.quantize(entry.detach().t().contiguous().to(weight.device), rowwise=True, columnwise=True)


def _reinstall_after_load(module: nn.Module, incompatible_keys) -> None:
    for attribute, (linear, weights) in module._qtensor_layers.items():
        weight = getattr(module, attribute)
        if isinstance(weight, QuantizedTensor) and not carries_quantizers(weight):
            setattr(module, attribute, nn.Parameter(quantized_weight(weight.detach(), linear), requires_grad=weight.requires_grad))
        elif not carries_quantizers(getattr(weight, "_local_tensor", weight)):  # sharded: its local shard carries them
            _install_weight(module, attribute, linear, weights)


def _install_weight(module: nn.Module, attribute: str, linear: LinearQuantizers, weights: str) -> None:
    weight = getattr(module, attribute)
    requires_grad = weight.requires_grad
    # An optimizer built before this call would hold this object, which no longer trains anything.
    weight._qtensor_replaced = linear.parameter_name
    if weights == "quantized" and linear.weight is not None and weight.dim() == 3:  # an expert stack: each expert cast on its own
        setattr(module, attribute, nn.Parameter(quantized_stack(weight, linear), requires_grad=requires_grad))
    elif weights == "quantized" and linear.weight is not None:
        # Both directions: fprop reads the rowwise copy, dgrad the columnwise one; a Conv1D's
        # [in, out] weight is quantized as the [out, in] matrix the GEMMs read.
        matrix = weight.detach().t().contiguous() if linear.transposed else weight.detach()
        quantized = quantized_weight(linear.weight.quantize(matrix, rowwise=True, columnwise=True), linear)
        setattr(module, attribute, nn.Parameter(quantized, requires_grad=requires_grad))
    else:
        setattr(module, attribute, nn.Parameter(DynamicWeight(weight.detach(), linear), requires_grad=requires_grad))


def save_running_state(model: nn.Module, saved: bool) -> None:
    """Whether `model.state_dict()` carries its quantized layers' running state (it does unless
    told otherwise). A loader that fills a model quantize_'d on the meta device from a plain
    checkpoint (qtensor.hf) leaves it out while it loads: quantize_ made that state, the checkpoint
    holds none, and it is not a parameter or buffer the loader could place."""
    for module in model.modules():
        if "_qtensor_layers" in module.__dict__:
            module._qtensor_running_state_saved = saved


def fill_weight(module: nn.Module, attribute: str, value: torch.Tensor) -> nn.Parameter:
    """Make `value`, a checkpoint's plain weight, the weight of a layer quantize_'d on the meta device,
    as quantize_ would have made it from that weight: a loader that fills such a model one weight at
    a time (qtensor.hf) never holds the whole plain model. Returns the new parameter."""
    linear, weights = module._qtensor_layers[attribute]
    placeholder = getattr(module, attribute)
    setattr(module, attribute, nn.Parameter(value.to(placeholder.dtype), requires_grad=placeholder.requires_grad))
    _install_weight(module, attribute, linear, weights)
    return getattr(module, attribute)


def is_qtensor_quantizer(hf_quantizer) -> bool:
    """Whether a transformers model's `hf_quantizer` is qtensor's (`from_pretrained` with a
    `QTensorConfig`), told by its config's `quant_method` without importing qtensor.hf."""
    return getattr(getattr(hf_quantizer, "quantization_config", None), "quant_method", None) == "qtensor"


def dequantize_(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Turn every quantized layer of `model` back into plain high-precision parameters, in the
    layout each module keeps (a Conv1D's [in, out]), in `dtype` (None: the dtype each weight was
    quantized from). A transformers model loaded with a `QTensorConfig` also drops its quantization
    config: it saves and loads as a plain model."""
    # The transformers model holding the quantizer: `model` itself, or the model a wrapper holds (peft's).
    loaded = next((m for m in model.modules() if "hf_quantizer" in m.__dict__), None)
    hf_quantizer = getattr(loaded, "hf_quantizer", None)
    if is_qtensor_quantizer(hf_quantizer):
        hf_quantizer.remove_quantization_config(loaded)  # transformers' own: config.json no longer names qtensor
    for module in model.modules():
        layers = module.__dict__.get("_qtensor_layers")
        if not layers:
            continue
        for attribute, (linear, _) in layers.items():
            weight = getattr(module, attribute)
            if isinstance(weight, (QuantizedTensor, QuantizedStack)):  # a stack's values come as its module keeps them
                plain = weight.dequantize(dtype)  # rounded once, to `dtype`
                plain = plain.t().contiguous() if linear.transposed and weight.dim() == 2 else plain
            else:
                plain = weight.plain().detach().clone()
                plain = plain if dtype is None else plain.to(dtype)
            weight._qtensor_replaced = f"{linear.parameter_name} (by dequantize_)"
            setattr(module, attribute, nn.Parameter(plain, requires_grad=weight.requires_grad))
        for hook in module._qtensor_hooks:
            hook.remove()
        del module._qtensor_hooks, module._qtensor_layers
        module.__dict__.pop("_qtensor_tensor_parallel", None)


def keep_forward_copies_(model: nn.Module) -> dict[str, str]:
    """Let each frozen held weight of `model` (`requires_grad=False`, `weights="quantized"`: a
    fine-tuning base under its adapters) keep only the forward's copy where its format rebuilds
    dgrad's from it (`Quantizer.rebuild_direction`: per-tensor Float8, 128×128 FP8 blocks, NVFP4's
    16×16 tiles): half its bytes, the backward re-laying out dgrad's copy each time it runs, bit
    for bit the copy dropped. Returns, by parameter name, what each frozen held weight keeps.
    Under FSDP2, call it on the sharded model before its first forward: a gather made before
    keeps the copy it brought."""
    kept = {}
    for module_name, module in model.named_modules():
        for attribute in module.__dict__.get("_qtensor_layers") or {}:
            weight = getattr(module, attribute)
            local = getattr(weight, "_local_tensor", weight)  # a DTensor's shard under FSDP2
            if weight.requires_grad or not isinstance(local, (QuantizedWeight, QuantizedStack)):
                continue
            name = _join(module_name, attribute)
            if isinstance(local, QuantizedStack):
                kept[name] = "both copies: an expert stack keeps its experts' two copies"
            elif local.rowwise is None or local.columnwise is None or local.columnwise is local.rowwise:
                kept[name] = "one copy already"
            elif not local.rebuilds_columnwise():  # (asked once per weight, as its forward asks)
                kept[name] = f"both copies: its {local.quantizer.quantizer_for('columnwise').format_name} columnwise copy differs from the rowwise one"
            else:
                before = local.storage_nbytes()
                local.update_usage(columnwise=False)
                kept[name] = f"the forward's copy: {before:,} -> {local.storage_nbytes():,} bytes"
    return kept
