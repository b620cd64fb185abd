#!/usr/bin/env bash
# One 2x H200 call: compiled tp2 (batch-sharded) against compiled dp2, with and without
# GarbageCollection, and both with FP8 linears.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 570 python benchmarks/bench_parallel3d.py --out "$OUT" --no-llama --timeout 550 --steps 8 \
    --only "dp2_compile,tp2_compile_batch,dp2_compile_gc,tp2_compile_batch_gc,dp2_compile_fp8,tp2_compile_batch_fp8" \
    2>&1 | grep -v Warn | tail -12
