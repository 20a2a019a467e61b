#!/usr/bin/env bash
# Run the test suite (builds the environments first if needed). Extra arguments go to pytest.
# Three environments, three runs: tests/ in the proxy's (.venv-proxy), tests/trainer/ in the trainer's
# (.venv: torch, transformers, vLLM), tests/verl/ in the verl backend's (.venv-verl). Test paths given
# as arguments go to the run they belong to; other arguments (-k, -x, ...) to each.
# Each run ends with its ten slowest tests (--durations=10).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
flags=() proxy_paths=() trainer_paths=() verl_paths=()
for a in "$@"; do
  case "$a" in
    tests/trainer|tests/trainer/*) trainer_paths+=("$a") ;;
    tests/verl|tests/verl/*) verl_paths+=("$a") ;;
    tests/*) proxy_paths+=("$a") ;;
    *) flags+=("$a") ;;
  esac
done
if [ ${#proxy_paths[@]} = 0 ] && [ ${#trainer_paths[@]} = 0 ] && [ ${#verl_paths[@]} = 0 ]; then
  proxy_paths=(tests --ignore=tests/trainer --ignore=tests/verl) trainer_paths=(tests/trainer)
  if [ "${LGT_SKIP_VERL:-0}" != 1 ]; then verl_paths=(tests/verl); fi
fi
rc=0
if [ ${#proxy_paths[@]} -gt 0 ]; then
  .venv-proxy/bin/python -m pytest -q --durations=10 "${flags[@]}" "${proxy_paths[@]}" || rc=$?
fi
if [ ${#trainer_paths[@]} -gt 0 ]; then
  .venv/bin/python -m pytest -q --durations=10 "${flags[@]}" "${trainer_paths[@]}" || rc=$?
fi
if [ ${#verl_paths[@]} -gt 0 ]; then
  .venv-verl/bin/python -m pytest -q --durations=10 "${flags[@]}" "${verl_paths[@]}" || rc=$?
fi
exit $rc
