#!/usr/bin/env bash
# The GPU path in one prepared run (one GPU, under 8 minutes): a Qwen2-0.5B-shaped model built here
# (nothing downloaded), then 3 collocated-async steps of `lgt-train run` on the arith agent with each
# backend (torch, verl), vLLM sharing the GPU (asleep while the trainer updates, weights pushed by CUDA
# IPC, bf16). Prints per backend: trained tokens/s, update, weight-sync and sleep/wake seconds.
#
#   LGT_PYTHON=/path/to/env/bin/python bench/gpu_check.sh     # an environment with lgt[gpu]: vllm, verl
#
# Needs CUDA, vLLM's GPU build and verl in one environment (on a GPU machine they share transformers),
# lgt-proxy's environment (.venv-proxy, or lgt-proxy on PATH / $LGT_PROXY_COMMAND). Written on a CPU
# machine; the figures in docs/trainer.md say whether it has run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${LGT_PYTHON:-python}
OUT=${LGT_GPU_CHECK_DIR:-/tmp/lgt-gpu-check}
mkdir -p "$OUT"
"$PY" -c 'import torch, vllm, verl; assert torch.cuda.is_available(), "no CUDA"' \
  || { echo "gpu_check: needs CUDA, vllm and verl in $PY" >&2; exit 2; }
export PATH="$(dirname "$PY"):$PATH"  # the agent's interpreter (the openai package) and lgt-train
start=$(date +%s)
"$PY" -m lgt.trainer.cli make-model "$OUT/model" --preset 0.5b --warm-start arith --seconds 60
for backend in torch verl; do
  extra=()
  if [ "$backend" = torch ]; then extra=(--set backend.dtype=bfloat16); fi
  "$PY" -m lgt.trainer.cli run examples/arith/run.yaml --steps 3 --run-dir "$OUT/run-$backend" \
    --set model.path="$OUT/model" --set model.make=null --set backend.name=$backend "${extra[@]}" \
    --set backend.lr=1e-5 --set engine.dtype=bfloat16 --set engine.gpu_memory_utilization=0.35 \
    --set engine.max_model_len=256 --set max_minutes=3
done
"$PY" - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
for backend in ("torch", "verl"):
    rows = [json.loads(l) for l in (out / f"run-{backend}" / "metrics.jsonl").read_text().splitlines() if l]
    later = rows[1:] or rows  # the first step pays for warm-up

    def med(key):
        return statistics.median(r.get(key, 0.0) for r in later)

    tokens = med("trained_tokens") or med("batch/tokens")
    print(f"{backend:5s} steps {len(rows)}  trained tokens/s {tokens / max(med('perf/train_s'), 1e-9):9.0f}  "
          f"update {med('perf/update_s'):.2f} s (train {med('perf/train_s'):.2f})  "
          f"weight sync {med('perf/sync_s'):.3f} s  sleep {med('perf/sleep_s'):.2f} s  "
          f"wake {med('perf/wake_s'):.2f} s  reward {rows[-1]['rollout/reward_mean']}")
EOF
echo "gpu_check: $(( $(date +%s) - start )) s"
