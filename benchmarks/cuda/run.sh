#!/usr/bin/env bash
# funcshard's CUDA paths checked and measured in one call on one GPU (issue 35). From the repository root:
#
#   bash benchmarks/cuda/run.sh                  # on the GPU machine: writes everything under $OUT (~7 min at most)
#   bash benchmarks/cuda/run.sh --cpu-dry-run    # here, without a GPU: the same stages on the CPU, tiny, no budget
#
# On the GPU machine the optree wheel is carried in .whl/ (the image has none). Each stage runs in its own process
# under its own `timeout`; a failure or a timeout is recorded and the next stage still runs; stages are skipped
# once the wall budget (CUDA_RUN_BUDGET seconds, default 420) is spent; the summary and the archive take seconds
# after it. $OUT gets at most 8 files (summary.md first; the profiler traces of three steps); every log and file of
# every stage is in $OUT/all.tar.gz.
DRY=0; [ "${1:-}" = "--cpu-dry-run" ] && DRY=1
if [ $DRY = 0 ]; then  # (the dry run uses this machine's optree: the carried wheel is for the device's Python)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site || echo "run.sh: no optree wheel installed from .whl/"
else
  export FUNCSHARD_DEVICE=cpu PYTHONPATH=$PWD
fi
set -u
ROOT=$PWD
export PYTHONPATH=${PYTHONPATH:-$ROOT}
OUT=${OUT:-/tmp/funcshard_cuda_out}
mkdir -p "$OUT"
W=$(mktemp -d /tmp/fscuda.XXXXXX)
PY=${PY:-python3}
BUDGET=${CUDA_RUN_BUDGET:-420}
[ $DRY = 1 ] && BUDGET=${CUDA_RUN_BUDGET:-100000}
T0=$(date +%s)
echo "| stage | status | rc | seconds | limit s |" > "$W/stages.md"
echo "|---|---|---|---|---|" >> "$W/stages.md"

# stage NAME LIMIT_S CMD...: run CMD under `timeout` (at most what is left of the budget), log to $W/NAME.log
stage() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - ($(date +%s) - T0)))
  if [ $DRY = 1 ]; then limit=$((limit * 20)); fi
  if [ "$left" -lt 15 ]; then
    echo "| $name | SKIPPED (wall budget spent) | - | 0 | $limit |" >> "$W/stages.md"
    echo "=== $name: skipped, budget spent" | tee -a "$W/progress.log"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $name (limit ${limit} s, $(($(date +%s) - T0)) s elapsed): $*" | tee -a "$W/progress.log"
  local s=$(date +%s.%N)
  timeout -k 5 "$limit" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  local secs=$(python3 -c "import time; print(f'{time.time() - $s:.1f}')" 2>/dev/null || echo "?")
  local status=OK
  case $rc in
    0) status=OK ;;
    124|137) status=TIMEOUT ;;
    1) status="FAILED (checks or tests failed)" ;;
    *) status=ERROR ;;
  esac
  echo "| $name | $status | $rc | $secs | $limit |" >> "$W/stages.md"
  echo "    -> $status rc=$rc ${secs}s" | tee -a "$W/progress.log"
  tail -3 "$W/$name.log" | sed 's/^/    | /'
}

if [ $DRY = 1 ]; then
  TINY="tiny-13g:1:1"; BIG="tiny-13g:1:1"; SYSTEMS="--systems unsharded fsdp2 fs_apply fs_fully_shard"
else
  TINY="tiny-33g:4:4"; BIG="gpt-100M-b8:3:3"; SYSTEMS=""
fi
CHECK="$PY benchmarks/cuda/check.py"
BENCH="$PY benchmarks/bench.py --no-cpu --no-fake-cpu --no-write-results"
[ $DRY = 1 ] && BENCH="$BENCH --cuda-dry-run"

# a) correctness: the environment, tests/test_cuda.py, parity / hooks / offload against FSDP2 and the unsharded model
[ $DRY = 0 ] && stage nvidia_smi 10 nvidia-smi
stage env 25 $CHECK env --out "$W/check"
stage pytest_cuda 60 $PY -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py --junitxml="$W/pytest_cuda.xml" -rA
stage parity 60 $CHECK parity --out "$W/check"
# b) the benchmark on CUDA: W=1 NCCL and fake-PG W=8 (each bench call runs both), fp32 then bf16 on ~100M params
stage bench_tiny_fp32 75 $BENCH $SYSTEMS --cuda-models $TINY --out "$W/bench_tiny_fp32"
stage bench_100M_fp32 75 $BENCH $SYSTEMS --cuda-models $BIG --out "$W/bench_100M_fp32"
stage bench_100M_bf16 65 $BENCH $SYSTEMS --mp bf16 --cuda-models $BIG --out "$W/bench_100M_bf16"
# c) one traced step per API (funcshard.trace + torch.profiler); d) the cost model's peak vs max_memory_allocated
stage trace 30 $CHECK trace --out "$W/check"
stage cost 40 $CHECK cost --out "$W/check"
# with what is left: fake-PG W=8 in this process (fp32, bf16), the cost at W=8, then torch 2.11 on the CPU suites
stage fake8 30 $CHECK fake8 --out "$W/check"
stage cost_w8 30 env CHECK_COST_WORLDS=8 CHECK_SUFFIX=_w8 $CHECK cost --out "$W/check"
if [ $DRY = 0 ]; then  # (the device's torch is 2.11: its CPU, gloo, for whatever budget is left)
  stage cpu_suites 120 $PY -m pytest -v -p no:cacheprovider tests/test_precision.py tests/test_offload.py \
    tests/test_comm.py --junitxml="$W/pytest_cpu.xml"
fi

echo "total wall $(($(date +%s) - T0)) s" >> "$W/stages.md"
timeout 60 $PY benchmarks/cuda/summarize.py "$W" "$OUT" > "$W/summarize.log" 2>&1 || {
  echo "summarize.py failed (see all.tar.gz: summarize.log)" > "$OUT/summary.md"
  cat "$W/stages.md" "$W/summarize.log" >> "$OUT/summary.md"
}
(cd "$W" && tar czf "$OUT/all.tar.gz" --exclude='trace_profiler_*' .) 2>/dev/null
[ "$(stat -c %s "$OUT/all.tar.gz" 2>/dev/null || echo 0)" -gt 15000000 ] && \
  (cd "$W" && tar czf "$OUT/all.tar.gz" --exclude='trace_*' --exclude='*.json.gz' *.md *.log check/*.json \
    bench_*/results.md bench_*/results.json 2>/dev/null)
ls -la "$OUT"
cat "$OUT/summary.md"
