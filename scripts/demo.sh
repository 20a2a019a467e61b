#!/usr/bin/env bash
# The main job on the embedded default: train an unmodified OpenAI-SDK agent (examples/arith/agent.py)
# with RL on CPU at two-digit additions that carry (examples/carry) — a tiny model built here (nothing
# downloaded), vLLM's CPU build serving it, lgt-proxy recording every call, collocated async GRPO, and
# held-out problems evaluated before and after. A few minutes; the run directory holds metrics, plots, a
# report and checkpoints. Extra arguments go to `lgt-train run` (e.g. --mode sync, --steps 5).
set -euo pipefail
cd "$(dirname "$0")/.."
# only the environments the demo uses: the proxy's and the trainer's (not verl's, not the example agents')
LGT_SKIP_VERL=1 LGT_SKIP_AGENTS=1 bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"  # the agent's interpreter (it needs the openai package) and lgt-train
exec lgt-train run examples/carry/run.yaml "$@"
