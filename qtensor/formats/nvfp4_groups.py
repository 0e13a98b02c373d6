"""NVFP4 casts of a grouped GEMM's operands, every group at once: the routed rows of all experts (a
grouped linear's input or gradient, rows sorted by expert) or every matrix of an expert stack
(its experts' rows one after another).

Each group gets the bytes of its own cast (nvfp4.py, `NVFP4Quantizer.quantize` of the group alone):
its own global amax and so its own tensor scale S_enc, 16x16 tiles and the Hadamard transform's
runs of 16 counted from its first row, and under stochastic rounding its own keys (row g of one
[G, 4] draw), with the draws numbered as in its own cast. The copies:

    routed rows x [M, K] in G groups
        rowwise      data [M, K/2]        scale_inv [M, K/16]      (fprop's, dgrad's left operand)
        columnwise   data [K, 8·runs]     scale_inv [K, runs]      (wgrad's: each group's rows run
                                                                    on to a multiple of 16, zero codes
                                                                    after them; `runs` of 16 in all)
        group_scales [G] each direction's global amax (after the transform, for a columnwise copy with it)

An expert stack [E, N, K] is the routed rows [E·N, K] in E groups of N rows. On a GPU the casts are
two kernels (qtensor_kernels/nvfp4_groups.py: the groups' amaxes, then both copies from one read of
each tile); elsewhere each group is cast by the reference in turn.
"""

from __future__ import annotations

import torch

from ..core.kernels import lookup
from ..core.groups import GroupedCopy, RowGroups

BLOCK_SIZE = 16  # nvfp4.BLOCK_SIZE: the quantizer's storages (`quantizer.storage_class`) lay out blocks of 16


def cast_groups(quantizer, x: torch.Tensor, groups: RowGroups, rowwise: bool, columnwise: bool, keys: torch.Tensor | None = None, values=(False, False)):
    """(rowwise, columnwise) `GroupedCopy` of `x` [M, K] (M the groups' rows) under the NVFP4
    `quantizer`, each group cast as its own cast (with `keys` [G, 4] its stochastic-rounding keys);
    on a GPU the copies `values` asks for (rowwise, columnwise) come with their bf16 values,
    written by the cast."""
    if columnwise and groups.align != BLOCK_SIZE:
        raise ValueError(f"NVFP4's grouped columnwise copy runs each group on to a multiple of {BLOCK_SIZE} rows, not {groups.align}.")
    # 16x16 tiles keep one scale each where every group is whole tiles; a group that ends inside a
    # tile leaves the rowwise scales one row each (the tile's scale repeated down its rows).
    tiles = quantizer.block_2d and all(n % BLOCK_SIZE == 0 for n in groups.lengths)
    kernel = lookup("nvfp4_groups.cast", x)
    if kernel is not None:
        transformed = quantizer.rht and columnwise
        amaxes = lookup("nvfp4_groups.amaxes", x)(x, groups.ends, groups.lengths, transformed)
        row_amax, col_amax = amaxes[0], amaxes[1] if transformed else amaxes[0]
        row, col = kernel(x, groups.ends, groups.lengths, row_amax, col_amax, keys, rowwise, columnwise, quantizer.block_2d, quantizer.rht, values, tiles=tiles)
    else:
        row, col, row_amax, col_amax = _cast_each(quantizer, x, groups.lengths, rowwise, columnwise, keys, tiles)
    runs = sum(-(-n // BLOCK_SIZE) for n in groups.lengths)
    # The storages' own global amax is never read (each group's factor comes from group_scales): NaN,
    # so that a misuse shows.
    unused = torch.full((), float("nan"), device=x.device)
    copy = lambda direction, rows, buffers, amax: GroupedCopy(
        quantizer._storage(direction, (rows, x.shape[1]), buffers[0], buffers[1], unused, tiles), amax, buffers[2] if len(buffers) > 2 else None
    )
    return (
        copy("rowwise", x.shape[0], row, row_amax) if rowwise else None,
        copy("columnwise", BLOCK_SIZE * runs, col, col_amax) if columnwise else None,
    )


def _cast_each(quantizer, x, lengths, rowwise, columnwise, keys, tiles):
    """The reference: each group cast alone (NVFP4Quantizer._reference_cast), its bytes placed in the
    grouped layout, with one scale per tile or (not `tiles`) per row. (row buffers, column
    buffers, row amaxes [G], column amaxes [G])."""
    M, K = x.shape
    runs = [-(-n // BLOCK_SIZE) for n in lengths]
    options = dict(rht=quantizer.rht, tile_scales=tiles)
    new = lambda direction, rows: [t.view(torch.uint8).zero_().view(t.dtype) for t in quantizer.storage_class.empty_buffers(("data", "scale_inv"), direction, rows, K, x.device, **options)]
    scales_of = lambda storage: storage.scale_inv if tiles else storage.block_scales()
    per_scale = BLOCK_SIZE if tiles else 1  # rows one row of rowwise scales covers
    row = new("rowwise", M) if rowwise else None
    col = new("columnwise", BLOCK_SIZE * sum(runs)) if columnwise else None
    row_amax = torch.zeros(len(lengths), device=x.device)
    col_amax = torch.zeros(len(lengths), device=x.device)
    start = run = 0
    for group, length in enumerate(lengths):
        if length:
            alone_row, alone_col = quantizer._reference_cast(x[start:start + length], None if keys is None else keys[group], rowwise, columnwise)
            if rowwise:
                row[0][start:start + length] = alone_row.data
                row[1][start // per_scale:(start + length) // per_scale] = scales_of(alone_row)
                row_amax[group] = alone_row.global_amax
            if columnwise:
                data, scales = alone_col.data, scales_of(alone_col)
                col[0][:, 8 * run:8 * run + data.shape[1]], col[1][:, run:run + scales.shape[1]] = data, scales
                col_amax[group] = alone_col.global_amax
        start, run = start + length, run + runs[group]
    return row, col, row_amax, col_amax
