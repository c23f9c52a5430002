# Sourced by serve_vs_vllm.sh and serve_ab.sh: benchmark runs whose failures are remembered,
# not fatal, so the remaining rounds and the comparison still run; the script then exits with
# the first failure's status (serving_benchmark.py and compare_runs.py exit 1 when a request or
# a run failed).
RUNS_STATUS=0  # the first failing run's exit status; 0 while none failed

# record_run OUT LABEL CMD...: run CMD, its standard output shown and appended to OUT; a nonzero
# exit is named on stderr and kept in RUNS_STATUS
record_run() {
  local out=$1 label=$2 rc=0
  shift 2
  ( set -o pipefail; "$@" | tee -a "$out" ) || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "$(basename "$0"): run \"$label\" exited $rc" >&2
    [ "$RUNS_STATUS" -ne 0 ] || RUNS_STATUS=$rc
  fi
}

# runs_exit [KEPT]: exit with RUNS_STATUS when a run failed (saying so, and where KEPT, the
# runs' JSON lines, stays); return when none did
runs_exit() {
  [ "$RUNS_STATUS" -eq 0 ] && return 0
  local kept=""
  [ -z "${1:-}" ] || kept="; the runs' JSON lines: $1"
  echo "$(basename "$0"): a run failed (first failing exit status $RUNS_STATUS)$kept" >&2
  exit "$RUNS_STATUS"
}
