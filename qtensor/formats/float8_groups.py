"""Float8 casts of a grouped GEMM's operands, every group at once: the routed rows of all experts (a
grouped linear's input or gradient, rows sorted by expert) and every matrix of an expert stack.

Each group and each expert gets the codes and scales it would get cast on its own (float8.py,
float8_block.py): one tensor scale per group of rows or per expert (`Float8Quantizer`, current
scaling), or one scale per row, and per column over the group's rows for the columnwise copy
(`Float8BlockQuantizer` row-wise). The casts are a few whole-tensor operations (on a GPU, the
kernels of qtensor_kernels/float8_groups.py) instead of a few per group, so a stack of 128 small
experts costs as many launches as one large one.

A grouped operand is a `GroupedOperand` (core/quantizer.py): FP8 codes with the GEMM's reduction
dimension last, the fp32 factor that dequantizes each row of `data` (a tensor scale appears
expanded to every row it covers: the form a grouped GEMM with row scales takes) and, for routed
rows, their `RowGroups`.

    routed rows x [M, K] in G groups
        rowwise      data [M, K]      scale_inv [M]      (fprop's and dgrad's left operand)
        columnwise   data [K, M']     scale_inv [G, K]   (wgrad's operands: xᵀ, each group's columns
                                                          run on to a multiple of 16)
    stack w [E, N, K]
        rowwise      data [E, N, K]   scale_inv [E, N]   (fprop's right operand)
        columnwise   data [E, K, N]   scale_inv [E, K]   (dgrad's right operand: each w_eᵀ)

The columnwise copy of routed rows runs each group on to a multiple of 16 columns with zero codes,
the alignment the FP8 grouped GEMM needs along its reduction dimension; zeros add nothing to wgrad.
"""

from __future__ import annotations

import torch

from ..core.kernels import lookup
from ..core.numerics import current_scale, exact_quotient, fp8_max, quantize_per_tensor
from ..core.groups import GroupedOperand, RowGroups

ALIGN = 16  # rows per group of a columnwise copy: a multiple of this


class CastsGroups:
    """The grouped casts of a Float8 quantizer (mixed into `Float8Quantizer` and
    `Float8BlockQuantizer`), which supplies `grouped_scaling()`, `fp8_dtype` and
    `group_scale_rule(amax)`: from each group's column amaxes [G, K], the amaxes its scales come
    from (one per group [G, 1], or per column [G, K]), amax_epsilon, and whether the scales round
    down to powers of two (Float8's current scaling, numerics.current_scale)."""

    def quantize_groups(self, x: torch.Tensor, groups: RowGroups, rowwise: bool, columnwise: bool):
        return cast_rows(self, x, groups, rowwise, columnwise)

    def quantize_stack(self, stack: torch.Tensor, rowwise: bool, columnwise: bool):
        return cast_stack(self, stack, rowwise, columnwise)

    def group_scales_and_inverses(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[G, K] fp32 scales from each group's column amaxes [G, K] (a per-group scale broadcast
        along K) and their correctly rounded inverses: on a GPU from one kernel, instead of a dozen
        small launches per cast."""
        amaxes, epsilon, pow2 = self.group_scale_rule(amax)
        kernel = lookup("float8_groups.scales", amax)
        if kernel is None:
            scale = current_scale(amaxes, fp8_max(self.fp8_dtype), epsilon, pow2)
            scale_inv = exact_quotient(1.0, scale)
        else:
            scale, scale_inv = kernel(amaxes, fp8_max(self.fp8_dtype), epsilon, pow2)
        return scale.expand(amax.shape), scale_inv.expand(amax.shape)


def _column_amax(x: torch.Tensor, groups: RowGroups, rows: bool = False):
    """[G, K] each group's finite column amaxes, and with `rows` [R] each row's (one read of `x`)."""
    kernel = lookup("float8_groups.column_amax", x)
    if kernel is not None:
        return kernel(x, groups.starts, groups.device_lengths, rows)
    magnitude = x.float().abs()
    magnitude = torch.where(torch.isfinite(magnitude), magnitude, 0.0)  # NaN and ±Inf do not set a scale
    columns = torch.segment_reduce(magnitude, "max", lengths=groups.device_lengths, axis=0, unsafe=True, initial=0.0)
    return (columns, magnitude.amax(dim=1) if x.shape[1] else magnitude.new_zeros(x.shape[0])) if rows else columns


def _cast(x, scale, groups: RowGroups, fp8_dtype, rowwise: bool, col_out, col_stride: int, row_scale=None):
    """Codes of `x` [R, K] at the groups' column scales `scale` [G, K]: rowwise [R, K] (or None; at
    `row_scale` [R] where given), and the columnwise runs written into `col_out` (group g's column k
    at k * col_stride + its base)."""
    row_out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device) if rowwise else None
    kernel = lookup("float8_groups.cast", x)
    if kernel is not None:
        kernel(x, scale, groups.starts, groups.device_lengths, groups.padded_rows(), fp8_dtype, row_out, col_out,
               groups.bases, col_stride, row_scale)
        return row_out
    one = torch.ones((), device=x.device)
    codes = quantize_per_tensor(x.float() * scale[groups.of_rows()], one, fp8_dtype)
    if rowwise:
        row_out.copy_(codes if row_scale is None else quantize_per_tensor(x.float() * row_scale[:, None], one, fp8_dtype))
    if col_out is not None:  # each group's rows from its base on; the padding stays zero
        flat = col_out.view(torch.uint8).view(-1)
        index = groups.positions()[None, :] + torch.arange(x.shape[1], device=x.device)[:, None] * col_stride
        flat[index.reshape(-1)] = codes[: index.shape[1]].view(torch.uint8).t().reshape(-1)  # (rows past the groups' left out)
    return row_out


def _row_scales(quantizer, row_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A row-wise quantizer's scale of each row and its inverse, from the rows' amaxes ([R] each)."""
    scale, scale_inv = quantizer.group_scales_and_inverses(row_amax[:, None])
    return scale.reshape(-1), scale_inv.reshape(-1)


def cast_rows(quantizer, x: torch.Tensor, groups: RowGroups, rowwise: bool, columnwise: bool):
    """(rowwise, columnwise) GroupedOperand of the routed rows `x` [M, K] (M = the groups' rows),
    each group cast as one tensor by `quantizer`; None for a direction not asked."""
    if not (rowwise or columnwise):
        return None, None
    groups = groups.aligned(ALIGN)
    x = x if x.stride(-1) == 1 else x.contiguous()
    tensor_scaled = quantizer.grouped_scaling() == "tensor"
    amaxes = _column_amax(x, groups, rows=rowwise and not tensor_scaled)
    col_amax, row_amax = amaxes if rowwise and not tensor_scaled else (amaxes, None)
    scale, scale_inv = quantizer.group_scales_and_inverses(col_amax)
    columns = groups.padded_rows()  # (a bound where the host does not know the groups' sizes: the runs fill a prefix)
    # Every column is written, the padding too, where the kernel runs; the reference leaves the padding as it is.
    allocate = torch.empty if lookup("float8_groups.cast", x) is not None else torch.zeros
    col_out = allocate((x.shape[1], columns), dtype=quantizer.fp8_dtype, device=x.device) if columnwise else None
    row = None
    if tensor_scaled:  # both copies from one pass, at the group's scale
        codes = _cast(x, scale, groups, quantizer.fp8_dtype, rowwise, col_out, columns)
        row = GroupedOperand(codes, scale_inv[:, 0][groups.of_rows()], groups) if rowwise else None
        col_scale_inv = scale_inv.contiguous()
    else:  # a row's scale does not depend on its group; each group's columns have their own
        row_scale, row_scale_inv = _row_scales(quantizer, row_amax) if rowwise else (None, None)
        codes = _cast(x, scale, groups, quantizer.fp8_dtype, rowwise, col_out, columns, row_scale)
        row = GroupedOperand(codes, row_scale_inv, groups) if rowwise else None
        col_scale_inv = scale_inv
    col = GroupedOperand(col_out, col_scale_inv, groups, padded=True) if columnwise else None
    return row, col


def cast_stack(quantizer, stack: torch.Tensor, rowwise: bool, columnwise: bool):
    """(rowwise, columnwise) GroupedOperand of an expert stack `stack` [E, N, K] (each w_e [N, K],
    the layer's [out, in]), each expert cast as one tensor by `quantizer`. The columnwise copy
    [E, K, N] is written by the cast itself (expert e's column k at e·K·N + k·N) where N is a
    multiple of 16, else transposed after (the cast runs each expert's columns on to a multiple of
    16, which would overrun into the next expert's)."""
    experts, n, k = stack.shape
    flat = stack.reshape(experts * n, k)  # a copy where the stack is a transposed view
    device = stack.device
    in_place = columnwise and n % ALIGN == 0
    bases = torch.arange(experts, device=device) * (k * n) if in_place else None
    groups = RowGroups((n,) * experts, torch.arange(1, experts + 1, device=device) * n, align=ALIGN, bases=bases)
    tensor_scaled = quantizer.grouped_scaling() == "tensor"
    by_rows = rowwise and not tensor_scaled
    amaxes = _column_amax(flat, groups, rows=by_rows)
    col_amax, row_amax = amaxes if by_rows else (amaxes, None)
    scale, scale_inv = quantizer.group_scales_and_inverses(col_amax)  # [E, K]: one per expert, or one per column of each expert
    row_scale, row_scale_inv = _row_scales(quantizer, row_amax) if by_rows else (None, None)
    col = torch.empty((experts, k, n), dtype=quantizer.fp8_dtype, device=device) if in_place else None
    codes = _cast(flat, scale, groups, quantizer.fp8_dtype, rowwise or (columnwise and tensor_scaled), col, n, row_scale)
    if tensor_scaled:
        scale_inv = scale_inv[:, :1]
        if columnwise and not in_place:
            col = codes.view(experts, n, k).transpose(1, 2).contiguous()
        row = GroupedOperand(codes.view(experts, n, k), scale_inv.expand(experts, n).contiguous()) if rowwise else None
        return row, (GroupedOperand(col, scale_inv.expand(experts, k).contiguous()) if columnwise else None)
    row = GroupedOperand(codes.view(experts, n, k), row_scale_inv.view(experts, n)) if rowwise else None
    if columnwise and not in_place:  # one scale per column of each expert: the rows of its transpose
        storage = quantizer.quantize(stack.transpose(1, 2).reshape(experts * k, n), rowwise=True, columnwise=False).storage_for("rowwise")
        col = storage.data.view(experts, k, n)
    return row, (GroupedOperand(col, scale_inv.contiguous()) if columnwise else None)
