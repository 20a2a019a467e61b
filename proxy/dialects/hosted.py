"""A hosted model's answers, read as they pass on their way to the agent, unchanged.

A call that goes where the agent sent it (observe-only, or ``--hosted-model``) is recorded in the
provider's own shape. A streamed answer is re-assembled into the body the same call would have had
unstreamed (:class:`Assembler`): Responses → the ``response.completed`` event's ``response``; Messages →
the message built from ``message_start`` … ``message_delta``; Gemini → the chunks' parts merged, the
last ``usageMetadata`` and ``modelVersion``; chat/completions and completions → the chunks merged as
the proxy merges the engine's. :func:`columns` reads the facts the ``calls`` table keeps of any answer:
the model that answered, usage, and a finish reason in chat/completions' words.

Pure functions and small state machines, no mitmproxy; nothing here raises on a strange answer — what
cannot be read is left out.
"""

from __future__ import annotations

import json
from typing import Any

from ..wire import CHAT, COMPLETIONS, Capture, Injected
from .common import MESSAGES, RESPONSES
from .gemini import GEMINI

# Responses events that end a stream (each carries the whole response)
RESPONSES_END = ("response.completed", "response.failed", "response.incomplete")
MESSAGES_STOP = {"end_turn": "stop", "stop_sequence": "stop", "pause_turn": "stop", "max_tokens": "length",
                 "model_context_window_exceeded": "length", "tool_use": "tool_calls",
                 "refusal": "content_filter"}
GEMINI_STOP = {"STOP": "stop", "MAX_TOKENS": "length", "MALFORMED_FUNCTION_CALL": "stop"}


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


class Assembler:
    """One streamed answer of ``api`` (``responses``, ``messages``, ``gemini``, or the engine endpoints
    ``chat/completions`` / ``completions``), fed each event's JSON in order; ``body()`` is the answer
    as the API gives it unstreamed. ``done`` is True once the API's last event has come (Responses:
    ``response.completed`` / ``.failed`` / ``.incomplete``; Messages: ``message_stop``; chat:
    ``[DONE]``, told by the caller; Gemini has no last event: the end of the body is its end)."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.done = False
        self.events = 0
        self.response: dict[str, Any] = {}  # Responses: the latest whole response an event carried
        self.items: dict[int, Any] = {}  # Responses: output items by output_index, as each is done
        self.message: dict[str, Any] = {}  # Messages: the message_start message, then grown
        self.blocks: dict[int, dict[str, Any]] = {}  # Messages: content blocks by index
        self.partial: dict[int, str] = {}  # Messages: a tool_use block's input JSON, as it grows
        self.gemini: dict[str, Any] = {}  # Gemini: the merged response
        self.chat = Capture(api if api in (CHAT, COMPLETIONS) else CHAT)

    def feed(self, obj: Any) -> None:
        """One event's data (parsed JSON)."""
        if not isinstance(obj, dict):
            return
        self.events += 1
        if self.api == RESPONSES:
            self._responses(obj)
        elif self.api == MESSAGES:
            self._messages(obj)
        elif self.api == GEMINI:
            self._gemini(obj)
        else:
            self.chat.add_chunk(obj)

    def _responses(self, ev: dict[str, Any]) -> None:
        if isinstance(ev.get("response"), dict):
            self.response = ev["response"]
        if ev.get("type") == "response.output_item.done" and _int(ev.get("output_index")) is not None:
            self.items[ev["output_index"]] = ev.get("item")
        if ev.get("type") in RESPONSES_END:
            self.done = True

    def _messages(self, ev: dict[str, Any]) -> None:
        kind, i = ev.get("type"), _int(ev.get("index"))
        if kind == "message_start":
            self.message = dict(_dict(ev.get("message")))
            self.message["usage"] = dict(_dict(self.message.get("usage")))
        elif kind == "content_block_start" and i is not None:
            self.blocks[i] = dict(_dict(ev.get("content_block")))
        elif kind == "content_block_delta" and i is not None:
            _grow(self.blocks.setdefault(i, {}), self.partial, i, _dict(ev.get("delta")))
        elif kind == "message_delta":
            self.message.update({k: v for k, v in _dict(ev.get("delta")).items()})
            self.message.setdefault("usage", {}).update(_dict(ev.get("usage")))
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            self.message["error"] = ev.get("error")

    def _gemini(self, chunk: dict[str, Any]) -> None:
        out = self.gemini
        for k, v in chunk.items():
            if k != "candidates":
                out[k] = v  # usageMetadata, modelVersion, responseId, promptFeedback: the latest
        cands = {(_int(c.get("index")) or 0): c for c in out.get("candidates", [])}
        for k, c in enumerate(_list(chunk.get("candidates"))):
            c = _dict(c)
            index = _int(c.get("index")) or (k if "index" not in c else 0)
            have = cands.setdefault(index, {"index": index, "content": {"role": "model", "parts": []}})
            for key, v in c.items():
                if key != "content":
                    have[key] = v
            content = _dict(c.get("content"))
            if content.get("role"):
                have["content"]["role"] = content["role"]
            parts = have["content"]["parts"]
            for p in _list(content.get("parts")):
                _add_part(parts, _dict(p))
        out["candidates"] = [cands[i] for i in sorted(cands)]

    def body(self) -> dict[str, Any]:
        """The answer so far as the API's unstreamed body."""
        if self.api == RESPONSES:
            resp = dict(self.response)
            if self.items and not resp.get("output"):  # ended early: the items that were done
                resp["output"] = [self.items[i] for i in sorted(self.items)]
            return resp
        if self.api == MESSAGES:
            msg = dict(self.message)
            blocks = []
            for i in sorted(self.blocks):
                b = dict(self.blocks[i])
                if i in self.partial:
                    try:
                        b["input"] = json.loads(self.partial[i] or "{}")
                    except ValueError:
                        b["input"] = self.partial[i]  # cut short: the text as it came
                blocks.append(b)
            msg["content"] = blocks
            return msg
        if self.api == GEMINI:
            return self.gemini
        return self.chat.assembled(Injected())


def _grow(block: dict[str, Any], partial: dict[int, str], i: int, delta: dict[str, Any]) -> None:
    """A Messages content block, one delta longer."""
    kind = delta.get("type")
    if kind == "text_delta":
        block["text"] = block.get("text", "") + str(delta.get("text", ""))
    elif kind == "input_json_delta":
        partial[i] = partial.get(i, "") + str(delta.get("partial_json", ""))
    elif kind == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + str(delta.get("thinking", ""))
    elif kind == "signature_delta":
        block["signature"] = block.get("signature", "") + str(delta.get("signature", ""))
    elif kind == "citations_delta":
        block.setdefault("citations", []).append(delta.get("citation"))


def _add_part(parts: list[dict[str, Any]], p: dict[str, Any]) -> None:
    """A Gemini part appended: text that continues a text part of the same kind (thought or not) joins it."""
    last = parts[-1] if parts else None
    if (last is not None and isinstance(p.get("text"), str) and isinstance(last.get("text"), str)
            and bool(p.get("thought")) == bool(last.get("thought")) and set(p) <= {"text", "thought"}
            and set(last) <= {"text", "thought", "thoughtSignature"}):
        last["text"] += p["text"]
    else:
        parts.append(dict(p))


def gemini_stream_body(raw: bytes) -> list[Any] | None:
    """A Gemini ``:streamGenerateContent`` answer without ``alt=sse``: one JSON array of responses."""
    try:
        chunks = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return chunks if isinstance(chunks, list) else None


def columns(api: str, body: Any) -> dict[str, Any]:
    """The ``calls`` columns a hosted answer fills: ``served_model``, ``finish_reason`` (in
    chat/completions' words: stop, length, tool_calls, content_filter) and the three usage counts
    (prompt tokens count cached and cache-written input too; completion tokens count reasoning)."""
    b = _dict(body)
    if api == RESPONSES:
        u = _dict(b.get("usage"))
        prompt, completion = _int(u.get("input_tokens")), _int(u.get("output_tokens"))
        total = _int(u.get("total_tokens"))
        model, finish = b.get("model"), _responses_finish(b)
    elif api == MESSAGES:
        u = _dict(b.get("usage"))
        counts = [_int(u.get(k)) for k in ("input_tokens", "cache_creation_input_tokens",
                                           "cache_read_input_tokens")]
        prompt = sum(c for c in counts if c) if counts[0] is not None else None
        completion, total = _int(u.get("output_tokens")), None
        model = b.get("model")
        finish = MESSAGES_STOP.get(b.get("stop_reason"), b.get("stop_reason"))
    elif api == GEMINI:
        u = _dict(b.get("usageMetadata"))
        prompt, total = _int(u.get("promptTokenCount")), _int(u.get("totalTokenCount"))
        outs = [_int(u.get("candidatesTokenCount")), _int(u.get("thoughtsTokenCount"))]
        completion = sum(c for c in outs if c) if any(c is not None for c in outs) else None
        model, finish = b.get("modelVersion"), _gemini_finish(b)
    else:
        u = _dict(b.get("usage"))
        prompt, completion = _int(u.get("prompt_tokens")), _int(u.get("completion_tokens"))
        total = _int(u.get("total_tokens"))
        first = next((c for c in _list(b.get("choices")) if isinstance(c, dict)), {})
        model, finish = b.get("model"), first.get("finish_reason")
    if total is None and prompt is not None and completion is not None:
        total = prompt + completion
    return {"served_model": model if isinstance(model, str) else None,
            "finish_reason": finish if isinstance(finish, str) else None,
            "usage_prompt_tokens": prompt, "usage_completion_tokens": completion,
            "usage_total_tokens": total}


def _responses_finish(b: dict[str, Any]) -> str | None:
    status = b.get("status")
    if status == "incomplete":
        reason = _dict(b.get("incomplete_details")).get("reason")
        return "content_filter" if reason == "content_filter" else "length"
    if status != "completed":
        return None
    calls = ("function_call", "custom_tool_call", "local_shell_call", "computer_call")
    return "tool_calls" if any(_dict(i).get("type") in calls for i in _list(b.get("output"))) else "stop"


def _gemini_finish(b: dict[str, Any]) -> str | None:
    cand = next((c for c in _list(b.get("candidates")) if isinstance(c, dict)), {})
    reason = cand.get("finishReason")
    if not isinstance(reason, str):
        return None
    parts = _list(_dict(cand.get("content")).get("parts"))
    if reason == "STOP" and any("functionCall" in _dict(p) or "function_call" in _dict(p) for p in parts):
        return "tool_calls"
    return GEMINI_STOP.get(reason, "content_filter")
