#!/usr/bin/env bash
# One H200 call, after the cast-transpose fix (second transposed load) and its triton_op form:
# (1) the FP8 GPU tests; (2) gpt-1.3b through the Trainer with kernels + fp8 against the plain bf16
# torch.compile loop (the earlier 1.33x ran with the faulty transposed copy for fp32 inputs);
# (3) 100 training steps with the kernel against its PyTorch reference, loss by loss;
# (4) host cost of the gpt2-124m FP8 step.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_linear.py -k gpu 2>&1 \
    | grep -i -E "AssertionError|passed|failed" | cut -c1-600
timeout 260 python benchmarks/bench_gpt.py --out "$OUT" --models gpt-1.3b:2048:8 --tag _fp8_1.3b \
    --variants plain-compile-model,trainer-triton-fp8-compile-model 2>&1 | grep -v Warning | tail -4
timeout 130 python benchmarks/bench_fp8.py --out "$OUT" --parts convergence --conv-steps 100 \
    --conv-runs fp8,fp8-reference-cast 2>&1 | grep -v Warning | grep '"fp8' | cut -c1-300
timeout 100 python benchmarks/profile_host.py --out "$OUT" --steps 5 2>&1 | grep "fp8="
