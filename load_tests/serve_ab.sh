#!/usr/bin/env bash
# Two versions of this app, the same serving load, alternating: does a change cost serving
# speed? Each version runs from its own git worktree (its code first on PYTHONPATH, this
# checkout's .venv), started the README's way (`serve run serve_app:build_app`, defaults), with
# the same client and load as serve_vs_vllm.sh. Loopback only. Usage:
#   [ROUNDS=3] [PLOT=f.png] load_tests/serve_ab.sh [BASE_REF] [NEW_REF] [NUM_PROMPTS] [CONCURRENCY]
# BASE_REF defaults to HEAD~1, NEW_REF to the working tree (uncommitted changes included). Each
# round starts each version afresh (the order flips every round), warms it up and measures it.
# Prints one JSON line per run (labels "base round N", "new round N"), then compare_runs.py's
# summary: medians, and the medians of the per-round ratios new / base. A run with failed
# requests (serving_benchmark.py exits 1) does not stop the rounds; the summary names it
# (compare_runs.py) and the script exits with the first failing run's status (a failed warm-up
# stops it at once).
# MODEL (default: the app's default model) is served by both; BASE_ARGS and NEW_ARGS are extra
# `key=value` arguments of build_app for one version only (a setting's A/B on one commit:
#   NEW_ARGS="separate_prefill_steps=false" load_tests/serve_ab.sh HEAD HEAD).
set -euo pipefail
cd "$(dirname "$0")/.."
source load_tests/runs.sh
PY=$PWD/.venv/bin/python
BASE=${1:-HEAD~1}
NEW=${2:-}
N=${3:-128}
C=${4:-64}
ROUNDS=${ROUNDS:-3}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
WORK=$(mktemp -d "${TMPDIR:-/tmp}/serve_ab.XXXXXX")
OUT=$WORK/runs.jsonl
APP=
cleanup() {
  [ -n "$APP" ] && kill -KILL -- "-$APP" 2>/dev/null || true
  git worktree remove --force "$WORK/base" 2>/dev/null || true
  [ -n "$NEW" ] && git worktree remove --force "$WORK/new" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
git worktree add -q --detach "$WORK/base" "$BASE"
if [ -n "$NEW" ]; then git worktree add -q --detach "$WORK/new" "$NEW"; NEW_DIR=$WORK/new
else NEW_DIR=$PWD; fi
LOAD=(--num-prompts "$N" --max-concurrency "$C" --input-len 128 --output-len 64
      --range-ratio 0.5 --prompt-mode tokens --vocab-size 700 --seed 0 --no-progress)

up() { for _ in $(seq 1 240); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && return 0
       sleep 1; done; echo "the app did not start: $WORK/app.log" >&2; return 1; }
start() {  # start DIR [ARGS]: the app from DIR's code, in its own process group
  set -m
  # shellcheck disable=SC2086  # ARGS: words, each a key=value
  (cd "$1" && PYTHONPATH="$1" exec "$(dirname "$PY")/serve" run serve_app:build_app \
     ${MODEL:+model="$MODEL"} ${2:-} >"$WORK/app.log" 2>&1) &
  APP=$!
  set +m
  up
}
stop() {  # Ctrl-C, as a user stops serve run (it shuts the app and its cluster down)
  kill -INT "$APP" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$APP" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$APP" 2>/dev/null || true; wait "$APP" 2>/dev/null || true; APP=
  "$(dirname "$PY")/ray" stop --force >/dev/null 2>&1 || true
}
measure() {  # measure LABEL DIR [ARGS]
  start "$2" "${3:-}"
  $PY load_tests/serving_benchmark.py "${LOAD[@]}" --num-prompts 16 --output-len 16 >/dev/null
  record_run "$OUT" "$1" $PY load_tests/serving_benchmark.py "${LOAD[@]}" --label "$1"
  stop
}
"$(dirname "$PY")/ray" stop --force >/dev/null 2>&1 || true  # serve run would join a running cluster
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then
    measure "base round $r" "$WORK/base" "${BASE_ARGS:-}"; measure "new round $r" "$NEW_DIR" "${NEW_ARGS:-}"
  else
    measure "new round $r" "$NEW_DIR" "${NEW_ARGS:-}"; measure "base round $r" "$WORK/base" "${BASE_ARGS:-}"
  fi
done
record_run /dev/null compare_runs.py \
  $PY load_tests/compare_runs.py "$OUT" --ours new --peer base ${PLOT:+--plot "$PLOT"} \
  --title "$N requests, $C concurrent streams: $BASE against ${NEW:-the working tree}"
runs_exit
