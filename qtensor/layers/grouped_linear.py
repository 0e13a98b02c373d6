"""An expert stack's grouped linear: `grouped_mm(x, stack, offs)` with each group of rows through its
expert's quantized linear, as one autograd Function over the whole stack (layers/experts.py). The
weight gradient is written into the stack's gradient whole: no per-expert autograd node, no
gradient of the whole stack per expert.

Three Functions, one picked per layer (`grouped_linear`); all three give each group the codes and
scales of its own cast, as that expert's quantized linear would cast it (linear.py):

- `GroupedFloat8Function`: Float8 roles (per-tensor current scaling, row-wise) cast every group at
  once (`Quantizer.quantize_groups` / `quantize_stack`), each GEMM one grouped FP8 GEMM
  (`gemm.grouped.scaled_nt`);
- `PaddedGroupsFunction`: MXFP8, NVFP4 and their hybrid over more than a few experts, every group
  cast at once with each group padded to whole blocks for the columnwise copy (each group at its
  own tensor scale), each GEMM one bf16 grouped GEMM over the exact values with each group's
  tensor scales in its epilogue (`gemm.grouped.copies_rows`, `copies_columns`);
- `GroupedLinearFunction`: any other layer, each group cast and multiplied in turn
  (`gemm.grouped.fprop` / `dgrad` / `wgrad`), every backward override included.
"""

from __future__ import annotations

import torch

from .. import gemm
from ..core.groups import GroupedCopy, GroupedOperand, RowGroups
from ..core.kernels import lookup
from ..core.quantizer import INPUT_DTYPES
from .config import LinearQuantizers
from .linear import _output_dtype, _pack_saved, _quantize, _unpack_saved, restored_storage, saved_storage
from ..core.tensor import QuantizedTensor


class GroupedLinearFunction(torch.autograd.Function):
    """y[rows of group g] = x[rows of g] · W_eᵀ over the groups `ends` gives (empty groups skipped)."""

    @staticmethod
    def forward(ctx, x, stack, groups: tuple, linear: LinearQuantizers, needs_grad: tuple, in_out: bool):
        input_needs_grad, weight_needs_grad = needs_grad
        override = linear.backward_override
        quantized_backward = override is None
        # [experts, out, in], or [experts, in, out] where `in_out`; None for a stack held quantized
        values = stack.plain() if stack.quantized_at_use else None
        out_features = stack.shape[-1] if in_out else stack.shape[-2]
        out = x.new_zeros((x.shape[0], out_features), dtype=_output_dtype(x, stack))
        operands, saved, rebuilds = [], [], []
        for expert, start, end in groups:
            x_g = x[start:end]
            x_q = _quantize(linear.input, x_g, rowwise=True, columnwise=weight_needs_grad and quantized_backward)
            if values is not None:
                w_e = values[expert].t() if in_out else values[expert]
                w_q = _quantize(linear.weight, w_e, rowwise=True, columnwise=input_needs_grad and quantized_backward)
            else:  # expert e's cast, both directions, [out, in]
                w_q = stack.experts[expert]
                w_e = w_q.dequantize() if override == "high_precision" else None
            operands.append((x_q, w_q))
            if override is None:
                keep = ((x_q, "columnwise"), (w_q, "columnwise"))
            elif override == "dequantized":
                keep = ((x_q, "rowwise"), (w_q, "rowwise"))
            else:  # high_precision: the original operands
                keep = ((x_g, None), (w_e, None))
            for (tensor, direction), needed in zip(keep, (weight_needs_grad, input_needs_grad)):
                tensors, rebuild = _pack_saved(tensor, direction) if needed else ([None], None)
                rebuilds.append((len(tensors), rebuild))
                saved.extend(tensors)
        gemm.grouped.fprop(out, groups, operands, fast_accumulation=linear.fprop_fast_accumulation)
        ctx.save_for_backward(*saved)
        ctx.rebuilds, ctx.groups, ctx.linear, ctx.needs_grad, ctx.in_out = rebuilds, groups, linear, needs_grad, in_out
        ctx.shapes = (x.shape, x.dtype, stack.shape, stack.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        linear, groups = ctx.linear, ctx.groups
        input_needs_grad, weight_needs_grad = ctx.needs_grad
        x_shape, x_dtype, stack_shape, stack_dtype = ctx.shapes
        saved, position, pairs = ctx.saved_tensors, 0, []
        for count, rebuild in ctx.rebuilds:
            pairs.append(_unpack_saved(saved[position:position + count], rebuild))
            position += count
        saved_x, saved_w = pairs[0::2], pairs[1::2]
        if linear.backward_override == "dequantized":
            dequantized = lambda t: t.dequantize(torch.float32, "rowwise") if isinstance(t, QuantizedTensor) else t
            saved_x, saved_w = [dequantized(t) for t in saved_x], [dequantized(t) for t in saved_w]
        grads = []
        for _, start, end in groups:
            grad_g = grad_out[start:end]
            if linear.backward_override is None:
                grad_g = _quantize(linear.grad_output, grad_g, rowwise=input_needs_grad, columnwise=weight_needs_grad)
            grads.append(grad_g)
        grad_x = grad_stack = None
        if input_needs_grad:
            grad_x = torch.zeros(x_shape, dtype=x_dtype, device=grad_out.device)
            gemm.grouped.dgrad(grad_x, groups, list(zip(grads, saved_w)), fast_accumulation=linear.backward_fast_accumulation)
        if weight_needs_grad:
            # Each expert's [out, in] product written whole; a stack read as [in, out] gets the transposed
            # view of it (no strided copy: autograd hands a transposed view's base the [out, in] tensor).
            experts, *matrix = stack_shape
            out_in = matrix[::-1] if ctx.in_out else matrix
            grad_stack = torch.zeros((experts, *out_in), dtype=stack_dtype, device=grad_out.device)
            gemm.grouped.wgrad(grad_stack, groups, list(zip(grads, saved_x)), fast_accumulation=linear.backward_fast_accumulation)
            grad_stack = grad_stack.transpose(-2, -1) if ctx.in_out else grad_stack
        return grad_x, grad_stack, None, None, None, None


class GroupedFloat8Function(torch.autograd.Function):
    """`GroupedLinearFunction` where every role is Float8 with current per-tensor or row-wise
    scaling and the backward is quantized: all groups cast at once (formats/float8_groups.py), each
    GEMM one grouped launch (`gemm.grouped.scaled_nt`). The same codes and scales as the groups cast
    one by one."""

    @staticmethod
    def forward(ctx, x, stack, groups: RowGroups, linear: LinearQuantizers, needs_grad: tuple, in_out: bool):
        input_needs_grad, weight_needs_grad = needs_grad
        # The groups' rows (or, where the host does not know their sizes, every row: the GEMMs zero
        # the rows past the last group's).
        x_row, x_col = linear.input.quantize_groups(x[: groups.rows], groups, True, weight_needs_grad)
        if stack.quantized_at_use:
            values = stack.plain()
            weights = values.transpose(1, 2) if in_out else values  # [experts, out, in]
            w_row, w_col = linear.weight.quantize_stack(weights, True, input_needs_grad)
        else:  # the experts' casts in place
            w_row, w_col = stack.stacked_operands(True, input_needs_grad)
        out_dtype = _output_dtype(x, stack)
        y = gemm.grouped.scaled_nt(
            x_row, w_row, out_dtype, tensor_scaled=_tensor_scaled(linear.input, linear.weight),
            fast_accumulation=linear.fprop_fast_accumulation,
        )
        ctx.save_for_backward(*(x_col[:2] if x_col else (None, None)), *(w_col[:2] if w_col else (None, None)))
        ctx.x_groups = x_col.groups if x_col else None  # the runs its columnwise copy was padded to
        ctx.groups, ctx.linear, ctx.needs_grad, ctx.in_out = groups, linear, needs_grad, in_out
        ctx.shapes = (x.shape, x.dtype, stack.dtype, _wgrad_dtype(out_dtype, stack))
        return _rows_past_end_zero(y, x.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        linear, groups = ctx.linear, ctx.groups
        input_needs_grad, weight_needs_grad = ctx.needs_grad
        x_shape, x_dtype, stack_dtype, wgrad_dtype = ctx.shapes
        x_data, x_scale_inv, w_data, w_scale_inv = ctx.saved_tensors
        g_row, g_col = linear.grad_output.quantize_groups(grad_out[: groups.rows], groups, input_needs_grad, weight_needs_grad)
        grad_x = grad_stack = None
        fast = linear.backward_fast_accumulation
        if input_needs_grad:
            w_col = GroupedOperand(w_data, w_scale_inv)
            tensor_scaled = _tensor_scaled(linear.grad_output, linear.weight)
            grad_x = gemm.grouped.scaled_nt(g_row, w_col, x_dtype, tensor_scaled=tensor_scaled, fast_accumulation=fast)
            grad_x = _rows_past_end_zero(grad_x, x_shape[0])
        if weight_needs_grad:
            x_col = GroupedOperand(x_data, x_scale_inv, ctx.x_groups, padded=True)
            tensor_scaled = _tensor_scaled(linear.grad_output, linear.input)
            # [experts, out, in], rounded as wgrad_dtype, in the stack's dtype
            grad_stack = gemm.grouped.scaled_nt(g_col, x_col, wgrad_dtype, tensor_scaled=tensor_scaled, fast_accumulation=fast, stored_dtype=stack_dtype)
            grad_stack = grad_stack.transpose(-2, -1) if ctx.in_out else grad_stack
        return grad_x, grad_stack, None, None, None, None


# A stack of at most this many experts multiplies MXFP8, and Float8 with an E5M2 role, group by group.
FEW_EXPERTS = 8


class PaddedGroupsFunction(torch.autograd.Function):
    """`GroupedLinearFunction` for block formats whose values, less a tensor scale, bf16 holds
    exactly (`Quantizer.group_block_rows`: MXFP8, NVFP4, their hybrid) and a quantized backward.
    Every group of routed rows is cast at once (`Quantizer.quantize_padded_groups`): the rowwise
    copy over the rows, the columnwise copy over each group run on to whole blocks with zero rows,
    so that no block spans two groups; the stack's experts as one [E·N, K] matrix (N a whole number
    of blocks). A format with a tensor scale (NVFP4) scales each group and each expert by its own.
    Each GEMM is one grouped GEMM over the copies' values, each group's tensor scales in its fp32
    epilogue (`gemm.grouped.copies_rows`, `copies_columns`). The codes and scales are those of the
    groups and experts cast one by one."""

    @staticmethod
    def forward(ctx, x, stack, groups: RowGroups, linear: LinearQuantizers, needs_grad: tuple, in_out: bool):
        input_needs_grad, weight_needs_grad = needs_grad
        rows = x[: sum(groups.lengths)]
        experts, n, k = stack.shape[0], stack.shape[-1] if in_out else stack.shape[-2], stack.shape[-2] if in_out else stack.shape[-1]
        # The copies multiplied at once come with their values (a cast may write them beside the codes).
        x_row, x_col = linear.input.quantize_padded_groups(rows, _aligned(groups, linear), True, weight_needs_grad, (True, False))
        if stack.quantized_at_use:
            values = stack.plain()
            weights = values.transpose(1, 2) if in_out else values  # [experts, out, in]
            w_row, w_col = linear.weight.quantize_padded_groups(
                weights.reshape(experts * n, k), _experts(linear, experts, n, x.device), True, input_needs_grad, (True, False)
            )
        else:  # the experts' casts in place, each direction as one [E·N, K] copy over the stack's bytes
            w_row, w_col = stack.grouped_copy("rowwise"), stack.grouped_copy("columnwise") if input_needs_grad else None
        out_dtype = _output_dtype(x, stack)
        y = gemm.grouped.copies_rows(x_row, w_row, "rowwise", experts, groups.offsets(False), groups.lengths, out_dtype)
        saved, ctx.rebuilds = [], []
        for copy in (x_col, w_col):
            tensors, rebuild = _pack_copy(copy)
            ctx.rebuilds.append((len(tensors), rebuild))
            saved.extend(tensors)
        ctx.save_for_backward(*saved)
        ctx.groups, ctx.linear, ctx.needs_grad, ctx.in_out = groups, linear, needs_grad, in_out
        ctx.shapes = (x.shape, x.dtype, stack.dtype, experts, _wgrad_dtype(out_dtype, stack))
        return _rows_past_end_zero(y, x.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        linear, groups = ctx.linear, ctx.groups
        input_needs_grad, weight_needs_grad = ctx.needs_grad
        x_shape, x_dtype, stack_dtype, experts, wgrad_dtype = ctx.shapes
        (x_count, x_rebuild), (_, w_rebuild) = ctx.rebuilds
        saved = ctx.saved_tensors
        x_col, w_col = _unpack_copy(saved[:x_count], x_rebuild), _unpack_copy(saved[x_count:], w_rebuild)
        padded = _aligned(groups, linear)
        g_row, g_col = linear.grad_output.quantize_padded_groups(grad_out[: sum(groups.lengths)], padded, input_needs_grad, weight_needs_grad, (True, True))
        grad_x = grad_stack = None
        if input_needs_grad:
            grad_x = gemm.grouped.copies_rows(g_row, w_col, "columnwise", experts, groups.offsets(False), groups.lengths, x_dtype)
            grad_x = _rows_past_end_zero(grad_x, x_shape[0])
        g_row = w_col = None  # g_row's values, the size of grad_out, freed before the weight gradient is made
        if weight_needs_grad:
            grad_stack = gemm.grouped.copies_columns(g_col, x_col, padded.offsets(True), padded.padded, wgrad_dtype, stack_dtype)  # [experts, out, in]
            grad_stack = grad_stack.transpose(-2, -1) if ctx.in_out else grad_stack
        return grad_x, grad_stack, None, None, None, None


def _aligned(groups: RowGroups, linear: LinearQuantizers) -> RowGroups:
    """`groups` with each group's columnwise run a whole number of the format's blocks of rows."""
    return groups.aligned(linear.input.group_block_rows())


def _experts(linear: LinearQuantizers, experts: int, rows: int, device) -> RowGroups:
    """A stack's experts, [E·N, K], as groups of N rows (whole blocks: `_pads_groups`)."""
    return RowGroups((rows,) * experts, torch.arange(1, experts + 1, device=device) * rows, align=linear.weight.group_block_rows())


def _pack_copy(copy: GroupedCopy | None):
    """(the plain tensors to save for backward, how to rebuild the copy from them), as `_pack_saved`
    saves a quantized operand's one direction: its storage's buffers, then its groups' scales."""
    if copy is None:
        return [None], None
    tensors, recipe = saved_storage(copy.storage)
    group_scales = copy.group_scales.data if copy.group_scales is not None else None  # (a held stack's: a view of its bytes)
    return tensors + [group_scales], recipe


def _unpack_copy(tensors, recipe) -> GroupedCopy | None:
    if recipe is None:
        return None
    return GroupedCopy(restored_storage(tensors[:-1], recipe), tensors[-1])


def _wgrad_dtype(out_dtype: torch.dtype, stack) -> torch.dtype:
    """The dtype a grouped path multiplies the weight gradient in, before the stack's own: bf16 where
    the forward multiplied in bf16 (autocast's bf16 grouped GEMM over the stack's cast gives a bf16
    gradient too; torch's grouped GEMMs write only bf16), else the stack's."""
    return torch.bfloat16 if out_dtype == torch.bfloat16 else stack.dtype


def _tensor_scaled(*quantizers) -> bool:
    return all(quantizer.grouped_scaling() == "tensor" for quantizer in quantizers)


def _rows_past_end_zero(y: torch.Tensor, rows: int) -> torch.Tensor:
    return y if y.shape[0] == rows else torch.cat([y, y.new_zeros((rows - y.shape[0], y.shape[1]))])


def _casts_groups_at_once(linear: LinearQuantizers, stack):
    """GroupedFloat8Function where it takes the layer: a quantized backward, and roles whose every
    group the format casts in one go. With an E5M2 role (`float8_current`'s gradient), which the
    FP8 grouped GEMM does not take, the backward's GEMMs run group by group on the grouped casts:
    only for a stack of more than a few experts (with few, the per-group path was faster where
    measured, on an H100 at the Mixtral-like shapes before the backward read its groups' slices in
    place: 1.25x bf16 against 1.09x)."""
    roles = (linear.input, linear.weight, linear.grad_output)
    if linear.backward_override is not None or not all(quantizer is not None and quantizer.grouped_scaling() for quantizer in roles):
        return None
    all_e4m3 = all(quantizer.fp8_dtype == torch.float8_e4m3fn for quantizer in roles)
    return GroupedFloat8Function if all_e4m3 or stack.shape[0] > FEW_EXPERTS else None


def _pads_groups(linear: LinearQuantizers, stack, in_out: bool):
    """PaddedGroupsFunction where it takes the layer: a quantized backward; every role's format
    casting padded groups, the routed rows' two columnwise copies (wgrad's operands) with blocks of
    one size and in one reduction transform; the weight's columnwise copy (dgrad's, beside the
    gradient's rowwise one) in none; and experts of whole blocks of rows."""
    roles = (linear.input, linear.weight, linear.grad_output)
    if linear.backward_override is not None or any(quantizer is None or quantizer.group_block_rows() is None for quantizer in roles):
        return None
    out_features = stack.shape[-1] if in_out else stack.shape[-2]
    takes = (
        linear.input.group_block_rows() == linear.grad_output.group_block_rows()
        and linear.input.reduction_transform("columnwise") == linear.grad_output.reduction_transform("columnwise")
        and linear.weight.reduction_transform("columnwise") is None
        and out_features % max(quantizer.group_block_rows() for quantizer in roles) == 0
    )
    # With few experts, each large, group by group is faster (it casts each group's two copies from
    # one read; measured on an H100 at Mixtral-like shapes, 8 experts: 0.87x bf16 against 0.80x).
    return PaddedGroupsFunction if takes and stack.shape[0] > FEW_EXPERTS else None


def sizes_on_device(x: torch.Tensor, stack, offs: torch.Tensor | None) -> bool:
    """Whether the grouped linear of `x` over `stack` runs with the groups' sizes left on the device
    (`grouped_linear` with `ends` None): where the host cannot read `offs` (`offs.tolist()` waits
    for the GPU), while a CUDA graph is captured, and the path takes sizes so
    (`takes_sizes_on_device`). Eager, the sizes are read: the paths over known sizes measured
    faster (docs/experts.md, "Sizes on the device")."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing() and takes_sizes_on_device(x, stack, offs)


def takes_sizes_on_device(x: torch.Tensor, stack, offs: torch.Tensor | None) -> bool:
    """Whether the grouped linear can run without the host knowing the groups' sizes: every role
    E4M3 Float8 cast for all groups at once, every GEMM on qtensor's grouped kernels (with the split
    accumulator or fast accumulation: torch's would leave the rows past the last group's
    unwritten), on a GPU, without delayed scaling's per-expert state."""
    linear = stack.linear_quantizers
    if offs is None or x.device.type != "cuda" or offs.device != x.device or not stack.shape[0] or linear.records_amaxes:
        return False
    if _casts_groups_at_once(linear, stack) is not GroupedFloat8Function:
        return False
    if not all(quantizer.fp8_dtype == torch.float8_e4m3fn for quantizer in (linear.input, linear.weight, linear.grad_output)):
        return False  # (an E5M2 gradient's GEMMs run group by group, over the groups' sizes)
    kernels = ("float8_groups.column_amax", "float8_groups.cast", "grouped_mm.float8_rows", "grouped_mm.float8_columns")
    return all(lookup(name, x) is not None for name in kernels)


def grouped_linear(x: torch.Tensor, stack: torch.Tensor, ends: list[int] | None, in_out: bool, offs: torch.Tensor | None = None) -> torch.Tensor:
    """The groups `ends` marks (cumulative row ends, one per expert; `offs`, the same on x's device
    where the caller has them there) through their experts' quantized linears, the stack's matrices
    read as [in, out] where `in_out`; rows past the last end zero. `ends` None: the host does not
    read them (`sizes_on_device`), and `offs` gives them."""
    linear = stack.linear_quantizers
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{linear.name or 'An expert stack'}: input is {x.dtype}; quantized layers take float32, bfloat16 or float16 inputs.")
    in_features = stack.shape[-2] if in_out else stack.shape[-1]
    if x.shape[-1] != in_features:
        raise ValueError(
            f"{linear.name or 'An expert stack'}: input of shape {list(x.shape)} does not match the stack {list(stack.shape)}; "
            f"the input's last dimension must be {in_features}."
        )
    grad_enabled = torch.is_grad_enabled()
    needs = (grad_enabled and x.requires_grad, grad_enabled and stack.requires_grad)
    if ends is None:  # the sizes stay on the device; a copy of the ends, as below
        with torch._C.DisableTorchFunctionSubclass():
            groups = RowGroups(None, offs.to(torch.int32, copy=True), rows=x.shape[0])
            return GroupedFloat8Function.apply(x, stack, groups, linear, needs, in_out)
    groups = tuple((expert, start, end) for expert, (start, end) in enumerate(zip([0, *ends], ends)) if end > start)
    with torch._C.DisableTorchFunctionSubclass():
        grouped = _casts_groups_at_once(linear, stack) or _pads_groups(linear, stack, in_out)
        if groups and grouped:
            lengths = tuple(end - start for start, end in zip([0, *ends], ends))
            # A copy: the backward derives from these ends, whatever the caller writes into its offsets after.
            device_ends = offs.to(x.device, torch.int32, copy=True) if offs is not None else torch.tensor(ends, device=x.device)
            return grouped.apply(x, stack, RowGroups(lengths, device_ends), linear, needs, in_out)
        return GroupedLinearFunction.apply(x, stack, groups, linear, needs, in_out)
