#!/usr/bin/env bash
# One H200 call: the GPU kernel tests (bf16 / large shapes, marked by "gpu" in their names) and the
# whole-model dispatch tests that run in fp16 on a GPU (kernels vs the PyTorch paths, compiled with
# fullgraph=True). Every kernel test compiled for the GPU does not fit one call (autotuning); these do.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 540 python -m pytest -q -p no:cacheprovider tests/kernels -rf --tb=line --junitxml "$OUT/gpu_tests.xml" \
    -k "gpu or matches_torch or graph_break or fullgraph or launch_checks" 2>&1 \
    | grep -E "passed|failed|^FAILED|^E " | cut -c1-300 | head -40
