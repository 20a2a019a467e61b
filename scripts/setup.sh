#!/usr/bin/env bash
# Build lgt's environments; idempotent (does nothing when pyproject.toml has not changed).
#   .venv-proxy  the proxy's own light environment: mitmproxy, aiohttp, pyarrow, duckdb, click
#                (+ test clients). Python >= 3.12 so that mitmproxy 12 (h11 0.16) is used; on 3.11
#                the newest mitmproxy is 11.0.2, which pins the pre-advisory h11<=0.14.
# The trainer's environment (torch) is separate: the proxy is deployed without it.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local c
  for c in python3.13 python3.12; do
    if command -v "$c" >/dev/null 2>&1; then command -v "$c"; return; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[23]\.[0-9]+$' | sort -rV); do
      c="$(pyenv prefix "$v")/bin/python${v%.*}"
      if [ -x "$c" ]; then echo "$c"; return; fi
    done
  fi
  command -v python3
}

venv=.venv-proxy
stamp="$venv/.lgt-installed"
want="$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
py="$(find_python)"
echo "setup: building $venv with $("$py" --version 2>&1) ($py)" >&2
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
extra=()
if ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  echo "setup: warning: no Python >= 3.12 found; using mitmproxy 11 (h11<=0.14) on $("$py" --version)" >&2
  extra=("openai<3")
fi
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
"$venv/bin/python" -m pip install -q -e ".[proxy,test]" "${extra[@]}"
echo "$want" > "$stamp"
echo "setup: $venv ready" >&2
