"""How `save_pretrained` lays out a qtensor model's tensors (qtensor/hf.py): which `state_dict`
entries qtensor owns, the empty placeholders under the names of quantized weights, and the
description under the names `transformers` stores the tensors under."""

from __future__ import annotations

import json
import os

import torch

from . import checkpoint
from .layers import experts
from .layers.quantized_stack import QuantizedStack
from .layers.stack_ops import expert_keys, is_stack
from .quantize import running_state


def with_placeholders(model, stored: dict, metadata: dict[str, str]) -> tuple[dict, dict[str, str]]:
    """`stored` with an empty tensor under the name of every quantized weight of the model, listed as
    `placeholders` in the description. A quantized weight is stored as its buffers, so without it the
    weight's own name would be missing, and transformers, in a process where qtensor did not register,
    would initialise the layer anew and train on it; with it, that load stops on the shape mismatch.
    qtensor's readers skip placeholders (docs/checkpoint-format.md)."""
    description = json.loads(metadata[checkpoint.METADATA_KEY])
    parameters = dict(model.named_parameters())
    placeholders = {name: torch.zeros(0, dtype=torch.uint8) for name in description["tensors"] if name in parameters and name not in stored}
    # A stack held quantized is stored as its experts' entries: its placeholder is `stack_placeholder`.
    placeholders.update({name: stack_placeholder(p) for name, p in parameters.items() if is_stack(p) and name not in stored})
    if not placeholders:
        return stored, metadata
    description["placeholders"] = sorted(placeholders)
    stored = {**stored, **placeholders}
    return stored, {**metadata, checkpoint.METADATA_KEY: json.dumps(description, sort_keys=True)}


def stack_placeholder(stack) -> torch.Tensor:
    """A held stack's placeholder: a stack of empty matrices, which transformers' conversions split
    into (and merge back from) empty per-expert matrices as they would the stack's own values."""
    return torch.zeros((stack.shape[0], 0, 0), dtype=torch.uint8)


def described_as_stored(model, metadata: dict[str, str]) -> dict[str, str]:
    """The metadata with qtensor's description under the names save_pretrained stores the tensors
    under: transformers renames some models' keys as it writes them (Mixtral's `mlp` to
    `block_sparse_moe`, the same renaming `revert_weight_conversion` gives here), so each renamed
    entry is described under its stored name and `names` maps it back to its state_dict key."""
    from transformers.core_model_loading import revert_weight_conversion

    description = json.loads(metadata[checkpoint.METADATA_KEY])
    parameters = dict(model.named_parameters())
    stacks = [name for name in description.get("placeholders", []) if is_stack(parameters.get(name))]
    if stacks:  # a held stack's placeholder, under the names its empty matrices are stored under
        split = revert_weight_conversion(model, {name: stack_placeholder(parameters[name]) for name in stacks})
        description["placeholders"] = sorted((set(description["placeholders"]) - set(stacks)) | set(split))
        metadata = {**metadata, checkpoint.METADATA_KEY: json.dumps(description, sort_keys=True)}
    keys = sorted(qtensor_entries(model) | set(description["tensors"]))
    if not keys:
        return metadata
    renamed = revert_weight_conversion(model, {key: torch.empty(index) for index, key in enumerate(keys)})  # each key tagged by its size
    names = {name: keys[tensor.numel()] for name, tensor in renamed.items() if name != keys[tensor.numel()]}
    if not names:
        return metadata
    stored_as = {key: name for name, key in names.items()}
    description["tensors"] = {stored_as.get(key, key): value for key, value in description["tensors"].items()}
    description["tied"] = {stored_as.get(a, a): stored_as.get(b, b) for a, b in description.get("tied", {}).items()}
    if "placeholders" in description:
        description["placeholders"] = sorted(stored_as.get(name, name) for name in description["placeholders"])
    description["names"] = names
    return {**metadata, checkpoint.METADATA_KEY: json.dumps(description, sort_keys=True)}


def quantized_modules(model):
    """(state_dict key prefix, module) of every module quantize_ gave a layer."""
    for name, module in model.named_modules():
        if "_qtensor_layers" in module.__dict__:
            yield (f"{name}." if name else ""), module


def qtensor_entries(model) -> set[str]:
    """The state_dict keys qtensor owns: each quantized layer's weight and its running state."""
    entries = set()
    for prefix, module in quantized_modules(model):
        # A dynamic expert stack's entry is its plain values, stored expert by expert, which
        # transformers loads through its own key conversions; a stack held quantized, its experts'.
        stacks = {attribute: count for attribute, count, *_ in experts.stacks_of(module)}
        for attribute in module._qtensor_layers:
            if attribute not in stacks:
                entries.add(prefix + attribute)
            elif isinstance(getattr(module, attribute), QuantizedStack):
                entries.update(expert_keys(prefix, attribute, stacks[attribute]))
        entries.update(prefix + suffix for suffix in running_state(module))
    return entries


# Where QTensorTrainer saves a peft model's base running state, beside peft's adapter files.
RUNNING_STATE_FILE = "qtensor_running_state.safetensors"


def checkpoint_files(directory) -> list[str]:
    """The safetensors files `save_pretrained` wrote into `directory`: `model.safetensors`, or the
    shards its `model.safetensors.index.json` names."""
    single, index = os.path.join(directory, "model.safetensors"), os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        return [os.path.join(directory, shard) for shard in sorted(set(checkpoint.read_index(index).values()))]
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{directory}: neither model.safetensors nor model.safetensors.index.json; not a save_pretrained directory.")
