#!/usr/bin/env bash
# One H200 call: (1) the cast-and-transpose kernel against its reference, bit for bit (e5m2 from
# fp32 sources failed on an H200); (2) where the gpt2-124m FP8 step loses time (GPU time per kernel
# and idle time of one profiled step, bf16 against fp8); (3) whether training with the kernel equals
# training with its PyTorch reference (same seed, losses step by step); (4) whether CUDA graphs (no
# per-kernel host cost) recover the 124M step through the Trainer.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m pip install --no-deps -e . -q > /dev/null 2>&1
timeout 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_linear.py 2>&1 \
    | grep -i -E "AssertionError|passed|failed" | cut -c1-600
timeout 170 python benchmarks/bench_fp8.py --out "$OUT" --parts step --step-preset gpt2-124m:1024:16 \
    --step-variants bf16,fp8 2>&1 | grep -v Warning | grep '"variant"\|matmul' | cut -c1-400
timeout 130 python benchmarks/bench_fp8.py --out "$OUT" --parts convergence --conv-steps 100 \
    --conv-runs fp8,fp8-reference-cast 2>&1 | grep -v Warning | grep '"fp8' | cut -c1-300
timeout 180 python benchmarks/bench_gpt.py --out "$OUT" --models gpt2-124m:1024:16 --tag _fp8_124m \
    --variants plain-compile-model,trainer-triton-fp8-compile-model,trainer-triton-fp8-cudagraphs-model \
    2>&1 | grep -v Warning | tail -5
