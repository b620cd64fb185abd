#!/usr/bin/env bash
# One 2x H200 call: ZeRO with FP8 linears with and without GarbageCollection (the collector on a fixed
# schedule on both ranks), against Lightning FSDP in the same run. The question: are the lopsided
# per-rank exposure (3-7% on one rank, 29-37% on the other) and the ~75 ms spread in host time per
# step between ranks automatic garbage collections pausing one rank at a time? And does grouping two
# blocks per FSDP2 unit (half the collectives and FSDP2 host work) help further?
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 560 python benchmarks/bench_parallel.py --out "$OUT" --steps 30 --budget 520 \
    --only lightning_fsdp_full_shard zero3_triton_compile_fp8_qkv zero3_triton_compile_fp8_qkv_gc \
    zero2_triton_compile_fp8_qkv zero2_triton_compile_fp8_qkv_gc zero3_triton_compile_fp8_qkv_gc_units2 \
    2>&1 | grep -v Warn | tail -9
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + '/bench_parallel_*.json'):
    for r in json.load(open(f))['results']:
        print(r['variant'], 'issue s / probe step s per rank', r.get('issue_s_and_probe_step_s_per_rank'),
              'host step per rank', r.get('host_step_s_median_per_rank'), 'exposed per rank',
              r.get('exposed_comm_pct_per_rank'))
PY
