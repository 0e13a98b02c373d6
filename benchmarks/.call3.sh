export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q tests/test_cuda_kernels.py -k "compiled_before_any_eager or every_kernel_of_the_table" -p no:cacheprovider 2>&1 | tail -3
timeout 330 bash benchmarks/before_after.sh .base 3 -- --skip-linear --blocks 4 --steps 20 > $OUT/before_after_stack.log 2>&1; echo before_after rc $?
grep -E "^===|^(bf16|float8_current|float8_delayed|mxfp8|nvfp4|mxfp8_fwd_nvfp4_bwd) +[0-9]" $OUT/before_after_stack.log
for round in 1 2; do for tree in .base .; do for r in float8_current mxfp8; do echo "$tree $r $( (cd benchmarks && PYTHONPATH=../$tree:. timeout 40 python3 profile_host.py --recipe $r --shape 1024,1024,1024 --top 0 --kernels 0 2>&1 | grep 'ms/step') )"; done; done; done | tee $OUT/profile_host.log
