#!/usr/bin/env bash
# One H200 call: the FP8 cast-transpose kernel's forms against the copy bandwidth, then one
# profiled gpt-1.3b FP8 step (whole-model compile) with GPU time per kernel category.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 330 python benchmarks/bench_cast_transpose.py --out "$OUT" 2>&1 | grep -v Warn | cut -c1-700
timeout 240 python benchmarks/profile_gpt.py --out "$OUT" --preset gpt-1.3b --seq-len 2048 --batch 8 --scope model \
    --sets all --profile all --fp8 --steps 6 --warmup 4 --tag _1.3b_fp8_model 2>&1 | grep -v Warn \
    | grep -E "median|\"(matmul|attention|inductor|pack_elementwise|copy_cast|optimizer|other|idle|total)" | head -20
