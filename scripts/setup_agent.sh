#!/usr/bin/env bash
# Build an example agent's own environment: DIR/.venv from DIR/requirements.txt (Python >= 3.12).
#   bash scripts/setup_agent.sh examples/agents_sdk [examples/anthropic_sdk ...]
# The agent's environment is not lgt's: lgt-train starts DIR/.venv/bin/python as the agent command.
# Idempotent: rebuilt only when requirements.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/find_python.sh
py=$(find_python 3.12 3.13)
for dir in "$@"; do
  req="$dir/requirements.txt"
  [ -f "$req" ] || { echo "setup_agent: $req does not exist" >&2; exit 2; }
  venv="$dir/.venv" stamp="$dir/.venv/.lgt-installed"
  want=$(sha256sum "$req" | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then continue; fi
  echo "setup_agent: building $venv ($(cat "$req" | grep -v '^#' | tr '\n' ' '))" >&2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install -q -r "$req" 2> >(grep -v "^WARNING: Location" >&2)
  echo "$want" > "$stamp"
done
