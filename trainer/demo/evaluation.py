"""How well a demo model does its task: replies generated with transformers (greedy or sampled), scored by
the task's reward."""

from __future__ import annotations

import random
import re

from lgt.trainer.demo.chat import parse_tool_call
from lgt.trainer.demo.tasks import (
    CALC_TOOL,
    WORDS_TOOLS,
    arith_reward,
    arith_tasks,
    calc_messages,
    calc_tasks,
    carry_tasks,
    filler,
    filler_length,
    words_messages,
    words_reward,
    words_tasks,
)
from lgt.trainer.demo.tokenizer import render


def _generate(model, tokenizer, prompts: list[str], *, sample: bool, max_new_tokens: int,
              seed: int) -> list[tuple[str, bool]]:
    """(reply text, stopped on eos) per prompt, with transformers generate (temperature 1, no top-k/top-p
    when sampling, like vLLM's defaults)."""
    import torch

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=sample, max_new_tokens=max_new_tokens,
                             temperature=1.0 if sample else None, top_k=0 if sample else None,
                             top_p=1.0 if sample else None, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    replies = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        stopped = tokenizer.eos_token_id in row
        row = row[: row.index(tokenizer.eos_token_id)] if stopped else row
        replies.append((tokenizer.decode(row, skip_special_tokens=False), stopped))
    return replies


def evaluate(model, tokenizer, task: str, *, sample: bool, n: int = 64, seed: int = 0) -> dict[str, float]:
    """Accuracy (format-exact reward, reply must stop on eos) and format rate of ``model`` on fresh
    dialogues of ``task`` (sampled at temperature 1 when ``sample``, else greedy).

    arith: ``n`` of its 200 prompts (the whole space, so the prompts RL will see; not held out); carry:
    ``n`` of its 3,645 problems (seen in the warm start or not, alike for a model that adds); calc: ``n``
    problems drawn apart from training's, both turns generated (the tool call parsed like vLLM's hermes
    parser and run with ``calculate``). "both" averages the two.
    """
    if task == "both":
        a = evaluate(model, tokenizer, "arith", sample=sample, n=n // 2, seed=seed)
        c = evaluate(model, tokenizer, "calc", sample=sample, n=n - n // 2, seed=seed)
        return {k: (a[k] + c[k]) / 2 for k in a}
    if task == "words":
        return _evaluate_words(model, tokenizer, sample=sample, n=n, seed=seed)
    fmt = re.compile(r"The answer is -?\d+\.")
    if task in ("arith", "carry"):
        tasks = (arith_tasks if task == "arith" else carry_tasks)(n, seed=seed + 7919)
        prompts = [render(tokenizer, [{"role": "user", "content": t["question"]}]) for t in tasks]
        replies = _generate(model, tokenizer, prompts, sample=sample, max_new_tokens=16, seed=seed)
    else:
        tasks = calc_tasks(n, seed=seed + 7919)
        firsts = _generate(model, tokenizer,
                           [render(tokenizer, [{"role": "user", "content": t["question"]}], [CALC_TOOL])
                            for t in tasks], sample=sample, max_new_tokens=40, seed=seed)
        replies = [("", False)] * len(tasks)
        second_prompts, where = [], []
        for i, (t, (text, stopped)) in enumerate(zip(tasks, firsts)):
            call = parse_tool_call(text) if stopped else None
            expr = call["arguments"].get("expression") if call and call["name"] == "calculator" else None
            try:
                msgs = calc_messages(t["question"], expr) if isinstance(expr, str) else None
            except ValueError:
                msgs = None
            if msgs is not None:
                second_prompts.append(render(tokenizer, msgs, [CALC_TOOL]))
                where.append(i)
        if second_prompts:
            for i, reply in zip(where, _generate(model, tokenizer, second_prompts, sample=sample,
                                                 max_new_tokens=16, seed=seed + 1)):
                replies[i] = reply
    ok = [arith_reward(text, t["answer"]) if stopped else 0.0 for t, (text, stopped) in zip(tasks, replies)]
    good_format = [1.0 if stopped and fmt.fullmatch(text.strip()) else 0.0 for text, stopped in replies]
    return {"accuracy": sum(ok) / len(ok), "format": sum(good_format) / len(good_format)}


def _evaluate_words(model, tokenizer, *, sample: bool, n: int, seed: int) -> dict[str, float]:
    """The words task's first turn on ``n`` fresh tasks, scored by words_reward (accuracy: the offered
    tool's call does exactly the task; format: it calls that tool with its arguments). System prompts
    are drawn like the warm start's."""
    rng = random.Random(seed + 1)
    tasks = words_tasks(n, seed=seed + 7919)
    prompts = []
    for t in tasks:
        words = filler_length(rng)
        system = filler(rng, words) if words else None
        prompts.append(render(tokenizer, words_messages(t, system)[:-3], [WORDS_TOOLS[t["tool"]]]))
    replies = _generate(model, tokenizer, prompts, sample=sample, max_new_tokens=96, seed=seed)
    scores = [words_reward(text, t) if stopped else (0.0, 0.0) for t, (text, stopped) in zip(tasks, replies)]
    return {"accuracy": sum(ok for ok, _ in scores) / n, "format": sum(fmt for _, fmt in scores) / n}
