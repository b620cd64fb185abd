#!/usr/bin/env bash
# The GPU measurements the memory planner, the accumulation modes, the pipelines at a real global batch and the
# preemption / startup work still need, as calls of under 10 minutes on one host of 4 GPUs (H100 80 GB or H200).
#
#   bash benchmarks/pending_gpu.sh PART [OUT]
#     PART  45a  llama-8b-zero3 as shipped, FP8, then the same in bf16 (4 GPUs in turn)
#           45b  gpt-1.3b-zero3 against ModelParallelStrategy + FSDP2 + compile (GPUs 0-1); gpt-1.3b-fp8 against
#                the plain compiled loop, its first step cold and warm and its exit (GPU 2); the planner's one-GPU
#                calibration of the single-device blocks (GPU 3)
#           46a  gpt-1.3b at 524,288 tokens per step: dp2 ZeRO-3 with accumulation, pp2 1F1B, pp2 auto (GPUs 0-1);
#                dp2 ZeRO-2, pp2 on torch's runtime schedule, tp2 (GPUs 2-3)
#           46b  llama-8b at 524,288 tokens per step: dp4 ZeRO-3 against pp2 x dp2 auto (4 GPUs)
#           47   the preemption test on a full card (GPUs 0-1), seconds from SIGTERM to exit at llama-8b on 4 GPUs
#                after it (4 GPUs)
#     OUT   where the JSON and logs go (default: $OUT, else benchmarks/results/pending)
# Every job writes its log beside its JSON; a summary of each is printed at the end.
set -u
part=${1:?usage: bash benchmarks/pending_gpu.sh 45a|45b|46a|46b|47 [OUT]}
out=${2:-${OUT:-benchmarks/results/pending}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

job() {  # job NAME GPUS SECONDS COMMAND...
    local name=$1 gpus=$2 limit=$3
    shift 3
    ( CUDA_VISIBLE_DEVICES=$gpus timeout -k 20 "$limit" "$@" > "$out/$name.log" 2>&1
      echo "$name gpus=$gpus rc=$?" >> "$out/jobs.txt" ) &
}

case $part in
45a)
    job llama8b-fp8 0,1,2,3 280 python benchmarks/bench_recipes.py --recipes llama-8b-zero3 --baselines none \
        --steps 2 --warmup 1 --no_checkpoint --no_validation --timeout 270 --tag auto --out "$out"
    wait
    job llama8b-bf16 0,1,2,3 280 python benchmarks/bench_recipes.py --recipes llama-8b-zero3 --baselines none \
        --steps 2 --warmup 1 --no_checkpoint --no_validation --timeout 270 --tag bf16 --out "$out/bf16" \
        --variant "bf16=--model.config_overrides.fp8 null --trainer.strategy.init_args.fp8_all_gather false"
    ;;
45b)
    job gpt13b-zero3 0,1 420 python benchmarks/bench_recipes.py --recipes gpt-1.3b-zero3 --baselines mp \
        --steps 20 --warmup 10 --no_checkpoint --no_validation --timeout 200 --out "$out"
    job gpt13b-fp8 2 520 python benchmarks/bench_recipes.py --recipes gpt-1.3b-fp8 --steps 20 --warmup 10 \
        --warm_cache --no_checkpoint --no_validation --timeout 240 --tag startup --out "$out/fp8"
    job memory-plan 3 520 python benchmarks/bench_memory_plan.py --part layers --timeout 240 \
        --only gpt13b_plain_block,gpt13b_plain_block_eager,gpt13b_fp8_delayed_block --out "$out/memory_plan"
    ;;
46a)
    job pp-gb 0,1 520 python benchmarks/bench_parallel3d.py --out "$out/pp" --no-llama --global-batch-tokens \
        --warmup 2 --steps 3 --timeout 420 --only 'gb_dp2_zero3_compile,gb_pp2_1f1b_compile,gb_pp2_auto_compile'
    job tp-gb 2,3 520 python benchmarks/bench_parallel3d.py --out "$out/tp" --no-llama --global-batch-tokens \
        --warmup 2 --steps 3 --timeout 420 --only 'gb_dp2_zero2_compile,gb_pp2_1f1b_runtime_compile,gb_tp2_compile_batch'
    ;;
46b)
    job llama8b-gb 0,1,2,3 540 python benchmarks/bench_8gpu.py --out "$out" --part 4gpu --gpus 4 \
        --global-batch-tokens 524288 --warmup 1 --steps 2 --budget 450 --only 'gb_llama8b_dp4*,gb_llama8b_pp2*auto'
    ;;
47)
    job preempt-test 0,1 200 python -m pytest -q -m gpu tests/reliability/test_preemption_gpu.py -p no:cacheprovider \
        --tb=long -rfE
    wait
    job preempt-8b 0,1,2,3 360 python benchmarks/bench_checkpoint.py --preempt --preset llama-8b --gpus 4 \
        --seq-len 8192 --batch 1 --ac selective --fp8 --fill-gb 1 --dir /tmp/preempt_ckpt --out "$out"
    ;;
*)
    echo "pending_gpu.sh: unknown part $part" >&2
    exit 2
    ;;
esac
wait
cat "$out/jobs.txt"
for f in "$out"/*.log; do echo "--- $f"; tail -n 8 "$f"; done
