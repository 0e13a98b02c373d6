"""A table of every format on one tensor: bytes per element and error. `python -m qtensor.formats_table`."""

import argparse

import torch

from ..formats.float8 import Float8Quantizer
from ..formats.float8_block import Float8BlockQuantizer
from ..formats.hybrid import HybridQuantizer
from ..formats.identity import IdentityQuantizer
from ..formats.mxfp8 import MXFP8Quantizer
from ..formats.nvfp4 import NVFP4Quantizer


def example_quantizers() -> dict:
    """One quantizer per format and notable option, by display name."""
    return {
        "identity (bf16)": IdentityQuantizer(torch.bfloat16),
        "float8 e4m3 current": Float8Quantizer(),
        "float8 e5m2 current": Float8Quantizer(torch.float8_e5m2),
        "float8 row-wise pow2": Float8BlockQuantizer(block_rows=1, block_cols=None, pow2_scales=True),
        "float8 1x128 blocks": Float8BlockQuantizer(block_rows=1, block_cols=128),
        "float8 128x128 tiles": Float8BlockQuantizer(block_rows=128, block_cols=128),
        "mxfp8 e4m3 rceil": MXFP8Quantizer(),
        "mxfp8 e4m3 floor": MXFP8Quantizer(scale_rounding="floor"),
        "nvfp4": NVFP4Quantizer(),
        "nvfp4 16x16 tiles": NVFP4Quantizer(block_2d=True),
        "nvfp4 rht": NVFP4Quantizer(rht=True),
        "nvfp4 stochastic": NVFP4Quantizer(stochastic_rounding=True, seed=0),
        "hybrid mxfp8 / nvfp4": HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()),
    }


def format_rows(x: torch.Tensor) -> list[tuple[str, float, float, float]]:
    """(name, bytes per element for one direction, rowwise error, columnwise error) per format.

    Error is the relative Frobenius norm ||dequantize(q) - x|| / ||x||.
    """
    rows = []
    for name, quantizer in example_quantizers().items():
        q = quantizer.quantize(x, rowwise=True, columnwise=True)
        errors = [
            ((q.dequantize(torch.float32, d) - x.float()).norm() / x.float().norm()).item()
            for d in ("rowwise", "columnwise")
        ]
        rowwise_only = quantizer.quantize(x, rowwise=True, columnwise=False)
        rows.append((name, rowwise_only.storage_nbytes() / x.numel(), *errors))
    return rows


def print_formats_table(rows: int = 1024, cols: int = 1024, device: str = "cpu", seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    # Magnitudes that vary from block to block, as activations and gradients do.
    x = torch.randn(rows, cols, generator=generator) * torch.exp2(torch.randint(-8, 8, (rows, cols // 32 + 1), generator=generator).float()).repeat_interleave(32, 1)[:, :cols]
    x = x.to(device=device, dtype=torch.bfloat16)
    print(f"one bf16 tensor [{rows}, {cols}] on {device}; bytes per element of one direction, relative error")
    print(f"{'format':<24}{'bytes/elem':>11}{'rowwise err':>13}{'columnwise err':>16}")
    for name, nbytes, row_error, column_error in format_rows(x):
        print(f"{name:<24}{nbytes:>11.3f}{row_error:>13.4f}{column_error:>16.4f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    print_formats_table(args.rows, args.cols, args.device)


if __name__ == "__main__":
    main()
