"""The safetensors files qtensor reads, checked before a byte of data is: a file's header (every
entry's dtype, shape and byte range) and a Hugging Face-style shard index (docs/checkpoint-format.md).
`qtensor.checkpoint` reads through these and exports them."""

from __future__ import annotations

import json
import math
import os
import struct

import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

# safetensors dtype codes this library reads: name -> (torch dtype, bytes per element)
SAFETENSORS_DTYPES = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2), "I8": (torch.int8, 1),
    "U64": (torch.uint64, 8), "U32": (torch.uint32, 4), "U16": (torch.uint16, 2), "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1), "F8_E8M0": (torch.float8_e8m0fnu, 1),
}


def read_index(index_path: str) -> dict[str, str]:
    """The `weight_map` of a Hugging Face-style shard index (stored name -> shard file name beside it)."""
    try:
        with open(index_path) as index_file:
            weight_map = json.load(index_file)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map names to shard file names")
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{index_path}: not a shard index ({error}).") from None
    for shard in weight_map.values():
        if os.path.basename(shard) != shard:
            raise ValueError(f"{index_path}: shard {shard!r} is not a file name beside the index.")
    return weight_map


def read_header(filename) -> tuple[dict, dict[str, str]]:
    """The tensor entries and `__metadata__` of a safetensors file, each entry checked against the
    file: a known dtype, a shape, and a byte range inside the data that matches them."""
    filename = os.fspath(filename)
    size = os.path.getsize(filename)
    with open(filename, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{filename}: {size} bytes is too short for a safetensors file (8-byte header length first).")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(
                f"{filename}: the header claims {header_length} bytes; the file has {size - 8} after the "
                "length. It is truncated or not a safetensors file."
            )
        raw = file.read(header_length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{filename}: the header is not valid JSON ({error}); the file is corrupt.") from None
    if not isinstance(header, dict):
        raise ValueError(f"{filename}: the header is not a JSON object.")
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"{filename}: __metadata__ must map strings to strings.")
    data_size = size - 8 - header_length
    ranges = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{filename}: {name}: expected dtype, shape and data_offsets, got {entry!r}.")
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{filename}: {name}: unsupported dtype {entry['dtype']!r}.")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"{filename}: {name}: shape must be a list of sizes >= 0, got {shape!r}.")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets):
            raise ValueError(f"{filename}: {name}: data_offsets must be two integers, got {offsets!r}.")
        begin, end = offsets
        nbytes = math.prod(shape) * SAFETENSORS_DTYPES[entry["dtype"]][1]
        if not 0 <= begin <= end or end - begin != nbytes:
            raise ValueError(f"{filename}: {name}: data_offsets {offsets} do not hold {nbytes} bytes of {entry['dtype']} {shape}.")
        if end > data_size:
            raise ValueError(f"{filename}: {name}: its bytes [{begin}, {end}) run past the end of the data ({data_size} bytes); the file is truncated.")
        ranges.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(ranges):
        if begin != position:
            raise ValueError(f"{filename}: {name}: its bytes start at {begin}, not at {position}; overlapping or gapped data.")
        position = end
    if position != data_size:
        raise ValueError(f"{filename}: the tensors cover {position} of {data_size} data bytes; the file is corrupt.")
    return header, metadata
