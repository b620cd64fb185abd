#!/usr/bin/env bash
# One H200 call: GPU kernel tests (bf16 / large shapes, "gpu" in their names) and the whole-model
# dispatch tests that run in fp16 on a GPU (kernels vs the PyTorch paths, compiled with
# fullgraph=True). Compiling and autotuning on the GPU is slow, so the set comes in parts, one call each:
#   PART=1 (default): dispatch, norms, elementwise, fused loss;  PART=2: flash attention;  PART=3: FP8 linears.
# TESTS=<node ids> runs just those instead. Each test's result is printed as it finishes (-v), so a call
# cut short by its time limit still reports what ran.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
K="gpu or matches_torch or graph_break or fullgraph or launch_checks or relaunch"
case "${PART:-1}" in
    1) FILES="tests/kernels/test_dispatch.py tests/kernels/test_norms.py tests/kernels/test_elementwise.py tests/kernels/test_fused_linear_cross_entropy.py" ;;
    2) FILES="tests/kernels/test_flash_attention.py" ;;
    *) FILES="tests/kernels/test_fp8_linear.py" ;;
esac
if [ -n "${TESTS:-}" ]; then FILES="$TESTS"; K="not nothing"; fi
timeout "${LIMIT:-540}" python -m pytest -v -p no:cacheprovider $FILES -rf --tb=line \
    --junitxml "$OUT/gpu_tests_part${PART:-1}.xml" -k "$K" 2>&1 \
    | grep --line-buffered -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|^E " | cut -c1-300
