#!/usr/bin/env bash
# The GPU run (pytest -m gpu) split over the GPUs of one host: shard i of N runs on GPU i alone
# (CUDA_VISIBLE_DEVICES=i, pytest --gpu-shard=i/N), all shards at once, each with its own log and the
# durations of its slowest tests; then one summary line per shard. With N=1 it is the whole run on GPU 0.
#
#   usage: tests/gpu_split.sh [N] [pytest arguments...]
#     N               number of GPUs to use (default: every GPU nvidia-smi lists)
#     pytest args     passed to every shard, e.g. --gpu-slow, -k flash, tests/kernels
#   environment: PYTHON (default python), LOG_DIR (default ${TMPDIR:-/tmp}/gpu_tests/<UTC time>),
#                OMP_NUM_THREADS (default: the CPU cores divided among the shards)
#   exit status: 0 when every shard passed, else 1
#
# A test needing more than one GPU (gpu(gpus=N)) is skipped in a shard, which sees one: run
# `pytest -m gpu` with all GPUs visible for those.
set -u -o pipefail

cd "$(dirname "$0")/.."
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    n=$1
    shift
else
    n=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
fi
if [[ $n -lt 1 ]]; then
    echo "gpu_split.sh: no GPU found (nvidia-smi --list-gpus); give the count: tests/gpu_split.sh N" >&2
    exit 2
fi
python=${PYTHON:-python}
log_dir=${LOG_DIR:-${TMPDIR:-/tmp}/gpu_tests/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$log_dir"
threads=${OMP_NUM_THREADS:-$(( $(nproc) / n > 0 ? $(nproc) / n : 1 ))}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

echo "GPU run in $n shard(s), logs in $log_dir/"
start=$SECONDS
pids=()
for ((i = 0; i < n; i++)); do
    # -rfEs: why each test failed or was skipped; --durations-min: only tests of a second or more
    CUDA_VISIBLE_DEVICES=$i OMP_NUM_THREADS=$threads "$python" -m pytest -m gpu --gpu-shard="$i/$n" \
        -v -p no:cacheprovider -rfEs --tb=short --durations=0 --durations-min=1.0 \
        --junitxml "$log_dir/shard$i.xml" "$@" >"$log_dir/shard$i.log" 2>&1 &
    pids+=($!)
done

status=0
for ((i = 0; i < n; i++)); do
    wait "${pids[$i]}"
    rc=$?
    [[ $rc -eq 0 || $rc -eq 5 ]] || status=1  # 5: pytest found nothing for this shard (fewer cases than GPUs)
    # pytest's last line: "== 20 passed, 3 skipped, 80 deselected in 61.2s =="
    echo "shard $i/$n (GPU $i): exit $rc: $(grep -E '^=+ .* in [0-9.]+s' "$log_dir/shard$i.log" | tail -n 1 | tr -d '=')"
done
echo "all shards: $((SECONDS - start)) s wall; slowest tests: the 'slowest durations' section of each log"
grep -hE '^(FAILED|ERROR) ' "$log_dir"/shard*.log || true
exit $status
