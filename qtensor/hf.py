"""Hugging Face `transformers` integration: `QTensorConfig`, a quantization config that
`from_pretrained` takes, and the quantizer `transformers` runs for it, registered under
`quant_method="qtensor"` when this module is imported (docs/huggingface.md).

    import qtensor.hf
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=qtensor.hf.QTensorConfig(recipe="mxfp8"))
    model.qtensor_report  # what quantize_ did, layer by layer

`from_pretrained` builds the model on the meta device, as usual; the quantizer runs
`qtensor.quantize_` on it there with the config's recipe, weight mode and exclusions, and each
linear weight is then cast as it loads: the model is exactly what `quantize_` makes of the same
checkpoint loaded by hand, without the plain model ever being in memory.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
from typing import Any, Callable

import torch
from transformers import Trainer
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from . import checkpoint, recipes
from .layers import experts
from .layers.quantized_stack import QuantizedStack
from .layers.stack_ops import expert_keys
from .hf_export import export  # noqa: F401 (qtensor.hf.export)
from .optim import MasterWeights
from .quantize import WEIGHT_MODES, fill_weight, quantize_, running_state, save_running_state
from .core.quantizer import decode_value, encode_value
from .recipes import Recipe
from .core.tensor import QuantizedTensor

# The ready recipes a config names (qtensor.recipes): a name is what config.json can carry.
RECIPES = (
    "float8_current", "float8_delayed", "float8_rowwise", "float8_rowwise_gw_hp", "float8_blockwise",
    "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd",
)


@register_quantization_config("qtensor")
class QTensorConfig(QuantizationConfigMixin):
    """What `from_pretrained` quantizes, and how.

    - `recipe`: a ready recipe's name (`RECIPES`; `recipe_options` are its keyword arguments, as
      `qtensor.recipes.mxfp8(**recipe_options)`), or a factory or `qtensor.Recipe` built by hand.
    - `weights`: `"dynamic"` (high-precision parameters, cast at each use) or `"quantized"`
      (each parameter the quantized tensor; train it through `qtensor.optim.MasterWeights`).
    - `modules_to_not_convert`: names or glob patterns of layers (or of modules whose layers all
      stay) kept in high precision, as `quantize_`'s `exclude`.
    - `filter_fn(module, name) -> bool`: as `quantize_`'s; not written to `config.json`.
    """

    def __init__(
        self,
        recipe: str | Callable | Recipe = "float8_current",
        weights: str = "dynamic",
        modules_to_not_convert: list[str] | None = None,
        recipe_options: dict[str, Any] | None = None,
        filter_fn: Callable | None = None,
        **kwargs,
    ):
        self.quant_method = "qtensor"
        if isinstance(recipe, str) and recipe not in RECIPES:
            raise ValueError(f"QTensorConfig: unknown recipe {recipe!r}; the ready recipes are {', '.join(RECIPES)} (or pass a factory).")
        if not isinstance(recipe, str) and not callable(recipe):
            raise TypeError(f"QTensorConfig: recipe must be a ready recipe's name or a factory, got {type(recipe).__name__}.")
        if recipe_options and not isinstance(recipe, str):
            raise ValueError("QTensorConfig: recipe_options are a ready recipe's keyword arguments; a factory takes its own.")
        if weights not in WEIGHT_MODES:
            raise ValueError(f"QTensorConfig: weights must be one of {WEIGHT_MODES}, got {weights!r}.")
        self.recipe = recipe
        self.weights = weights
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        # From config.json the options arrive in their JSON form ({"dtype": "float8_e5m2"}).
        self.recipe_options = {
            name: value if isinstance(value, torch.dtype) else decode_value(value, f"QTensorConfig.recipe_options[{name!r}]")
            for name, value in (recipe_options or {}).items()
        }
        self.filter_fn = filter_fn
        self.factory()  # a bad option raises here, not halfway through loading

    def factory(self):
        """The factory (or Recipe) `quantize_` is given."""
        if isinstance(self.recipe, str):
            return getattr(recipes, self.recipe)(**self.recipe_options)
        return self.recipe

    def to_dict(self) -> dict[str, Any]:
        """What `config.json` carries: JSON values only (a factory as its repr; `filter_fn` not at all)."""
        return {
            "quant_method": self.quant_method,
            "recipe": self.recipe if isinstance(self.recipe, str) else repr(self.recipe),
            "weights": self.weights,
            "modules_to_not_convert": list(self.modules_to_not_convert),
            "recipe_options": {name: encode_value(value) for name, value in self.recipe_options.items()},
        }

    def __repr__(self) -> str:
        return f"QTensorConfig({self.to_json_string(use_diff=False).strip()})"


@register_quantizer("qtensor")
class QTensorHfQuantizer(HfQuantizer):
    """Runs `qtensor.quantize_` for `from_pretrained`.

    - A plain checkpoint: the model `transformers` builds on the meta device is `quantize_`'d before
      any weight is read, and each linear layer's weight is then cast as it is loaded
      (`_FillQuantizedWeight`): the plain weights are never all in memory at once.
    - A checkpoint `save_pretrained` wrote from a quantized model: the model is loaded in the
      checkpoint's precision, `quantize_`'d, then given the saved quantized tensors and running state.
    """

    requires_calibration = False

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        """True for the weight of a layer quantize_ prepared: its checkpoint tensor is cast on load."""
        module_path, _, attribute = param_name.rpartition(".")
        try:
            module = model.get_submodule(module_path)
        except AttributeError:
            return False
        return attribute in module.__dict__.get("_qtensor_layers", {})

    def get_quantize_ops(self):
        return _FillQuantizedWeight()

    def param_element_size(self, model, param_name: str, param: torch.Tensor) -> float:
        """Bytes per element as loaded (what transformers reserves on the GPU before loading): a
        quantized weight's own buffers, not its high-precision dtype's."""
        if isinstance(param, QuantizedTensor):
            buffers = param.buffer_dict(quantizer_state=False)
            return sum(buffer.numel() * buffer.element_size() for buffer in buffers.values()) / param.numel()
        return super().param_element_size(model, param_name, param)

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not checkpoint_files:
            raise ValueError("qtensor: from_pretrained with a QTensorConfig reads safetensors files; none were found.")
        self.checkpoint_files = list(checkpoint_files)
        stored, renamed = set(), {}  # the stored names, and those saved under another name (stored -> state_dict key)
        for filename in self.checkpoint_files:
            header, metadata = checkpoint.read_header(filename)
            stored.update(header)
            renamed.update(checkpoint.parse_description(filename, metadata)["names"])
        if self.pre_quantized:
            # The checkpoint holds qtensor's entries (a quantized weight as its buffers, running
            # state) where the plain model has plain weights: transformers loads the rest and is
            # told not to report those, which _process_model_after_weight_loading restores.
            planned = copy.deepcopy(model)
            with torch.device("cpu"), _default_dtype(torch.float32):
                self._quantize(planned)
            entries = _qtensor_entries(planned)
            # Each stored name as the model names it (transformers renames back what it renamed on saving).
            as_model = lambda name: next((renamed[p] + name[len(p):] for p in (name, *checkpoint.entry_prefixes(name)) if p in renamed), name)
            stored = {as_model(name) for name in stored}
            owned = {name for name in stored if name in entries or any(key in entries for key in checkpoint.entry_prefixes(name))}
            exact = lambda names: {rf"^{re.escape(name)}$" for name in names}
            model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | exact(owned)
            # A stack held quantized is stored as its experts' entries, not under its own name.
            held = {prefix + a for prefix, module in _quantized_modules(planned) for a in module._qtensor_layers if isinstance(getattr(module, a), QuantizedStack)}
            model._keys_to_ignore_on_load_missing = set(model._keys_to_ignore_on_load_missing or ()) | exact((entries | held) - stored)
            return model
        # transformers ties weights only after loading: tie now what it will tie, so that quantize_
        # leaves tied layers in high precision, as it does on the loaded model.
        _tie_as_loading_will(model, stored)
        # The quantizers' running state is made as quantize_ makes it outside from_pretrained (on
        # the CPU, in fp32), not on the meta device in the checkpoint's dtype.
        # Expert stacks are quantized after loading: a checkpoint stores each expert's matrices on
        # their own, which transformers merges into the stacks as it loads them.
        with torch.device("cpu"), _default_dtype(torch.float32):
            model.qtensor_report = self._quantize(model, stacks=False)
        _check_weights_stored(model, stored)
        save_running_state(model, False)  # until loaded: transformers places what state_dict() lists
        return model

    def _quantize(self, model, stacks: bool | None = None):
        """quantize_ as the config says; `stacks` True or False: only the modules that hold expert
        stacks, or only the others (None: every module)."""
        config = self.quantization_config
        chosen = config.filter_fn
        if stacks is not None:
            user = config.filter_fn
            chosen = lambda module, name: bool(experts.stacks_of(module)) == stacks and (user is None or user(module, name))
        return quantize_(model, config.factory(), weights=config.weights, exclude=config.modules_to_not_convert, filter_fn=chosen)

    def _process_model_after_weight_loading(self, model, **kwargs):
        if not self.pre_quantized:
            save_running_state(model, True)
            _add_to_report(model.qtensor_report, self._quantize(model, stacks=True))
            return model
        model.qtensor_report = self._quantize(model)
        # The quantized weights' bytes and the running state, as saved (the rest transformers loaded,
        # through the model's own key conversions).
        device = next(model.parameters()).device
        checkpoint.load_model_files(model, self.checkpoint_files, strict=True, device=device, keys=_qtensor_entries(model))
        return model

    def get_state_dict_and_metadata(self, model):
        """What save_pretrained writes: qtensor's stored tensors and their description (docs/checkpoint-format.md)."""
        if not isinstance(self.quantization_config.recipe, str):
            raise ValueError(
                f"qtensor: save_pretrained needs a ready recipe's name in QTensorConfig (config.json names it for "
                f"from_pretrained); this model was quantized with {self.quantization_config.recipe!r}. Save it with "
                "qtensor.save_model and load it with qtensor.load_model into a model quantize_'d the same way."
            )
        stored, metadata = checkpoint.state_for_writer(model)
        return stored, _described_as_stored(model, metadata)

    def is_serializable(self, safe_serialization=None) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        # The whole model trains through qtensor's layers (no adapters needed).
        return True

    @property
    def is_compileable(self) -> bool:
        return True


class _FillQuantizedWeight(ConversionOps):
    """The load step for a weight of a layer quantize_ prepared on the meta device: the checkpoint's
    plain tensor is cast into the layer's weight as it arrives (`qtensor.quantize.fill_weight`)."""

    def convert(self, input_dict, full_layer_name=None, model=None, **kwargs):
        (value,) = input_dict.values()
        value = value[0] if isinstance(value, list) else value
        module_path, _, attribute = full_layer_name.rpartition(".")
        module = model.get_submodule(module_path)
        return {full_layer_name: fill_weight(module, attribute, value)}


def _add_to_report(report, stacks_report) -> None:
    """The report of the pass that quantized the expert stacks, over the first pass's."""
    for name, text in stacks_report.quantized.items():
        report.skipped.pop(name, None)
        report.quantized[name] = text
    for name, text in stacks_report.skipped.items():
        if name in report.skipped and report.skipped[name] == "filtered out by filter_fn" and text != report.skipped[name]:
            report.skipped[name] = text  # a stack the first pass left to this one


def _described_as_stored(model, metadata: dict[str, str]) -> dict[str, str]:
    """The metadata with qtensor's description under the names save_pretrained stores the tensors
    under: transformers renames some models' keys as it writes them (Mixtral's `mlp` to
    `block_sparse_moe`, the same renaming `revert_weight_conversion` gives here), so each renamed
    entry is described under its stored name and `names` maps it back to its state_dict key."""
    from transformers.core_model_loading import revert_weight_conversion

    description = json.loads(metadata[checkpoint.METADATA_KEY])
    keys = sorted(_qtensor_entries(model) | set(description["tensors"]))
    if not keys:
        return metadata
    renamed = revert_weight_conversion(model, {key: torch.empty(index) for index, key in enumerate(keys)})  # each key tagged by its size
    names = {name: keys[tensor.numel()] for name, tensor in renamed.items() if name != keys[tensor.numel()]}
    if not names:
        return metadata
    stored_as = {key: name for name, key in names.items()}
    description["tensors"] = {stored_as.get(key, key): value for key, value in description["tensors"].items()}
    description["tied"] = {stored_as.get(a, a): stored_as.get(b, b) for a, b in description.get("tied", {}).items()}
    description["names"] = names
    return {**metadata, checkpoint.METADATA_KEY: json.dumps(description, sort_keys=True)}


def _quantized_modules(model):
    """(state_dict key prefix, module) of every module quantize_ gave a layer."""
    for name, module in model.named_modules():
        if "_qtensor_layers" in module.__dict__:
            yield (f"{name}." if name else ""), module


def _qtensor_entries(model) -> set[str]:
    """The state_dict keys qtensor owns: each quantized layer's weight and its running state."""
    entries = set()
    for prefix, module in _quantized_modules(model):
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


def _stored(model, stored: set[str]):
    """Whether a model's state_dict key is in the checkpoint (saved with or without the base model's prefix)."""
    prefix = f"{model.base_model_prefix}."
    return lambda key: key in stored or key.removeprefix(prefix) in stored or prefix + key in stored


def _tie_as_loading_will(model, stored: set[str]) -> None:
    """Tie on the meta model the weights `from_pretrained` ties after loading: each pair of
    `all_tied_weights_keys` unless the checkpoint holds both (then transformers keeps both)."""
    present = _stored(model, stored)
    for target, source in getattr(model, "all_tied_weights_keys", {}).items():
        if not (present(target) and present(source)):
            module_path, _, name = target.rpartition(".")
            setattr(model.get_submodule(module_path), name, model.get_parameter(source))


def _check_weights_stored(model, stored: set[str]) -> None:
    present = _stored(model, stored)
    absent = [
        prefix + attribute for prefix, module in _quantized_modules(model) for attribute in module._qtensor_layers
        if not present(prefix + attribute)
    ]
    if absent:
        raise ValueError(
            f"qtensor: the checkpoint holds no weight for {absent}, which the QTensorConfig quantizes; "
            "keep those layers in high precision with modules_to_not_convert, or load a checkpoint that has them."
        )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class QTensorTrainer(Trainer):
    """`transformers.Trainer` for a model `from_pretrained` quantized with a `QTensorConfig`:

    - with quantized weights (`weights="quantized"`), the optimizer `Trainer` builds
      (`create_optimizer`, the documented hook) is wrapped in `qtensor.optim.MasterWeights`, which
      steps high-precision masters and writes them back into the quantized weights;
    - `train(resume_from_checkpoint=...)` restores the checkpoint's qtensor tensors (quantized
      weights' bytes, delayed scaling's histories) with `qtensor.checkpoint.load_model_files`,
      where `Trainer`'s own `load_state_dict` of the file's plain tensors would leave them out,
      and restores them again after `MasterWeights`' state (whose loading casts the masters).

    Anything else is `Trainer`'s own. A model with dynamic weights also trains with a plain
    `Trainer`, but resumes exactly only here."""

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        target = model if model is not None else self.model
        if any(isinstance(p, QuantizedTensor) for p in target.parameters()) and not isinstance(optimizer, MasterWeights):
            self.optimizer = optimizer = MasterWeights(optimizer)
        return optimizer

    def _load_optimizer_and_scheduler(self, checkpoint_dir):
        super()._load_optimizer_and_scheduler(checkpoint_dir)
        if checkpoint_dir is not None and isinstance(self.optimizer_unwrapped(), MasterWeights):
            # Loading MasterWeights' state writes its masters back into the weights (a cast that
            # records delayed scaling's amaxes): the checkpoint's weights and histories, restored
            # again after it, are the ones the run saved.
            self._load_from_checkpoint(checkpoint_dir)

    def optimizer_unwrapped(self):
        """The optimizer `create_optimizer` made, under accelerate's wrapper if `Trainer` added one."""
        if isinstance(self.optimizer, MasterWeights):
            return self.optimizer
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        model = model if model is not None else self.model
        if not isinstance(getattr(model, "hf_quantizer", None), QTensorHfQuantizer):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        checkpoint.load_model_files(model, checkpoint_files(resume_from_checkpoint), strict=True, device=next(model.parameters()).device)


def checkpoint_files(directory) -> list[str]:
    """The safetensors files `save_pretrained` wrote into `directory`: `model.safetensors`, or the
    shards its `model.safetensors.index.json` names."""
    single, index = os.path.join(directory, "model.safetensors"), os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        return [os.path.join(directory, shard) for shard in sorted(set(checkpoint.read_index(index).values()))]
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{directory}: neither model.safetensors nor model.safetensors.index.json; not a save_pretrained directory.")
