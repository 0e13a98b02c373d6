"""Quantizer base: input checks, folding to 2-D, configuration, copy and repr."""

from __future__ import annotations

import math

import torch

from .storage import Storage

QUANTIZER_CLASSES: dict[str, type["Quantizer"]] = {}

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fold_to_2d(x: torch.Tensor) -> torch.Tensor:
    """`[..., K]` → `[prod(...), K]`: leading dimensions become rows."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


class Quantizer:
    """Turns a high-precision tensor into a QuantizedTensor of one format.

    Subclasses set `format_name` and `tensor_class`, store their constructor arguments under the
    same names (so `config()` and `copy()` follow), and implement `_quantize_2d`.
    """

    format_name: str = ""
    tensor_class: type = None  # the QuantizedTensor subclass this quantizer produces

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Only a class that names its own format is registered: a user subclass never shadows it.
        if "format_name" in cls.__dict__:
            QUANTIZER_CLASSES[cls.format_name] = cls

    # ---- public -------------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True):
        """Quantize `x` (fp32, bf16 or fp16, at least 1-D) in the directions asked for."""
        x2d = self._check_input(x, rowwise, columnwise)
        rowwise_storage, columnwise_storage = self._quantize_2d(x2d, rowwise, columnwise)
        return self.tensor_class(x.shape, x.dtype, rowwise_storage, columnwise_storage, self)

    def config(self) -> dict:
        """The constructor arguments that rebuild this quantizer's configuration."""
        return {name: getattr(self, name) for name in self._config_names()}

    def copy(self) -> "Quantizer":
        """An independent quantizer with the same configuration and a copy of its running state."""
        duplicate = type(self)(**{k: v.copy() if isinstance(v, Quantizer) else v for k, v in self.config().items()})
        duplicate.load_state_dict(self.state_to_dict())
        return duplicate

    def __reduce__(self):
        # Pickled through its JSON description: configuration and running state, nothing else.
        return quantizer_from_dict, (quantizer_to_dict(self),)

    def describe(self) -> str:
        """A short name for tables: the format and the options that differ from the defaults."""
        import inspect

        defaults = {n: p.default for n, p in inspect.signature(type(self).__init__).parameters.items()}
        options = [
            _short(name, value) for name, value in self.config().items() if defaults.get(name, inspect.Parameter.empty) != value
        ]
        return " ".join([self.format_name, *options])

    def unsupported_shape_reason(self, shape: torch.Size, role: str) -> str | None:
        """Why this quantizer cannot take a tensor of `shape` in `role`, or None when it can.

        The reference path takes any shape (partial blocks behave as zero-padded); a subclass
        restricts this where its kernels need it, and qtensor.quantize_ skips such layers.
        """
        return None

    def state_to_dict(self) -> dict:
        """Running state to save with the configuration (delayed scaling's amax history)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)}.")

    def same_format(self, other: "Quantizer") -> bool:
        """True when `other` produces byte-compatible tensors (same class, same configuration)."""
        return type(self) is type(other) and quantizer_to_dict(self)["config"] == quantizer_to_dict(other)["config"]

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={_format_value(value)}" for name, value in self.config().items())
        return f"{type(self).__name__}({args})"

    # ---- for subclasses -----------------------------------------------------------------------
    def _quantize_2d(
        self, x: torch.Tensor, rowwise: bool, columnwise: bool, *, update_state: bool = True
    ) -> tuple[Storage | None, Storage | None]:
        """Quantize `x` `[rows, cols]` (fp32, bf16 or fp16) in the asked directions.

        Returns (rowwise storage, columnwise storage), None for a direction not asked. With
        `update_state=False` (quantized zeros for new_zeros/zero_) running state such as the
        delayed-scaling amax history or a stochastic-rounding generator is left untouched.
        """
        raise NotImplementedError

    def _config_names(self) -> tuple[str, ...]:
        import inspect

        return tuple(inspect.signature(type(self).__init__).parameters)[1:]

    def _check_input(self, x, rowwise: bool, columnwise: bool) -> torch.Tensor:
        name = type(self).__name__
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}.quantize expects a torch.Tensor, got {type(x).__name__}.")
        from .tensor import QuantizedTensor

        if isinstance(x, QuantizedTensor):
            x = x.dequantize()
        if x.dtype not in INPUT_DTYPES:
            raise TypeError(
                f"{name}.quantize expects a float32, bfloat16 or float16 tensor, got {x.dtype}. "
                "Convert it with .float() first."
            )
        if x.dim() == 0:
            raise ValueError(f"{name}.quantize needs a tensor with at least one dimension; got a scalar. Use x.reshape(1).")
        if not (rowwise or columnwise):
            raise ValueError(
                f"{name}.quantize was asked for no direction; pass rowwise=True and/or columnwise=True."
            )
        return fold_to_2d(x)


def _short(name: str, value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.float8_")
    if isinstance(value, Quantizer):
        return f"{name}=({value.describe()})"
    if value is True:
        return name
    return f"{name}={value}"


def _format_value(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value)
    return repr(value)


# ---- JSON form (pickling and safetensors metadata); only qtensor's own classes are rebuilt ----
_CONFIG_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
}


def _encode(value):
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, Quantizer):
        return {"quantizer": quantizer_to_dict(value)}
    return value


def _decode(value):
    if isinstance(value, dict) and "dtype" in value:
        if value["dtype"] not in _CONFIG_DTYPES:
            raise ValueError(f"Unsupported dtype {value['dtype']!r} in a qtensor quantizer description.")
        return _CONFIG_DTYPES[value["dtype"]]
    if isinstance(value, dict) and "quantizer" in value:
        return quantizer_from_dict(value["quantizer"])
    return value


def quantizer_to_dict(quantizer: Quantizer) -> dict:
    """A JSON-able description: format name, configuration and any running state."""
    return {
        "format": quantizer.format_name,
        "config": {name: _encode(value) for name, value in quantizer.config().items()},
        "state": quantizer.state_to_dict(),
    }


def quantizer_from_dict(description: dict) -> Quantizer:
    name = description["format"]
    if name not in QUANTIZER_CLASSES:
        raise ValueError(f"Unknown qtensor quantizer format {name!r}.")
    quantizer = QUANTIZER_CLASSES[name](**{k: _decode(v) for k, v in description["config"].items()})
    quantizer.load_state_dict(description.get("state", {}))
    return quantizer
