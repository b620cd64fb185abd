#!/usr/bin/env bash
# One 2x H200 call: the optimizer step on FSDP2 shards (bench_optimizer), async TP with and without
# the collective reordering, and the code Inductor generates for a compiled tp2 block.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/o" "$OUT/p3" "$OUT/code"
python -m pip install --no-deps -e . -q > /dev/null 2>&1
timeout 150 python benchmarks/bench_optimizer.py --out "$OUT/o" > "$OUT/o/bench_optimizer.log" 2>&1
grep -v USDT "$OUT/o/bench_optimizer.log" | tail -30
timeout 150 python benchmarks/bench_parallel3d.py --out "$OUT/p3" --no-llama \
    --only 'dp2_compile,tp2_async_compile,tp2_async_compile_no_reorder' \
    > "$OUT/p3/bench_parallel3d.log" 2>&1; tail -8 "$OUT/p3/bench_parallel3d.log"
TORCH_LOGS=output_code timeout 120 python benchmarks/bench_parallel3d.py --out /tmp/p3code --no-llama \
    --only 'tp2_compile' --warmup 1 --steps 1 > /tmp/code.log 2>&1
grep -a "rank0" /tmp/code.log | grep -a -E "def call|extern_kernels\.|_c10d_functional|triton_[a-z]+_fused_[a-zA-Z0-9_]*\.run|torch\.ops\." \
    | sed 's/.*__output_code\]//' > "$OUT/code/tp2_compile_calls.txt"; wc -l "$OUT/code/tp2_compile_calls.txt"
