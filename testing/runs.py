"""``lgt-train`` in tests and benchmarks: a run config for the arith example (``write_config``), the CLI
run as a subprocess of this interpreter (``lgt_train`` for ``lgt-train run``, ``lgt_train_cmd`` for any
command, its output captured; ``lgt_train_shown`` for a benchmark's stage, its output on the terminal),
the environment they run in (``trainer_env``), and what a run directory holds (``metrics``,
``trained_ids``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout (testing/ sits beside examples/ and tests/)


def write_config(tmp_path: Path, model: Path, *, engine_url: str | None = None, **over) -> Path:
    """``tmp_path/run.yaml``: the arith example for 3 steps, ``over`` replacing top-level keys;
    ``engine_url``: a running engine the run uses (``engine.url``) instead of starting its own."""
    import yaml

    cfg = {
        "name": "t", "model": {"path": str(model)}, "tasks": str(ROOT / "examples/arith/tasks.jsonl"),
        "agent": {"command": [sys.executable, str(ROOT / "examples/arith/agent.py")],
                  "env": {"OPENAI_BASE_URL": "https://api.openai.invalid/v1", "OPENAI_API_KEY": "sk-x"},
                  "python_preload": ["openai"], "timeout_s": 90},
        "group_size": 4, "batch_groups": 2, "max_inflight": 16, "steps": 3, "max_staleness": 1,
        "engine": {"max_model_len": 256, **({"url": engine_url} if engine_url else {})},
        "backend": {"lr": 1e-3}, "algorithm": {"sample_mode": "exact"},
    }
    cfg.update(over)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def lgt_train(*args: str, env: dict | None = None, timeout: float = 420) -> subprocess.CompletedProcess:
    return lgt_train_cmd("run", *args, env=env, timeout=timeout)


def trainer_env(env: dict | None = None) -> dict[str, str]:
    """This environment with this interpreter's folder first on PATH (``lgt-proxy`` and the agents'
    ``python`` found beside it), ``env`` on top."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **(env or {})}


def lgt_train_cmd(*args: str, env: dict | None = None, timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lgt.trainer.cli", *args], capture_output=True,
                          text=True, env=trainer_env(env), timeout=timeout)


def lgt_train_shown(*args: str) -> None:
    """``lgt-train ARGS`` as a benchmark's stage: the command on stderr, its output on this terminal,
    CalledProcessError when it fails."""
    print(f"$ lgt-train {' '.join(args)}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "lgt.trainer.cli", *args], check=True, env=trainer_env())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def trained_ids(rows: list[dict]) -> list[str]:
    return [sid for r in rows for sid in r["sample_ids"]]
