"""Benchmark: the trainer backends against the bare training loop on the same batches, side by side.

    .venv/bin/python bench/trainer_throughput.py                      # tiny model and ~11M-param Qwen2
    .venv/bin/python bench/trainer_throughput.py --models 10m --repeats 7 --samples 32
    .venv/bin/python bench/trainer_throughput.py --with-sync          # + weight sync vs engine restart
    .venv-verl/bin/python bench/trainer_throughput.py --verl          # + verl, 1 rank and 2 Ray ranks
    python bench/trainer_throughput.py --models 0.5b --device cuda --dtype bfloat16 --max-len 1024  # one GPU
    .venv/bin/python bench/trainer_throughput.py --models smollm2     # a real model's shape: the options

Models (random weights, nothing downloaded): ``tiny`` is the tests' tiny Qwen2 (lgt.testing.
models: vocab ~400, hidden 128, 2 layers); ``10m`` is a Qwen2 with vocab 32000, hidden 256,
4 layers, 4 heads of 64, intermediate 768, tied embeddings (~11.3M parameters, 8.2M of them the
embedding), which makes the (B, T, V) logits as heavy as they are in real models. ``smollm2`` is
SmolLM2-135M-Instruct's exact shape from a LlamaConfig (hidden 576, 30 layers, 9 heads and 3 KV heads
of 64, intermediate 1536, vocab 49,152, tied embeddings, rope_theta 100000: 134,515,008 parameters);
its run measures what each CPU option buys, side by side: the backend and the bare loop in float32,
the backend training only the top ``--train-layers`` layers (6), and the same three in bf16 autocast
where the device computes in bf16 natively (elsewhere bf16 is emulated, many times slower than
float32, and ``dtype: auto`` picks float32: the rows are left out unless ``--with-bf16``; the header
says what this machine has and what a bf16 matmul costs on it). Each backend row's ratio is against
the bare loop of its own dtype (which trains every layer); the last column is its tokens per
CPU-second over the float32 backend's. Its defaults are cut to fit a few minutes on 2 cores
(``--samples 4 --min-len 96 --max-len 192 --repeats 3`` unless given).

Batches: ``--samples`` synthetic SAMPLES rows of ``--min-len``..``--max-len`` tokens, the last
``--gen-frac`` of each generated (loss_mask 1; agent samples are mostly prompt and tool output, so
0.5 is generous), advantages +-1, store-rule loss weights. Both sides train on the same
rows split into the same micro-batches (:func:`pack_micro_batches`, ``--micro-batch-tokens``):

* backend: ``TorchBackend.train_step(table)`` from the Arrow table (reading the samples, padding,
  PPO/IS loss with rollout weights, grad clip, AdamW, metrics), once with its default config and once
  with the exact entropy metric on (``entropy=True``: one more pass over the logits);
* bare loop (the physical floor): the padded tensors made beforehand, then per micro-batch
  ``model(input_ids).logits``, token cross-entropy (labels shifted, as transformers' loss does, so no
  copy of the logits) times mask and advantage, summed / trained tokens, ``backward``; one
  ``optimizer.step()`` (AdamW) per batch; no clipping, no metrics.

With ``--verl`` (in the verl environment) two more sides: the verl backend in this process (world size 1)
and on verl's Ray worker groups with 2 CPU ranks (each one torch thread), both micro-batching by the
same token budget (``micro_batch_tokens``: verl's dynamic batch size), fp32, the same loss. For the Ray
side "CPU s" is the ranks' CPU time (the driver's is left out; on 2 cores the ranks share them).

Each repeat runs every side once, in turn, after one warm-up step each; the medians of ``--repeats``
are printed with the ratio (tokens / s of the backend over the bare loop; the goal is >= 0.9). Both
wall-clock and process CPU time are measured: on a shared machine the CPU-time ratio is the stable one
(``--threads 1``, the default, keeps it free of thread spinning).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lgt.store.samples import SAMPLES  # noqa: E402
from lgt.trainer.backends.samples import read_samples  # noqa: E402
from lgt.trainer.backends.torch_backend import (  # noqa: E402
    TorchBackend,
    TorchConfig,
    pack_micro_batches,
    pad_micro_batch,
)
from lgt.trainer.rl.algorithm import training_schema  # noqa: E402
from lgt.trainer.serving.hardware import bf16_native  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# batch settings a model gets unless given: smollm2's are cut to fit a few minutes on 2 cores
DEFAULTS = {"": {"samples": 32, "min_len": 64, "max_len": 256, "repeats": 5},
            "smollm2": {"samples": 4, "min_len": 96, "max_len": 192, "repeats": 3}}


def make_tiny(out: Path) -> Path:
    """The tests' tiny model (lgt.testing.random_model) in ``out``."""
    from lgt.testing.random_model import make_test_model

    return make_test_model(out)


def make_10m(out: Path, tokenizer_from: Path) -> Path:
    """A random ~11M-parameter Qwen2 (vocab 32000) with the tiny model's tokenizer files next to it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    return save_random(Qwen2ForCausalLM, cfg, out, tokenizer_from)


def make_smollm2(out: Path, tokenizer_from: Path) -> Path:
    """SmolLM2-135M-Instruct's shape (a LlamaConfig, random weights; 134,515,008 parameters) with the
    tiny model's tokenizer files next to it (nothing here tokenizes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    return save_random(LlamaForCausalLM, cfg, out, tokenizer_from)


def save_random(model_cls: Any, cfg: Any, out: Path, tokenizer_from: Path) -> Path:
    """``model_cls(cfg)`` with random weights (seed 0) saved in ``out``, with ``tokenizer_from``'s
    tokenizer files beside it."""
    torch.manual_seed(0)
    model_cls(cfg).save_pretrained(out)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, out / f.name)
    return out


def make_batch(n: int, min_len: int, max_len: int, vocab: int, gen_frac: float, seed: int = 0) -> pa.Table:
    """``n`` SAMPLES rows of random length in [min_len, max_len]: a prompt, then ``gen_frac`` of the
    tokens generated (loss_mask 1)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=n)
    rows = []
    for i, length in enumerate(lengths.tolist()):
        gen = max(1, min(length - 1, round(length * gen_frac)))
        mask = [0] * (length - gen) + [1] * gen
        rows.append({
            "sample_id": f"r{i}~0#0", "rollout_id": f"r{i}", "attempt": 0, "group_id": f"g{i // 8}",
            "task_id": "t", "sample_index": 0, "n_calls": 1,
            "input_ids": rng.integers(0, vocab, size=length).tolist(), "loss_mask": mask,
            "behaviour_logprobs": [float(-x) if m else 0.0 for x, m in zip(rng.exponential(2.0, length), mask,
                                                                             strict=True)],
            "policy_versions": [0 if m else -1 for m in mask], "reward": float(i % 2),
            "advantage": 1.0 if i % 2 else -1.0, "loss_weight": 1.0 / (n * gen), "rollout_tokens": gen,
            "group_size": 8, "zero_variance": False, "mode": "exact"})
    return pa.Table.from_pylist(rows, schema=training_schema(SAMPLES))


def make_05b(out: Path) -> Path:
    """lgt's 0.5b preset (Qwen2-0.5B's shape, random weights, lgt's small vocabulary; ~0.36B params)."""
    from lgt.trainer.demo.model import build_model

    return build_model(out, preset="0.5b")


class BareLoop:
    """The floor: forward, masked token cross-entropy, backward, AdamW — on tensors padded beforehand
    (on ``device``; ``dtype`` bfloat16: float32 weights and AdamW, the forward under autocast, as the
    backend does)."""

    def __init__(self, model_dir: Path, table: pa.Table, budget: int, lr: float, device: str = "cpu",
                 dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        dev = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if dtype == "bfloat16"
                         else contextlib.nullcontext())
        batch = read_samples(table)
        self.micro = [pad_micro_batch(batch, rows, dev) for rows in pack_micro_batches(batch.lengths, budget)]
        self.num_tokens = float(batch.masked.sum())
        self.tokens = float(batch.lengths.sum())

    def step(self) -> None:
        """One update over the batch."""
        self.opt.zero_grad(set_to_none=True)
        for mb in self.micro:
            ids, mask = mb["input_ids"], mb["loss_mask"]
            with self.autocast:
                logits = self.model(ids).logits
            # labels shifted instead of logits (as transformers' own loss does): no (B, T, V) copy
            labels = F.pad(ids[:, 1:], (0, 1), value=-100)
            nll = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1),
                                  reduction="none").view(ids.shape)
            weight = F.pad(mask[:, 1:], (0, 1)) * mb["advantages"][:, None]
            loss = (nll * weight).sum() / self.num_tokens
            loss.backward()
        self.opt.step()


def timed(fn, cpu_clock=time.process_time) -> tuple[float, float]:
    """(wall seconds, CPU seconds by ``cpu_clock``) of ``fn()`` (a GPU's queued work included)."""
    wall, cpu = time.perf_counter(), cpu_clock()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - wall, cpu_clock() - cpu


def verl_sides(model_dir: Path, args: argparse.Namespace) -> dict[str, tuple[object, object]]:
    """``{name: (actor, cpu_seconds)}``: the verl backend in this process and on 2 Ray ranks."""
    from lgt.trainer.backends.base import VerlConfig
    from lgt.trainer.backends.verl_actor import VerlInProcessActor
    from lgt.trainer.backends.verl_ray import VerlRayActor

    cfg = VerlConfig(model_path=str(model_dir), lr=1e-5, param_dtype="fp32",
                     micro_batch_tokens=args.micro_batch_tokens)
    one = VerlInProcessActor(cfg)
    two = VerlRayActor(cfg, world_size=2)
    return {"verl, world size 1": (one, time.process_time), "verl, 2 Ray ranks": (two, two.cpu_seconds)}


def side_specs(name: str, args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """``(label, "backend" | "bare", TorchConfig options)`` of every side measured for model ``name``;
    a backend row's floor is the bare loop of its dtype."""
    if name == "smollm2":
        n = args.train_layers
        fp32 = [("bare loop, float32", "bare", {"dtype": "float32"}),
                ("backend, float32", "backend", {"dtype": "float32"}),
                (f"backend, float32, top {n}", "backend", {"dtype": "float32", "train_layers": n})]
        if not (args.with_bf16 or bf16_native(args.device)[0]):
            return fp32
        return [*fp32, ("bare loop, bf16", "bare", {"dtype": "bfloat16"}),
                ("backend, bf16 autocast", "backend", {"dtype": "bfloat16"}),
                (f"backend, bf16, top {n}", "backend", {"dtype": "bfloat16", "train_layers": n})]
    return [("backend", "backend", {"dtype": args.dtype}),
            ("backend, entropy=True", "backend", {"dtype": args.dtype, "entropy": True}),
            ("bare loop", "bare", {"dtype": args.dtype})]


def bf16_matmul_cost(device: str, reps: int = 5) -> float:
    """How many times float32's time a (64 x 576) @ (576 x 1536) matmul takes in bfloat16 on ``device``
    (one of SmolLM2's MLP projections for 64 tokens): ~1 where bf16 is native, far more where emulated."""
    a, w = torch.randn(64, 576, device=device), torch.randn(1536, 576, device=device)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), w.to(dtype)
        x @ y.T  # warm-up
        seconds[dtype] = timed(lambda x=x, y=y: [x @ y.T for _ in range(reps)])[1 if device == "cpu" else 0]
    return seconds[torch.bfloat16] / seconds[torch.float32]


def bench_model(name: str, model_dir: Path, args: argparse.Namespace) -> None:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    table = make_batch(args.samples, args.min_len, args.max_len, vocab, args.gen_frac)
    on = {"lr": 1e-5, "micro_batch_tokens": args.micro_batch_tokens, "device": args.device}
    run, cpu_of, floor_of = {}, {}, {}
    bares: dict[str, BareLoop] = {}
    backends: dict[str, TorchBackend] = {}
    for label, kind, opts in side_specs(name, args):
        if kind == "bare":
            bares[opts["dtype"]] = bare = BareLoop(model_dir, table, args.micro_batch_tokens, lr=1e-5,
                                                   device=args.device, dtype=opts["dtype"])
            run[label] = bare.step
        else:
            backends[label] = backend = TorchBackend.load(model_dir, TorchConfig(**on, **opts))
            run[label] = lambda b=backend: b.train_step(table)
        cpu_of[label] = time.process_time
        floor_of[label] = next(k for k, kind2, o in side_specs(name, args)
                               if kind2 == "bare" and o["dtype"] == opts["dtype"])
    verl = verl_sides(model_dir, args) if args.verl else {}
    for k, (actor, cpu) in verl.items():
        run[k], cpu_of[k], floor_of[k] = (lambda a=actor: a.train_step(table)), cpu, "bare loop"
    for fn in run.values():  # warm-up
        fn()
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in run}
    for _ in range(args.repeats):
        for k, fn in run.items():
            times[k].append(timed(fn, cpu_of[k]))
    for actor, _ in verl.values():
        actor.close()
    bare = next(iter(bares.values()))
    params = sum(p.numel() for p in bare.model.parameters())
    padded = sum(mb["input_ids"].numel() for mb in bare.micro)
    dtypes = {o["dtype"] for _, _, o in side_specs(name, args)}
    native = f" {args.dtype}" if name != "smollm2" else ""
    if name == "smollm2" or "bfloat16" in dtypes:
        native += (f"; {bf16_native(args.device)[1]} (a bf16 matmul takes "
                   f"{bf16_matmul_cost(args.device):.1f}x float32's time here)")
    if name == "smollm2" and "bfloat16" not in dtypes:
        native += "; the bf16 rows are left out (--with-bf16 runs them anyway)"
    print(f"\n## {name}: {params / 1e6:.2f}M params, vocab {vocab}; {args.samples} samples, "
          f"{bare.tokens:.0f} tokens ({bare.num_tokens:.0f} trained), {len(bare.micro)} micro-batches of "
          f"<= {args.micro_batch_tokens} padded tokens ({padded} padded in all); "
          f"median of {args.repeats}, torch threads {torch.get_num_threads()}, {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
          + native)
    med = {k: (statistics.median(w for w, _ in ts), statistics.median(c for _, c in ts))
           for k, ts in times.items()}
    base = med[next(iter(backends))][1]  # the first backend row: what the options are measured against
    width = max(22, *map(len, med))
    print(f"  {'':<{width}} {'wall s':>8} {'tokens/s':>9} {'ratio':>6}   "
          f"{'CPU s':>8} {'tokens/CPU-s':>12} {'ratio':>6} {'x first':>8}")
    for k, (wall, cpu) in med.items():
        floor_wall, floor_cpu = med[floor_of[k]]
        print(f"  {k:<{width}} {wall:8.3f} {bare.tokens / wall:9.0f} {floor_wall / wall:6.2f}   "
              f"{cpu:8.3f} {bare.tokens / cpu:12.0f} {floor_cpu / cpu:6.2f} {base / cpu:8.2f}")
    for label, backend in backends.items():
        if backend.cfg.train_layers:
            print(f"  {label}: {backend.summary.split('; ', 1)[1]}")


def bench_sync(model_dir: Path, n: int) -> None:
    """Weight sync vs engine restart, from bench/weight_sync.py's measure(model_dir, n)."""
    path = ROOT / "bench" / "weight_sync.py"
    if not path.is_file():
        print(f"\n## weight sync: {path} is not there yet; skipped")
        return
    spec = importlib.util.spec_from_file_location("weight_sync", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.measure(model_dir, n)
    print(f"\n## weight sync on {model_dir.name} ({n} updates)")
    for k, v in (result.items() if isinstance(result, dict) else [("result", result)]):
        print(f"  {k:<28} {v}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,10m", help="comma-separated: tiny, 10m, 0.5b, smollm2")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--samples", type=int, help="default 32 (smollm2: 4)")
    parser.add_argument("--min-len", type=int, help="default 64 (smollm2: 96)")
    parser.add_argument("--max-len", type=int, help="default 256 (smollm2: 192)")
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--gen-frac", type=float, default=0.5,
                        help="fraction of each sample's tokens that are generated (trained)")
    parser.add_argument("--repeats", type=int, help="default 5 (smollm2: 3)")
    parser.add_argument("--with-bf16", action="store_true",
                        help="smollm2: the bf16 rows even where this CPU emulates bf16 (slow)")
    parser.add_argument("--train-layers", type=int, default=6,
                        help="smollm2's partial-training rows train the top N layers")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--with-sync", action="store_true", help="also time weight sync vs engine restart")
    parser.add_argument("--verl", action="store_true",
                        help="also the verl backend, 1 rank in-process and 2 Ray ranks (run in .venv-verl)")
    parser.add_argument("--sync-updates", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny(Path(tmp) / "tiny")
        dirs = {"tiny": tiny}
        if "10m" in args.models.split(","):
            dirs["10m"] = make_10m(Path(tmp) / "qwen2-11m", tiny)
        if "0.5b" in args.models.split(","):
            dirs["0.5b"] = make_05b(Path(tmp) / "qwen2-0.5b")
        if "smollm2" in args.models.split(","):
            dirs["smollm2"] = make_smollm2(Path(tmp) / "smollm2-135m", tiny)
        for name in args.models.split(","):
            if name not in dirs:
                sys.exit(f"unknown model {name!r}: choose tiny, 10m, 0.5b or smollm2")
            given = {k: v for k, v in vars(args).items() if v is not None}
            bench_model(name, dirs[name], argparse.Namespace(**{**DEFAULTS.get(name, DEFAULTS[""]), **given}))
        if args.with_sync:
            bench_sync(tiny, args.sync_updates)


if __name__ == "__main__":
    main()
