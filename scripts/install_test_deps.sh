#!/usr/bin/env bash
# The programs the test suite runs besides Python packages (`make test` calls this first):
#   prometheus  tests/serve/test_metrics.py scrapes the app with a real Prometheus server
#   cc          tests/kernels/test_cpu_kernels.py compiles kernels/csrc (skipped without one)
# Missing ones are installed with Debian's apt-get when this runs as root; otherwise it prints
# one line saying what to install, and exits 1 before any test runs.
set -euo pipefail

packages=()
command -v prometheus >/dev/null || packages+=(prometheus)
if [ -z "${CC:-}" ] && ! command -v cc >/dev/null; then
  packages+=(gcc libc6-dev)
fi
[ ${#packages[@]} -eq 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing what the tests run: ${packages[*]} (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" \
    >/dev/null
  exit 0
fi
echo "make test needs ${packages[*]}: install with 'sudo apt-get install -y --no-install-recommends ${packages[*]}' (Debian/Ubuntu; elsewhere, put them on PATH), then rerun" >&2
exit 1
