#!/usr/bin/env bash
# What the lent GPU machine can run of lgt in one call (its image: torch, transformers, pyarrow — no
# vLLM, verl, Ray, mitmproxy or DuckDB, and no network): the torch backend's bf16 training step on the
# 0.5b preset next to a bare loop on the same batches (bench/trainer_throughput.py), and the CUDA-IPC
# weight hand-off between two processes next to the host path (bench/ipc_handoff.py).
#
#   bash bench/device_check.sh            # PYTHON=… to pick the interpreter
#
# lgt is imported from this checkout without installing it (a folder named lgt whose proxy, store and
# trainer are links here); modules lgt imports at the top but these two never call (duckdb, orjson)
# are empty stand-ins when the machine lacks them.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
shim=$(mktemp -d)
mkdir -p "$shim/lgt" "$shim/stubs"
for d in proxy store trainer; do ln -s "$PWD/$d" "$shim/lgt/$d"; done
for m in duckdb orjson; do "$py" -c "import $m" 2>/dev/null || : > "$shim/stubs/$m.py"; done
export PYTHONPATH="$shim:$shim/stubs${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")'
"$py" bench/trainer_throughput.py --models "${MODELS:-0.5b}" --device "${DEVICE:-cuda}" --dtype bfloat16 \
    --samples 64 --min-len 256 --max-len "${MAX_LEN:-2048}" --micro-batch-tokens 16384 --repeats 5 --threads 8
if [ "${DEVICE:-cuda}" = cuda ]; then "$py" bench/ipc_handoff.py --preset 0.5b --dtype bfloat16 --repeats 5; fi
