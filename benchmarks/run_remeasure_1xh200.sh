#!/usr/bin/env bash
# One H200 call: the single-GPU records taken before the launch-device fix, re-measured against the
# plain compiled loop in the same run: gpt-1.3b with FP8 linears + fused q/k/v (whole-model compile;
# the 1.16x record), and gpt2-124m with per-block compile (the 476.0k / 418.8k question). Set
# OLD=.oldpkg (a `git archive <commit> lightning_perf` extracted there) to add the same 124M variant
# run on that older package.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "${PROFILE:-1}" != only ]; then
PYTHONPATH=$PWD timeout 330 python benchmarks/bench_gpt.py --out "$OUT" --models gpt-1.3b:2048:8 --tag _1.3b_fp8_remeasure \
    --variants plain-compile-model,trainer-triton-fp8-qkv-compile-model 2>&1 | grep -v Warn | tail -4
PYTHONPATH=$PWD timeout 150 python benchmarks/bench_gpt.py --out "$OUT" --models gpt2-124m:1024:16 --tag _124m_block_new \
    --variants plain-compile,trainer-triton-compile 2>&1 | grep -v Warn | tail -4
if [ -n "${OLD:-}" ]; then
    PYTHONPATH=$PWD/$OLD:$PWD timeout 100 python benchmarks/bench_gpt.py --out "$OUT" --models gpt2-124m:1024:16 \
        --tag _124m_block_old --variants trainer-triton-compile 2>&1 | grep -v Warn | tail -3
fi
fi
# (PROFILE=0 leaves the profile out, so the timed runs fit one call; PROFILE=only runs the profile alone)
# the dispatcher's default (norms / activations left to Inductor inside compiled graphs) was chosen from
# a profile taken while every support check broke the graph: per-block compile, each op on its own,
# with the pack's norms / activations kept inside the graphs
[ "${PROFILE:-1}" = 0 ] && exit 0
PYTHONPATH=$PWD timeout 200 python benchmarks/profile_gpt.py --out "$OUT/prof" --preset gpt2-124m --scope block \
    --sets torch,each --profile none --elementwise-under-compile triton --tag _124m_block_triton_elementwise 2>&1 \
    | grep -E "median" | head -8
