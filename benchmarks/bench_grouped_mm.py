"""The grouped FP8 GEMMs of an expert stack at the Qwen3-30B-A3B-like shapes (128 experts, hidden
2048, width 768, 131,072 routed rows in balanced groups): each of the three GEMMs of both stacks,
FP8 codes with a factor per row (float8_rowwise's grouped operands):

- `bf16`: torch's grouped GEMM over bf16 operands (the bf16 model's own GEMM);
- `torch split` / `torch fast`: `torch._scaled_grouped_mm` with the split accumulator and with fast
  accumulation;
- `kernel split` / `kernel fast`: qtensor's grouped kernel (qtensor_kernels/grouped_mm.py), for each
  tile with `--sweep` (default: the kernel's own).

Also prints the kernel's largest difference from torch's split product (same codes and factors).
With `--bf16`, the bf16 grouped GEMMs instead (NVFP4's values with each group's tensor scales in
the epilogue): torch's bf16 grouped GEMM against qtensor's `bf16_rows` / `bf16_columns`.

With `--mxfp8`, the GEMMs over MXFP8 copies as the experts' grouped path runs them: each copy
dequantized to bf16, then torch's bf16 grouped GEMM; wgrad's product stored in fp32 (an fp32
stack's gradient) by a conversion pass after torch's, or by qtensor's `bf16_columns`, which reads
the columnwise copies' values in place (any strides) and stores the rounded product as fp32.

    python benchmarks/bench_grouped_mm.py [--sweep] [--bf16 | --mxfp8]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qtensor.core.kernels import registered  # noqa: E402
from qtensor.core.storage import TensorScale  # noqa: E402
from timing import median_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time every tile of FLOAT8_SWEEP (BF16_SWEEP)")
    parser.add_argument("--bf16", action="store_true", help="the bf16 grouped GEMMs with a factor per group")
    parser.add_argument("--mxfp8", action="store_true", help="the bf16 grouped GEMMs decoding MXFP8 codes")
    args = parser.parse_args()
    registered()
    (bf16 if args.bf16 else mxfp8 if args.mxfp8 else float8)(args.sweep)


BF16_SWEEP = [(128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 32, 4, 5), (64, 128, 64, 4, 4)]


def bf16(sweep: bool):
    from qtensor_kernels import grouped_mm

    experts, hidden, width, rows = 128, 2048, 768, 131072
    ends = torch.tensor([rows // experts] * experts, device="cuda").cumsum(0).to(torch.int32)
    values = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    scale = TensorScale(torch.rand(experts, device="cuda") + 0.5, 2688.0)  # each group's global amax, as NVFP4's
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 values, tensor scales per group, median ms of 20 calls")
    print(f"{'stack':10} {'gemm':6} {'system':34} {'ms':>8} {'x bf16':>7}")
    for name, (n, k) in {"gate_up": (2 * width, hidden), "down": (hidden, width)}.items():
        x, grad, w3 = values(rows, k), values(rows, n), values(experts, n, k)
        grad_t, x_t = grad.t().contiguous(), x.t().contiguous()  # the columnwise copies' layout
        w3_t = w3.transpose(-2, -1).contiguous()  # [E, K, N]: dgrad reads each W_e with N contiguous
        cases = {
            "fprop": (lambda: torch._grouped_mm(x, w3.transpose(-2, -1), offs=ends), lambda tile: grouped_mm.bf16_rows(x, w3, scale, scale, ends, torch.bfloat16, tile)),
            "dgrad": (lambda: torch._grouped_mm(grad, w3, offs=ends), lambda tile: grouped_mm.bf16_rows(grad, w3_t, scale, scale, ends, torch.bfloat16, tile)),
            "wgrad": (lambda: torch._grouped_mm(grad_t, x, offs=ends), lambda tile: grouped_mm.bf16_columns(grad_t, x_t, scale, scale, ends, torch.bfloat16, tile)),
        }
        for gemm_name, (torch_bf16, kernel) in cases.items():
            base = median_ms(torch_bf16)
            print(f"{name:10} {gemm_name:6} {'torch bf16':34} {base:8.3f} {1.0:7.2f}")
            for tile in BF16_SWEEP if sweep else [None]:
                try:
                    ms = median_ms(lambda: kernel(tile))
                except Exception as error:  # a tile the compiler refuses (shared memory)
                    print(f"{name:10} {gemm_name:6} {'kernel ' + str(tile):34} failed: {type(error).__name__}")
                    continue
                print(f"{name:10} {gemm_name:6} {'kernel ' + str(tile or 'default'):34} {ms:8.3f} {base / ms:7.2f}")


def mxfp8(sweep: bool):
    from qtensor.formats.mxfp8 import MXFP8Quantizer
    from qtensor_kernels import grouped_mm

    experts, hidden, width, rows = 128, 2048, 768, 131072
    ends = torch.tensor([rows // experts] * experts, device="cuda").cumsum(0).to(torch.int32)
    quantizer = MXFP8Quantizer()
    copy = lambda *shape, direction: quantizer.quantize(torch.randn(*shape, device="cuda", dtype=torch.bfloat16)).storage_for(direction)
    values = lambda storage: storage.dequantize_as(torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; MXFP8 copies, median ms of 20 calls")
    print(f"{'stack':10} {'gemm':6} {'system':40} {'ms':>8} {'x bf16':>7}")
    for name, (n, k) in {"gate_up": (2 * width, hidden), "down": (hidden, width)}.items():
        x_row, g_row = copy(rows, k, direction="rowwise"), copy(rows, n, direction="rowwise")
        w_row, w_col = copy(experts * n, k, direction="rowwise"), copy(experts * n, k, direction="columnwise")
        g_col, x_col = copy(rows, n, direction="columnwise"), copy(rows, k, direction="columnwise")
        x16, g16, w16 = values(x_row), values(g_row), values(w_row).view(experts, n, k)
        cases = {  # torch over bf16 operands; the copies dequantized, then ...
            "fprop": (lambda: torch._grouped_mm(x16, w16.transpose(-2, -1), offs=ends),
                      {"torch": lambda: torch._grouped_mm(values(x_row), values(w_row).view(experts, n, k).transpose(-2, -1), offs=ends)}),
            "dgrad": (lambda: torch._grouped_mm(g16, w16, offs=ends),
                      {"torch": lambda: torch._grouped_mm(values(g_row), values(w_col).view(experts, n, k), offs=ends)}),
            "wgrad": (lambda: torch._grouped_mm(g16.t(), x16, offs=ends), {
                "torch, then to fp32": lambda: torch._grouped_mm(values(g_col).t(), values(x_col), offs=ends).float(),
                "bf16_columns, stored fp32": lambda: grouped_mm.bf16_columns(values(g_col).t(), values(x_col).t(), None, None, ends, torch.bfloat16, stored_dtype=torch.float32),
            }),
        }
        for gemm_name, (torch_bf16, systems) in cases.items():
            base = median_ms(torch_bf16)
            print(f"{name:10} {gemm_name:6} {'torch bf16 (bf16 operands)':40} {base:8.3f} {1.0:7.2f}")
            for system, run in systems.items():
                ms = median_ms(run)
                print(f"{name:10} {gemm_name:6} {'dequantized, ' + system:40} {ms:8.3f} {base / ms:7.2f}")


FLOAT8_SWEEP = {
    "rows": [(128, 128, 128, 8, 4), (256, 128, 128, 8, 3), (128, 256, 128, 8, 3), (256, 128, 64, 8, 4)],
    "columns": [(128, 128, 128, 8, 4), (128, 128, 64, 8, 4), (128, 128, 128, 4, 4), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (64, 128, 128, 4, 4)],
}


def float8(sweep: bool):
    from qtensor_kernels import grouped_mm

    experts, hidden, width, rows = 128, 2048, 768, 131072
    ends = torch.tensor([rows // experts] * experts, device="cuda").cumsum(0).to(torch.int32)
    fp8 = lambda *shape: torch.randn(*shape, device="cuda").to(torch.float8_e4m3fn)
    scale = lambda *shape: torch.rand(*shape, device="cuda") + 0.5
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; Float8 row-wise, median ms of 20 calls")
    print(f"{'stack':10} {'gemm':6} {'system':34} {'ms':>8} {'x bf16':>7}")
    for name, (n, k) in {"gate_up": (2 * width, hidden), "down": (hidden, width)}.items():
        x, grad = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        w3 = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
        a_f, sa_f, b_f, sb_f = fp8(rows, k), scale(rows), fp8(experts, n, k), scale(experts, n)
        a_d, sa_d, b_d, sb_d = fp8(rows, n), scale(rows), fp8(experts, k, n), scale(experts, k)
        a_w, sa_w, b_w, sb_w = fp8(n, rows), scale(experts, n), fp8(k, rows), scale(experts, k)
        cases = {
            "fprop": (lambda: torch._grouped_mm(x, w3.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16),
                      lambda fast: torch._scaled_grouped_mm(a_f, b_f.transpose(-2, -1), sa_f, sb_f, offs=ends, out_dtype=torch.bfloat16, use_fast_accum=fast),
                      lambda fast, tile: grouped_mm.float8_rows(a_f, sa_f, b_f, sb_f, ends, torch.bfloat16, fast, tile)),
            "dgrad": (lambda: torch._grouped_mm(grad, w3, offs=ends, out_dtype=torch.bfloat16),
                      lambda fast: torch._scaled_grouped_mm(a_d, b_d.transpose(-2, -1), sa_d, sb_d, offs=ends, out_dtype=torch.bfloat16, use_fast_accum=fast),
                      lambda fast, tile: grouped_mm.float8_rows(a_d, sa_d, b_d, sb_d, ends, torch.bfloat16, fast, tile)),
            "wgrad": (lambda: torch._grouped_mm(grad.t(), x, offs=ends, out_dtype=torch.bfloat16),
                      lambda fast: torch._scaled_grouped_mm(a_w, b_w.t(), sa_w.reshape(-1), sb_w.reshape(-1), offs=ends, out_dtype=torch.bfloat16, use_fast_accum=fast),
                      lambda fast, tile: grouped_mm.float8_columns(a_w, sa_w, b_w, sb_w, ends, torch.bfloat16, fast, tile)),
        }
        for gemm_name, (bf16, torch_fp8, kernel) in cases.items():
            base = median_ms(bf16)
            reference, ours = torch_fp8(False).float(), kernel(False, None).float()
            difference = ((ours - reference).abs().max() / reference.abs().max()).item()
            print(f"{name:10} {gemm_name:6} {'bf16':34} {base:8.3f} {1.0:7.2f}   kernel vs torch: max diff {difference:.2e} of max")
            for fast in (False, True):
                label = "fast" if fast else "split"
                ms = median_ms(lambda: torch_fp8(fast))
                print(f"{name:10} {gemm_name:6} {'torch ' + label:34} {ms:8.3f} {base / ms:7.2f}")
                for tile in FLOAT8_SWEEP["columns" if gemm_name == "wgrad" else "rows"] if sweep else [None]:
                    try:
                        ms = median_ms(lambda: kernel(fast, tile))
                    except Exception as error:  # a tile the compiler refuses (shared memory)
                        print(f"{name:10} {gemm_name:6} {'kernel ' + label + ' ' + str(tile):34} failed: {type(error).__name__}")
                        continue
                    print(f"{name:10} {gemm_name:6} {'kernel ' + label + ' ' + str(tile or 'default'):34} {ms:8.3f} {base / ms:7.2f}")


if __name__ == "__main__":
    main()
