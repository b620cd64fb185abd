#!/usr/bin/env bash
# One 2x H200 call: ZeRO with FP8 linears against Lightning's FSDP, same run (the first fp8 zero3 run
# had 32% exposed communication and a 245-378 ms step spread; gpu_time per variant shows idle time).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m pip install --no-deps -e . -q > /dev/null 2>&1
timeout 560 python benchmarks/bench_parallel.py --out "$OUT" --steps 20 --budget 520 \
    --only lightning_fsdp_full_shard zero3_triton_compile_fp8 zero3_triton_compile_fp8_gather zero2_triton_compile_fp8 \
    zero2_triton_compile_fp8_gather zero3_triton_compile_fp8_bf16_reduce \
    2>&1 | grep -v Warn | tail -8
