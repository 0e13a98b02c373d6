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

The training side, `QTensorTrainer` and `PrecisionScheduleCallback` (qtensor/hf_trainer.py,
qtensor/hf_schedule.py), is imported at its first use: `transformers.Trainer` imports peft where
it is installed, and `import qtensor` registers this module while transformers is being imported,
which may be from inside peft's own import (`import qtensor; import peft`).
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from typing import Any, Callable

import torch
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from . import checkpoint, hf_files, recipes
from .layers import experts
from .layers.quantized_stack import QuantizedStack
from .hf_export import export  # noqa: F401 (qtensor.hf.export)
from .hf_files import RUNNING_STATE_FILE  # noqa: F401 (qtensor.hf.RUNNING_STATE_FILE)
from .quantize import WEIGHT_MODES, dequantize_, fill_weight, quantize_, save_running_state
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
    - `modules_to_not_convert` (or `exclude`, `quantize_`'s name for it; the two are joined): names
      or glob patterns of layers (or of modules whose layers all stay) kept in high precision.
    - `strict`: as `quantize_`'s, a ValueError naming every layer that would stay in high
      precision other than by the config's choice (shapes, tied weights, unknown layer types).
    - `filter_fn(module, name) -> bool`: as `quantize_`'s; not written to `config.json`.

    Any other keyword raises TypeError, when the config is made or read from `config.json`.
    """

    def __init__(
        self,
        recipe: str | Callable | Recipe = "float8_current",
        weights: str = "dynamic",
        modules_to_not_convert: list[str] | None = None,
        recipe_options: dict[str, Any] | None = None,
        filter_fn: Callable | None = None,
        strict: bool = False,
        exclude: str | list[str] | None = None,
        **kwargs,
    ):
        # config.json carries `quant_method` (transformers passes every stored key back here); any
        # other name is a misspelt option, which would otherwise be dropped without a word.
        quant_method = kwargs.pop("quant_method", "qtensor")
        if quant_method != "qtensor":
            raise ValueError(f"QTensorConfig: quant_method is 'qtensor', got {quant_method!r}.")
        if kwargs:
            raise TypeError(
                f"QTensorConfig got unexpected keyword argument(s) {', '.join(sorted(kwargs))}; it takes recipe, weights, "
                "modules_to_not_convert (or exclude), recipe_options, strict and filter_fn."
            )
        if not isinstance(strict, bool):
            raise TypeError(f"QTensorConfig: strict must be True or False, got {strict!r}.")
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
        excluded = [exclude] if isinstance(exclude, str) else list(exclude or [])
        self.modules_to_not_convert = list(modules_to_not_convert or []) + [name for name in excluded if name not in (modules_to_not_convert or [])]
        self.strict = strict
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
            "strict": self.strict,
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
        """True for the weight of a layer quantize_ prepared: its checkpoint tensor is cast on load;
        for a saved quantized model, for the placeholder of a quantized weight (see `hf_files.with_placeholders`)."""
        if self.pre_quantized:
            return param_name in getattr(self, "placeholders", {})
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
        stored, renamed, placeholders = set(), {}, set()  # stored names; those saved under another name (stored -> key)
        for filename in self.checkpoint_files:
            header, metadata = checkpoint.read_header(filename)
            stored.update(header)
            description = checkpoint.parse_description(filename, metadata)
            renamed.update(description["names"])
            placeholders.update(description["placeholders"])
        if self.pre_quantized:
            # The checkpoint holds qtensor's entries (a quantized weight as its buffers, running
            # state) where the plain model has plain weights: transformers loads the rest and is
            # told not to report those, which _process_model_after_weight_loading restores.
            planned = copy.deepcopy(model)
            with torch.device("cpu"), _default_dtype(torch.float32):
                self._quantize(planned)
            entries = hf_files.qtensor_entries(planned)
            # Each stored name as the model names it (transformers renames back what it renamed on saving).
            as_model = lambda name: next((renamed[p] + name[len(p):] for p in (name, *checkpoint.entry_prefixes(name)) if p in renamed), name)
            stored = {as_model(name) for name in stored}
            # Each placeholder loads as an empty stand-in for its weight (param_needs_quantization lets
            # its shape differ); the weight is made again, then given its bytes, after loading.
            # A stack held quantized is stored as its experts' entries, not under its own name; its
            # placeholder (empty matrices, which transformers' conversions may have split per expert) too.
            held = {prefix + a for prefix, module in hf_files.quantized_modules(planned) for a in module._qtensor_layers if isinstance(getattr(module, a), QuantizedStack)}
            parameters = dict(model.named_parameters())
            self.placeholders = {
                name: (p.shape, p.dtype, p.requires_grad) for name in {*map(as_model, placeholders), *held} if name in parameters for p in [parameters[name]]
            }
            owned = {name for name in stored if name in entries or any(key in entries for key in checkpoint.entry_prefixes(name))}
            exact = lambda names: {rf"^{re.escape(name)}$" for name in names}
            model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | exact(owned)
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
        return quantize_(
            model, config.factory(), weights=config.weights, exclude=config.modules_to_not_convert, filter_fn=chosen, strict=config.strict,
        )

    def _process_model_after_weight_loading(self, model, **kwargs):
        if not self.pre_quantized:
            save_running_state(model, True)
            model.qtensor_report.merge(self._quantize(model, stacks=True))  # the stacks' pass over the first
            _warn_if_mostly_high_precision(model)
            return model
        for name, (shape, dtype, requires_grad) in getattr(self, "placeholders", {}).items():
            module_path, _, attribute = name.rpartition(".")
            stand_in = model.get_parameter(name)
            setattr(model.get_submodule(module_path), attribute, torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=stand_in.device), requires_grad))
        model.qtensor_report = self._quantize(model)
        # The quantized weights' bytes and the running state, as saved (the rest transformers loaded,
        # through the model's own key conversions).
        device = next(model.parameters()).device
        checkpoint.load_model_files(model, self.checkpoint_files, strict=True, device=device, keys=hf_files.qtensor_entries(model))
        _warn_if_mostly_high_precision(model)
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
        if stored:  # the writing rank (under FSDP2 the others get nothing to write)
            stored, metadata = hf_files.with_placeholders(model, stored, metadata)
        return stored, hf_files.described_as_stored(model, metadata)

    def _dequantize(self, model, dtype=None):
        """`model.dequantize(dtype=None)`: every quantized layer back to plain parameters
        (`qtensor.dequantize_`: in `dtype`, or the dtype each was quantized from); transformers then
        drops the quantization config, so the model saves and loads as a plain one."""
        dequantize_(model, dtype)
        return model

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


def _warn_if_mostly_high_precision(model) -> None:
    warning = model.qtensor_report.mostly_high_precision()
    if warning:
        warnings.warn(warning, stacklevel=3)


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
        prefix + attribute for prefix, module in hf_files.quantized_modules(model) for attribute in module._qtensor_layers
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


# The Trainer's side, imported at its first use (the module's docstring says why).
_LAZY = ("QTensorTrainer", "PrecisionScheduleCallback", "checkpoint_files")


def __getattr__(name: str):
    if name == "checkpoint_files":  # (a name `from_pretrained`'s hook takes as an argument here)
        return hf_files.checkpoint_files
    if name == "QTensorTrainer":
        from .hf_trainer import QTensorTrainer

        return QTensorTrainer
    if name == "PrecisionScheduleCallback":
        from .hf_schedule import PrecisionScheduleCallback

        return PrecisionScheduleCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
