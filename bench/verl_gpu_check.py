"""Check: verl's FSDP actor, driven by lgt's verl backend, updates a tiny model the right way.

    .venv-verl/bin/python bench/verl_gpu_check.py            # on CUDA (one GPU, well under a minute)
    .venv-verl/bin/python bench/verl_gpu_check.py --cpu      # same check on the CPU (FSDP2 over gloo)
    .venv-verl/bin/python bench/verl_gpu_check.py --model-dir DIR --param-dtype bf16

Builds a tiny random Qwen2 model (lgt.testing.random_model; nothing downloaded) unless
``--model-dir`` names one, and a synthetic samples table in the store's SAMPLES schema: single- and
multi-turn samples (tool tokens masked out), GRPO-style advantages of +1 / -1, loss weights
1/(R * tokens of the rollout), and behaviour logprobs recorded by a plain transformers forward pass, as
a freshly synced engine would record them. Then ``VerlInProcessActor.train_step`` runs ``--steps`` times.

Checks (exit status 1 when one fails, each printed with its numbers):
  * alignment: verl's logprobs of the response tokens before training equal the recorded ones;
  * on-policy start: the first step's ``actor/ppo_kl`` is ~0;
  * every metric finite, gradient norm > 0, and the policy loss moves;
  * the update follows the advantages: mean logprob change > 0 on positive-advantage tokens and < 0 on
    negative-advantage tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa


def build_tiny_model(out: Path) -> Path:
    from lgt.testing.random_model import make_test_model

    return make_test_model(out)


def synthetic_samples(model_dir: Path, device: str, *, rollouts: int, seed: int) -> pa.Table:
    """``rollouts`` rollouts of one sample each (every third multi-turn); behaviour logprobs: the model's."""
    import torch
    from transformers import AutoModelForCausalLM

    from lgt.store.samples import SAMPLES
    from lgt.trainer.rl.algorithm import training_schema

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(rollouts):
        segments = [(0, rng.integers(3, vocab, rng.integers(6, 24))),
                    (1, rng.integers(3, vocab, rng.integers(4, 16)))]
        if i % 3 == 1:  # a tool result, then more generated tokens
            segments += [(0, rng.integers(3, vocab, rng.integers(3, 10))), (1, rng.integers(3, vocab, 5))]
        ids = np.concatenate([s for _, s in segments]).astype(np.int32)
        mask = np.concatenate([np.full(len(s), g, np.int8) for g, s in segments])
        with torch.no_grad():
            x = torch.tensor(ids[None].astype(np.int64), device=device)
            lp = torch.log_softmax(model(x).logits[0].float(), -1)[:-1].gather(-1, x[0, 1:, None])[:, 0]
        behaviour = np.concatenate([[0.0], lp.cpu().numpy()]).astype(np.float32) * mask
        tokens = int(mask.sum())
        rows.append(dict(
            sample_id=f"r{i}/0", rollout_id=f"r{i}", attempt=0, group_id=f"g{i // 4}", task_id=f"t{i // 4}",
            sample_index=0, n_calls=1 + (i % 3 == 1), input_ids=ids.tolist(), loss_mask=mask.tolist(),
            behaviour_logprobs=behaviour.tolist(), policy_versions=np.where(mask == 1, 0, -1).tolist(),
            reward=float(i % 2 == 0), advantage=1.0 if i % 2 == 0 else -1.0,
            loss_weight=1.0 / (rollouts * tokens), rollout_tokens=tokens, group_size=4, zero_variance=False,
            mode="exact"))
    del model
    return pa.Table.from_pylist(rows, schema=training_schema(SAMPLES))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is available")
    p.add_argument("--model-dir", type=Path, help="an HF causal LM to use instead of the tiny random one")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--param-dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--old-logprobs", default="behaviour", choices=["behaviour", "recompute"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: the backend picks its platform

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.cpu and device == "cpu":
        print("no CUDA here: pass --cpu to run the check on the CPU", file=sys.stderr)
        return 2
    from lgt.trainer.backends.verl_actor import VerlConfig, VerlInProcessActor

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lgt-verl-check-") as tmp:
        model_dir = args.model_dir or build_tiny_model(Path(tmp) / "model")
        samples = synthetic_samples(model_dir, device, rollouts=args.rollouts, seed=args.seed)
        cfg = VerlConfig(model_path=str(model_dir), lr=args.lr, param_dtype=args.param_dtype,
                         ppo_micro_batch_size_per_gpu=args.micro_batch, seed=args.seed,
                         old_logprobs=args.old_logprobs)
        backend = VerlInProcessActor(cfg)
        t_built = time.perf_counter()
        try:
            batch = backend.to_dataproto(samples)
            mask = batch.batch["response_mask"].bool()
            before = backend.logprobs(samples)
            history, step_s = [], []
            for _ in range(args.steps):
                t = time.perf_counter()
                history.append(backend.train_step(samples))
                step_s.append(time.perf_counter() - t)
            after = backend.logprobs(samples)
        finally:
            backend.close()

    print(f"device {device}, param dtype {args.param_dtype}, old logprobs {args.old_logprobs}, "
          f"{len(samples)} samples, {int(mask.sum())} trained tokens, setup {t_built - t0:.1f} s, "
          f"step {np.median(step_s):.2f} s (median of {len(step_s)})")
    print(f"{'step':>4} {'loss/pg':>10} {'ppo_kl':>10} {'clipfrac':>9} {'grad_norm':>10}")
    for i, m in enumerate(history):
        print(f"{i:>4} {m['loss/pg']:>10.5f} {m['actor/ppo_kl']:>10.2e} {m['actor/pg_clipfrac']:>9.3f} "
              f"{m['actor/grad_norm']:>10.4f}")

    advantage = np.asarray(samples.column("advantage").to_pylist())[:, None]
    delta = (after - before).numpy()
    m = mask.numpy()
    align = float(np.abs(before.numpy()[m] - batch.batch["old_log_probs"].numpy()[m]).max())
    tol = 1e-3 if args.param_dtype == "fp32" else 0.1
    losses = [h["loss/pg"] for h in history]
    checks = {
        f"verl logprobs = recorded (max |diff| {align:.2e} <= {tol})": align <= tol,
        f"first step on-policy (|ppo_kl| {abs(history[0]['actor/ppo_kl']):.2e} <= {tol})":
            abs(history[0]["actor/ppo_kl"]) <= tol,
        "all metrics finite": all(math.isfinite(v) for h in history for v in h.values()),
        f"gradient flows (grad_norm {history[0]['actor/grad_norm']:.3g} > 0)":
            history[0]["actor/grad_norm"] > 0,
        f"loss moves ({losses[0]:.5f} -> {losses[-1]:.5f})": len(losses) < 2 or losses[-1] != losses[0],
        f"positive-advantage tokens rise (mean dlogp {delta[m & (advantage > 0)].mean():+.4f})":
            delta[m & (advantage > 0)].mean() > 0,
        f"negative-advantage tokens fall (mean dlogp {delta[m & (advantage < 0)].mean():+.4f})":
            delta[m & (advantage < 0)].mean() < 0,
    }
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
