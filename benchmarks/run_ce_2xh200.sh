#!/usr/bin/env bash
# One 2x H200 call: TP-sized all-gather / reduce-scatter alone and under matmuls, NCCL against
# copy-engine copies over symmetric memory (benchmarks/bench_overlap.py); NCCL with 8 channels too.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 200 python benchmarks/bench_overlap.py --out "$OUT" 2>&1 | grep -v Warn | tail -20
NCCL_MIN_NCHANNELS=8 NCCL_MAX_NCHANNELS=8 timeout 150 python benchmarks/bench_overlap.py --out "$OUT/ch8" 2>&1 \
    | grep -v Warn | grep -E "nccl|matmuls" | tail -8
