#!/usr/bin/env bash
# The proxy on its own: an unchanged OpenAI-SDK agent runs through lgt-proxy against a local
# vLLM-compatible upstream, and the recorded calls are shown with SQL.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv-proxy/bin/python scripts/demo.py "$@"
