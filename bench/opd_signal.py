"""How fast each distillation signal moves the student towards the teacher, on one fixed batch.

    .venv/bin/python bench/opd_signal.py                 # the tiny arith student and teacher (~3 CPU-min)
    .venv/bin/python bench/opd_signal.py --lrs 1e-4,3e-4 --steps 6

``algorithm.estimator: opd`` gives each generated token the sampled log-ratio ``log t(x) - log s(x)`` as
its advantage: one number per token, for the token the student happened to sample. The teacher knows more
than that: its whole next-token distribution at each of the student's positions. This bench takes one
seeded batch (48 answers the student sampled to arith questions), the same Adam and learning rate, and
trains the student on it with

- ``sampled``: the policy gradient with the sampled log-ratio (what ``opd`` does; the baseline);
- ``reverse``: KL(student ‖ teacher) over the whole vocabulary at each position;
- ``top-k``: cross-entropy to the teacher's top k tokens, renormalised (what an engine's top-k
  ``prompt_logprobs`` would give for a large vocabulary);

and prints the exact reverse KL on the batch after each step, as a fraction of where it started, and each
signal's drop over the baseline's. In-sample on one batch: it measures the signal's strength per step, not
generalisation (``bench/distill.py`` measures whole runs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lrs", default="1e-4,3e-4", help="comma-separated Adam learning rates")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps on the batch")
    ap.add_argument("--answers", type=int, default=48, help="answers in the batch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lgt.trainer.demo.factory import make_model

    work = Path(tempfile.mkdtemp(prefix="lgt-opd-signal-"))
    # the arith warm start (knows the format, mostly wrong) and a teacher trained on right answers only
    student_dir = make_model(work / "student", preset="tiny", warm_start_task="arith", steps=40,
                             progress=False)
    teacher_dir = make_model(work / "teacher", preset="tiny", warm_start_task="arith", steps=150,
                             correct_fraction=1.0, progress=False)

    def load(d: Path) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, local_files_only=True)

    tok = AutoTokenizer.from_pretrained(str(student_dir), local_files_only=True)
    student, teacher = load(student_dir).eval(), load(teacher_dir).eval()
    tasks = [json.loads(line) for line in (ROOT / "examples/arith/tasks.jsonl").read_text().splitlines()]
    torch.manual_seed(args.seed)
    batch = []  # (ids, the positions predicting the answer, the answer's ids, the teacher's logprobs there)
    with torch.no_grad():
        for task in tasks[:args.answers]:
            prompt = tok.apply_chat_template([{"role": "user", "content": task["question"]}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
            prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
            out = student.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_k=0,
                                   max_new_tokens=16, pad_token_id=tok.eos_token_id)[0].tolist()
            at = slice(len(prompt) - 1, len(out) - 1)
            ids = torch.tensor([out])
            batch.append((ids, at, torch.tensor(out[len(prompt):])[:, None],
                          torch.log_softmax(teacher(input_ids=ids).logits[0, at].float(), -1)))
    tokens = sum(len(g) for _, _, g, _ in batch)

    def exact_kl(model: torch.nn.Module) -> float:
        total = 0.0
        with torch.no_grad():
            for ids, at, _, t in batch:
                s = torch.log_softmax(model(input_ids=ids).logits[0, at].float(), -1)
                total += float((s.exp() * (s - t)).sum())
        return total / tokens

    def loss(kind: str, s: torch.Tensor, gen: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if kind == "sampled":
            with torch.no_grad():
                adv = (t.gather(-1, gen) - s.gather(-1, gen))[:, 0]
            return -(adv * s.gather(-1, gen)[:, 0]).sum()
        if kind == "reverse":
            return (s.exp() * (s - t)).sum()
        k = int(kind.split("-")[1])
        top, idx = t.topk(k, -1)
        return -(torch.softmax(top, -1) * s.gather(-1, idx)).sum()

    start = exact_kl(student)
    print(f"{len(batch)} answers, {tokens} generated tokens; exact KL(student ‖ teacher) per token "
          f"{start:.3f} before\n")
    kinds = ("sampled", "reverse", "top-1", "top-8")
    head = f"{'lr':>7} {'signal':>8}  " + " ".join(f"{'step ' + str(i + 1):>7}" for i in range(args.steps))
    print(head + "   drop / sampled's")
    print("-" * (len(head) + 19))
    for lr in (float(x) for x in args.lrs.split(",")):
        drops = {}
        for kind in kinds:
            torch.manual_seed(args.seed)
            model = load(student_dir).train()
            opt = torch.optim.Adam(model.parameters(), lr=lr)
            fractions = []
            for _ in range(args.steps):
                opt.zero_grad()
                total = sum(loss(kind, torch.log_softmax(model(input_ids=ids).logits[0, at].float(), -1),
                                 g, t) for ids, at, g, t in batch)
                (total / tokens).backward()
                opt.step()
                model.eval()
                fractions.append(exact_kl(model) / start)
                model.train()
            drops[kind] = 1 - fractions[-1]
            ratio = (f"{drops[kind] / drops['sampled']:.1f}×" if kind != "sampled" and drops["sampled"] > 0
                     else "")
            print(f"{lr:>7.0e} {kind:>8}  " + " ".join(f"{x:>7.3f}" for x in fractions) + f"   {ratio}")
        print()


if __name__ == "__main__":
    main()
