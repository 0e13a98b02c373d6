"""qtensor's grouped FP8 GEMM kernels (qtensor_kernels/grouped_mm.py) against the float64 product of
the operands' dequantized values, group by group, held to the bound of Hopper's FP8 accumulation
(docs/numerics.md, FP8 GEMMs). Skipped without a GPU; run on the device machine."""

import numpy as np
import pytest
import torch

from qtensor.core.kernels import lookup

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
    bound = BOUND[fast] * (np.abs(a) @ np.abs(b)) + 1e-30
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
    for expert, (start, end) in enumerate(zip([0, *ends.tolist()], ends.tolist())):
        if end == start:
            assert torch.equal(out[expert], torch.zeros_like(out[expert]))
            continue
        a_e = a[:, start:end].float() * a_scale[expert][:, None]
        b_e = b[:, start:end].float() * b_scale[expert][:, None]
        within(out[expert].float(), a_e, b_e.t(), fast, out_dtype)
