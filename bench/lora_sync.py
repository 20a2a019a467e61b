"""A LoRA adapter into the running engine vs every weight of the model, side by side in one run.

    .venv/bin/python bench/lora_sync.py           # the demo model and SmolLM2-135M, if in runs/models
    .venv/bin/python bench/lora_sync.py --model DIR --model DIR2 --rank 16 --syncs 5

For each model: one vLLM engine started for adapters (``lora_rank``), and a peft LoRA on every linear
projection of the model in transformers. Each round moves every lora_B (as a training step would), then
puts that version into the engine both ways, in an order that alternates every round:

- **adapter**: :class:`lgt.trainer.serving.sync.Adapters` — ``save_adapter`` (peft's
  ``save_pretrained`` into a fresh folder) and ``POST /v1/load_lora_adapter`` under ``policy-v<N>``,
  then the older adapter unloaded (what a LoRA run does after each step);
- **full**: ``Engine.update_weights`` with every named tensor of the merged model (the path a full
  fine-tuning run takes after each step: pause, load, reset the prefix cache, resume; the CPU default
  transport, shared memory). The merge itself is not timed.

The first round checks the adapter's logprobs against transformers with the adapter applied, the last
the full weights' against the merged model. Prints the median seconds of each and the ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lgt.trainer.serving.engine import Engine
from lgt.trainer.serving.launch import EngineConfig
from lgt.trainer.serving.sync import Adapters

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS = (REPO / "runs" / "models" / "carry-demo", REPO / "runs" / "models" / "smollm2-135m-instruct")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOLERANCE = 1e-3


def _engine_logprobs(engine: Engine, model: str, ids: list[int]) -> torch.Tensor:
    with httpx.Client(trust_env=False, timeout=300) as http:
        resp = http.post(f"{engine.url}/completions", json={"model": model, "prompt": ids, "max_tokens": 1,
                                                            "temperature": 0, "prompt_logprobs": 0})
    resp.raise_for_status()
    steps = resp.json()["choices"][0]["prompt_logprobs"]
    return torch.tensor([s[str(t)]["logprob"] for s, t in zip(steps[1:], ids[1:])])


def _hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def measure(model_dir: Path, *, rank: int = 8, n_syncs: int = 5, max_model_len: int = 512) -> dict[str, Any]:
    """Seconds per sync each way (lists), the adapter's and the weights' bytes, the checks' errors."""
    work = Path(tempfile.mkdtemp(prefix="lgt-bench-lora-"))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in base.parameters())
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    n_lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    ids = [1 + (7 * i) % 200 for i in range(24)]
    gen = torch.Generator().manual_seed(0)
    engine = Engine.start(EngineConfig(model=model_dir, max_model_len=max_model_len, lora_rank=rank,
                                       log_path=work / "vllm.log"))
    sync = Adapters(model.save_pretrained, work / "adapters", "policy")
    out: dict[str, Any] = {"model": model_dir.name, "params": n_params, "lora_params": n_lora,
                           "adapter": [], "save": [], "load": [], "full": []}
    try:
        for n in range(1, n_syncs + 1):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.add_(torch.randn(p.shape, generator=gen) * 0.02)
            merged = copy.deepcopy(model).merge_and_unload()
            named = dict(merged.named_parameters())
            for way in (("adapter", "full") if n % 2 else ("full", "adapter")):
                t = time.perf_counter()
                if way == "adapter":
                    sync.update(engine, n)
                    out["save"].append(sync.save_s)
                    out["load"].append(sync.load_s)
                else:
                    engine.update_weights(named.items())
                    out["full_bytes"] = engine.last_sync.nbytes
                out[way].append(time.perf_counter() - t)
                if n == 1 and way == "adapter" and not out["full"]:  # the base still the checkpoint's
                    err = (_engine_logprobs(engine, sync.current, ids) - _hf_logprobs(model, ids)).abs().max()
                    out["adapter_error"] = float(err)
            out["adapter_bytes"] = (sync.loaded[sync.current] / "adapter_model.safetensors").stat().st_size
            if n == n_syncs:
                err = (_engine_logprobs(engine, "policy", ids) - _hf_logprobs(merged, ids)).abs().max()
                out["full_error"] = float(err)
    finally:
        sync.close()
        engine.stop()
    return out


def report(r: dict[str, Any]) -> str:
    med = {k: statistics.median(r[k]) for k in ("adapter", "save", "load", "full")}
    lines = [f"{r['model']}: {r['params'] / 1e6:.1f}M parameters, LoRA {r['lora_params'] / 1e6:.2f}M "
             f"({r['adapter_bytes'] / 1e6:.2f} MB adapter file vs {r['full_bytes'] / 1e6:.1f} MB of weights)",
             f"  adapter sync  {med['adapter'] * 1e3:8.1f} ms  (save_adapter {med['save'] * 1e3:.1f} ms, "
             f"load {med['load'] * 1e3:.1f} ms, older unloaded)",
             f"  full weights  {med['full'] * 1e3:8.1f} ms  (update_weights, shared memory)",
             f"  ratio         {med['full'] / med['adapter']:8.1f}x  full / adapter (medians of "
             f"{len(r['adapter'])})",
             f"  checks: adapter vs transformers {r.get('adapter_error', float('nan')):.1e}, "
             f"full vs merged {r.get('full_error', float('nan')):.1e} (max |logprob| error)"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, action="append",
                    help="an HF causal LM directory (repeatable; default: the demo model and SmolLM2-135M "
                         "under runs/models, those that exist)")
    ap.add_argument("--rank", type=int, default=8, help="the adapter's rank")
    ap.add_argument("--syncs", type=int, default=5, help="syncs to time each way")
    args = ap.parse_args()
    models = args.model or [m for m in DEFAULT_MODELS if (m / "config.json").exists()]
    if not models:
        ap.error("no model: give --model DIR (runs/models/carry-demo is made by the demo, "
                 "runs/models/smollm2-135m-instruct by model.make: {pretrained: smollm2-135m-instruct})")
    results = [measure(m, rank=args.rank, n_syncs=args.syncs) for m in models]
    print(f"\nLoRA rank {args.rank} on every linear projection; {args.syncs} syncs each way per model\n")
    for r in results:
        print(report(r))
        bad = [k for k in ("adapter_error", "full_error") if r.get(k, 0.0) > TOLERANCE]
        if bad:
            raise SystemExit(f"{r['model']}: the engine's logprobs differ from transformers' "
                             f"({', '.join(bad)})")


if __name__ == "__main__":
    main()
