"""Weight sync without a restart, by each transport, vs a full vLLM restart, side by side in one run.

    .venv/bin/python bench/weight_sync.py                 # the tiny test model (built in a temp dir)
    .venv/bin/python bench/weight_sync.py --size 10m      # a ~10M-parameter random Qwen2, same tokenizer
    .venv/bin/python bench/weight_sync.py --model DIR     # any HF causal LM directory

Starts the engine once, then ``n_syncs`` rounds: each round perturbs the weights in transformers and
pushes them with ``Engine.update_weights`` (pause -> reload -> reset prefix cache -> resume) once per
transport, in an order that rotates every round — ``disk`` (a safetensors file on disk, the path a
9B model would take without /dev/shm), ``file`` (the same file under /dev/shm: memory), ``shm`` (the
tensors copied once into a shared-memory segment the workers view in place: no file, no
serialisation; the CPU default) — and checks the engine's logprobs against transformers' after each.
Then restarts the engine the way one would without the sync (save the checkpoint, stop, start until
ready). Prints seconds per sync (total and parts) per transport, the restart's, and the ratios.
``measure(model_dir, n_syncs)`` returns the same numbers as a dict for other benches.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from lgt.testing.random_model import make_test_model
from lgt.trainer.serving.engine import Engine
from lgt.trainer.serving.launch import EngineConfig
from lgt.trainer.serving.weights import weights_dir

PROMPT_IDS = [1, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150]


def make_tiny(out: Path) -> Path:
    """The tests' tiny Qwen2 (lgt.testing.random_model) in ``out``."""
    return make_test_model(out)


def make_qwen2_10m(out: Path) -> Path:
    """A random Qwen2 of ~10M parameters (hidden 384, 6 layers) with the tiny model's tokenizer."""
    tiny = make_tiny(out.with_name(out.name + "-tok"))
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    base = Qwen2Config.from_pretrained(tiny)
    cfg = Qwen2Config(vocab_size=base.vocab_size, hidden_size=384, intermediate_size=1024,
                      num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=base.eos_token_id,
                      bos_token_id=base.bos_token_id, pad_token_id=base.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def _engine_logprobs(engine: Engine) -> torch.Tensor:
    with httpx.Client(trust_env=False) as http:
        resp = http.post(f"{engine.url}/completions", json={"model": "policy", "prompt": PROMPT_IDS,
                                                            "max_tokens": 1, "prompt_logprobs": 0})
    resp.raise_for_status()
    steps = resp.json()["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([s[str(t)]["logprob"] for s, t in zip(steps, PROMPT_IDS[1:])])


def _hf_logprobs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT_IDS])).logits[0].float(), dim=-1)
    return logp[torch.arange(len(PROMPT_IDS) - 1), torch.tensor(PROMPT_IDS[1:])]


def measure(model_dir: Path, n_syncs: int = 5, *, max_model_len: int = 512) -> dict[str, Any]:
    """Seconds of ``n_syncs`` weight syncs vs one restart of the engine on ``model_dir`` (a copy is
    restarted from, with the last synced weights). Keys: params, sync_* (medians: total, write, pause, load,
    reset, resume; sync_all: every total), first_start, restart (save + stop + start), restart_save,
    restart_stop, restart_start, ratio (restart / median sync), max_logprob_error (engine vs
    transformers float32 after the last sync)."""
    model_dir = Path(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    work = Path(tempfile.mkdtemp(prefix="lgt-bench-sync-"))
    cfg = EngineConfig(model=model_dir, max_model_len=max_model_len, log_path=work / "vllm.log")
    gen = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    engine = Engine.start(cfg)
    first_start = time.perf_counter() - t
    disk = work / "weights"
    disk.mkdir()
    ways = {"disk": ("file", disk), "file": ("file", weights_dir()), "shm": ("shm", None)}
    timings: dict[str, list] = {way: [] for way in ways}
    error = 0.0
    try:
        for i in range(n_syncs):
            order = list(ways)[i % len(ways):] + list(ways)[:i % len(ways)]
            for way in order:
                transport, where = ways[way]
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen) * 0.01)
                engine.update_weights(model.named_parameters(), transport, directory=where)
                timings[way].append(engine.last_sync)
                error = max(error, (_engine_logprobs(engine) - _hf_logprobs(model)).abs().max().item())

        t0 = time.perf_counter()
        restart_dir = work / "model"
        shutil.copytree(model_dir, restart_dir)
        model.save_pretrained(restart_dir)
        t1 = time.perf_counter()
        engine.stop()
        t2 = time.perf_counter()
        engine = Engine.start(EngineConfig(model=restart_dir, max_model_len=max_model_len,
                                           log_path=work / "vllm-restart.log"))
        t3 = time.perf_counter()
    finally:
        engine.stop()
    shutil.rmtree(work, ignore_errors=True)

    out: dict[str, Any] = {"params": params, "n_syncs": n_syncs, "first_start": first_start,
                           "restart": t3 - t0, "restart_save": t1 - t0, "restart_stop": t2 - t1,
                           "restart_start": t3 - t2, "max_logprob_error": error}
    for way, runs in timings.items():
        med = {f: statistics.median(getattr(s, f) for s in runs)
               for f in ("total", "write", "pause", "load", "reset", "resume")}
        out[way] = {**med, "all": [s.total for s in runs], "ratio": (t3 - t0) / med["total"]}
    out["sync_total"], out["ratio"] = out["shm"]["total"], out["shm"]["ratio"]  # the default, for others
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="an HF causal LM directory (default: build one, see --size)")
    ap.add_argument("--size", choices=("tiny", "10m"), default="tiny", help="the model to build")
    ap.add_argument("--syncs", type=int, default=5, help="weight syncs to time")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lgt-bench-model-") as tmp:
        model_dir = args.model or (make_tiny if args.size == "tiny" else make_qwen2_10m)(Path(tmp) / "m")
        r = measure(model_dir, args.syncs)
    print(f"model: {model_dir} ({r['params'] / 1e6:.2f}M params); first start {r['first_start']:.1f} s")
    for way in ("disk", "file", "shm"):
        w = r[way]
        print(f"sync by {way:4s} (median of {r['n_syncs']}): {w['total']:.3f} s = write {w['write']:.3f} "
              f"+ pause {w['pause']:.3f} + load {w['load']:.3f} + reset {w['reset']:.3f} "
              f"+ resume {w['resume']:.3f}; all: {', '.join(f'{s:.3f}' for s in w['all'])}")
    print(f"restart: {r['restart']:.1f} s = save {r['restart_save']:.2f} + stop {r['restart_stop']:.1f} "
          f"+ start {r['restart_start']:.1f}")
    print(f"disk / shm: {r['disk']['total'] / r['shm']['total']:.2f}x; /dev/shm file / shm: "
          f"{r['file']['total'] / r['shm']['total']:.2f}x; restart / shm sync: {r['ratio']:.0f}x; engine vs "
          f"transformers max |logprob error| after each sync: {r['max_logprob_error']:.2e}")


if __name__ == "__main__":
    main()
