"""The three GEMMs of an expert stack's grouped linear (layers/grouped_linear.py): one product per
group of rows, each on its expert's operands. `fprop`, `dgrad` and `wgrad` run the groups one after
another over the dense GEMMs (`dense.py`), and so the backend each pair of operand forms picks.
`scaled_nt` multiplies FP8 grouped operands (`GroupedOperand`) and `values_nt` exact bf16 values,
every group in one grouped GEMM where torch's takes them, else group by group; `blocks_rows` and
`blocks_columns` take the quantized copies whose values `values_nt` multiplies.

    fprop  Y_g  = X_g · W_eᵀ       dgrad  dX_g = dY_g · W_e       wgrad  dW_e = dY_gᵀ · X_g
"""

from __future__ import annotations

import torch

from ..core.kernels import lookup
from . import dense


def fprop(out: torch.Tensor, groups, operands, *, fast_accumulation: bool = False) -> None:
    """out[rows of g] = X_g · W_eᵀ for each group `g` = (expert, start, end) and its operands (X_g, W_e)."""
    for (_, start, end), (x, weight) in zip(groups, operands):
        out[start:end] = dense.fprop(x, weight, None, out.dtype, fast_accumulation=fast_accumulation)


def dgrad(out: torch.Tensor, groups, operands, *, fast_accumulation: bool = False) -> None:
    """out[rows of g] = dY_g · W_e for each group and its operands (dY_g, W_e)."""
    for (_, start, end), (grad, weight) in zip(groups, operands):
        out[start:end] = dense.dgrad(grad, weight, out.dtype, fast_accumulation=fast_accumulation)


def wgrad(out: torch.Tensor, groups, operands, *, fast_accumulation: bool = False) -> None:
    """out[e] = dY_gᵀ · X_g ([out_features, in_features]) for each group."""
    for (expert, _, _), (grad, x) in zip(groups, operands):
        out[expert] = dense.wgrad(grad, x, out.dtype, fast_accumulation=fast_accumulation)


# ---- FP8 codes with per-row factors (formats/float8_groups.py), every group in one launch ---------
def scaled_nt(a, b, out_dtype: torch.dtype, *, tensor_scaled: bool, fast_accumulation: bool = False, stored_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The grouped product C = A · Bᵀ of two `GroupedOperand`s (reduction dimension last),
    each dequantized by its rows' factors, over the groups `a.lengths` gives:

        A [M, K], B [E, N, K]   C [M, N]      rows of group e times B_eᵀ           (fprop, dgrad)
        A [N, M], B [K, M]      C [E, N, K]   group e's columns of A times B's     (wgrad)

    On the FP8 tensor cores where `torch._scaled_grouped_mm` takes the operands (E4M3 × E4M3, bf16
    out, dimensions multiples of 16): one launch for every group, qtensor's kernel for the split
    accumulator (qtensor_kernels/grouped_mm.py: 1.9 to 3 times torch's speed there, measured on an
    H100 at the Qwen3-like shapes, docs/experts.md) and torch's for fast accumulation. Else group
    by group: FP8 GEMMs with tensor scales where every factor of a group is one scale
    (`tensor_scaled`) and `_scaled_mm` takes the pair, otherwise the reference product of the
    dequantized values. The result is rounded to `out_dtype` and returned as `stored_dtype` (a
    weight gradient in its parameter's dtype), which qtensor's wgrad kernel stores directly."""
    stored_dtype = stored_dtype or out_dtype
    if _grouped_fp8_fits(a, b, out_dtype):
        # qtensor's kernel for the split accumulator, for a weight gradient stored wider than it is
        # rounded (torch's would need a pass to convert it), and for groups whose sizes the host does
        # not know (it zeroes the rows past the last group's, which torch's leaves unwritten: zeroing
        # them after took 0.7 ms a GEMM at the Qwen3-like shapes on an H100); torch's for the rest of
        # fast accumulation.
        sizes_unknown = a.groups is not None and not a.groups.sized_on_host
        ours = not fast_accumulation or (b.data.dim() == 2 and stored_dtype != out_dtype) or sizes_unknown
        kernel = _float8_kernel(a, b, fast_accumulation) if ours else None
        if kernel is not None:
            return kernel(a, b, out_dtype, stored_dtype).to(stored_dtype)
        # A 2-D operand's factors as one vector (per row; per group and row for wgrad), a stack's [E, N].
        scales = [g.scale_inv.reshape(-1) if g.data.dim() == 2 else g.scale_inv for g in (a, b)]
        product = torch._scaled_grouped_mm(
            a.data, b.data.transpose(-2, -1), *scales, offs=a.groups.offsets(a.padded), out_dtype=out_dtype,
            use_fast_accum=fast_accumulation,
        )
        if b.data.dim() == 2 and 0 in a.lengths:  # an expert with no rows: its weight gradient is zero
            product.masked_fill_((a.groups.device_lengths == 0)[:, None, None], 0)
        return product.to(stored_dtype)
    return _scaled_groups(a, b, a.lengths, out_dtype, tensor_scaled, fast_accumulation).to(stored_dtype)


def _float8_kernel(a, b, fast_accumulation: bool):
    """qtensor's split-accumulator grouped FP8 GEMM for the pair, as a function of (a, b, out_dtype,
    stored_dtype: where wgrad's kernel stores the rounded product);
    None where it is not registered (no Triton, the reference switch) or a run of wgrad's rows is
    not whole 16s (the kernel reads 16 codes at a time along them)."""
    if b.data.dim() == 3:
        kernel = lookup("grouped_mm.float8_rows", a.data)
        return None if kernel is None else lambda a, b, out_dtype, stored_dtype: kernel(
            a.data, a.scale_inv.reshape(-1), b.data.contiguous(), b.scale_inv.contiguous(), a.groups.offsets(a.padded), out_dtype, fast_accumulation
        )
    kernel = lookup("grouped_mm.float8_columns", a.data)
    # (A padded copy's runs are whole 16s by construction: its groups' sizes are not asked for.)
    if kernel is None or (not a.padded and any(length % 16 for length in a.lengths)):
        return None
    return lambda a, b, out_dtype, stored_dtype: kernel(
        a.data, a.scale_inv.contiguous(), b.data, b.scale_inv.contiguous(), a.groups.offsets(a.padded), out_dtype, fast_accumulation, stored_dtype=stored_dtype
    )


def _grouped_fp8_fits(a, b, out_dtype: torch.dtype) -> bool:
    if a.data.device.type != "cuda" or out_dtype != torch.bfloat16 or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    if torch.cuda.get_device_capability(a.data.device) < (9, 0):
        return False
    if not a.data.dtype == b.data.dtype == torch.float8_e4m3fn:
        return False
    # Every row of each operand and of the result starts 16-byte aligned.
    return all(size % 16 == 0 for size in (a.data.shape[-1], *b.data.shape[-2:]))


def _pair_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `_scaled_mm` takes FP8 codes A [M, K] and B [N, K], each row-major with its rows
    16-byte aligned (a group's slice of a larger copy): every dimension a multiple of 16, and not
    both E5M2 (as backends._fp8_pair_fits for whole tensors). M too: on an H100, cuBLAS took an
    E5M2 × E4M3 product of 37 rows and refused one of 59 (CUBLAS_STATUS_NOT_SUPPORTED); such a
    group runs on the reference."""
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b or m % 16 or n % 16 or k % 16 or a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) % 16 or b.stride(0) % 16:
        return False
    return not (a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2)


def _scaled_groups(a, b, lengths, out_dtype, tensor_scaled: bool, fast_accumulation: bool) -> torch.Tensor:
    from .backends import _finish, _fp32_matmul

    grouped_rows = b.data.dim() == 3

    def product(group: int, start: int, end: int) -> torch.Tensor:
        if grouped_rows:  # this group's rows of A, expert `group` of B
            a_g, a_inv, b_g, b_inv = a.data[start:end], a.scale_inv[start:end], b.data[group], b.scale_inv[group]
        else:  # this group's columns of both: row-major slices, each row 16-byte aligned (runs of 16 columns)
            a_g, a_inv = a.data[:, start:end], a.scale_inv[group]
            b_g, b_inv = b.data[:, start:end], b.scale_inv[group]
        if tensor_scaled and a_g.device.type == "cuda" and _pair_fits(a_g, b_g):
            return torch._scaled_mm(
                a_g, b_g.t(), scale_a=a_inv[0], scale_b=b_inv[0], out_dtype=out_dtype, use_fast_accum=fast_accumulation
            )
        values = lambda codes, inv: codes.float() * inv[:, None]
        return _finish(_fp32_matmul(values(a_g, a_inv), values(b_g, b_inv).t()), None, out_dtype)

    shape = (a.data.shape[0], b.data.shape[1]) if grouped_rows else (len(lengths), a.data.shape[0], b.data.shape[0])
    # A row of C past the last group's, and a group's matrix with no rows (wgrad), stay zero.
    every_row = grouped_rows and sum(lengths) == a.data.shape[0]
    out = a.data.new_empty(shape, dtype=out_dtype) if every_row else a.data.new_zeros(shape, dtype=out_dtype)
    return _each_group(out, lengths, grouped_rows, product)


def _each_group(out: torch.Tensor, lengths, grouped_rows: bool, product) -> torch.Tensor:
    """`out` with each non-empty group's `product(group, start, end)` written into its rows (the
    groups run along C's rows) or its matrix (one per group)."""
    start = 0
    for group, length in enumerate(lengths):
        end = start + length
        if length:
            (out[start:end] if grouped_rows else out[group]).copy_(product(group, start, end))
        start = end
    return out


# ---- values bf16 holds exactly (MXFP8, NVFP4 less its tensor scales), every group in one launch ----
def values_nt(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, lengths: tuple[int, ...], out_dtype: torch.dtype, scales=(None, None), stored_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`grouped_mm(a, b, offs)` of two operands' dequantized values, the product summed in fp32,
    times group g's tensor scales where given (`scales`: each operand's TensorScale over [G], or
    over [1] for every group, or None; their values multiplied first, as the dense epilogue does),
    rounded once to `out_dtype`:

        a [M, K], b [E, K, N]   C [M, N]      rows of group e times b_e        (fprop, dgrad)
        a [N, M], b [M, K]      C [E, N, K]   group e's columns times its rows (wgrad)

    On the bf16 tensor cores where the values are bf16 (exact: the caller's format holds them so):
    `torch._grouped_mm` (bf16 out) without scales, qtensor's grouped GEMMs with them
    (qtensor_kernels/grouped_mm.py: the scales in the fp32 epilogue) or for a weight gradient
    stored wider than `out_dtype` (stored so by the kernel); else the reference, group by
    group in fp32 (torch's CPU grouped GEMM where it takes fp32). Returned as `stored_dtype` (as
    `scaled_nt`)."""
    grouped_rows = b.dim() == 3
    stored_dtype = stored_dtype or out_dtype
    scaled = scales[0] is not None or scales[1] is not None
    on_gpu = a.device.type == "cuda" and a.dtype == b.dtype == torch.bfloat16
    # A weight gradient stored wider than it is rounded goes to qtensor's kernel, which stores it so
    # (torch's writes only bf16: a pass to convert it would follow).
    stored_wider = not grouped_rows and stored_dtype != out_dtype
    kernel = lookup("grouped_mm.bf16_rows" if grouped_rows else "grouped_mm.bf16_columns", a) if on_gpu and (scaled or stored_wider) else None
    if on_gpu and not scaled and kernel is None and out_dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16).to(stored_dtype)
    if kernel is not None:
        a_scale, b_scale = (_each_group_scale(scale, len(lengths)) for scale in scales)
        if grouped_rows:  # b_e read as [N, K]: K, the reduction, contiguous
            b_nk = b.transpose(-2, -1)
            return kernel(a.contiguous(), b_nk if b_nk.stride(-1) == 1 else b_nk.contiguous(), a_scale, b_scale, offs, out_dtype)
        return kernel(a, b.t(), a_scale, b_scale, offs, out_dtype, stored_dtype=stored_dtype)  # read in place, any strides
    factor = _factor(*scales).expand(len(lengths)) if scaled else None
    if a.device.type == "cpu":
        product = torch._grouped_mm(a.float(), b.float(), offs=offs.to(torch.int32))
        if factor is not None:
            product = product * (torch.repeat_interleave(factor, torch.tensor(lengths))[:, None] if grouped_rows else factor[:, None, None])
        return product.to(out_dtype).to(stored_dtype)
    from .backends import _finish, _fp32_matmul

    def product(group: int, start: int, end: int) -> torch.Tensor:
        a_g, b_g = (a[start:end], b[group]) if grouped_rows else (a[:, start:end], b[start:end])
        summed = _fp32_matmul(a_g.float(), b_g.float())
        return _finish(summed if factor is None else summed * factor[group], None, out_dtype)

    shape = (a.shape[0], b.shape[-1]) if grouped_rows else (len(lengths), a.shape[0], b.shape[1])
    return _each_group(a.new_zeros(shape, dtype=out_dtype), lengths, grouped_rows, product).to(stored_dtype)


def _each_group_scale(scale, groups: int):
    """A TensorScale over [1] (one for every group) as one over [groups]; None stays None."""
    if scale is None or (scale.tensor.numel() == groups and scale.tensor.is_contiguous()):
        return scale
    # (a held stack's per-expert scales are a strided view of its stacked buffer: the kernel reads them packed)
    return type(scale)(scale.tensor.expand(groups).contiguous(), scale.amax_max)


def _factor(a_scale, b_scale) -> torch.Tensor:
    """Each group's factor, [G] fp32: the two TensorScales' values multiplied (either may be None)."""
    if a_scale is None:
        return b_scale.value()
    return a_scale.value() if b_scale is None else a_scale.value() * b_scale.value()


# ---- grouped copies (core/groups.GroupedCopy), through `values_nt` --------------------------------
def copies_rows(a, stack, stack_direction: str, experts: int, offs: torch.Tensor, lengths: tuple[int, ...], out_dtype: torch.dtype) -> torch.Tensor:
    """C [M, N]: the rows of group e of `a` (the routed rows' rowwise GroupedCopy, [M, K]) times
    expert e of `stack` (a GroupedCopy of the experts' matrices as one [E·R, C]), reduced along the
    copy's blocks: the rowwise copy gives A_e · W_eᵀ (N = R, fprop), the columnwise one A_e · W_e
    (N = C, dgrad), times group e's tensor scales of both copies."""
    a_values, a_scale = a.operand()
    values, b_scale = stack.operand()  # stored: [E·R, C] rowwise, [C, E·R] columnwise
    if stack_direction == "rowwise":
        b = values.view(experts, -1, values.shape[1]).transpose(-2, -1)  # [E, C, R]: W_eᵀ
    else:
        b = values.view(values.shape[0], experts, -1).permute(1, 2, 0)  # [E, R, C]: W_e
    return values_nt(a_values, b, offs, lengths, out_dtype, (a_scale, b_scale))


def copies_columns(a, b, offs: torch.Tensor, lengths: tuple[int, ...], out_dtype: torch.dtype, stored_dtype: torch.dtype | None = None) -> torch.Tensor:
    """C [E, N, K], C_e = A[run e]ᵀ · B[run e] of the columnwise GroupedCopies of `a` [R, N] and `b`
    [R, K], each group's run of rows (`offs`, `lengths`) whole blocks (wgrad), times group e's
    tensor scales; an empty run gives zeros. The two copies hold their values in the same
    reduction transform, which cancels. Returned as `stored_dtype` (as `scaled_nt`)."""
    (a_values, a_scale), (b_values, b_scale) = a.operand(), b.operand()  # [N, R], [K, R]
    return values_nt(a_values, b_values.t(), offs, lengths, out_dtype, (a_scale, b_scale), stored_dtype)
