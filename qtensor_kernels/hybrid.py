"""Triton kernel of the hybrid cast of qtensor's mxfp8_fwd_nvfp4_bwd recipe (an MXFP8 rowwise copy for
the forward GEMM, an NVFP4 columnwise copy for the backward GEMMs): both copies from one read of
each tile of `x`, bit-identical to the two children's references (formats/hybrid.py, docs/numerics.md, Hybrid).

The tile is NVFP4's (qtensor_kernels/nvfp4.py): 16 rows, each thread holding VEC adjacent columns
of all 16, so each column's NVFP4 block (and its transform) is in one thread's registers and a row's
MXFP8 block of 32 spans 32/VEC adjacent threads.
"""

import torch
import triton
import triton.language as tl

from qtensor.formats.mxfp8 import MXFP8Storage
from qtensor.formats.nvfp4 import NVFP4Storage

from . import mxfp8, nvfp4
from .launch import launch


@triton.jit
def _cast_kernel(
    x_ptr, M, N, stride_m, row_data_ptr, row_codes_ptr, col_amax_ptr, keys_ptr, col_data_ptr, col_scale_ptr, col_length,
    FP8_MAX: tl.constexpr, EMAX: tl.constexpr, E5M2: tl.constexpr, RCEIL: tl.constexpr,
    BLOCK_2D: tl.constexpr, RHT: tl.constexpr, STOCHASTIC: tl.constexpr, COL_INT32: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr, VEC: tl.constexpr,
):
    rows, cols, x = nvfp4._load_tile(x_ptr, M, N, stride_m, BLOCK_N, VEC)
    mxfp8._quantize_rows(x, rows, cols, tl.program_id(1), row_data_ptr, row_codes_ptr, row_data_ptr, M, N, 16, BLOCK_N, FP8_MAX, EMAX, E5M2, RCEIL, True, False)
    nvfp4._cast_columns(x, col_amax_ptr, keys_ptr + 2, tl.program_id(0) * 8, (col_length + 1) // 2, cols, col_data_ptr, col_scale_ptr, col_data_ptr, N, col_length, BLOCK_N, BLOCK_2D, RHT, STOCHASTIC, COL_INT32, WIDE, False, BLOCK_2D)


_CAST_TILE = (4, 8)  # (warps, bytes per thread and row), as nvfp4's: benchmarks/sweep_cast.py --nvfp4 on an H200


def cast(x, fp8_dtype, scale_rounding, column_amax, keys, block_2d, rht, tile=_CAST_TILE):
    """((MXFP8 rowwise data, scale codes), (NVFP4 columnwise data, scales)) of the 2-D `x`, as
    mxfp8.cast and nvfp4.cast give them (shaped as the storages' layouts declare); `keys` (4 int64,
    the columnwise copy's at 2 and 3) round the NVFP4 copy stochastically."""
    M, N = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    col_length = NVFP4Storage.stored_length_for("columnwise", M, N, rht)
    row = MXFP8Storage.empty_buffers(("data", "scale_inv"), "rowwise", M, N, x.device, fp8_dtype=fp8_dtype)
    col = NVFP4Storage.empty_buffers(("data", "scale_inv"), "columnwise", M, N, x.device, rht=rht, tile_scales=block_2d)
    if M and N:
        block_n, vec, warps = nvfp4._tile_columns(x, tile)
        launch(
            _cast_kernel, (triton.cdiv(M, 16), triton.cdiv(N, block_n)),
            x, M, N, x.stride(0), row[0].view(torch.uint8), row[1], column_amax, keys if keys is not None else column_amax,
            *nvfp4._kernel_view(col, col_length), col_length,
            FP8_MAX=mxfp8._FP8_MAX[fp8_dtype], EMAX=mxfp8._ELEMENT_EMAX[fp8_dtype], E5M2=fp8_dtype == torch.float8_e5m2,
            RCEIL=scale_rounding == "rceil", BLOCK_2D=block_2d, RHT=rht, STOCHASTIC=keys is not None, COL_INT32=col_length % 8 == 0,
            WIDE=nvfp4._wide_pairs(M, N, col_length), BLOCK_N=block_n, VEC=vec, num_warps=warps, enable_fp_fusion=False,
        )
    return row, col


# Registered into qtensor's kernel table (qtensor_kernels/__init__.py).
KERNELS = {"hybrid.cast": cast}
