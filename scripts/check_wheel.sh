#!/usr/bin/env bash
# The package as users install it, checked from outside the checkout (CI runs this):
#   1. `pip wheel` builds the wheel (with build isolation, as `pip install .` does) from a copy
#      of the checkout's files, and a fresh venv installs it (not editable) with its grafana
#      extra and the versions of constraints-cpu.txt;
#   2. every bundled autoscaling policy loads by name, and `python -m deploy.grafana --help` runs;
#   3. `serve run serve_app:app` starts the default model (built and compiled into a fresh cache):
#      GET /health answers 200 and POST /v1/completions a completion; then Ctrl-C (SIGINT to
#      its process group) stops it, and no process of its Ray cluster is left.
# Every wait has a deadline (START_S for the app, default 300 s). Needs port 8000 free.
# Usage: scripts/check_wheel.sh        PYTHON=python3.11 to choose the interpreter, KEEP=1 to
#                                      keep the work folder (venv, wheel, serve.log)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/check-wheel.XXXXXX)
venv="$work/venv"
start_s=${START_S:-300}
app=""

say() { echo "check_wheel: $*"; }
fail() { say "FAILED: $*" >&2; exit 1; }

# Processes of this run's Ray cluster: their command lines name its temp folder, under $work.
leftovers() { pgrep -f -- "$work/" | grep -vx "$$" || true; }

# Ctrl-C: SIGINT to serve run's process group; serve run then shuts the app and its cluster down.
stop_app() {
  [ -n "$app" ] || return 0
  local pid=$app
  app=""
  kill -INT -- "-$pid" 2>/dev/null || true
  for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  say "serve run was still running 60 s after SIGINT: killing it"
  kill -KILL -- "-$pid" 2>/dev/null || true
  return 1
}

cleanup() {
  local rc=$?
  if [ -n "$app" ]; then
    say "serve run's log ends with:"
    tail -n 40 "$work/serve.log" || true
    stop_app || true
  fi
  local pids; pids=$(leftovers)
  # shellcheck disable=SC2086  # a list of pids
  [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  if [ -n "${KEEP:-}" ]; then say "kept $work"; else rm -rf "$work"; fi
  exit "$rc"
}
trap cleanup EXIT

say "building the wheel"
mkdir "$work/src"
if git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
  (cd "$root" && git ls-files -z --cached --others --exclude-standard \
     | xargs -0 sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh \
     | tar -cf - --null -T -) | tar -xf - -C "$work/src"
else
  tar -C "$root" --exclude=./.venv --exclude=./build --exclude='*.egg-info' -cf - . \
    | tar -xf - -C "$work/src"
fi
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheel=$(echo "$work"/dist/pagedserve-*.whl)
[ -f "$wheel" ] || fail "no wheel in $work/dist"
say "installing $(basename "$wheel") with its grafana extra into a fresh venv"
"$venv/bin/python" -m pip install -q -c "$root/constraints-cpu.txt" "$wheel[grafana]"

cd "$work"  # outside the checkout: nothing may come from its source tree
unset PYTHONPATH
policies=$(cd "$root/deploy/autoscaling" && ls -- *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')
"$venv/bin/python" - "$venv" $policies <<'EOF'
import sys
from pathlib import Path

import serve_app
from serve_app.autoscaling.config import bundled_policies
from serve_app.config import AppConfig

venv, expected = Path(sys.argv[1]).resolve(), sys.argv[2:]
where = Path(serve_app.__file__).resolve()
if not where.is_relative_to(venv):
    sys.exit(f"serve_app was imported from {where}, not from the venv {venv}")
if bundled_policies() != sorted(expected):
    sys.exit(f"bundled policies {bundled_policies()} != the checkout's {sorted(expected)}")
for name in expected:  # as `serve run serve_app:build_app autoscaling=<name>` does
    AppConfig.model_validate({"autoscaling": name})
print(f"check_wheel: policies load by name from the wheel: {', '.join(expected)}")
EOF
"$venv/bin/python" -m deploy.grafana --help | grep -q -- "--prometheus-url" \
  || fail "python -m deploy.grafana --help"
say "python -m deploy.grafana --help runs"

say "starting serve run serve_app:app (deadline ${start_s} s)"
"$venv/bin/python" -c "import socket; socket.create_server(('127.0.0.1', 8000)).close()" 2>/dev/null \
  || fail "port 8000 is in use on 127.0.0.1 (serve run's port): stop what listens there"
mkdir "$work/ray"
# A process group of its own, as in a terminal (without job control a background job would
# ignore SIGINT, and serve run would never see the Ctrl-C).
set -m
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_TMPDIR="$work/ray" PAGEDSERVE_CACHE_DIR="$work/cache" \
  "$venv/bin/serve" run serve_app:app >"$work/serve.log" 2>&1 </dev/null &
app=$!
set +m
"$venv/bin/python" - "$start_s" "$app" <<'EOF' || fail "the app did not answer"
import json
import os
import sys
import time
import urllib.error
import urllib.request

deadline, pid = time.monotonic() + float(sys.argv[1]), int(sys.argv[2])
base = "http://127.0.0.1:8000"
while True:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("check_wheel: serve run exited")
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            if r.status == 200:
                break
    except (OSError, urllib.error.URLError):
        pass
    if time.monotonic() > deadline:
        sys.exit(f"check_wheel: GET /health was not 200 within {sys.argv[1]} s")
    time.sleep(1)
body = {"model": "pagedserve-default", "prompt": "Hello, my name is", "max_tokens": 8}
req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    out = json.load(r)
tokens = out["usage"]["completion_tokens"]
if not (out["choices"][0]["text"] and 0 < tokens <= 8):
    sys.exit(f"check_wheel: unexpected completion {out}")
print(f"check_wheel: /health 200; /v1/completions gave {tokens} tokens")
EOF

say "stopping the app (SIGINT)"
stop_app || fail "serve run did not stop on SIGINT"
for _ in $(seq 30); do [ -z "$(leftovers)" ] && break; sleep 1; done
[ -z "$(leftovers)" ] || fail "processes of the app's Ray cluster outlived serve run: $(leftovers | tr '\n' ' ')"
say "ok"
