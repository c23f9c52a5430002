#!/usr/bin/env bash
# Side by side: this app and `vllm serve` (vLLM's CPU build in its own venv, never a project
# dependency) on the same model and the same load, measured with the same client
# (load_tests/serving_benchmark.py). Loopback only. Usage:
#   VLLM_PY=/tmp/vllm-venv/bin/python load_tests/serve_vs_vllm.sh [MODEL_DIR] [NUM_PROMPTS] [CONCURRENCY]
# MODEL_DIR defaults to the default model. Prints one JSON line per server (pagedserve through
# Serve's proxy, pagedserve with direct ingress, vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
MODEL=${1:-$($PY -m engine.default_model)}
N=${2:-128}
C=${3:-64}
VLLM_PY=${VLLM_PY:-/tmp/vllm-venv/bin/python}
VLLM_CLI=${VLLM_CLI:-../shared/peer/vllm_cli.py}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
LOAD=(--num-prompts "$N" --max-concurrency "$C" --input-len 128 --output-len 64 --range-ratio 0.5
      --prompt-mode tokens --vocab-size 700 --seed 0 --no-progress)

wait_up() { for _ in $(seq 1 240); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }

# --- this app: one Worker with both cores' worth of threads, one Router; run twice: through
# Serve's HTTP proxy (port 8000), and in Ray Serve's throughput-optimized mode
# (RAY_SERVE_THROUGHPUT_OPTIMIZED=1: the Router replica serves HTTP itself, "direct ingress",
# on the first port from RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, 30000 by default)
run_app() {  # run_app LABEL PORT [ENV=VALUE ...]
  local label=$1 port=$2; shift 2
  env "$@" $PY - "$MODEL" <<'PY' &
import sys, time, ray
from ray import serve
ray.init(address="local", include_dashboard=False, num_cpus=4)
serve.start(http_options={"host": "127.0.0.1", "port": 8000})
from serve_app import build_app
serve.run(build_app({"model": sys.argv[1], "dtype": "bfloat16", "max_model_len": 2048,
                     "num_threads": 2, "worker_num_cpus": 2, "max_batch_size": 32,
                     "batch_wait_ms": 2}), name="bench", route_prefix="/")
time.sleep(10**6)
PY
  APP=$!
  wait_up "http://127.0.0.1:$port"
  $PY load_tests/serving_benchmark.py --url "http://127.0.0.1:$port" "${LOAD[@]}" --label "$label"
  kill $APP; wait $APP 2>/dev/null || true
  sleep 3
}
trap 'kill ${APP:-} 2>/dev/null || true; [ -n "${VLLM:-}" ] && kill $VLLM 2>/dev/null || true' EXIT
run_app pagedserve 8000
run_app pagedserve-direct-ingress 30000 RAY_SERVE_THROUGHPUT_OPTIMIZED=1

# --- vLLM's CPU build on the same model
VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  "$VLLM_PY" "$VLLM_CLI" serve "$MODEL" --host 127.0.0.1 --port 8100 --dtype bfloat16 \
  --max-model-len 2048 >/tmp/serve_vs_vllm.vllm.log 2>&1 &
VLLM=$!
wait_up http://127.0.0.1:8100
$PY load_tests/serving_benchmark.py --url http://127.0.0.1:8100 "${LOAD[@]}" --label vllm
