#!/usr/bin/env bash
# One 2x H200 session: norm kernels (GPU 0 alone, first), ZeRO with bf16 gradient reduction against
# Lightning FSDP, and the TP collective-ordering ablation against dp2 (all compiled).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/k" "$OUT/p" "$OUT/p3"
python -m pip install --no-deps -e . -q > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.used --format=csv
[ "${SKIP_KERNELS:-0}" = 1 ] || CUDA_VISIBLE_DEVICES=0 timeout 120 python benchmarks/bench_kernels.py --quick --only norm --out "$OUT/k" \
    > "$OUT/k/bench_kernels.log" 2>&1; tail -20 "$OUT/k/bench_kernels.log" 2>/dev/null
timeout 240 python benchmarks/bench_parallel.py --out "$OUT/p" --budget 200 --only lightning_fsdp_full_shard \
    zero3_triton_compile zero3_triton_compile_bf16_reduce zero2_triton_compile_bf16_reduce \
    > "$OUT/p/bench_parallel.log" 2>&1; tail -8 "$OUT/p/bench_parallel.log"
timeout 180 python benchmarks/bench_parallel3d.py --out "$OUT/p3" --no-llama \
    --only "${P3_ONLY:-dp2_compile,tp2_compile,tp2_compile_no_reorder,tp2_compile_schedule,tp2_async_compile}" \
    > "$OUT/p3/bench_parallel3d.log" 2>&1; tail -12 "$OUT/p3/bench_parallel3d.log"
