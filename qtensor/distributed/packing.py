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
