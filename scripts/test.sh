#!/usr/bin/env bash
# Run the test suite (builds the environments first if needed). Extra arguments go to pytest.
# Two environments, two runs: tests/ in the proxy's (.venv-proxy) and tests/trainer/ in the trainer's
# (.venv: torch, transformers, vLLM). Test paths given as arguments go to the run they belong to;
# other arguments (-k, -x, ...) to both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
flags=() proxy_paths=() trainer_paths=()
for a in "$@"; do
  case "$a" in
    tests/trainer|tests/trainer/*) trainer_paths+=("$a") ;;
    tests/*) proxy_paths+=("$a") ;;
    *) flags+=("$a") ;;
  esac
done
if [ ${#proxy_paths[@]} = 0 ] && [ ${#trainer_paths[@]} = 0 ]; then
  proxy_paths=(tests --ignore=tests/trainer) trainer_paths=(tests/trainer)
fi
rc=0
if [ ${#proxy_paths[@]} -gt 0 ]; then
  .venv-proxy/bin/python -m pytest -q "${flags[@]}" "${proxy_paths[@]}" || rc=$?
fi
if [ ${#trainer_paths[@]} -gt 0 ]; then
  .venv/bin/python -m pytest -q "${flags[@]}" "${trainer_paths[@]}" || rc=$?
fi
exit $rc
