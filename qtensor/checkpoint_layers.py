"""The quantized layers' configurations a checkpoint records (the `layers` field of its qtensor
description, docs/checkpoint-format.md), and the check that a model loading it is quantized the same
way (docs/checkpoints.md, What loading guarantees).

A quantized weight's own description names only its weight quantizer, and a dynamic weight is stored
as plain values: neither tells the recipe of the layer. So a file written from a model records, for
every layer `quantize_` gave quantizers, its three roles' quantizer configurations, its backward
override, its fast-accumulation flags and how its weight is held, under the parameter's state_dict
key. A loader compares them with the model's layers of the same names before anything is written.
"""

from __future__ import annotations

from torch import nn

from .core.quantizer import Quantizer, quantizer_from_dict, quantizer_to_dict
from .layers.config import BACKWARD_OVERRIDES

ROLES = ("input", "weight", "grad_output")
FLAGS = ("fprop_fast_accumulation", "backward_fast_accumulation")
FIELDS = (*ROLES, "backward_override", *FLAGS, "weights")
HELD = ("dynamic", "quantized")


def model_layers(model: nn.Module) -> dict[str, dict]:
    """The configuration of every quantized layer of `model` by its parameter's state_dict key, with
    the quantizers themselves (`record` makes JSON of it)."""
    layers = {}
    for name, module in model.named_modules():
        for attribute, (linear, _) in module.__dict__.get("_qtensor_layers", {}).items():
            weight = getattr(module, attribute)
            quantized = not getattr(getattr(weight, "_local_tensor", weight), "quantized_at_use", True)
            layers[f"{name}.{attribute}" if name else attribute] = {
                **{role: getattr(linear, role) for role in ROLES},
                "backward_override": linear.backward_override,
                **{flag: getattr(linear, flag) for flag in FLAGS},
                "weights": "quantized" if quantized else "dynamic",
            }
    return layers


def record(layers: dict[str, dict]) -> dict[str, dict]:
    """`model_layers`' configurations as the JSON a file stores: each quantizer as `{"format", "config"}`."""
    return {
        key: {field: quantizer_to_dict(value) if isinstance(value, Quantizer) else value for field, value in layer.items()}
        for key, layer in layers.items()
    }


def parse(filename: str, layers) -> dict[str, dict]:
    """A file's `layers` field, checked, its quantizers built (qtensor's own classes only); ValueError
    naming the file and the layer for anything else."""
    if not isinstance(layers, dict):
        raise ValueError(f"{filename}: the qtensor description's layers must map parameter names to configurations.")
    parsed = {}
    for key, layer in layers.items():
        where = f"{filename}: layers[{key!r}]"
        if not isinstance(layer, dict) or set(layer) != set(FIELDS):
            fields = sorted(layer) if isinstance(layer, dict) else type(layer).__name__
            raise ValueError(f"{where}: expected the fields {list(FIELDS)}, got {fields}.")
        roles = {role: None if layer[role] is None else quantizer_from_dict(layer[role], f"{where}.{role}") for role in ROLES}
        if layer["backward_override"] not in BACKWARD_OVERRIDES:
            raise ValueError(f"{where}.backward_override: expected one of {BACKWARD_OVERRIDES}, got {layer['backward_override']!r}.")
        if not all(isinstance(layer[flag], bool) for flag in FLAGS) or layer["weights"] not in HELD:
            raise ValueError(f"{where}: {FLAGS} must be true or false and weights one of {HELD}.")
        parsed[key] = {**layer, **roles}
    return parsed


def check(model: nn.Module, recorded: dict[str, dict], source: str) -> None:
    """ValueError naming the first layer that the file records and `model` holds, quantized otherwise in
    the two: which of its settings differ (the file's and the model's) and what to do. A layer quantized
    on one side only is not compared: a plain model takes a dynamic weight's values, a quantized model
    a plain checkpoint's."""
    if not recorded:  # a file of a plain model, or written before files recorded their layers
        return
    for key, mine in model_layers(model).items():
        theirs = recorded.get(key)
        if theirs is None:
            continue
        differences = [_difference(field, theirs[field], mine[field]) for field in FIELDS if theirs[field] != mine[field]]
        if differences:
            raise ValueError(
                f"{source}: {key}: the file's layer was quantized otherwise than this model's ({'; '.join(differences)}). "
                "Quantize the model as the file's was (the same recipe and options, the same weights mode), or, to "
                "start from the file's values under another recipe, load them into the plain model "
                "(plain.load_state_dict(qtensor.load_file(path), strict=False)) and quantize_ that. Nothing was loaded."
            )


def _difference(field: str, file_value, model_value) -> str:
    show = lambda value: _show(value) if field in ROLES else repr(value)
    file_text, model_text = show(file_value), show(model_value)
    if file_text == model_text:  # two configurations one short name covers: all of each
        file_text, model_text = _full(file_value), _full(model_value)
    return f"{field}: file {file_text}, model {model_text}"


def _show(quantizer: Quantizer | None) -> str:
    return "high precision" if quantizer is None else quantizer.describe()


def _full(value) -> str:
    return repr(quantizer_to_dict(value)) if isinstance(value, Quantizer) else repr(value)
