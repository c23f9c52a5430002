#!/usr/bin/env bash
# Side by side: this app and `vllm serve` (vLLM's CPU build in its own venv, never a project
# dependency) on the same model and the same load, measured with the same client
# (load_tests/serving_benchmark.py). Loopback only. Usage:
#   VLLM_PY=/tmp/vllm-venv/bin/python [ROUNDS=3] [RATE=40] load_tests/serve_vs_vllm.sh [MODEL_DIR] [NUM_PROMPTS] [CONCURRENCY]
# MODEL_DIR defaults to the default model. Each server gets a short warm-up load, then ROUNDS
# (default 1) measured runs; one JSON line per run (pagedserve with its default ingress,
# pagedserve through Serve's Python proxy, vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
MODEL=${1:-$($PY -m engine.default_model)}
N=${2:-128}
C=${3:-64}
VLLM_PY=${VLLM_PY:-/tmp/vllm-venv/bin/python}
VLLM_CLI=${VLLM_CLI:-../shared/peer/vllm_cli.py}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
RATE=${RATE:-inf}  # requests/s (Poisson arrivals); inf = as fast as CONCURRENCY allows
LOAD=(--num-prompts "$N" --max-concurrency "$C" --request-rate "$RATE" --input-len 128
      --output-len 64 --range-ratio 0.5 --prompt-mode tokens --vocab-size 700 --seed 0 --no-progress)

ROUNDS=${ROUNDS:-1}

measure() {  # measure LABEL URL: a warm-up, then ROUNDS runs of the load
  $PY load_tests/serving_benchmark.py --url "$2" --num-prompts 16 --max-concurrency 16 \
    --input-len 128 --output-len 16 --prompt-mode tokens --vocab-size 700 --seed 1 --no-progress \
    >/dev/null
  for r in $(seq 1 "$ROUNDS"); do
    $PY load_tests/serving_benchmark.py --url "$2" "${LOAD[@]}" --label "$1 round $r"
  done
}

wait_up() { for _ in $(seq 1 240); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }

# --- this app, started the way users start it (`serve run`, which starts a local Ray cluster):
# once with its default ingress (HAProxy on port 8000 forwarding to the Router's own HTTP
# server), once through Serve's Python proxy (RAY_SERVE_ENABLE_HA_PROXY=0). One Worker with
# two torch threads; the Router and the Worker reserve the machine's CPUs between them.
run_app() {  # run_app LABEL [ENV=VALUE ...]
  local label=$1; shift
  set -m  # its own job: a script's background jobs otherwise ignore SIGINT (serve run's Ctrl-C)
  env "$@" .venv/bin/serve run serve_app:build_app model="$MODEL" dtype=bfloat16 \
    max_model_len=2048 num_threads=2 worker_num_cpus=1.5 router_num_cpus=0.5 \
    max_batch_size=32 batch_wait_ms=2 >/tmp/serve_vs_vllm.app.log 2>&1 &
  APP=$!
  set +m
  wait_up http://127.0.0.1:8000
  measure "$label" http://127.0.0.1:8000
  kill -INT $APP  # serve run shuts the app and its local cluster down
  for _ in $(seq 1 60); do kill -0 $APP 2>/dev/null || break; sleep 0.5; done
  kill -9 $APP 2>/dev/null || true; wait $APP 2>/dev/null || true
  sleep 3
}
trap 'kill ${APP:-} 2>/dev/null || true; [ -n "${VLLM:-}" ] && kill $VLLM 2>/dev/null || true' EXIT
run_app pagedserve
run_app pagedserve-serve-proxy RAY_SERVE_ENABLE_HA_PROXY=0

# --- vLLM's CPU build on the same model
VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  "$VLLM_PY" "$VLLM_CLI" serve "$MODEL" --host 127.0.0.1 --port 8100 --dtype bfloat16 \
  --max-model-len 2048 >/tmp/serve_vs_vllm.vllm.log 2>&1 &
VLLM=$!
wait_up http://127.0.0.1:8100
measure vllm http://127.0.0.1:8100
