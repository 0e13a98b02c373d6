"""safetensors checkpoints of quantized tensors and models (docs/checkpoints.md).

A file is a plain safetensors file. A quantized tensor saved under `key` becomes the ordinary named
tensors `key.<buffer>` of its buffer contract (`QuantizedTensor.to_buffers`), and its description
(format, shape, logical dtype, directions, quantizer configuration) is JSON under the `qtensor` entry
of the header's `__metadata__`, with a model's tied names and its quantized layers' configurations
(checkpoint_layers.py), which `load_model` compares with the model's. docs/checkpoint-format.md
specifies the layout.

Loading parses and checks the whole header before reading a byte of data: every name, dtype, shape
and byte range, and every metadata field against the formats' declared layouts. Nothing is
unpickled and no class named in the file is imported; only qtensor's own types are built. A bad file
raises ValueError naming the key and the problem, and a failed `load_model` leaves the model as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from . import checkpoint_layers
from .checkpoint_files import MAX_HEADER_BYTES, SAFETENSORS_DTYPES, read_header, read_index  # noqa: F401 (public here too)
from .layers.dynamic_weight import DynamicWeight
from .distributed.fsdp import full_tensor
from .core.plan import TensorPlan
from .core.tensor import QuantizedTensor, own_bytes

FORMAT_VERSION = 1
METADATA_KEY = "qtensor"
# A model under a precision schedule (schedule.py): its position, as JSON, in the file's metadata.
SCHEDULE_KEY = "qtensor.precision_schedule"


# ---- tensors ------------------------------------------------------------------------------------
def save_file(tensors: dict[str, torch.Tensor], filename, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` to a safetensors file, quantized tensors as their low-precision buffers."""
    _write(tensors, filename, _user_metadata(metadata), {})


def load_file(filename, device="cpu") -> dict[str, torch.Tensor]:
    """Read a file written by `save_file`/`save_model` (or any safetensors file): quantized tensors
    come back as the same subclass, byte for byte; everything else as plain tensors."""
    return _read(filename, device).tensors


# ---- models -------------------------------------------------------------------------------------
def save_model(model: nn.Module, filename, metadata: dict[str, str] | None = None, max_shard_size=None) -> None:
    """Write `model.state_dict()` (quantized weights, running state) with tied weights saved once.

    A model sharded with FSDP2 is saved whole: call it on every rank (it gathers the shards, quantized
    weights in low precision) and rank 0 writes the file that a single-process model loads.

    With `max_shard_size` (bytes, or a string like "5GB") the model is written as Hugging Face-style
    shards `<stem>-00001-of-0000N.safetensors` next to `filename`, plus `<filename>.index.json`
    mapping every stored tensor to its shard (one shard: a single file, as Hugging Face does).
    """
    entries, model_fields = _entries(model)
    user = _user_metadata(metadata)
    schedule = _schedule_of(model)
    if schedule is not None:  # load_model moves the schedule there before it loads the weights
        user[SCHEDULE_KEY] = json.dumps(schedule.state_dict())
    filename = os.fspath(filename)
    max_bytes = _parse_size(max_shard_size) if max_shard_size is not None else None  # on every rank, first
    if _sharded(model, entries):
        # A sharded (FSDP2) model: every rank gathers the whole tensors (quantized ones as their
        # low-precision bytes), rank 0 writes, and every rank returns once the files exist.
        import torch.distributed as dist

        entries = {key: full_tensor(value, key) for key, value in entries.items()}
        if dist.get_rank() == 0:
            _save_entries(entries, filename, user, model_fields, max_bytes)
        dist.barrier()
        return
    _save_entries(entries, filename, user, model_fields, max_bytes)


def _save_entries(entries: dict, filename: str, user: dict, model_fields: dict, max_bytes: int | None) -> None:
    shards = _plan_shards(entries, max_bytes) if max_bytes is not None else [list(entries)]
    directory, base = os.path.split(filename)
    if len(shards) == 1:
        _write(entries, filename, user, model_fields)
        _remove_stale_files(filename, keep={base})
        return
    stem = base.removesuffix(".safetensors")
    weight_map, total = {}, 0
    for index, keys in enumerate(shards, start=1):
        shard_name = f"{stem}-{index:05d}-of-{len(shards):05d}.safetensors"
        stored = _write({key: entries[key] for key in keys}, os.path.join(directory, shard_name), user, model_fields)
        total += sum(_nbytes(t) for t in stored.values())
        weight_map.update({name: shard_name for name in stored})
    with open(filename + ".index.json", "w") as index_file:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, index_file, indent=2, sort_keys=True)
    _remove_stale_files(filename, keep=set(weight_map.values()) | {base + ".index.json"})


def load_model(model: nn.Module, filename, strict: bool = True, device=None) -> tuple[list[str], list[str]]:
    """Load a file (or the shards of `<filename>.index.json`) written by `save_model` into `model`.

    Quantized parameters must hold the same format, configuration, directions and shape as the
    file's (a model quantized with the same recipe); they are restored byte for byte. Every entry is
    checked before anything is written, so a failed load leaves the model untouched. Returns the
    (missing, unexpected) keys, as safetensors.torch.load_model does; with `strict` either raises.
    """
    return _load_read(model, _read_model_files(os.fspath(filename), device or "cpu"), strict, f"load_model({filename!r})")


def load_model_files(model: nn.Module, filenames, strict: bool = True, device=None, keys=None) -> tuple[list[str], list[str]]:
    """`load_model` from all the shards of a writer that split `state_for_writer`'s output itself;
    with `keys`, only those state_dict entries are read and restored (strict: all of them)."""
    filenames = [os.fspath(f) for f in filenames]
    return _load_read(model, _read_files(filenames, device or "cpu", keys), strict, f"load_model_files({filenames[0]!r}, ...)", keys)


def _load_read(model: nn.Module, read: _Read, strict: bool, source: str, keys=None) -> tuple[list[str], list[str]]:
    schedule = _schedule_of(model) if read.schedule is not None else None
    if schedule is None:
        return _load_checked(model, read, strict, source, keys)
    # A model under a precision schedule, from a file saved under one: the model moves to the
    # file's position (its layers in the formats the file's were saved in), back if the load fails.
    with schedule.loading_at(json.loads(read.schedule)):
        return _load_checked(model, read, strict, source, keys)


def _schedule_of(model: nn.Module):
    from .schedule import schedule_of  # (schedule.py builds on quantize_, which this module's users import)

    return schedule_of(model)


def _load_checked(model: nn.Module, read: _Read, strict: bool, source: str, keys=None) -> tuple[list[str], list[str]]:
    loaded = dict(read.tensors)
    # A weight saved once for several tied names serves each of them.
    for alias, kept in read.tied.items():
        if kept in loaded:
            loaded.setdefault(alias, loaded[kept])
    expected = {key: value for key, value in model.state_dict().items() if keys is None or key in keys}
    missing = [key for key in expected if key not in loaded]
    unexpected = [key for key in loaded if key not in expected and key not in read.tied]
    # Everything is checked before anything is written: the quantized entries, then the layers'
    # configurations the file records (the whole model's), then the keys and the plain entries.
    both = [key for key in expected if key in loaded]
    quantized = lambda key: isinstance(expected[key], QuantizedTensor) or isinstance(loaded[key], QuantizedTensor)
    for key in filter(quantized, both):
        _check_loadable(key, expected[key], loaded[key])
    checkpoint_layers.check(model, read.layers, source)
    if strict and (missing or unexpected):
        raise ValueError(f"{source}: missing keys {missing}, unexpected keys {unexpected}; nothing was loaded.")
    for key in both:
        _check_loadable(key, expected[key], loaded[key])
    model.load_state_dict({key: loaded[key] for key in expected if key in loaded}, strict=False)
    return missing, unexpected


def state_for_writer(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`model.state_dict()` as the plain tensors a file stores (tied weights once, quantized tensors
    as their buffers) and the safetensors metadata that describes them all, for a writer that shards
    them itself and writes the same metadata into every shard (`transformers`' `save_pretrained`);
    `load_model_files` reads them back.

    A sharded model (FSDP2, tensor parallelism) is gathered as `save_model` gathers it: a collective
    that every rank must join (every rank calls `save_pretrained`, `is_main_process` on rank 0).
    Rank 0 gets the whole tensors, on the CPU; the other ranks an empty dict, as
    `get_model_state_dict(full_state_dict=True, cpu_offload=True)` gives them."""
    entries, model_fields = _entries(model)
    header = lambda described: {METADATA_KEY: _header(described, model_fields)}
    if not _sharded(model, entries):
        stored, described = _stored_tensors(entries)
        return stored, header(described)
    import torch.distributed as dist

    writer = dist.get_rank() == 0
    stored, described, seen = {}, {}, set()
    for key, value in entries.items():  # one whole tensor at a time on the device
        pieces, description = _stored_tensors({key: full_tensor(value, key)}, seen)
        described.update(description)
        if writer:
            stored.update({name: piece.cpu() for name, piece in pieces.items()})
    _check_namespaces(entries, described)
    return stored, header(described)


def _sharded(model: nn.Module, entries: dict) -> bool:
    return any(hasattr(value, "_local_tensor") for value in (*entries.values(), *model.parameters()))


def _entries(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """`model.state_dict()` without the tied aliases, and what the description says of the model:
    the aliases (`tied`: alias -> the name kept) and its quantized layers' configurations (`layers`)."""
    state = model.state_dict()
    tied = _tied_names(model, state)
    layers = checkpoint_layers.record(checkpoint_layers.model_layers(model))
    return {key: value for key, value in state.items() if key not in tied}, {"tied": tied, "layers": layers}


def _header(described: dict, model_fields: dict) -> str:
    """The `qtensor` metadata entry: the quantized tensors' descriptions, and of a model the tied
    names and the quantized layers' configurations (each left out when empty)."""
    fields = {name: value for name, value in model_fields.items() if value}
    return json.dumps({"version": FORMAT_VERSION, "tensors": described, **fields}, sort_keys=True)


def _check_loadable(key: str, target: torch.Tensor, source: torch.Tensor) -> None:
    """ValueError naming the parameter unless `source` can be restored exactly into `target`."""
    if isinstance(target, QuantizedTensor) or isinstance(source, QuantizedTensor):
        if not (isinstance(target, QuantizedTensor) and isinstance(source, QuantizedTensor)):
            hint = (
                "model.load_state_dict(qtensor.load_file(path)) loads its dequantized values"
                if isinstance(source, QuantizedTensor)
                else "model.load_state_dict(qtensor.load_file(path)) quantizes the plain values with the layer's quantizer"
            )
            raise ValueError(
                f"{key}: the model holds {_describe(target)}, the file {_describe(source)}; load_model "
                f"restores only the same format. {hint}."
            )
        if target.shape != source.shape:  # a model of another size, however quantized
            raise ValueError(f"{key}: the model holds shape {list(target.shape)}, the file {list(source.shape)}.")
        if TensorPlan.of(target).data_key() != TensorPlan.of(source).data_key() or target.quantizer != source.quantizer:
            raise ValueError(
                f"{key}: the model holds {_describe(target)}, the file {_describe(source)}. Quantize the model "
                "with the recipe (and weights mode) it was saved with."
            )
    elif target.shape != source.shape:
        raise ValueError(f"{key}: the model holds shape {list(target.shape)}, the file {list(source.shape)}.")


def _describe(tensor: torch.Tensor) -> str:
    if isinstance(tensor, QuantizedTensor):
        directions = "+".join(d for d in ("rowwise", "columnwise") if getattr(tensor, d) is not None)
        return f"{type(tensor).data_class.__name__} {list(tensor.shape)} ({directions}) from {tensor.quantizer!r}"
    return f"plain {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def _tied_names(model: nn.Module, state: dict) -> dict[str, str]:
    """alias -> kept name, for state_dict entries that are one parameter or buffer under several names."""
    first: dict[int, str] = {}
    tied = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if name not in state:
            continue
        if id(tensor) in first:
            tied[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return tied


# ---- writing ------------------------------------------------------------------------------------
def _user_metadata(metadata) -> dict[str, str]:
    metadata = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("metadata must map str to str, as safetensors requires.")
    for reserved, what in ((METADATA_KEY, "qtensor's description of the tensors"), (SCHEDULE_KEY, "a precision schedule's position")):
        if reserved in metadata:
            raise ValueError(f"metadata key {reserved!r} is reserved for {what}.")
    return {"format": "pt", **metadata}


def _stored_tensors(tensors: dict[str, torch.Tensor], seen_storages: set[int] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The named tensors a file holds for `tensors`, and the qtensor description of the quantized ones
    (`seen_storages`: those of buffers already stored, where the tensors come a few at a time)."""
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise ValueError("save_file takes a dict mapping str to torch.Tensor.")
    stored, described = {}, {}
    seen_storages = set() if seen_storages is None else seen_storages
    for key, value in tensors.items():
        if isinstance(value, QuantizedTensor):
            buffers, metadata = value.to_buffers()
            described[key] = metadata
            for name, buffer in buffers.items():
                buffer = own_bytes(buffer.detach())
                # Pieces of one tensor share their tensor-wide buffers; a file stores each on its own.
                if buffer.numel() and buffer.untyped_storage().data_ptr() in seen_storages:
                    buffer = buffer.clone()
                stored[f"{key}.{name}"] = buffer
                seen_storages.add(buffer.untyped_storage().data_ptr())
        else:
            stored[key] = value.plain().detach() if isinstance(value, DynamicWeight) else value.detach()
    _check_namespaces(tensors, described)
    return stored, described


def _check_namespaces(tensors: dict, described: dict) -> None:
    for key in described:
        clash = [name for name in tensors if name.startswith(key + ".")]
        if clash:
            raise ValueError(f"{clash[0]!r} would collide with the buffers of quantized tensor {key!r} (named {key}.<buffer>). Rename one of them.")


def _write(tensors: dict, filename, user: dict[str, str], model_fields: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file as safetensors_save_file

    stored, described = _stored_tensors(tensors)
    safetensors_save_file(stored, os.fspath(filename), metadata={**user, METADATA_KEY: _header(described, model_fields)})
    return stored


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _entry_nbytes(value: torch.Tensor) -> int:
    if isinstance(value, QuantizedTensor):
        buffers = value.buffer_dict()
        return sum(_nbytes(b) for b in buffers.values())
    return _nbytes(value)


def _plan_shards(entries: dict, max_bytes: int) -> list[list[str]]:
    """Keys in state_dict order, cut into shards of at most `max_bytes` (an entry never split)."""
    shards, current, size = [], [], 0
    for key, value in entries.items():
        nbytes = _entry_nbytes(value)
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes
    return shards + [current] if current or not shards else shards


_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _parse_size(size) -> int:
    """Bytes from an int or a string like "5GB" / "500MiB" (Hugging Face's units)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper()) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"max_shard_size must be a positive number of bytes or a string like '5GB', got {size!r}.")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def _remove_stale_files(filename: str, keep: set[str]) -> None:
    """After a save has been written whole: remove the shards, index or single file of an earlier save
    under the same name, so that load_model never mixes them in."""
    directory, base = os.path.split(filename)
    stem = re.escape(base.removesuffix(".safetensors"))
    pattern = re.compile(rf"{stem}-\d{{5}}-of-\d{{5}}\.safetensors")
    for name in os.listdir(directory or "."):
        if name not in keep and (pattern.fullmatch(name) or name in (base, base + ".index.json")):
            os.remove(os.path.join(directory, name))


# ---- reading ------------------------------------------------------------------------------------
@dataclass
class _Read:
    tensors: dict[str, torch.Tensor]
    tied: dict[str, str]
    layers: dict[str, dict]  # the quantized layers' configurations the files record (checkpoint_layers)
    schedule: str | None = None  # a precision schedule's position (SCHEDULE_KEY), as JSON


def _read_model_files(filename: str, device) -> _Read:
    if os.path.exists(filename):
        return _read(filename, device)
    index_path = filename if filename.endswith(".index.json") else filename + ".index.json"
    if not os.path.exists(index_path):
        raise FileNotFoundError(f"Neither {filename!r} nor the shard index {index_path!r} exists.")
    weight_map = read_index(index_path)
    directory = os.path.dirname(index_path)
    tensors, tied, layers = {}, {}, {}
    for shard in sorted(set(weight_map.values())):
        read = _read(os.path.join(directory, shard), device)
        names = {name for name, file in weight_map.items() if file == shard}
        stored = _stored_names(read.tensors)
        if stored != names:
            raise ValueError(f"{index_path}: shard {shard} holds {sorted(stored)}, the index says {sorted(names)}.")
        tensors.update(read.tensors)
        tied.update(read.tied)
        layers.update(read.layers)
    return _Read(tensors, tied, layers, read.schedule)


def _stored_names(tensors: dict[str, torch.Tensor]) -> set[str]:
    names = set()
    for key, value in tensors.items():
        if isinstance(value, QuantizedTensor):
            names.update(f"{key}.{name}" for name in value.buffer_dict())
        else:
            names.add(key)
    return names


def _read(filename, device) -> _Read:
    return _read_files([os.fspath(filename)], device)


def _read_files(filenames: list[str], device, keys=None) -> _Read:
    """The tensors of one or more files under one qtensor description. One file: `save_file` /
    `save_model`'s. Several: the shards of a writer that splits the state itself (`transformers`'
    `save_pretrained`, `qtensor.hf`), each carrying the whole model's description in its metadata,
    where one quantized tensor's buffers may lie in different shards."""
    from safetensors import safe_open

    header, owner_file, description, schedule = {}, {}, None, None
    for filename in filenames:
        entries, metadata = read_header(filename)
        parsed = parse_description(filename, metadata)
        if description is None:
            description, schedule = parsed, (metadata or {}).get(SCHEDULE_KEY)
        elif parsed != description:
            raise ValueError(f"{filename}: its qtensor description differs from {filenames[0]}'s: the files are not one model's shards.")
        for name, entry in entries.items():
            if name in header:
                raise ValueError(f"{filename}: {name} is also in {owner_file[name]}.")
            header[name], owner_file[name] = entry, filename
    where = filenames[0] if len(filenames) == 1 else os.path.dirname(filenames[0]) or "."
    # Group the stored names: every `key.<name>` of a quantized key belongs to it.
    groups: dict[str, dict[str, str]] = {key: {} for key in description["tensors"]}
    plain = []
    # A placeholder (an empty tensor under a quantized weight's own name, docs/checkpoint-format.md)
    # only stops a reader that does not know qtensor: nothing to read.
    placeholders = set(description["placeholders"])
    for name in (name for name in header if name not in placeholders):
        owner = next((key for key in entry_prefixes(name) if key in groups), None)
        if owner is None:
            plain.append(name)
        else:
            groups[owner][name[len(owner) + 1 :]] = name
    # A writer that stored entries under other names (transformers renames some models' keys as it
    # saves them) lists them: stored name -> state_dict key.
    renamed = description["names"]
    if keys is not None:  # read only these entries (state_dict keys)
        keys = {stored for stored in [*groups, *plain] if renamed.get(stored, stored) in keys}
        groups, plain = {key: names for key, names in groups.items() if key in keys}, [name for name in plain if name in keys]
    # Check every quantized tensor against its declared layouts on meta tensors: no data read yet.
    for key, names in groups.items():
        meta = {buffer: _meta_tensor(header[name], device) for buffer, name in names.items()}
        QuantizedTensor.check_buffers(meta, description["tensors"][key], where=f"{where}: {key}.")
    try:
        with contextlib.ExitStack() as stack:
            files = {filename: stack.enter_context(safe_open(filename, framework="pt", device=str(device))) for filename in filenames}
            read = lambda name: files[owner_file[name]].get_tensor(name)
            tensors = {name: read(name) for name in plain}
            for key, names in groups.items():
                buffers = {buffer: read(name) for buffer, name in names.items()}
                tensors[key] = QuantizedTensor.from_buffers(buffers, description["tensors"][key], where=f"{where}: {key}.")
    except ValueError:
        raise
    except Exception as error:  # safetensors' own error for anything the header check let through
        raise ValueError(f"{where}: safetensors could not read it ({error}).") from None
    back = lambda name: renamed.get(name, name)
    tied = {back(a): back(b) for a, b in description["tied"].items()}
    return _Read({back(key): value for key, value in tensors.items()}, tied, description["layers"], schedule)


def entry_prefixes(name: str):
    """"a.b.c.d" -> "a.b.c", "a.b", "a": the keys whose buffers a stored name could be."""
    parts = name.split(".")
    return (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))


def _meta_tensor(entry: dict, device) -> torch.Tensor:
    return torch.empty(entry["shape"], dtype=SAFETENSORS_DTYPES[entry["dtype"]][0], device="meta")


def parse_description(filename: str, metadata: dict[str, str]) -> dict:
    if METADATA_KEY not in metadata:
        return {"tensors": {}, "tied": {}, "names": {}, "layers": {}, "placeholders": []}
    try:
        description = json.loads(metadata[METADATA_KEY])
    except ValueError as error:
        raise ValueError(f"{filename}: __metadata__[{METADATA_KEY!r}] is not valid JSON ({error}).") from None
    if not isinstance(description, dict) or description.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{filename}: __metadata__[{METADATA_KEY!r}] must be an object with version {FORMAT_VERSION}, "
            f"got {str(description)[:200]}."
        )
    tensors, tied, names = description.get("tensors"), description.get("tied", {}), description.get("names", {})
    placeholders = description.get("placeholders", [])
    unknown = set(description) - {"version", "tensors", "tied", "names", "layers", "placeholders"}
    if unknown or not isinstance(tensors, dict) or not isinstance(tied, dict) or not isinstance(names, dict):
        raise ValueError(
            f"{filename}: __metadata__[{METADATA_KEY!r}] holds version, tensors, tied, names, layers and placeholders only; "
            f"got {sorted(description)}."
        )
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in (*tied.items(), *names.items())):
        raise ValueError(f"{filename}: tied and names must map names to names.")
    if not isinstance(placeholders, list) or not all(isinstance(name, str) for name in placeholders):
        raise ValueError(f"{filename}: placeholders must be a list of the names of empty stand-in tensors the file holds.")
    # Files written before the layers were recorded have none: nothing to check them against.
    layers = checkpoint_layers.parse(filename, description.get("layers", {}))
    return {"tensors": tensors, "tied": tied, "names": names, "layers": layers, "placeholders": placeholders}
