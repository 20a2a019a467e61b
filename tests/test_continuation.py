"""The pure parts of continuing a call across an update (``proxy/continuation.py``); the whole path runs
against a real vLLM in ``tests/trainer/test_continue.py``."""

from __future__ import annotations

import pytest

from lgt.proxy.continuation import _says_something, continuable

BASE = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "return_token_ids": True,
        "logprobs": True}


TOOLS = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize("extra,parser,ok", [
    ({}, None, True),
    ({"stream": True, "stream_options": {"include_usage": True}}, None, True),
    ({"tools": []}, None, True),  # an empty list is no tools
    ({"tool_choice": "none", "max_tokens": 9, "temperature": 0.7, "stop": ["\n"]}, None, True),
    ({"tools": TOOLS}, None, False),  # the engine's parser would read only the continuation
    ({"tools": TOOLS}, "hermes", True),  # the proxy reads the tool calls itself
    ({"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False}, "hermes", True),
    ({"tools": TOOLS}, "mistral", False),  # a parser the proxy does not know
    ({"tools": TOOLS, "tool_choice": "none"}, None, True),  # nothing to parse
    ({"tools": TOOLS, "tool_choice": "required"}, "hermes", False),  # a grammar over the whole reply
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "hermes", False),
    ({"functions": [{"name": "f"}]}, "hermes", False),
    ({"response_format": {"type": "json_object"}}, "hermes", False),
    ({"n": 2}, None, False),
    ({"top_logprobs": 3}, None, False),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, None, False),
    ({"return_token_ids": False}, "hermes", False),  # no token ids: nothing to continue from
])
def test_which_calls_can_be_continued(extra: dict, parser: str | None, ok: bool) -> None:
    assert continuable("chat/completions", {**BASE, **extra}, parser) is ok
    assert continuable("completions", {**BASE, **extra, "prompt": "x"}, parser) is False


def test_a_token_chunk_says_something_when_it_shows_text_or_ends() -> None:
    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "token_ids": [5]}]}

    assert _says_something(chunk({"content": "a"}))
    assert _says_something(chunk({"reasoning": "so"}))
    assert _says_something(chunk({}, "length"))
    assert not _says_something(chunk({}))  # a token that ends inside a character, or a special token
    assert not _says_something(chunk({"content": ""}))
    assert not _says_something(chunk({"role": "assistant"}))
