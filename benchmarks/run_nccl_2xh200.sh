#!/usr/bin/env bash
# One 2x H200 call: NCCL all-gather / reduce-scatter bandwidth alone under several NCCL settings,
# then tp2 (compiled) against dp2 with the setting that moved most bytes per second.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/n" "$OUT/p3"
python -m pip install --no-deps -e . -q > /dev/null 2>&1
nvidia-smi topo -m | head -5
python benchmarks/bench_nccl.py --out "$OUT/n" --tag default 2>&1 | grep "^\["
NCCL_PROTO=Simple python benchmarks/bench_nccl.py --out "$OUT/n" --tag simple 2>&1 | grep "^\["
NCCL_PROTO=LL128 python benchmarks/bench_nccl.py --out "$OUT/n" --tag ll128 2>&1 | grep "^\["
NCCL_MIN_NCHANNELS=32 NCCL_MAX_NCHANNELS=32 python benchmarks/bench_nccl.py --out "$OUT/n" --tag ch32 2>&1 | grep "^\["
