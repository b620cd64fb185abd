#!/usr/bin/env bash
# One 2x H200 call: the FP8 cast-transpose kernel's GPU test, then ZeRO with FP8 linears against
# Lightning's FSDP in the same run: weights gathered in bf16 (then quantised) or in FP8
# (ZeroStrategy(fp8_all_gather=True)), q/k/v as one linear; gpu_time per variant shows idle time.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
CUDA_VISIBLE_DEVICES=0 timeout 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_linear.py \
    -k "bitwise_on_gpu or absmax" 2>&1 | grep -i -E "AssertionError|passed|failed" | cut -c1-400
timeout 380 python benchmarks/bench_parallel.py --out "$OUT" --steps 20 --budget 330 \
    --only lightning_fsdp_full_shard zero3_triton_compile_fp8_qkv zero2_triton_compile_fp8_qkv \
    2>&1 | grep -v Warn | tail -9
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + '/bench_parallel_*.json'):
    for r in json.load(open(f))['results']:
        print(r['variant'], 'issue s / probe step s per rank', r.get('issue_s_and_probe_step_s_per_rank'),
              'step', r.get('step_s_median'), 'exposed per rank', r.get('exposed_comm_pct_per_rank'))
PY
