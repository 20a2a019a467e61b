#!/usr/bin/env bash
# Run the test suite (builds the environments first if needed). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv-proxy/bin/python -m pytest -q "$@"
