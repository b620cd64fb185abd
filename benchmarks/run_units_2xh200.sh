#!/usr/bin/env bash
# One 2x H200 call: ZeRO-3 with two blocks per FSDP2 unit (blocks_per_unit=2), with and without
# GarbageCollection, FP8 and bf16, against Lightning FSDP in the same run: which of the two removes
# the lopsided exposed communication of the compiled runs.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 560 python benchmarks/bench_parallel.py --out "$OUT" --steps 30 --budget 520 \
    --only lightning_fsdp_full_shard zero3_triton_compile_fp8_qkv_units2 zero3_triton_compile_fp8_qkv_gc_units2 \
    zero3_triton_compile_fp8_qkv zero3_triton_compile_units2 zero3_triton_compile_gc_units2 zero3_triton_compile \
    2>&1 | grep -v Warn | tail -10
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + '/bench_parallel_*.json'):
    for r in json.load(open(f))['results']:
        print(r['variant'], 'host step per rank', r.get('host_step_s_median_per_rank'), 'exposed per rank',
              r.get('exposed_comm_pct_per_rank'))
PY
