#!/usr/bin/env bash
# Issue 41: NVFP4 weights cast in 16x16 tiles hold one E4M3 scale per tile. On the GPU: the CUDA
# tests of the NVFP4 kernels (casts, grouped casts, the hybrid's, dequantize) and of the layers
# that use them, then LoRA at batch 1 over each base (blocks as CUDA graphs, chunked loss) for the
# peak memory against torchao's NF4. Logs in $OUT.
#   benchmarks/nvfp4_tiles_device.sh
source "$(dirname "$0")/device_env.sh"
carried transformers; carried peft; carried torchao
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
RUN_TIMEOUT=330 run test_cuda_nvfp4_tiles python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_kernels.py \
    tests/test_nvfp4.py tests/test_nvfp4_groups.py tests/test_cuda.py tests/test_lora.py tests/test_quantized_stacks.py tests/test_experts.py
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-lora
timeout 240 python3 benchmarks/bench_lora.py --systems "bf16,nvfp4 weight-only one-copy,nvfp4 one-copy,nf4" --compile --cuda-graphs \
    --checkpointing --chunked-loss 8 --batch 1 --steps 10 2>&1 | grep -v -i warn | tee "$OUT/bench_lora_nvfp4_tiles_b1.log"
