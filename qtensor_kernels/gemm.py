"""The epilogue of a GEMM whose operands carry tensor scales (qtensor/gemm.py): the fp32 product
times the scale, plus the bias, rounded once to the output dtype, in one pass. Bit-identical to
`gemm._scale_and_finish` (the same fp32 operations in the same order, the product rounded before
the bias is added: compiled without fused multiply-adds). Each operand's scale is computed in the
kernel from its `TensorScale` (a scale_inv, or NVFP4's 1/S_enc from the global amax), as
`TensorScale.value` computes it, and the two multiplied in fp32: no launches besides this one."""

import torch
import triton
import triton.language as tl
from .launch import launch

_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _tensor_scale(ptr, AMAX_MAX: tl.constexpr):
    """TensorScale.value: the 0-d value at ptr, or with AMAX_MAX (not 0) 1 / scale_from_amax."""
    value = tl.load(ptr)
    if AMAX_MAX != 0.0:
        scale = tl.div_rn(tl.full((), AMAX_MAX, tl.float32), value)
        scale = tl.where(scale == float("inf"), _FLT_MAX, scale)
        scale = tl.where(value == 0.0, 1.0, scale)
        value = tl.div_rn(tl.full((), 1.0, tl.float32), scale)
    return value


@triton.jit
def _scale_output_kernel(product_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr, numel, N,
                         A_AMAX_MAX: tl.constexpr, HAS_B: tl.constexpr, B_AMAX_MAX: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    scale = _tensor_scale(a_scale_ptr, A_AMAX_MAX)
    if HAS_B:
        scale = scale * _tensor_scale(b_scale_ptr, B_AMAX_MAX)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    values = tl.load(product_ptr + offsets, mask=mask) * scale
    if HAS_BIAS:
        values += tl.load(bias_ptr + offsets % N, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=mask)


def scale_output(product: torch.Tensor, a_scale, b_scale, bias, out_dtype: torch.dtype) -> torch.Tensor:
    """`product` [M, N] fp32 (contiguous) times the operands' TensorScales (either may be None, not
    both), plus `bias` [N], in `out_dtype`."""
    if a_scale is None:
        a_scale, b_scale = b_scale, None
    out = torch.empty(product.shape, dtype=out_dtype, device=product.device)
    numel = product.numel()
    if numel:
        block = 4096
        launch(
            _scale_output_kernel, (triton.cdiv(numel, block),),
            product, a_scale.tensor, (b_scale or a_scale).tensor, bias if bias is not None else product, out, numel, product.shape[-1],
            A_AMAX_MAX=a_scale.amax_max or 0.0, HAS_B=b_scale is not None, B_AMAX_MAX=(b_scale.amax_max or 0.0) if b_scale else 0.0,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=8, enable_fp_fusion=False,
        )
    return out


# Registered into qtensor's kernel table (qtensor_kernels/__init__.py).
KERNELS = {"gemm.scale_output": scale_output, "gemm.scale_bias_output": scale_output}
