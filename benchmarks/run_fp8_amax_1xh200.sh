#!/usr/bin/env bash
# One H200 call: the streaming amax kernel's GPU tests, then gpt-1.3b through the Trainer with kernels
# + fp8 + fused q/k/v, amax by the pack's kernel or by PyTorch (Inductor-fused), against the plain bf16
# torch.compile loop in the same run.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 80 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_linear.py -k "absmax and gpu" 2>&1 \
    | grep -i -E "AssertionError|Error|passed|failed" | cut -c1-600
timeout 500 python benchmarks/bench_gpt.py --out "$OUT" --models gpt-1.3b:2048:8 --tag _fp8_amax_1.3b \
    --steps 20 --warmup 6 \
    --variants plain-compile-model,trainer-triton-fp8-qkv-compile-model,trainer-triton-fp8-qkv-torch-amax-compile-model \
    2>&1 | grep -v Warning | tail -5
