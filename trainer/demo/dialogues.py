"""The warm start's dialogues as token ids and loss masks, formatted with the model's chat template exactly
as the example agents send them (the ids equal what vLLM sees), the replies in the loss."""

from __future__ import annotations

import json
import re
from typing import Any

from lgt.trainer.demo.chat import IM_END, tool_call_text
from lgt.trainer.demo.tasks import (
    CALC_TOOL,
    WORDS_TOOLS,
    calc_messages,
    calculate,
    words_call,
    words_messages,
)
from lgt.trainer.demo.tokenizer import encode, render


def arith_example(tokenizer, question: str, answer: int) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one arith dialogue whose reply is ``The answer is <answer>.<|im_end|>``."""
    prompt = encode(tokenizer, render(tokenizer, [{"role": "user", "content": question}]))
    reply = encode(tokenizer, f"The answer is {answer}.{IM_END}")
    return prompt + reply, [0] * len(prompt) + [1] * len(reply)


def calc_example(tokenizer, question: str, expression: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one two-turn calc dialogue: the tool call for ``expression``, the tool's
    result, and the answer that repeats the result. Both replies are in the loss; the ids equal what vLLM
    sees (each prompt's tokens extend the previous prompt + reply exactly)."""
    return _two_turns(tokenizer, calc_messages(question, expression), [CALC_TOOL],
                      tool_call_text("calculator", {"expression": expression}) + IM_END,
                      f"The answer is {calculate(expression)}.{IM_END}", "calc")


def _two_turns(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]], call: str,
               answer: str, what: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a dialogue whose ``messages`` end with an assistant tool call (``call``,
    as rendered) and its result, followed by ``answer``: both replies in the loss, and the ids equal
    what vLLM sees (the second prompt extends the first prompt + ``call`` exactly)."""
    prompt1 = render(tokenizer, messages[:-2], tools)
    prompt2 = render(tokenizer, messages, tools)
    if not prompt2.startswith(prompt1 + call):
        raise AssertionError(f"the chat template does not extend the first turn; the {what} dialogue is off")
    ids: list[int] = []
    mask: list[int] = []
    for text, m in [(prompt1, 0), (call, 1), (prompt2[len(prompt1 + call):], 0), (answer, 1)]:
        t = encode(tokenizer, text)
        ids += t
        mask += [m] * len(t)
    return ids, mask


def words_example(tokenizer, task: dict[str, Any], system: str | None = None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one words dialogue (words_messages): both assistant turns in the loss."""
    return _two_turns(tokenizer, words_messages(task, system)[:-1], [WORDS_TOOLS[task["tool"]]],
                      tool_call_text(*words_call(task)) + IM_END, f"Done.{IM_END}", "words")


class DialogueEncoder:
    """Fast token ids + loss masks of the warm-start dialogues (same ids as arith_example/calc_example).

    The chat template is rendered once with placeholders; its constant pieces are tokenised once and
    only the numbers are tokenised per dialogue. That is exact because every placeholder sits between
    pre-tokenizer boundaries (digits are single tokens; a newline, quote or special token on each side).
    """

    SLOTS = ("QUESTIONSLOT", "EXPRESSIONSLOT", "RESULTSLOT", "REPLYSLOT")
    SIMPLE = re.compile(r"[1-9]\d*[-+*][1-9]\d*")  # expressions the placeholders are exact for

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._arith: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
        q, e, r, a = self.SLOTS
        call = {"name": "calculator", "arguments": json.dumps({"expression": e})}
        msgs = [{"role": "user", "content": q},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "call_0", "type": "function", "function": call}]},
                {"role": "tool", "tool_call_id": "call_0", "content": r}]
        prompt1 = render(tokenizer, msgs[:1], [CALC_TOOL])
        reply1 = tool_call_text("calculator", {"expression": e}) + IM_END
        prompt2 = render(tokenizer, msgs, [CALC_TOOL])
        if not prompt2.startswith(prompt1 + reply1):
            raise AssertionError("the chat template does not extend the first turn; the calc dialogue is off")
        segments = [(prompt1, 0), (reply1, 1), (prompt2[len(prompt1 + reply1):], 0),
                    (f"{a}{IM_END}", 1)]  # the whole answer: " -" is one token
        split = re.compile("(" + "|".join(self.SLOTS) + ")")
        # (constant token ids | slot name, mask) pieces in order
        self._calc: list[tuple[list[int] | str, int]] = []
        for text, m in segments:
            for piece in split.split(text):
                if piece in self.SLOTS:
                    self._calc.append((piece, m))
                elif piece:
                    self._calc.append((encode(tokenizer, piece), m))

    def arith(self, question: str, answer: int) -> tuple[list[int], list[int]]:
        key = (question, answer)
        if key not in self._arith:
            self._arith[key] = arith_example(self.tokenizer, question, answer)
        return self._arith[key]

    def calc(self, question: str, expression: str) -> tuple[list[int], list[int]]:
        if not self.SIMPLE.fullmatch(expression):
            return calc_example(self.tokenizer, question, expression)
        result = calculate(expression)
        values = dict(zip(self.SLOTS, (question, expression, str(result), f"The answer is {result}.")))
        ids: list[int] = []
        mask: list[int] = []
        for piece, m in self._calc:
            t = encode(self.tokenizer, values[piece]) if isinstance(piece, str) else piece
            ids += t
            mask += [m] * len(t)
        return ids, mask
