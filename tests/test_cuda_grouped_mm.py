"""qtensor's grouped GEMM kernels (qtensor_kernels/grouped_mm.py) against the float64 product of the
operands' dequantized values, group by group: the FP8 kernels held to the bound of Hopper's FP8
accumulation (docs/numerics.md, FP8 GEMMs), the bf16 kernels (each group's factor in the fp32
epilogue) to fp32 accumulation's. Skipped without a GPU; run on the device machine."""

import numpy as np
import pytest
import torch

from qtensor.core.kernels import lookup
from qtensor.core.storage import TensorScale

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BOUND = {False: 2.0**-9, True: 2.0**-7}  # split, fast accumulation


def fp8_codes(*shape, seed):
    """E4M3 codes of values spread over 2**-6 .. 2**6 (a varied exponent, as real activations)."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.randint(-6, 6, shape, generator=generator).float())
    return (torch.randn(*shape, generator=generator) * magnitude).to(torch.float8_e4m3fn).cuda()


def factors(*shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=generator) * 2.0**-3 + 2.0**-4).cuda()


def within(actual, a, b, fast, out_dtype):
    """|actual - a @ b| <= bound (|a| @ |b|) (+ half a bf16 ulp when rounded to bf16), in float64:
    the product of the dequantized values (codes times their rows' factors) taken on the CPU."""
    a, b = a.double().cpu().numpy(), b.double().cpu().numpy()
    expected = a @ b
    # The bf16 kernels sum exact products in fp32: recursive summation's bound, K · 2**-24.
    relative = a.shape[1] * 2.0**-24 if fast == "bf16" else BOUND[fast]
    bound = relative * (np.abs(a) @ np.abs(b)) + 1e-30
    if out_dtype == torch.bfloat16:
        bound = bound + np.abs(expected) * 2.0**-8
    error = np.abs(actual.double().cpu().numpy() - expected)
    ratio = float(np.max(error / bound)) if error.size else 0.0
    print(f"max error / bound: {ratio:.3g}")
    assert ratio <= 1.0


LENGTHS = {
    "groups of any size": (0, 37, 130, 5, 0, 64, 1, 300),
    "one group": (512,),
    "all empty but one": (0, 0, 33, 0),
}


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fast", [False, True], ids=["split", "fast"])
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_grouped_float8_rows_kernel_multiplies_each_group_by_its_expert(lengths, fast, out_dtype):
    """C[rows of e] = (A[rows of e] · B_eᵀ) times each row's factor of A and of B_e, over groups of
    any size (empty ones, one row, tiles that straddle two groups), K = 4096 (the accumulation's
    bound is reached over long reductions), N not a multiple of the tile."""
    lengths = LENGTHS[lengths]
    experts, k, n = len(lengths), 4096, 144
    ends = torch.tensor(lengths, device="cuda").cumsum(0).to(torch.int32)
    rows = sum(lengths)
    a, a_scale = fp8_codes(rows, k, seed=1), factors(rows, seed=2)
    b, b_scale = fp8_codes(experts, n, k, seed=3), factors(experts, n, seed=4)
    kernel = lookup("grouped_mm.float8_rows", a)
    out = kernel(a, a_scale, b, b_scale, ends, out_dtype, fast)
    assert out.shape == (rows, n) and out.dtype == out_dtype
    a_values = a.float() * a_scale[:, None]
    for expert, (start, end) in enumerate(zip([0, *ends.tolist()], ends.tolist())):
        within(out[start:end].float(), a_values[start:end], (b[expert].float() * b_scale[expert][:, None]).t(), fast, out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fast", [False, True], ids=["split", "fast"])
def test_grouped_float8_columns_kernel_reduces_each_groups_run(fast, out_dtype):
    """C_e = (A[:, run e] · B[:, run e]ᵀ) times the group's factors of A's rows and B's rows, over
    runs of whole 16s (empty runs give zero matrices), runs of up to 2048 columns; the zero codes
    a cast pads a run with add nothing."""
    runs = (0, 16, 2048, 48, 0, 144, 1024)
    experts, n, k = len(runs), 80, 96
    ends = torch.tensor(runs, device="cuda").cumsum(0).to(torch.int32)
    total = sum(runs)
    a, b = fp8_codes(n, total, seed=5), fp8_codes(k, total, seed=6)
    a_scale, b_scale = factors(experts, n, seed=7), factors(experts, k, seed=8)
    kernel = lookup("grouped_mm.float8_columns", a)
    out = kernel(a, a_scale, b, b_scale, ends, out_dtype, fast)
    assert out.shape == (experts, n, k) and out.dtype == out_dtype
    # Rounded to bf16 and stored as fp32 (a weight gradient in its parameter's dtype): the same values.
    assert torch.equal(kernel(a, a_scale, b, b_scale, ends, torch.bfloat16, fast, stored_dtype=torch.float32), kernel(a, a_scale, b, b_scale, ends, torch.bfloat16, fast).float())
    for expert, (start, end) in enumerate(zip([0, *ends.tolist()], ends.tolist())):
        if end == start:
            assert torch.equal(out[expert], torch.zeros_like(out[expert]))
            continue
        a_e = a[:, start:end].float() * a_scale[expert][:, None]
        b_e = b[:, start:end].float() * b_scale[expert][:, None]
        within(out[expert].float(), a_e, b_e.t(), fast, out_dtype)


def bf16_values(*shape, seed):
    """bf16 values spread over 2**-6 .. 2**6 (exact: the q·s values of NVFP4 copies are such)."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.randint(-6, 6, shape, generator=generator).float())
    return (torch.randn(*shape, generator=generator) * magnitude).to(torch.bfloat16).cuda()


def group_scales(experts, seed, which):
    """Each group's TensorScales of A and of B (NVFP4's, from global amaxes spread over 2**-8 .. 2**8;
    with `which` "A" only A's), and the factors the reference multiplies by (TensorScale.value)."""
    generator = torch.Generator().manual_seed(seed)
    amax = lambda: (torch.rand(experts, generator=generator) * torch.exp2(torch.randint(-8, 8, (experts,), generator=generator).float())).cuda()
    a_scale = TensorScale(amax(), 2688.0)
    b_scale = TensorScale(amax(), 2688.0) if which == "A and B" else None
    factor = a_scale.value() * (b_scale.value() if b_scale else 1.0)
    return a_scale, b_scale, factor


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("b_layout", ["[E, N, K]", "[K, E·N]"])
@pytest.mark.parametrize("which", ["A and B", "A"])
def test_grouped_bf16_rows_kernel_scales_each_group_by_its_tensor_scales(lengths, out_dtype, b_layout, which):
    """C[rows of e] = (A[rows of e] · B_eᵀ) times group e's tensor scales (1/S_enc of each operand's
    global amax, computed in the epilogue) with B a contiguous stack (fprop) or the experts'
    columns of one [K, E·N] copy (dgrad of a stack cast as one matrix), K = 2048."""
    lengths = LENGTHS[lengths]
    experts, k, n = len(lengths), 2048, 144
    ends = torch.tensor(lengths, device="cuda").cumsum(0).to(torch.int32)
    a = bf16_values(sum(lengths), k, seed=1)
    if b_layout == "[E, N, K]":
        b = bf16_values(experts, n, k, seed=3)
    else:
        b = bf16_values(n, experts * k, seed=3).view(n, experts, k).permute(1, 0, 2)  # b[e, n, :] = copy[n, e·K:(e+1)·K]
    a_scale, b_scale, factor = group_scales(experts, 4, which)
    out = lookup("grouped_mm.bf16_rows", a)(a, b, a_scale, b_scale, ends, out_dtype)
    assert out.shape == (sum(lengths), n) and out.dtype == out_dtype
    for expert, (start, end) in enumerate(zip([0, *ends.tolist()], ends.tolist())):
        within(out[start:end].float(), a[start:end].float() * factor[expert], b[expert].float().t(), "bf16", out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("which", ["A and B", "none"])
@pytest.mark.parametrize("layout", ["[N, R]", "[R, N] read transposed"])
def test_grouped_bf16_columns_kernel_scales_each_groups_product_by_its_tensor_scales(out_dtype, which, layout):
    """C_e = (A[:, run e] · B[:, run e]ᵀ) times group e's tensor scales (or none: MXFP8's wgrad),
    over runs of whole 16s, empty runs zero; the operands read in place with the runs contiguous
    (NVFP4's columnwise copies) or strided (MXFP8's, which keep the [rows, cols] order)."""
    runs = (0, 16, 2048, 48, 0, 144, 1024)
    experts, n, k = len(runs), 80, 96
    ends = torch.tensor(runs, device="cuda").cumsum(0).to(torch.int32)
    if layout == "[N, R]":
        a, b = bf16_values(n, sum(runs), seed=5), bf16_values(k, sum(runs), seed=6)
    else:
        a, b = bf16_values(sum(runs), n, seed=5).t(), bf16_values(sum(runs), k, seed=6).t()
    if which == "none":
        a_scale = b_scale = None
        factor = torch.ones(experts, device="cuda")
    else:
        a_scale, b_scale, factor = group_scales(experts, 7, which)
    kernel = lookup("grouped_mm.bf16_columns", a)
    out = kernel(a, b, a_scale, b_scale, ends, out_dtype)
    assert out.shape == (experts, n, k) and out.dtype == out_dtype
    assert torch.equal(kernel(a, b, a_scale, b_scale, ends, torch.bfloat16, stored_dtype=torch.float32), kernel(a, b, a_scale, b_scale, ends, torch.bfloat16).float())
    for expert, (start, end) in enumerate(zip([0, *ends.tolist()], ends.tolist())):
        if end == start:
            assert torch.equal(out[expert], torch.zeros_like(out[expert]))
            continue
        within(out[expert].float(), a[:, start:end].float() * factor[expert], b[:, start:end].float().t(), "bf16", out_dtype)
