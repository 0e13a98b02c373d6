"""Quantizer base: input checks, folding to 2-D, configuration, copy and repr."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math

import torch

from .groups import GroupedCopy, RowGroups
from .storage import Storage, holds_storages

QUANTIZER_CLASSES: dict[str, type["Quantizer"]] = {}

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fold_to_2d(x: torch.Tensor) -> torch.Tensor:
    """`[..., K]` → `[prod(...), K]`: leading dimensions become rows."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


_SHARD_BLOCKS: dict[tuple, tuple[int, int]] = {}  # Quantizer.shard_block by configuration


def _col_block(storages) -> int | None:
    """The column block of `storages`' layouts, or None where one declares no column axis."""
    try:
        return max(s.col_block() for s in storages)
    except ValueError:
        return None


def _fresh(quantizer: "Quantizer") -> "Quantizer":
    """A new quantizer of `quantizer`'s configuration (children too), with new running state."""
    return type(quantizer)(**{k: _fresh(v) if isinstance(v, Quantizer) else v for k, v in quantizer.config().items()})


# One key object for each configuration kept by a quantizer (`config_key`): two quantizers of one
# configuration then compare by identity, as a compiled graph's guards compare a weight's at every call.
_KEYS: dict[tuple, tuple] = {}


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

    def config_key(self) -> tuple:
        """Hashable configuration: what `==` and `hash` compare. Running state is not part of it.

        torch.compile compares the quantizers a weight carries on every call of a compiled graph,
        so the key is kept until one of its configuration attributes is written (`__setattr__`); a
        quantizer holding other quantizers (a hybrid's children) builds its key from theirs each time."""
        key = self.__dict__.get("_config_key")
        if key is None:
            config = self.config()
            key = (type(self).__name__, tuple((n, v.config_key() if isinstance(v, Quantizer) else v) for n, v in config.items()))
            if not any(isinstance(v, Quantizer) for v in config.values()):
                try:
                    key = _KEYS.setdefault(key, key)
                except TypeError:  # a new format's unhashable option: compared by value only
                    pass
                self.__dict__["_config_key"] = key
        return key

    def __setattr__(self, name, value):
        if name in self._config_names():  # the configuration changes (running state does not count)
            self.__dict__.pop("_config_key", None)
        object.__setattr__(self, name, value)

    def __eq__(self, other) -> bool:
        # By value (two quantizers with one configuration make byte-compatible tensors), so that
        # torch.compile can guard on the quantizer a tensor carries.
        if self is other:
            return True
        if not isinstance(other, Quantizer):
            return False
        mine, theirs = self.__dict__.get("_config_key"), other.__dict__.get("_config_key")
        if mine is not None and mine is theirs:  # one kept key for each configuration (`_KEYS`)
            return True
        return self.config_key() == other.config_key()

    def __hash__(self) -> int:
        return hash(self.config_key())

    def copy(self) -> "Quantizer":
        """An independent quantizer with the same configuration and a copy of its running state."""
        duplicate = type(self)(**{k: v.copy() if isinstance(v, Quantizer) else v for k, v in self.config().items()})
        duplicate.load_state_buffers(self.state_buffers())
        return duplicate

    def __reduce__(self):
        # Pickled as its JSON configuration plus its running-state tensors, nothing else.
        return _rebuild_quantizer, (json.dumps(quantizer_to_dict(self)), {n: b.detach().clone() for n, b in self.state_buffers().items()})

    def describe(self) -> str:
        """A short name for tables: the format and the options that differ from the defaults."""
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

    def shard_block(self) -> tuple[int, int]:
        """(rows, columns) such that a shard of a tensor whose edges fall on multiples of them,
        quantized with the whole tensor's tensor-wide amaxes, holds exactly its slice of the whole
        tensor's quantization: the largest block of either direction's stored layout. Columns are
        None where a layout cannot be split along them (scales spanning whole rows)."""
        key = self.config_key()
        if key not in _SHARD_BLOCKS:
            # A probe cast by a fresh quantizer of this configuration, on the CPU, recording nothing
            # and drawing no random numbers: this quantizer's state and torch's generators stay put.
            storages = [s for s in _fresh(self)._quantize_2d(torch.zeros(1, 1), True, True, update_state=False) if s is not None]
            _SHARD_BLOCKS[key] = (max(s.row_block() for s in storages), _col_block(storages))
        return _SHARD_BLOCKS[key]

    def quantizer_for(self, direction: str) -> "Quantizer":
        """The quantizer that makes this quantizer's `direction` storage (a hybrid's child)."""
        return self

    def rebuild_direction(self, storage: Storage, direction: str) -> "Storage | None":
        """`storage`, one copy this quantizer made, re-laid out as its copy for `direction`, bytes
        equal to that copy's cast; None where the two copies differ. By default the storage's own
        `to_direction` (per-tensor Float8's transpose, square FP8 blocks), where one quantizer makes
        both copies; a quantizer whose casts make the copies alike in a way the storage does not
        record overrides this (NVFP4's 16×16 tiles)."""
        return storage.to_direction(direction) if self.quantizer_for(direction) is self.quantizer_for(storage.direction) else None

    def current_layout(self, storage: Storage) -> Storage:
        """`storage`, read from a file, in the layout this quantizer's casts make today: a format
        whose layout changed re-lays out an older file's bytes (NVFP4's scales per 16x16 tile)."""
        return storage

    def tensor_amaxes(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> list[torch.Tensor] | None:
        """The tensor-wide amaxes a cast of the 2-D `x` in these directions reduces over the ranks
        holding the other shards (each `tensor_amax` / `reduce_amax` it makes), computed on `x`
        alone and in the order the cast asks for them; [] for a format without any. FSDP2 reduces
        every dynamic weight's in one collective before their casts (dynamic_weight.py), which then
        take them in that order (numerics.sharded_cast with reduced=). None, the default: not declared, so
        this quantizer's casts reduce their own amaxes, one collective each."""
        return None

    # ---- grouped GEMMs (an expert stack's grouped linear) -----------------------------------------
    def grouped_scaling(self) -> str | None:
        """How `quantize_groups` and `quantize_stack` scale, for a format that casts every group of a
        grouped GEMM at once: "tensor" (one scale per group of rows, per expert) or "row" (one per
        row, and per column of each group for the columnwise copy). None: no such casts, and a grouped
        GEMM casts its groups one by one through `quantize`."""
        return None

    def group_block_rows(self) -> int | None:
        """For a format whose values, less a tensor scale, bf16 holds exactly: the rows of its
        columnwise blocks. A grouped GEMM then casts all its groups at once
        (`quantize_padded_groups`), each group run on to a whole number of blocks with zero rows for
        the columnwise copy (no block spans two groups, so each group gets the codes and scales of
        its own cast), and multiplies the values in one bf16 grouped GEMM, each group's tensor
        scales in its epilogue. None for any other format."""
        return None

    def reduction_transform(self, direction: str) -> str | None:
        """The transform `direction`'s copy holds its values in along the dimension its GEMM reduces
        over (Storage.reduction_transform): two operands multiply only in the same one."""
        return None

    def quantize_padded_groups(self, x: torch.Tensor, groups: RowGroups, rowwise: bool, columnwise: bool, values=(False, False)):
        """(rowwise, columnwise) GroupedCopy of the routed rows `x` [M, K], each of the `groups`
        given the codes and scales of its own cast (the columnwise copy over the groups' rows run on
        to multiples of `groups.align` with zero rows), for a format with `group_block_rows`;
        `values` (rowwise, columnwise): copies a GEMM multiplies at once, whose bf16 values a cast
        may write beside the codes. Here a format without a tensor-wide scale: a row's codes do not
        depend on its group, so the rows are cast as one tensor, and their columnwise copy as one
        from the padded rows (`_cast_rows`)."""
        if groups.padded == groups.lengths and rowwise and columnwise:  # both copies from one cast
            return self._cast_rows(x, True, True, values)
        row = self._cast_rows(x, True, False, values)[0] if rowwise else None
        col = self._cast_rows(groups.pad(x), False, True, values)[1] if columnwise else None
        return row, col

    def _cast_rows(self, rows: torch.Tensor, rowwise: bool, columnwise: bool, values) -> tuple:
        """(rowwise, columnwise) GroupedCopy of one cast of `rows` [M, K] (None for a direction not
        asked for); a format may give a copy in `values` as its bf16 values instead of codes."""
        both = self.quantize(rows, rowwise=rowwise, columnwise=columnwise)
        return GroupedCopy(both.rowwise) if rowwise else None, GroupedCopy(both.columnwise) if columnwise else None

    def quantize_groups(self, x: torch.Tensor, groups: RowGroups, rowwise: bool, columnwise: bool):
        """(rowwise, columnwise) GroupedOperand of `x` [M, K], each of the `groups` of consecutive
        rows cast as `quantize` would cast it alone (formats/float8_groups.py has the layouts)."""
        raise NotImplementedError(f"{type(self).__name__} has no grouped casts (grouped_scaling() is None).")

    def quantize_stack(self, stack: torch.Tensor, rowwise: bool, columnwise: bool):
        """(rowwise, columnwise) GroupedOperand of an expert stack [E, N, K], each expert cast as
        `quantize` would cast it alone."""
        raise NotImplementedError(f"{type(self).__name__} has no grouped casts (grouped_scaling() is None).")

    def state_buffers(self) -> dict[str, torch.Tensor]:
        """Running state, as named tensors (delayed scaling's amax history); empty when stateless.
        These are the live tensors: writing into them changes the quantizer."""
        return {}

    def casts_reproducibly(self) -> bool:
        """True when casting the same values twice gives the same bytes and changes nothing (no
        running state, no random draws): one cast of an input can then serve every layer reading it."""
        return not self.state_buffers()

    def state_version(self) -> tuple[int, ...]:
        """Changes whenever the running state is written (a cast recording its amax, a load):
        a quantized copy made before such a write may differ from one made now."""
        return tuple(buffer._version for buffer in self.state_buffers().values())

    def move_state(self, device: torch.device) -> None:
        """Move the running state to `device` (where the tensors this quantizer casts live)."""

    @contextlib.contextmanager
    def using_state(self, buffers: dict[str, torch.Tensor]):
        """Inside, the running state is `buffers` (the names of `state_buffers()`): casts read them
        and write into them. torch.compile traces a layer with the traced copies of its state
        (traced_state.py), so that the history is a graph input the compiled step updates in place."""
        mine = self.state_buffers()
        if set(buffers) != set(mine):
            raise ValueError(f"{type(self).__name__}: running state {sorted(buffers)} given, expected {sorted(mine)}.")
        if all(buffers[name] is mine[name] for name in mine):
            yield
            return
        self._set_state_buffers(buffers)
        try:
            yield
        finally:
            self._set_state_buffers(mine)

    def _set_state_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """Make `buffers` the running state (for `using_state`); stateless quantizers have none."""
        if buffers:
            raise NotImplementedError(f"{type(self).__name__} keeps running state but cannot swap it.")

    def check_state_buffers(self, buffers: dict[str, torch.Tensor], where: str = "") -> None:
        """ValueError unless `buffers` are exactly this quantizer's running state (names, dtypes, shapes)."""
        mine = self.state_buffers()
        if set(buffers) != set(mine):
            raise ValueError(
                f"{where or type(self).__name__}: running state {sorted(buffers)} does not match this "
                f"quantizer's {sorted(mine)} ({self!r})."
            )
        for name, target in mine.items():
            source = buffers[name]
            if source.dtype != target.dtype or source.shape != target.shape:
                raise ValueError(
                    f"{where}{name}: expected {target.dtype} of shape {list(target.shape)} for {self!r}, "
                    f"got {source.dtype} of shape {list(source.shape)}."
                )

    def load_state_buffers(self, buffers: dict[str, torch.Tensor], where: str = "") -> None:
        """Copy saved running state into this quantizer's own buffers, in place (on their device)."""
        self.check_state_buffers(buffers, where)
        with torch.no_grad():
            for name, target in self.state_buffers().items():
                target.copy_(buffers[name])

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
        return _constructor_arguments(type(self))

    def _check_input(self, x, rowwise: bool, columnwise: bool) -> torch.Tensor:
        if type(x) is torch.Tensor and x.dtype in INPUT_DTYPES and x.dim() == 2 and (rowwise or columnwise):
            return x  # the common case (a layer's own 2-D operand): nothing to fold or refuse
        name = type(self).__name__
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}.quantize expects a torch.Tensor, got {type(x).__name__}.")
        if holds_storages(x):  # a quantized tensor: its values
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
        return x if x.dim() == 2 else fold_to_2d(x)


@functools.cache
def _constructor_arguments(cls: type) -> tuple[str, ...]:
    """The names of a quantizer class's constructor arguments (a cache per class: `==` reads them)."""
    return tuple(inspect.signature(cls.__init__).parameters)[1:]


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


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast gives a linear's operands on `x`'s device, None outside autocast (a meta
    tensor, shapes only, has none to ask)."""
    if x.is_meta or not torch.is_autocast_enabled(x.device.type):
        return None
    return torch.get_autocast_dtype(x.device.type)


def autocast_off(device_type: str):
    """A context with autocast off on `device_type`: torch.autocast(enabled=False) where autocast is
    on, nothing to enter where it is off (the per-step hooks run this often)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


# ---- JSON form (pickling and checkpoint metadata); only qtensor's own classes are rebuilt ----
DTYPES_BY_NAME = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
}


def encode_value(value):
    """A configuration or option value as JSON: dtypes and quantizers become tagged objects."""
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, Quantizer):
        return {"quantizer": quantizer_to_dict(value)}
    return value


def decode_value(value, where: str):
    """Inverse of `encode_value`; anything but plain scalars and the two tagged forms is refused."""
    if isinstance(value, dict) and set(value) == {"dtype"}:
        if value["dtype"] not in DTYPES_BY_NAME:
            raise ValueError(f"{where}: unsupported dtype {value['dtype']!r}; expected one of {sorted(DTYPES_BY_NAME)}.")
        return DTYPES_BY_NAME[value["dtype"]]
    if isinstance(value, dict) and set(value) == {"quantizer"}:
        return quantizer_from_dict(value["quantizer"], where)
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ValueError(f"{where}: {value!r} is not a valid quantizer option value.")


def quantizer_to_dict(quantizer: Quantizer) -> dict:
    """A JSON-able description of the configuration: format name and constructor arguments."""
    return {
        "format": quantizer.format_name,
        "config": {name: encode_value(value) for name, value in quantizer.config().items()},
    }


def quantizer_from_dict(description, where: str = "quantizer") -> Quantizer:
    """A new quantizer from `quantizer_to_dict`'s form; ValueError for anything else (unknown
    format or option, wrong value), and only qtensor's own quantizer classes are ever built."""
    if not isinstance(description, dict) or set(description) != {"format", "config"} or not isinstance(description["config"], dict):
        raise ValueError(f"{where}: expected {{'format': ..., 'config': {{...}}}}, got {description!r}.")
    name = description["format"]
    if not isinstance(name, str) or name not in QUANTIZER_CLASSES:
        raise ValueError(f"{where}: unknown qtensor quantizer format {name!r}; expected one of {sorted(QUANTIZER_CLASSES)}.")
    cls = QUANTIZER_CLASSES[name]
    allowed = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = set(description["config"]) - allowed
    if unknown:
        raise ValueError(f"{where}: {cls.__name__} has no option(s) {sorted(unknown)}.")
    config = {key: decode_value(value, f"{where}.{key}") for key, value in description["config"].items()}
    try:
        return cls(**config)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None


def _rebuild_quantizer(description_json: str, state: dict) -> Quantizer:
    quantizer = quantizer_from_dict(json.loads(description_json))
    quantizer.load_state_buffers(state)
    return quantizer
