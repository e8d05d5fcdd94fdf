#!/usr/bin/env bash
# The checks that need a CUDA device, in one go, with the python3 that holds
# a CUDA build of torch (no venv: GPU machines here have no package index).
#
#   bash tests/gpu_check.sh OUT_DIR [SECONDS]
#
# Builds the extension in place against that torch (GPU_CHECK_SKIP_BUILD=1:
# already built), then, in order of worth,
# each step bounded by what is left of SECONDS (default 585):
#   1. the `cuda` tests of the main suite;
#   2. the `cuda` tests of the stream, CUDA graph and staging modules, and
#      the zoo's eval/train test for its two many-branched models, again
#      under TORCH_CUDA_SANITIZER=1 (PyTorch's stream sanitizer over every
#      kernel), one pytest per file side by side (csan_<file>.log);
#   3. beside step 2, the zoo's `cuda` tests (torchvision models on four
#      real streams, and torch.cuda._sanitizer against each removed wait);
#   4. benchmarks/compile_backends.py (the torch_stage backend on inductor
#      against inductor, with and without CUDA graphs: two branchy models,
#      batch 1, forward), benchmarks/device_staging.py (host-to-device
#      staging against the plain ways), benchmarks/pinned_gather.py (its
#      gather step, modelled), the demo and benchmarks/multi_stream.py
#      (models section, GPU times).
# Logs and JSON go to OUT_DIR; the last lines say which step passed. Each
# CSAN file stops at its fourth failure, so that their reports are printed
# before its time runs out (pytest prints them at the end).
#
# The compiler is $CXX, else c++. setup.py refuses a library linked with a
# copy of libstdc++ of its own (it crashes beside torch's): on a machine
# whose CXX does that (one GPU machine here: /opt/gcc/bin/g++), run with
# CXX=c++.
set -u
OUT=${1:?usage: tests/gpu_check.sh OUT_DIR [SECONDS]}
BUDGET=${2:-585}
PY=${GPU_PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
mkdir -p "$OUT"
START=$SECONDS
SUMMARY=()
export PYTHONUNBUFFERED=1

left() { echo $((BUDGET - (SECONDS - START))); }

# step NAME CAP LOG command...: runs under min(CAP, time left - 15 s).
step() {
  local name=$1 cap=$2 log=$3
  shift 3
  local t
  t=$(left)
  t=$((t - 15 < cap ? t - 15 : cap))
  if ((t < 20)); then
    SUMMARY+=("$name: not run (no time left)")
    return
  fi
  echo "== $name (at most ${t}s) =="
  local s=$SECONDS rc
  timeout -k 5 "$t" "$@" >"$OUT/$log" 2>&1
  rc=$?
  # A benchmark's table, not the JSON report it prints after it (only a few
  # files come back from some GPU machines, so stdout is what is read).
  awk '/^[{]$/ { exit } { print }' "$OUT/$log" | tail -n 25
  SUMMARY+=("$name: rc=$rc in $((SECONDS - s))s ($(grep -E '^(=+ )?[0-9]+ (passed|failed)|passed|failed' "$OUT/$log" | tail -1))")
}

{
  nvidia-smi -L
  "$PY" -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
} 2>&1 | tee "$OUT/summary.txt"

echo "== build =="
s=$SECONDS
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then
  echo "skipped (GPU_CHECK_SKIP_BUILD=1)"
elif ! MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install -q --disable-pip-version-check \
  --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
  tail -n 60 "$OUT/build.log"
  echo "build failed after $((SECONDS - s))s"
  exit 1
else
  echo "built in $((SECONDS - s))s"
fi

PYTEST=("$PY" -m pytest -p no:cacheprovider -v -rfEs --continue-on-collection-errors)
step "cuda tests" 120 cuda.log "${PYTEST[@]}" -m cuda --timeout 120 tests \
  --ignore=tests/zoo_torchvision
# One pytest per file, side by side: CSAN is Python work on every op, and
# a GPU machine has the cores. Left out: the timing tests (CSAN slows every
# op), the torch.compile ones (Dynamo compiles nothing while a dispatch mode
# such as CSAN is active, so they would run eager; the backend's own CSAN
# test compiles first and then enables CSAN, in the plain step), and the
# zoo but its two many-branched models.
csan_files() {
  local pids=() f
  for f in tests/streams/test_multi_stream.py tests/streams/test_stream_ops.py tests/streams/test_stream_scope.py \
    tests/streams/fx/test_fx_effects.py tests/staging/test_stage.py tests/staging/test_loader.py tests/records/test_records.py \
    tests/records/test_records_staged.py tests/streams/test_cuda_graphs.py tests/zoo_torchvision; do
    TORCH_CUDA_SANITIZER=1 "${PYTEST[@]}" -m cuda --timeout 300 --maxfail 4 "$f" \
      -k "not torchs_own and not overlap and not backend_option and not reduce_overhead \
and not jit_trace and (not torchvision or googlenet or inception_v3)" \
      >"$OUT/csan_$(basename "$f" .py).log" 2>&1 &
    pids+=($!)
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  grep -h -E '^(=+ )?[0-9]+ (passed|failed)|^FAILED' "$OUT"/csan_*.log
  return $rc
}
export -f csan_files
export OUT
export PYTEST_CMD="${PYTEST[*]}"
# The zoo on real streams runs beside the CSAN files: both check results,
# not timings, and one GPU machine's cores and memory hold both.
ZOO_LEFT=$(($(left) - 15))
ZOO_START=$SECONDS
if ((ZOO_LEFT > 240)); then ZOO_LEFT=240; fi
if ((ZOO_LEFT >= 20)); then
  timeout -k 5 "$ZOO_LEFT" "${PYTEST[@]}" -m cuda --timeout 300 tests/zoo_torchvision \
    >"$OUT/zoo.log" 2>&1 &
  ZOO_PID=$!
fi
step "cuda tests under TORCH_CUDA_SANITIZER=1" 200 csan.log bash -c \
  'PYTEST=($PYTEST_CMD); csan_files'
if [ -n "${ZOO_PID:-}" ]; then
  wait "$ZOO_PID"
  rc=$?
  echo "== zoo on cuda (beside CSAN) =="
  tail -n 25 "$OUT/zoo.log"
  SUMMARY+=("zoo on cuda: rc=$rc in $((SECONDS - ZOO_START))s ($(grep -E '^(=+ )?[0-9]+ (passed|failed)|passed|failed' "$OUT/zoo.log" | tail -1))")
else
  SUMMARY+=("zoo on cuda: not run (no time left)")
fi
step "compile backends benchmark" 150 compile_backends.log "$PY" benchmarks/compile_backends.py \
  --models inception,rec_8_towers --batches 1 --modes forward --rounds 3 \
  --json "$OUT/compile_backends.json"
step "device staging benchmark" 90 device_staging.log "$PY" benchmarks/device_staging.py \
  --items 20 --rounds 2 --json "$OUT/device_staging.json"
step "pinned gather model" 40 pinned_gather.log "$PY" benchmarks/pinned_gather.py \
  --rounds 2 --json "$OUT/pinned_gather.json"
step "demo" 60 demo.log "$PY" examples/demo.py --steps 400 --rounds 2
step "multi_stream benchmark" 80 multi_stream.log "$PY" benchmarks/multi_stream.py \
  --only-models --no-inductor --iters 20 --rounds 2 --json "$OUT/multi_stream.json"

echo "== summary (${BUDGET}s budget, $((SECONDS - START))s used) =="
printf '%s\n' "${SUMMARY[@]}" | tee -a "$OUT/summary.txt"
