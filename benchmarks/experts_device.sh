#!/usr/bin/env bash
# The expert stacks on one GPU: the grouped GEMM kernels' CUDA tests and the stacks' (TESTS=0 skips
# them), bench_grouped_mm.py --mxfp8 (GEMMS=0 skips it), bench_moe.py at the Qwen3-like shapes
# ($SYSTEMS), and the MXFP8 systems with an fp32 stack's weight gradient converted after torch's
# grouped GEMM, as before qtensor's kernel stored it (BEFORE=0 skips it); GRAPHS=1 the Float8
# row-wise systems with each step captured in a CUDA graph (the groups' sizes left on the device). LORA=1 adds
# benchmarks/bench_lora.py at the 1.1B shape and the LoRA CUDA tests. Logs go to $OUT.
#   benchmarks/experts_device.sh
source "$(dirname "$0")/device_env.sh"
carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
if [ "${TESTS:-1}" != 0 ]; then
    RUN_TIMEOUT=150 run grouped_kernels python3 -m pytest -q -rA -s -m cuda -p no:cacheprovider tests/test_cuda_grouped_mm.py
    grep -E "max error" "$OUT/grouped_kernels.log" | sort -k5 -g | tail -2
fi
[ "${GEMMS:-1}" = 0 ] || timeout 150 python3 benchmarks/bench_grouped_mm.py --mxfp8 2>&1 | tee "$OUT/bench_grouped_mm_mxfp8.log"
SYSTEMS=${SYSTEMS:-"bf16,float8_rowwise quantized,mxfp8,mxfp8 quantized,mxfp8_fwd_nvfp4_bwd quantized,nvfp4 quantized"}
timeout 240 python3 benchmarks/bench_moe.py --shapes qwen3 --systems "$SYSTEMS" 2>&1 | tee "$OUT/bench_moe_qwen3.log"
[ "${BEFORE:-1}" = 0 ] || timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/bench_moe_before.log"
import sys
sys.argv = ["bench_moe.py", "--shapes", "qwen3", "--systems", "bf16,mxfp8,mxfp8 quantized", "--steps", "5"]
import qtensor.gemm.grouped as grouped
lookup = grouped.lookup  # MXFP8's wgrad through torch's grouped GEMM, then converted, as before (NVFP4 needs the kernel)
grouped.lookup = lambda name, tensor: None if name == "grouped_mm.bf16_columns" else lookup(name, tensor)
import runpy
runpy.run_path("benchmarks/bench_moe.py", run_name="__main__")
PY
[ -z "${GRAPHS:-}" ] || timeout 200 python3 benchmarks/bench_moe.py --shapes qwen3,mixtral --cuda-graphs --steps 20 \
    --systems "bf16,torchao rowwise,float8_rowwise quantized,float8_rowwise quantized fast-backward" 2>&1 | tee "$OUT/bench_moe_graphs.log"
if [ "${TESTS:-1}" != 0 ]; then
    RUN_TIMEOUT=240 run experts_cuda python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_experts.py tests/test_quantized_stacks.py
fi
if [ "${LORA:-0}" != 0 ]; then  # (LORA=1 TESTS=0 GEMMS=0 SYSTEMS=bf16 BEFORE=0: the LoRA part alone)
    carried transformers; carried peft
    LORA_SYSTEMS=${LORA_SYSTEMS:-"bf16,float8_current,float8_current one-copy,float8_blockwise one-copy,nvfp4,nf4"}
    timeout 300 python3 benchmarks/bench_lora.py --checkpointing --systems "$LORA_SYSTEMS" 2>&1 | grep -v -i warn | tee "$OUT/bench_lora_1b_checkpointing.log"
    [ -z "${LORA_PLAIN:-}" ] || timeout 200 python3 benchmarks/bench_lora.py --systems "$LORA_PLAIN" 2>&1 | grep -v -i warn | tee "$OUT/bench_lora_1b.log"
    RUN_TIMEOUT=200 run lora_cuda python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_lora.py
fi
