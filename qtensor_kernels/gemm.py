"""The epilogue of a GEMM whose operands carry tensor scales (qtensor/gemm.py): the fp32 product
times the scale, plus the bias, rounded once to the output dtype, in one pass. Bit-identical to
`gemm._scale_and_finish` (the same fp32 operations in the same order, the product rounded before
the bias is added: compiled without fused multiply-adds)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _scale_output_kernel(product_ptr, scale_ptr, bias_ptr, out_ptr, numel, N, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    values = tl.load(product_ptr + offsets, mask=mask) * tl.load(scale_ptr)
    if HAS_BIAS:
        values += tl.load(bias_ptr + offsets % N, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=mask)


def scale_output(product: torch.Tensor, scale: torch.Tensor, bias, out_dtype: torch.dtype) -> torch.Tensor:
    """`product` [M, N] fp32 (contiguous) times the 0-d fp32 `scale`, plus `bias` [N], in `out_dtype`."""
    out = torch.empty(product.shape, dtype=out_dtype, device=product.device)
    numel = product.numel()
    if numel:
        block = 4096
        _scale_output_kernel[(triton.cdiv(numel, block),)](
            product, scale, bias if bias is not None else product, out, numel, product.shape[-1],
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=8, enable_fp_fusion=False,
        )
    return out
