"""``lgt-train sft``: supervised fine-tuning of the student on a teacher's recorded traces, with the run's
backend, checkpoints and held-out evaluation. The samples come from :mod:`lgt.trainer.distill.traces`;
each has advantage 1 and no behaviour logprobs, so with one update per batch the policy loss's ratio is
1 and its gradient is the negative log-likelihood's on the reply tokens (tests/trainer/test_sft.py)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from lgt.trainer.backends.checkpoints import is_adapter
from lgt.trainer.distill.traces import (
    SftConfig,
    SftError,
    batches,
    build_samples,
    choose_rollouts,
    read_traces,
    samples_table,
)


def train(cfg: Any, run_dir: Path, *, traces: Path | None = None, echo: Any = print) -> dict[str, Any]:
    """``lgt-train sft``: samples from the teacher's traces, trained with the run's backend; metrics.jsonl,
    checkpoints/ and summary.json in RUN_DIR; held-out eval before and after when the config has one."""
    from transformers import AutoTokenizer

    from lgt.trainer.backends.base import entry
    from lgt.trainer.model_dir import ModelError, check_model_dir
    from lgt.trainer.policy import with_chat_template
    from lgt.trainer.preflight import chat_template, validate_eval

    chat_template(cfg)  # model.chat_template, checked before anything is read or written
    sft: SftConfig = cfg.sft or SftConfig()
    store = traces or sft.traces
    if store is None:
        raise SftError("no traces store: give --traces STORE or sft.traces in the config")
    run_dir.mkdir(parents=True, exist_ok=True)
    calls, rollouts = read_traces(Path(store))
    kept = choose_rollouts(rollouts, sft)
    if not kept:
        raise SftError(f"the reward filter kept none of the {len(rollouts)} rollouts in {store}")
    tasks = validate_eval(cfg) if cfg.eval is not None else None  # checked once, for both evaluations
    if tasks is not None:  # first: it builds the model when model.make says so
        summary_eval = {"eval_before": _evaluate(cfg, tasks, None, run_dir)}
    else:
        summary_eval = {}
    try:
        check_model_dir(cfg.model.path, need_chat_template=cfg.model.chat_template is None)
    except ModelError as e:
        raise SftError(str(e)) from None
    model_dir = with_chat_template(cfg, cfg.model.path, run_dir)  # the template the traces render with
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    built = build_samples(tokenizer, calls, kept, sft.max_seq_len)
    if not built.samples:
        raise SftError(f"none of the {built.calls} ok calls of the kept rollouts could be trained on: "
                       f"bad traces {dict(built.bad_traces)}")
    summary: dict[str, Any] = {
        "rollouts_read": len(rollouts), "rollouts_kept": len(kept), "calls": built.calls,
        "samples": len(built.samples), "merge_breaks": dict(built.merge_breaks),
        "bad_traces": dict(built.bad_traces),
        "tokens_trained": sum(sum(s["loss_mask"]) for s in built.samples)}
    summary |= summary_eval
    bcfg = sft_backend(cfg.backend, sft.lr)
    backend = entry(bcfg.name).load_class().load(model_dir, bcfg)
    nll: list[float] = []
    started = time.perf_counter()
    try:
        with open(run_dir / "metrics.jsonl", "a") as f:
            for step, batch in enumerate(batches(built.samples, sft.batch_rollouts, sft.epochs, cfg.seed)):
                t0 = time.perf_counter()
                m = backend.train_step(samples_table(batch))
                row = {"step": step, "samples": len(batch), "tokens": int(m.get("trained_tokens", 0)),
                       "nll": m.get("actor/neg_logprob"), "loss": m.get("loss"),
                       "time_s": time.perf_counter() - t0}
                nll.append(row["nll"])
                f.write(json.dumps(row) + "\n")
                echo(f"step {step}: {row['samples']} samples, {row['tokens']} tokens, nll {row['nll']:.4f}")
        ckpt = backend.save_checkpoint(run_dir / "checkpoints", {"sft": True, "step": len(nll)})
    finally:
        backend.close()
    summary |= {"steps": len(nll), "nll_first": nll[0] if nll else None, "nll_last": nll[-1] if nll else None,
                "minutes": round((time.perf_counter() - started) / 60, 3),  # training and its checkpoint
                "checkpoint": str(ckpt)}
    if tasks is not None:
        summary["eval_after"] = _evaluate(cfg, tasks, Path(ckpt), run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def sft_backend(backend: Any, lr: float | None) -> Any:
    """The run's backend config as SFT trains with it: one pass over each batch (``sft.epochs`` counts
    the passes over the traces), and ``sft.lr`` when given."""
    return dataclasses.replace(backend, **{type(backend).PASSES: 1}, **({"lr": lr} if lr is not None else {}))


def _evaluate(cfg: Any, tasks: Any, checkpoint: Path | None, run_dir: Path) -> dict[str, Any]:
    """One held-out evaluation (``lgt-train eval``'s), its row appended to RUN_DIR/eval.jsonl:
    ``{"greedy", "sampled"}`` mean rewards, as a run's summary gives them."""
    from lgt.trainer.run.evaluate import evaluate

    _, result = evaluate(cfg, tasks, checkpoint=checkpoint, run_dir=run_dir)
    row = result.row(result.seconds)
    return {"greedy": row["eval/reward_greedy"], "sampled": row["eval/reward_sampled"]}


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The one-screen summary of ``lgt-train sft``."""
    lines = [f"rollouts: {s['rollouts_read']} read, {s['rollouts_kept']} kept by the filter",
             f"calls: {s['calls']} ok → {s['samples']} samples, {s['tokens_trained']} tokens trained",
             f"merge breaks: {s['merge_breaks'] or 'none'}", f"bad traces: {s['bad_traces'] or 'none'}",
             f"NLL per token: {s['nll_first']:.4f} → {s['nll_last']:.4f} over {s['steps']} steps "
             f"in {60 * s['minutes']:.0f} s"]
    if "eval_before" in s:
        b, a = s["eval_before"], s["eval_after"]
        lines.append(f"held-out eval: greedy {_f(b['greedy'])} → {_f(a['greedy'])}   "
                     f"sampled {_f(b['sampled'])} → {_f(a['sampled'])}")
    ckpt = Path(s["checkpoint"])
    use = (f"a LoRA adapter: lgt-train export {ckpt.parent.parent} --merge DIR makes it a model.path"
           if is_adapter(ckpt) else "use it as model.path of a run")
    return lines + [f"checkpoint: {ckpt} ({use})"]


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"
