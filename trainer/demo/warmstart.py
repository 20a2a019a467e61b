"""The supervised warm start (SFT) of a demo model on synthetic dialogues, so that RL has something to
amplify.

It trains on answers that are right only ``correct_fraction`` of the time; otherwise the answer (or the
calculator expression) is a *fixed* plausible error per prompt (carry: the answer without the carry).
Uniformly random errors would let greedy decoding recover the right answer; a fixed error leaves RL real
work to do.
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lgt.store.files import replace_atomic
from lgt.trainer.demo.dialogues import DialogueEncoder, words_example
from lgt.trainer.demo.evaluation import evaluate
from lgt.trainer.demo.tasks import (
    CARRY_SPACE,
    TASKS,
    TinyModelError,
    arith_error,
    arith_tasks,
    calc_error,
    calc_tasks,
    carry_error,
    carry_tasks,
    filler,
    filler_length,
    words_tasks,
)
from lgt.trainer.demo.tokenizer import load_tokenizer

WORDS_EVAL_N = 64  # the most words dialogues warm_start evaluates


def _draw_example(enc: DialogueEncoder, task: str, rng: random.Random, correct_fraction: float,
                  pool: Sequence[dict[str, Any]],
                  exclude: frozenset[str] = frozenset(),
                  filler_words: int = 0) -> tuple[list[int], list[int]]:
    """One training dialogue: right with probability correct_fraction, else the prompt's fixed error;
    never one of the ``exclude`` questions (held-out tasks). ``pool``: the arith or carry problems.
    ``filler_words``: a words dialogue's filler system prompt (0: none)."""
    kind = rng.choice(["arith", "calc"]) if task == "both" else task
    if kind == "words":  # always right: the copying skill, not a habit for RL to correct
        t = words_tasks(1, seed=rng.getrandbits(32))[0]
        return words_example(enc.tokenizer, t, filler(rng, filler_words) if filler_words else None)
    right = rng.random() < correct_fraction
    if kind in ("arith", "carry"):
        t = rng.choice(pool)
        if right:
            return enc.arith(t["question"], t["answer"])
        wrong = arith_error(t["question"], t["answer"]) if kind == "arith" else carry_error(t["question"])
        return enc.arith(t["question"], wrong)
    while (t := calc_tasks(1, seed=rng.getrandbits(32))[0])["question"] in exclude:
        pass
    return enc.calc(t["question"], t["expression"] if right else calc_error(t["expression"]))


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded (B, T) input_ids, attention_mask and labels (-100 where the mask is 0)."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (row, mask) in enumerate(examples):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        labels[i, : len(row)] = torch.where(torch.tensor(mask) == 1, torch.tensor(row), -100)
    return ids, attn, labels


def _save_weights(model, model_dir: Path) -> None:
    """Replace model_dir's weights atomically (save beside it, then rename the one weights file over)."""
    with tempfile.TemporaryDirectory(dir=model_dir.parent, prefix=f".{model_dir.name}.") as tmp:
        model.save_pretrained(tmp)
        files = sorted(p.name for p in Path(tmp).glob("*.safetensors"))
        if files != ["model.safetensors"]:
            raise AssertionError(f"expected one weights file, got {files}")
        replace_atomic(Path(tmp) / "model.safetensors", model_dir / "model.safetensors")


def warm_start(model_dir: str | Path, *, task: str = "arith", seconds: float | None = 90.0,
               steps: int | None = None, correct_fraction: float = 0.4, lr: float = 1e-3,
               batch: int | None = None, seed: int = 0, eval_n: int = 200, threads: int | None = 1,
               progress: bool = True, exclude: Sequence[str] = ()) -> dict[str, float]:
    """Supervised warm start of the model in ``model_dir`` on synthetic dialogues of ``task``; saves the
    weights back (atomically) and returns metrics.

    Dialogues are formatted with the model's chat template exactly as the example agents send them (arith:
    one user message; calc: user message + the calculator tool, tool call, tool result, answer). The loss
    (mean cross-entropy, nats/token) covers the assistant tokens only. Training stops after ``steps`` steps
    or ``seconds`` of training, whichever comes first. ``seconds`` counts this process's CPU time
    (``time.process_time``), not wall time, so a shared, loaded machine trains as much as an idle one;
    evaluation is not counted. Metrics: ``steps``, ``seconds`` (training CPU time), ``wall_seconds``,
    ``first_loss``/``final_loss`` (mean of the first/last 10 steps),
    ``greedy_accuracy``, ``sampled_accuracy`` (temperature 1), ``sampled_format``.

    ``batch``: dialogues per step; default 64 for arith and carry, 16 when calc or words dialogues
    (~6x longer) are in the mix (measured on the demo preset in 90 CPU-s: batch 16 copied the
    calculator's expression, batch 64 had too few steps to learn it).

    ``threads``: torch CPU threads while it runs (restored after). One is the default: these models are
    too small to gain from more, and on a shared machine extra threads spin-wait (measured: a batch of 64
    took 0.18 s of CPU on one thread, 0.5-2.4 s on two, under load).

    ``words`` trains on right calls only (``correct_fraction`` does not apply): a skill to build on, not a
    habit for RL to correct.

    ``exclude``: questions never shown (the run's held-out tasks, so that evaluating on them measures
    what the model never saw, in the warm start or in RL).
    """
    import torch

    if task not in TASKS:
        raise TinyModelError(f"task {task!r} is not one of {', '.join(TASKS)}")
    if not 0.0 <= correct_fraction <= 1.0:
        raise TinyModelError(f"correct_fraction {correct_fraction} is not between 0 and 1")
    if steps is None and seconds is None:
        raise TinyModelError("warm_start needs a limit: give steps or seconds")
    model_dir = Path(model_dir)
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _warm_start(model_dir, task=task, seconds=seconds, steps=steps,
                           correct_fraction=correct_fraction, lr=lr, seed=seed, eval_n=eval_n,
                           batch=batch if batch is not None else 64 if task in ("arith", "carry") else 16,
                           progress=progress, exclude=frozenset(exclude))
    finally:
        torch.set_num_threads(saved_threads)


def _warm_start(model_dir: Path, *, task: str, seconds: float | None, steps: int | None,
                correct_fraction: float, lr: float, batch: int, seed: int, eval_n: int,
                progress: bool, exclude: frozenset[str] = frozenset()) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    every = carry_tasks(len(CARRY_SPACE)) if task == "carry" else arith_tasks(200)
    pool = [t for t in every if t["question"] not in exclude]
    if not pool and task != "calc":
        raise TinyModelError(f"the warm start excludes every {'carry' if task == 'carry' else 'arith'} "
                             "problem: nothing is left to train on")
    enc = DialogueEncoder(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    bar = _progress(total=steps, seconds=seconds, enabled=progress, desc=f"warm start ({task})")
    losses: list[float] = []
    start, wall_start = time.process_time(), time.monotonic()
    model.train()
    while (done := _progress_fraction(len(losses), steps, time.process_time() - start, seconds)) < 1.0:
        for group in opt.param_groups:  # cosine decay to lr/10 over the budget (steps or seconds)
            group["lr"] = lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * done)))
        words = filler_length(rng) if task == "words" else 0
        ids, attn, labels = _batch([_draw_example(enc, task, rng, correct_fraction, pool, exclude, words)
                                    for _ in range(batch)], tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.update(loss=losses[-1], elapsed=time.process_time() - start)
    elapsed, wall = time.process_time() - start, time.monotonic() - wall_start
    bar.close()
    model.eval()
    if task == "words":  # its dialogues are ~20x longer: 200 of them took 4 min on one thread
        eval_n = min(eval_n, WORDS_EVAL_N)
    greedy = evaluate(model, tokenizer, task, sample=False, n=eval_n, seed=seed)
    sampled = evaluate(model, tokenizer, task, sample=True, n=eval_n, seed=seed)
    _save_weights(model, model_dir)
    head, tail = losses[:10] or [math.nan], losses[-10:] or [math.nan]
    return {"steps": len(losses), "seconds": round(elapsed, 2), "wall_seconds": round(wall, 2),
            "first_loss": sum(head) / len(head), "final_loss": sum(tail) / len(tail),
            "greedy_accuracy": greedy["accuracy"], "greedy_format": greedy["format"],
            "sampled_accuracy": sampled["accuracy"], "sampled_format": sampled["format"]}


def _progress_fraction(step: int, steps: int | None, cpu: float, seconds: float | None) -> float:
    """How much of the training budget is spent (0..1, the larger of steps and seconds)."""
    return max(step / steps if steps else 0.0, cpu / seconds if seconds else 0.0)


class _progress:
    """A tqdm bar over steps (or over seconds when no step count is given); a no-op when disabled."""

    def __init__(self, *, total: int | None, seconds: float | None, enabled: bool, desc: str) -> None:
        self.by_time = total is None
        self.bar = None
        self.last = 0.0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=round(seconds) if self.by_time else total, desc=desc,
                            unit="s" if self.by_time else "step", leave=False)

    def update(self, *, loss: float, elapsed: float) -> None:
        if self.bar is None:
            return
        if self.by_time:
            now = min(int(elapsed), self.bar.total)
            self.bar.update(now - self.last)
            self.last = now
        else:
            self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
