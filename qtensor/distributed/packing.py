"""A storage's per-row buffers as bytes: what all-gathers of row shards send (FSDP2's, fsdp.py, and
sequence parallelism's, sequence_parallel.py), and the storage rebuilt from what arrives. Tensor-wide
buffers are never sent: a shard was quantized with the whole tensor's scale, which every rank holds."""

from __future__ import annotations

import math

import torch

from ..core.numerics import ceil_div
from ..core.storage import Storage, _layout


def row_buffers(storage: Storage) -> list[torch.Tensor]:
    """The buffers that follow the rows, in layout order: what an all-gather of row shards sends
    (tensor-wide buffers are every rank's already)."""
    return [getattr(storage, spec.name) for spec in storage.buffer_specs() if not spec.tensor_wide]


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to 8: each packed buffer starts on an 8-byte boundary."""
    return ceil_div(nbytes, 8) * 8


def unpacked_rows(raw: torch.Tensor, template: Storage, rows: int, offset: int = 0) -> tuple[Storage, int]:
    """(a storage like `template` of `rows` rows over the per-row buffers packed in the uint8 `raw`
    from `offset` on, the offset after them): the inverse of packing `row_buffers`, each at an
    `aligned` offset. Tensor-wide buffers are not sent: the template's are every rank's."""
    buffers = {}
    for spec in _layout(type(template), template.direction, rows, template.cols, template.options).values():
        if spec.tensor_wide:
            buffers[spec.name] = getattr(template, spec.name)
            continue
        nbytes = math.prod(spec.shape) * spec.dtype.itemsize
        buffers[spec.name] = raw[offset : offset + nbytes].view(spec.dtype).reshape(spec.shape)
        offset += aligned(nbytes)
    return template.rebuilt(buffers, rows=rows), offset


# ---- one all-gather input holding several buffers' bytes ----------------------------------------
# The integer dtypes an all-gather can carry: gloo refuses int16 (`Invalid scalar type`) and NCCL has none.
PACK_DTYPES = (torch.uint8, torch.int32, torch.int64)


def payload(buffers: list[torch.Tensor], rooms: list[int], capacity: int, device, shape=None) -> torch.Tensor:
    """One all-gather input of `capacity` bytes holding each buffer's bytes at the start of its room
    (`rooms`: bytes each, laid end to end; the rest zero): a uint8 tensor, or with `shape` (FSDP2's
    padded shard, which every all-gather input of an uneven shard must match) a tensor of that shape
    in the smallest of PACK_DTYPES that holds `capacity` bytes."""
    if shape is None:
        packed = torch.zeros(capacity, dtype=torch.uint8, device=device)
    else:
        dtype = next((d for d in PACK_DTYPES if math.prod(shape) * d.itemsize >= capacity), None)
        if dtype is None:
            raise NotImplementedError(
                f"{capacity} bytes of codes and scales do not fit FSDP2's padded shard {list(shape)} even as int64: "
                "shard this weight evenly, or keep its layer out of quantize_."
            )
        packed = torch.zeros(shape, dtype=dtype, device=device)
    raw, offset = packed.view(-1).view(torch.uint8), 0
    for buffer, room in zip(buffers, rooms):
        if buffer.numel():
            raw[offset : offset + buffer.nbytes].copy_(buffer.contiguous().reshape(-1).view(torch.uint8))
        offset += room
    return packed


def packed_experts(buffers: list[torch.Tensor], padded_shape) -> torch.Tensor:
    """`buffers` (each `[local experts, ...]`) as one tensor of `padded_shape` (FSDP2's padded shard
    of a stack, `[padded experts, ...]`): room for `padded_shape[0]` experts of each buffer (zero
    bytes for the experts this rank lacks), as `payload` packs them."""
    rooms = [aligned(padded_shape[0] * _expert_bytes(b)) for b in buffers]
    return payload(buffers, rooms, sum(rooms), buffers[0].device, padded_shape)


def unpacked_experts(output: torch.Tensor, templates: list[torch.Tensor], world_size: int, experts: int) -> list[torch.Tensor]:
    """The gathered buffers `[experts, ...]` from the all-gather output of `packed_experts` payloads
    (one per rank, each of `padded` experts): every rank's experts cut from its payload, joined,
    and the padding experts past `experts` dropped. `templates` give each buffer's dtype and shape."""
    raw = output.reshape(-1).view(torch.uint8)
    per_rank = raw.numel() // world_size
    padded = output.shape[0] // world_size
    counts = [max(0, min(padded, experts - rank * padded)) for rank in range(world_size)]  # each rank's real experts
    gathered, offset = [], 0
    for template in templates:
        each = _expert_bytes(template)
        pieces = [raw[rank * per_rank + offset : rank * per_rank + offset + count * each] for rank, count in enumerate(counts)]
        gathered.append(torch.cat(pieces).view(template.dtype).reshape(experts, *template.shape[1:]))
        offset += aligned(padded * each)
    return gathered


def _expert_bytes(buffer: torch.Tensor) -> int:
    return math.prod(buffer.shape[1:]) * buffer.element_size()
