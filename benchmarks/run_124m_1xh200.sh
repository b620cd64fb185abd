#!/usr/bin/env bash
# One H200 call: gpt2-124m whole-model step. (1) the plain torch.compile loop against the Trainer
# with the pack's kernels + CUDA graphs, in bf16 and with FP8 linears (q/k/v as one linear);
# (2) one profiled step of the plain whole-model compiled loop: GPU time per kernel category.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/prof"
timeout 330 python benchmarks/bench_gpt.py --out "$OUT" --models gpt2-124m:1024:16 --tag _124m_cudagraphs \
    --variants plain-compile-model,trainer-triton-cudagraphs-model,trainer-triton-qkv-cudagraphs-model,trainer-triton-fp8-qkv-cudagraphs-model \
    2>&1 | grep -v Warn | tail -8
timeout 200 python benchmarks/profile_gpt.py --out "$OUT/prof" --preset gpt2-124m --seq-len 1024 --batch 16 \
    --scope model --sets torch --profile torch --tag _124m_model 2>&1 | grep -v Warn | tail -25
