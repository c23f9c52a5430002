#!/usr/bin/env bash
# One prepared GPU check with a verdict, from the repository root on a CUDA machine that has
# torch, triton and transformers (nothing is installed):  bash load_tests/gpu_check.sh
#   load_tests/gpu_check.py   preflight, kernel tests on CUDA, engine parity (Triton vs the torch
#                             references, CUDA graphs vs eager, HF teacher-forced), KV sizing, a
#                             CUDA-graph-captured NCCL all_reduce, a replica's start time (imports,
#                             engine phases with CUDA graphs, first TTFTs), decode ms/step against the HBM
#                             floor and tokens/s against HF (9 minutes at most)
#   load_tests/kernel_bench.py  kernel GB/s against a copy of the same bytes (1 minute at most)
# Everything lands in $OUT (default /tmp/gpu_check): summary.json as each step ends, logs, the
# benchmark's JSON lines. Exit status: nonzero when any step failed. GPU_CHECK_DRY=1 runs it on a
# CPU (CUDA steps SKIP), as CI does.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
export OUT
mkdir -p "$OUT"
timeout --kill-after=10 540 "$PY" load_tests/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
if [ "${GPU_CHECK_DRY:-0}" != 1 ]; then
  rm -f "$OUT/kernel_bench.jsonl"
  timeout --kill-after=10 60 "$PY" load_tests/kernel_bench.py --json "$OUT/kernel_bench.jsonl" \
    2>&1 | tee "$OUT/kernel_bench.log" | tail -n 25
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "kernel_bench FAIL"; rc=1; }
fi
echo "gpu_check: exit $rc (summary: $OUT/summary.json)"
exit "$rc"
