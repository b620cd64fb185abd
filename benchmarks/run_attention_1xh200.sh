#!/usr/bin/env bash
# One H200 call: flash attention after the forward's FMA change: its GPU tests, then the attention
# group of bench_kernels (headline shapes; every SDPA backend in the same run).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_flash_attention.py -k "gpu and not fused" -x 2>&1 \
    | grep -i -E "Error|passed|failed" | cut -c1-400
timeout 380 python benchmarks/bench_kernels.py --out "$OUT" --only attention --quick --budget-s 330 2>&1 \
    | grep -v Warn | grep -E "attn|->" | cut -c1-300
