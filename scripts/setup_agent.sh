#!/usr/bin/env bash
# Build an example agent's own environment: DIR/.venv from DIR/requirements.txt (Python >= 3.12), or
# DIR/node_modules from DIR/package-lock.json (npm ci).
#   bash scripts/setup_agent.sh examples/agents_sdk [examples/node_agent ...]
# The agent's environment is not lgt's: lgt-train starts DIR/.venv/bin/python (or node) as the agent
# command. Idempotent: rebuilt only when requirements.txt (package-lock.json) changed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/find_python.sh
py=$(find_python 3.12 3.13)
for dir in "$@"; do
  if [ -f "$dir/package-lock.json" ]; then
    lock="$dir/package-lock.json" stamp="$dir/node_modules/.lgt-installed"
    want=$(sha256sum "$lock" | cut -c1-16)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then continue; fi
    command -v npm >/dev/null 2>&1 || { echo "setup_agent: $dir needs npm (Node.js), which is not installed" >&2; exit 2; }
    echo "setup_agent: npm ci in $dir" >&2
    (cd "$dir" && npm ci --no-audit --no-fund --silent)
    echo "$want" > "$stamp"
    continue
  fi
  req="$dir/requirements.txt"
  [ -f "$req" ] || { echo "setup_agent: $dir has neither requirements.txt nor package-lock.json" >&2; exit 2; }
  venv="$dir/.venv" stamp="$dir/.venv/.lgt-installed"
  want=$(sha256sum "$req" | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then continue; fi
  echo "setup_agent: building $venv ($(cat "$req" | grep -v '^#' | tr '\n' ' '))" >&2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install -q -r "$req" 2> >(grep -v "^WARNING: Location" >&2)
  echo "$want" > "$stamp"
done
