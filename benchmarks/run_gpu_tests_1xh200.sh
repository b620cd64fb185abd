#!/usr/bin/env bash
# One H200 call: the kernel tests compiled for the GPU (bf16 and large shapes included), and the
# perf / MFU tests that read CUDA device facts. Regression check of the GPU paths on the GPU image.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m pip install --no-deps -e . -q > /dev/null 2>&1
timeout 540 python -m pytest -q -p no:cacheprovider tests/kernels tests/perf tests/callbacks/test_callbacks_mfu.py \
    -rfs --junitxml "$OUT/gpu_tests.xml" 2>&1 | grep -v Warn | tail -40
