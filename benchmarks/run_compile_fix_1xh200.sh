#!/usr/bin/env bash
# One H200 call after the kernels' launch-device check moved out of traced code (Dynamo cannot take
# the Python type of a compiled Triton kernel: every support check inside a compiled region failed
# under fullgraph and broke the graph otherwise). (1) the dispatch tests that caught it, on the GPU;
# (2) the GPT steps with the pack's kernels under per-block and whole-model compile against the
# plain compiled loop, gpt2-124m and gpt-1.3b (FP8 + fused q/k/v), same run.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_dispatch.py -rf --tb=line \
    -k "matches_torch or graph_break or fullgraph or gpu or checkpointing" 2>&1 | grep -E "passed|failed|^FAILED|^E |Error" | cut -c1-300 | head -20
timeout 200 python benchmarks/bench_gpt.py --out "$OUT" --models gpt2-124m:1024:16 --tag _124m_compile_fix \
    --variants plain-compile,trainer-triton-compile,plain-compile-model,trainer-triton-compile-model 2>&1 | grep -v Warn | tail -6
timeout 200 python benchmarks/bench_gpt.py --out "$OUT" --models gpt-1.3b:2048:8 --tag _1.3b_compile_fix \
    --variants plain-compile-model,trainer-triton-fp8-qkv-compile-model 2>&1 | grep -v Warn | tail -4
