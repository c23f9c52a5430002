#!/usr/bin/env bash
# One prepared GPU check (an H200 box with torch, triton and transformers; no network), run from
# the repository root:  bash load_tests/gpu_check.sh
#   1. the kernel tests natively on CUDA   (python3 -m pytest -q -m gpu tests/kernels)
#   2. the kernel benchmarks               (load_tests/kernel_bench.py, JSON lines + table)
#   3. offline throughput, when present    (load_tests/offline_throughput.py --gpu)
# then a short summary table. Each step has its own time limit so that the whole run stays under
# about 5 minutes and a hung step cannot eat the others' time. Logs go to $OUT (or /tmp/gpu_check).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/gpu_check}
mkdir -p "$LOGS"
SUMMARY=()

step() {  # step NAME LIMIT_S CMD...: run with a time limit, log to $LOGS/NAME.log, record rc
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    SUMMARY+=("$(printf '%-20s rc=%-4s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(tail -n 1 "$LOGS/$name.log" | cut -c1-90)")")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$LOGS/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$LOGS/gpu.txt"

step kernel_tests 140 $PY -m pytest -q -m gpu tests/kernels -p no:cacheprovider --durations=5
rm -f "$LOGS/kernel_bench.jsonl"
step kernel_bench 75 $PY load_tests/kernel_bench.py --json "$LOGS/kernel_bench.jsonl"
if [ -f load_tests/offline_throughput.py ]; then
    step offline_throughput 75 $PY load_tests/offline_throughput.py --gpu
fi

echo
echo "=== summary (logs in $LOGS)"
printf '%s\n' "${SUMMARY[@]}"
if [ -f "$LOGS/kernel_bench.jsonl" ]; then
    $PY - "$LOGS/kernel_bench.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{'kernel':46} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'vs peer':>8}")
for r in rows:
    print(f"{r['bench']:46} {r['ms']:8.3f} {r.get('gbps', ''):>7} {r.get('pct_of_copy', ''):>6} "
          f"{r.get('tflops', ''):>8} {str(r.get('speedup', '')) + 'x':>8}")
EOF
fi
