#!/usr/bin/env bash
# Side by side: this app and `vllm serve` (vLLM's CPU build in its own venv, never a project
# dependency) on the same model and the same load, measured with the same client
# (load_tests/serving_benchmark.py). Loopback only. Usage:
#   VLLM_PY=/tmp/vllm-venv/bin/python [ROUNDS=3] [RATE=40] [PROXY=1] [APP_ARGS="k=v ..."] [PLOT=f.png] \
#     [ISA=avx2] [SAMPLING="--temperature 0.7 --top-p 0.8"] load_tests/serve_vs_vllm.sh [MODEL_DIR] [NUM_PROMPTS] [CONCURRENCY]
# MODEL_DIR defaults to the default model. ROUNDS rounds alternate between the two (the order
# flips every round), so the drift of a shared machine hits both alike. vLLM stays up throughout
# (idle, its two processes take ~2% of a core); this app runs only for its own runs: its local
# Ray cluster idles at ~17% of a core (GCS, raylet, dashboard, Serve's controller and proxies,
# each Ray worker's 100 Hz signal check), which would be taken from vLLM's runs, so it is
# stopped before a vLLM run and started afresh, and warmed up, for its next one. One JSON
# line per run, then a summary line: medians, and the medians of the per-round ratios
# (pagedserve / vLLM). PROXY=1 adds ROUNDS runs of this app through Serve's Python proxy
# (RAY_SERVE_ENABLE_HA_PROXY=0) after vLLM has stopped. APP_ARGS go to build_app (e.g.
# "max_batch_size=1 batch_wait_ms=0" for one handle call per request). PLOT=file.png draws each
# run's tokens/s and p50 TTFT by server (load_tests/compare_runs.py, which also prints the
# summary). ISA=CLASS runs both servers as on a CPU of that class at most (kernels/cpu_isa.py:
# this project's C kernels, oneDNN, MKL and ATen capped; vLLM's own C++ kernels ignore the caps).
# A run with failed requests (serving_benchmark.py exits 1) does not stop the rounds; the summary
# names it (compare_runs.py), and the script exits with the first failing run's status, keeping
# the runs' JSON lines in the file it names (a failed warm-up stops it at once).
set -euo pipefail
cd "$(dirname "$0")/.."
source load_tests/runs.sh
PY=.venv/bin/python
MODEL=${1:-$($PY -m engine.models.default_model)}
N=${2:-128}
C=${3:-64}
VLLM_PY=${VLLM_PY:-/tmp/vllm-venv/bin/python}
VLLM_CLI=${VLLM_CLI:-../shared/peer/vllm_cli.py}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
if [ -n "${ISA:-}" ]; then  # both servers (and the dtype choice below) see the caps
  CAPS=$($PY -c "import sys; from kernels.cpu_isa import isa_env
print(' '.join(f'{k}={v}' for k, v in isa_env(sys.argv[1]).items()))" "$ISA")
  for kv in $CAPS; do export "${kv?}"; done
fi
# the dtype the app's dtype=auto takes for this checkpoint on this CPU: vLLM runs the same
DTYPE=$($PY -c "import sys, torch; from engine.loader import resolve_dtype
from engine.models.hf_config import HFConfig
print(str(resolve_dtype('auto', HFConfig.load(sys.argv[1]).torch_dtype, torch.device('cpu'))).split('.')[1])" "$MODEL")
RATE=${RATE:-inf}  # requests/s (Poisson arrivals); inf = as fast as CONCURRENCY allows
ROUNDS=${ROUNDS:-3}
# SAMPLING="--temperature 0.7 --top-p 0.8 --top-k 20 --repetition-penalty 1.05": sampled load
# (serving_benchmark.py's flags; greedy without it)
read -r -a SAMPLE_ARGS <<< "${SAMPLING:-}"
LOAD=(--num-prompts "$N" --max-concurrency "$C" --request-rate "$RATE" --input-len 128
      --output-len 64 --range-ratio 0.5 --prompt-mode tokens --vocab-size 700 --no-progress
      "${SAMPLE_ARGS[@]}")
OUT=$(mktemp /tmp/serve_vs_vllm.XXXXXX.jsonl)
PS_URL=http://127.0.0.1:8000
VLLM_URL=http://127.0.0.1:8100

warm_up() {
  $PY load_tests/serving_benchmark.py --url "$1" --num-prompts 16 --max-concurrency 16 \
    --input-len 128 --output-len 16 --prompt-mode tokens --vocab-size 700 --seed 1 --no-progress \
    >/dev/null
}
# run LABEL URL ROUND: each round's prompts are new (seed 100+ROUND), so no run is served from
# prompts an earlier one left in the prefix cache; both servers get the same prompts in a round
run() {
  record_run "$OUT" "$1" \
    $PY load_tests/serving_benchmark.py --url "$2" "${LOAD[@]}" --seed $((100 + $3)) --label "$1"
}
wait_up() { for _ in $(seq 1 240); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }

# This app, started the way users start it (`serve run`, which starts a local Ray cluster with
# its default ingress: HAProxy on port 8000 forwarding to the Router's own HTTP server), with
# the README's defaults: one Worker taking the machine's cores, dtype auto (bfloat16 only where
# the CPU has it natively; vLLM gets the same dtype), batcher defaults.
start_app() {  # start_app [ENV=VALUE ...]
  set -m  # its own job: a script's background jobs otherwise ignore SIGINT (serve run's Ctrl-C)
  # shellcheck disable=SC2086  # APP_ARGS is a list of key=value words
  env "$@" .venv/bin/serve run serve_app:build_app model="$MODEL" max_model_len=2048 \
    ${APP_ARGS:-} >/tmp/serve_vs_vllm.app.log 2>&1 &
  APP=$!
  set +m
}
stop_app() {
  kill -INT "$APP"  # serve run shuts the app and its local cluster down
  for _ in $(seq 1 60); do kill -0 "$APP" 2>/dev/null || break; sleep 0.5; done
  kill -9 "$APP" 2>/dev/null || true; wait "$APP" 2>/dev/null || true
  APP=
}
trap 'kill ${APP:-} 2>/dev/null || true; [ -n "${VLLM:-}" ] && kill $VLLM 2>/dev/null || true' EXIT

# vLLM's CPU build on the same model, its torch threads bound to the two cores
VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  "$VLLM_PY" "$VLLM_CLI" serve "$MODEL" --host 127.0.0.1 --port 8100 --dtype "$DTYPE" \
  --max-model-len 2048 >/tmp/serve_vs_vllm.vllm.log 2>&1 &
VLLM=$!
wait_up $VLLM_URL
warm_up $VLLM_URL
app_up() { start_app; wait_up $PS_URL; warm_up $PS_URL; }
for r in $(seq 1 "$ROUNDS"); do  # odd rounds: this app first (then stopped), even: vLLM first
  if [ $((r % 2)) -eq 1 ]; then
    [ -n "${APP:-}" ] || app_up
    run "pagedserve round $r" $PS_URL "$r"; stop_app; run "vllm round $r" $VLLM_URL "$r"
  else
    run "vllm round $r" $VLLM_URL "$r"; app_up; run "pagedserve round $r" $PS_URL "$r"
  fi
done
kill $VLLM; wait $VLLM 2>/dev/null || true; VLLM=
[ -z "${APP:-}" ] || stop_app

if [ "${PROXY:-0}" = 1 ]; then  # the same app through Serve's Python proxy
  sleep 3
  start_app RAY_SERVE_ENABLE_HA_PROXY=0
  wait_up $PS_URL
  warm_up $PS_URL
  for r in $(seq 1 "$ROUNDS"); do run "pagedserve-serve-proxy round $r" $PS_URL "$r"; done
  stop_app
fi

record_run /dev/null compare_runs.py $PY load_tests/compare_runs.py "$OUT" ${PLOT:+--plot "$PLOT"} \
  --title "$N requests, $C concurrent streams, rate $RATE/s; each dot one run, bar: median"
runs_exit "$OUT"
rm -f "$OUT"
