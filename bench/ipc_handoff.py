"""The CUDA-IPC weight hand-off, measured on one GPU without vLLM: what the trainer does to hand an
engine its new weights (``lgt.trainer.serving.weights.ipc_payload``) and what the engine's worker does to take
them (``vllm_ext.open_ipc_payload``), in two processes, next to the host path the CPU build
uses (the tensors copied to the host and packed into shared memory: ``weights.shm_pack`` /
``vllm_ext.open_shm_layout``, then copied back to the GPU by the worker).

    python bench/ipc_handoff.py [--preset 0.5b] [--dtype bfloat16] [--repeats 5]

Prints, per path, the median seconds of the trainer's side, the worker's side and both, the bytes
handed over, and whether the worker saw exactly the trainer's tensors (a checksum per tensor).
Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

WORKER = r"""
import json, sys, time, torch
from lgt.trainer.serving.vllm_ext import open_ipc_payload, open_shm_layout
for line in sys.stdin:
    msg = json.loads(line)
    t0 = time.perf_counter()
    if msg["path"] == "ipc":
        tensors = open_ipc_payload(msg["payload"], 0)
    else:
        segment, views = open_shm_layout(msg["segment"], msg["layout"])
        tensors = [(n, t.to("cuda", non_blocking=True)) for n, t in views]
    sums = {n: float(t.float().sum()) for n, t in tensors}
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    if msg["path"] != "ipc":
        del views
        segment.close()
    del tensors
    print(json.dumps({"took": took, "sums": sums}), flush=True)
"""


def main() -> int:
    from lgt.trainer.demo.model import build_model
    from lgt.trainer.serving.weights import ipc_payload, shm_pack

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="0.5b")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ipc_handoff: needs a CUDA GPU")
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(build_model(Path(tmp) / "m", preset=args.preset),
                                                     dtype=getattr(torch, args.dtype)).to("cuda")
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    want = {n: float(t.float().sum()) for n, t in tensors.items()}
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    rows = {}
    try:
        for path in ("ipc", "host shared memory"):
            sender, receiver, exact = [], [], True
            for _ in range(args.repeats + 1):  # the first pays for the worker's CUDA context
                t0 = time.perf_counter()
                segment = None
                if path == "ipc":
                    msg = {"path": "ipc", "payload": ipc_payload(tensors)}
                else:
                    segment, layout, _ = shm_pack({n: t.cpu() for n, t in tensors.items()})
                    msg = {"path": "shm", "segment": segment.name, "layout": layout}
                sent = time.perf_counter() - t0
                worker.stdin.write(json.dumps(msg) + "\n")
                worker.stdin.flush()
                got = json.loads(worker.stdout.readline())
                if segment is not None:
                    segment.close()
                    segment.unlink()
                sender.append(sent)
                receiver.append(got["took"])
                exact &= got["sums"] == want
            rows[path] = (statistics.median(sender[1:]), statistics.median(receiver[1:]), exact)
    finally:
        worker.stdin.close()
        worker.wait(30)
    params = sum(t.numel() for t in tensors.values())
    print(f"{args.preset} preset, {params / 1e6:.0f}M parameters, {args.dtype}, {nbytes / 2**20:.0f} MiB on "
          f"{torch.cuda.get_device_name()}; median of {args.repeats}")
    print(f"  {'path':<20} {'trainer s':>10} {'worker s':>10} {'total s':>9} {'GiB/s':>7}  same tensors")
    for path, (s, r, exact) in rows.items():
        print(f"  {path:<20} {s:10.4f} {r:10.4f} {s + r:9.4f} {nbytes / 2**30 / (s + r):7.1f}  {exact}")
    ipc, host = rows["ipc"], rows["host shared memory"]
    print(f"  ratio (host path / ipc, total): {(host[0] + host[1]) / (ipc[0] + ipc[1]):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
