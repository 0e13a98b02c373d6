"""SASS instructions a grouped NVFP4 cast executes per element, compiled for Hopper (sm_90) without a GPU.

    python benchmarks/cast_instructions.py [--columns-per-thread 4] [--warps 4]

Needs Triton (its bundled ptxas and nvdisasm), not a GPU: `qtensor_kernels/nvfp4_groups.py`'s cast
kernel is compiled as a launch would specialize it (pointers 16-byte aligned, sizes and strides
multiples of 16) for each combination of options the recipes use, and its instructions counted.
A tile is 16 rows by 32·warps·columns-per-thread columns; each thread holds 16 rows of its columns,
so one thread's instructions over its 16·columns-per-thread elements is the count per element (the
kernel has no loops; the IEEE-division subroutines it calls count once). Against the memory: an
H100 issues about 29,600 G instructions a second (132 SMs, 128 lanes, 1.755 GHz) and moves 3,350
GB/s, so a cast keeps up with the memory at about 29.6 / (GB/s per element moved) instructions.
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from qtensor_kernels import nvfp4_groups  # noqa: E402

POINTERS = {
    "x_ptr": "*bf16", "ends_ptr": "*i64", "row_amax_ptr": "*fp32", "col_amax_ptr": "*fp32", "keys_ptr": "*i64",
    "row_data_ptr": "*i32", "row_scale_ptr": "*u8", "row_values_ptr": "*bf16",
    "col_data_ptr": "*i32", "col_scale_ptr": "*u8", "col_values_ptr": "*bf16",
}

# (name, options, bytes moved per element: the bf16 input, each copy's codes and scales, each bf16 values copy)
CASES = [
    ("rowwise, nearest", dict(COLUMNWISE=False, RHT=False, STOCHASTIC=False, ROW_VALUES=False, COL_VALUES=False), 2 + 0.5625),
    ("rowwise, nearest, values", dict(COLUMNWISE=False, RHT=False, STOCHASTIC=False, ROW_VALUES=True, COL_VALUES=False), 4 + 0.5625),
    ("rowwise, stochastic, values", dict(COLUMNWISE=False, RHT=False, STOCHASTIC=True, ROW_VALUES=True, COL_VALUES=False), 4 + 0.5625),
    ("columnwise, Hadamard", dict(ROWWISE=False, STOCHASTIC=False, ROW_VALUES=False, COL_VALUES=False), 2 + 0.5625),
    ("columnwise, Hadamard, stochastic, values", dict(ROWWISE=False, STOCHASTIC=True, ROW_VALUES=False, COL_VALUES=True), 4 + 0.5625),
    ("an input: rowwise with values, columnwise Hadamard", dict(STOCHASTIC=False, ROW_VALUES=True, COL_VALUES=False), 4 + 2 * 0.5625),
    ("a gradient: both stochastic with values, columnwise Hadamard", dict(), 6 + 2 * 0.5625),
]


def compile_cast(options: dict, columns: int, warps: int):
    kernel = nvfp4_groups._cast_kernel
    names = kernel.arg_names
    constants = dict(ROWWISE=True, COLUMNWISE=True, BLOCK_2D=False, RHT=True, STOCHASTIC=True, ROW_INT32=True, COL_INT32=True, WIDE=False,
                     G_POW2=128, BLOCK_N=columns * 32 * warps, VEC=columns, ROW_VALUES=True, COL_VALUES=True)
    constants.update(options)
    signature = {n: "constexpr" if n in constants else POINTERS.get(n, "i32") for n in names}
    aligned = [n for n in names if signature[n].startswith("*") or n in ("N", "stride_m", "col_length")]
    source = triton.compiler.ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "enable_fp_fusion": False})


def instructions(compiled) -> collections.Counter:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as file:
        file.write(compiled.asm["cubin"])
    listing = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm"), file.name], capture_output=True, text=True, check=True).stdout
    os.unlink(file.name)
    ops = collections.Counter()
    for line in listing.splitlines():
        match = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", line)
        if match:
            ops[match.group(2)] += 1
    return ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--columns-per-thread", type=int, default=4)
    parser.add_argument("--warps", type=int, default=4)
    args = parser.parse_args()
    elements = 16 * args.columns_per_thread
    print(f"Triton {triton.__version__}, sm_90, {args.warps} warps, {args.columns_per_thread} columns a thread")
    print(f"{'cast':<62} {'per element':>11} {'memory-bound at':>16} {'spills':>7} {'shuffles':>9}")
    for name, options, moved in CASES:
        ops = instructions(compile_cast(options, args.columns_per_thread, args.warps))
        bound = 29600 / (3350 / moved)  # instructions per element an H100 issues while moving its bytes
        print(f"{name:<62} {sum(ops.values()) / elements:>11.1f} {bound:>16.1f} {ops['LDL'] + ops['STL']:>7} {ops['SHFL']:>9}")


if __name__ == "__main__":
    main()
