"""The proxy's hermes tool call parser (``lgt.proxy.tool_parsers``, used for calls it continues across an
update) reads a reply as vLLM's own ``Hermes2ProToolParser`` does: the same deltas for a streamed reply
cut into pieces anywhere, the same content and tool calls for a whole one. Runs in the trainer's
environment, which has vLLM."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from lgt.proxy.tool_parsers import Hermes

pytest.importorskip("vllm")

TEXTS = [
    "The answer is 42.",
    'Let me add them. <tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
    '{"name": "mul", "arguments": {"x": "a <b> \\"c\\"", "y": [1, 2]}}\n</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": 1,',  # cut off mid-call (max_tokens)
    '<tool_call>{"name": "add", "arguments": {"a": 1}}',  # whole JSON, no closing tag
    '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> and some text after',
    "<tool_call> not json at all </tool_call>",
    "A < B and <tool an almost-tag, then <tool_call>",
    '   \n<tool_call>{"name": "f", "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {"a": 1}, "name": "late"}</tool_call>',
    'Ünïcødé ✓ <tool_call>{"name": "say", "arguments": {"text": "héllo ✓"}}</tool_call>',
]


@pytest.fixture(scope="module")
def vllm_parser() -> Any:
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    return lambda: Hermes2ProToolParser(tokenizer=object())


def pieces(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8])
        out.append(text[i:i + n])
        i += n
    return out


def without_ids(delta: dict[str, Any] | None) -> dict[str, Any] | None:
    if delta is None:
        return None
    calls = [{k: v for k, v in c.items() if k != "id"} for c in delta.get("tool_calls") or []]
    return {"content": delta.get("content"), "tool_calls": calls}


def vllm_delta(message: Any) -> dict[str, Any] | None:
    if message is None:
        return None
    calls = [{k: v for k, v in c.model_dump(exclude_none=True).items() if k != "id"}
             for c in message.tool_calls]
    return {"content": message.content, "tool_calls": calls}


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_streamed_reply_gives_vllms_deltas_wherever_it_is_cut(vllm_parser: Any, text: str,
                                                                  seed: int) -> None:
    theirs, ours = vllm_parser(), Hermes()
    sofar = ""
    got, want = [], []
    for piece in pieces(text, random.Random(seed)):
        before, sofar = sofar, sofar + piece
        want.append(vllm_delta(theirs.extract_tool_calls_streaming(before, sofar, piece, [], [], [],
                                                                   request=None)))
        got.append(without_ids(ours.stream(sofar)))
    assert got == want
    named = [c for d in got if d for c in d["tool_calls"] if "type" in c]
    assert ours.called is bool(named)


@pytest.mark.parametrize("text", TEXTS)
def test_a_whole_reply_gives_vllms_content_and_tool_calls(vllm_parser: Any, text: str) -> None:
    info = vllm_parser().extract_tool_calls(text, request=None)
    content = info.content if info.content and info.content.strip() else None
    want = (content if info.tools_called else info.content,
            [(c.function.name, c.function.arguments) for c in info.tool_calls])
    got_content, calls = Hermes().whole(text)
    assert (got_content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]) == want
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)


def test_parallel_tool_calls_false_keeps_the_first_call_only() -> None:
    text = TEXTS[2]
    content, calls = Hermes(parallel=False).whole(text)
    assert [c["function"]["name"] for c in calls] == ["add"]
    streamed = Hermes(parallel=False)
    deltas = [streamed.stream(text[:i]) for i in range(1, len(text) + 1)]
    indexes = {c["index"] for d in deltas if d for c in d["tool_calls"]}
    assert indexes == {0}
    assert json.loads("".join(c["function"].get("arguments", "") for d in deltas if d
                              for c in d["tool_calls"])) == {"a": 1, "b": 2}
