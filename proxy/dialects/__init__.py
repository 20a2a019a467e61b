"""The OpenAI Responses API and the Anthropic Messages API, spoken to agents over chat/completions.

An agent that calls ``POST …/responses`` (Codex, the OpenAI Agents SDK) or ``POST …/v1/messages``
(Claude Code, Anthropic-SDK agents) is answered in its own API, while the engine is asked through
chat/completions: the one endpoint where vLLM returns the prompt's and the answer's token ids and one
logprob per generated token (its native ``/v1/responses`` leaves gaps in the logprobs — none for a
function call, none for a streamed end token — and its ``/v1/messages`` drops every extra field, so
neither gives an exact capture). vLLM renders the same chat template for all three, so the prompt ids
are those the agent's call would have had.

Pure functions and small state machines, no mitmproxy:

- ``to_chat(api, request, history)`` → the chat/completions request (``BadRequest``: one sentence);
- ``Translator`` turns the engine's chat answer into the agent's API: ``body(chat)`` for a whole
  response, ``chunk(obj)`` / ``finish(capture)`` for a stream — the typed event sequence of the API
  (``response.created`` … ``response.completed``; ``message_start`` … ``message_stop``);
- ``error_body(api, status, message)`` — an error in the API's own shape.

What cannot be translated is refused with a 400 naming it: hosted tools (web search, file search,
computer use …), stored items referenced by id, files, audio. Reasoning items an agent passes back are
dropped from the prompt (chat templates render no reasoning history); ``previous_response_id`` is
resolved by the caller (the proxy keeps each rollout's recent conversations) and passed as ``history``.
"""

from __future__ import annotations

import json
from typing import Any

from ..wire import BadRequest
from .common import EMPTY_SCHEMA, MESSAGES, RESPONSES, Notes, chat_tool, new_id, text_of, tool_input
from .messages import messages_to_chat
from .responses import carried_history, responses_to_chat, wants_logprobs
from .stream import Translator

APIS = (RESPONSES, MESSAGES)
__all__ = ["APIS", "EMPTY_SCHEMA", "MESSAGES", "RESPONSES", "BadRequest", "Notes", "Translator", "api_of",
           "as_chat", "carried_history", "chat_tool", "error_body", "messages_to_chat", "models_answer",
           "models_path", "new_id", "responses_to_chat", "text_of", "to_chat", "tool_input", "translator",
           "wants_logprobs"]


def api_of(method: str, path: str) -> str | None:
    """``responses`` or ``messages`` for a call of those APIs (whatever the host or prefix), else None."""
    if method.upper() != "POST":
        return None
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith("/responses") or p == "responses":
        return RESPONSES
    if p.endswith("/v1/messages") or p in ("messages", "/messages"):
        return MESSAGES
    return None


def models_path(method: str, path: str) -> str | None:
    """For ``GET …/v1/models`` the empty string, for ``GET …/v1/models/<id>`` the id; else None."""
    if method.upper() != "GET":
        return None
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith("/v1/models"):
        return ""
    _, sep, tail = p.rpartition("/v1/models/")
    return tail if sep and tail and "/" not in tail else None


def models_answer(anthropic: bool, model_id: str, names: list[str]) -> dict[str, Any]:
    """What a model listing (``model_id`` "") or lookup answers: every name in ``names`` (the served
    model, the names agents asked for), or the one asked about, in OpenAI's or Anthropic's shape."""
    ids = [model_id] if model_id else names
    if anthropic:
        data = [{"type": "model", "id": m, "display_name": m, "created_at": "2026-01-01T00:00:00Z"}
                for m in ids]
        if model_id:
            return data[0]
        return {"data": data, "has_more": False, "first_id": ids[0] if ids else None,
                "last_id": ids[-1] if ids else None}
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "lgt"} for m in ids]
    return data[0] if model_id else {"object": "list", "data": data}


def to_chat(api: str, req: dict[str, Any], history: list[dict[str, Any]] | None = None,
            notes: Notes | None = None) -> dict[str, Any]:
    """The chat/completions request for an agent's ``api`` request; BadRequest names what cannot be sent.
    What the translation approximates is appended to ``notes`` (one sentence each)."""
    notes = [] if notes is None else notes
    if api == RESPONSES:
        return responses_to_chat(req, history, notes)
    return messages_to_chat(req, notes)


def translator(api: str, request: dict[str, Any], model: str | None) -> Translator:
    """The object that gives one call's answer in ``api`` (whole: ``body``; streamed: ``chunk`` /
    ``finish`` / ``failure``; ``final``, ``history``, ``notes``, ``response_id``)."""
    return Translator(api, request, model=model)


def error_body(api: str, status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """An error in the API's own shape (Responses: OpenAI's; Messages: Anthropic's)."""
    if api == MESSAGES:
        kind = kind or {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                        404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                        529: "overloaded_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind or ("invalid_request_error" if status < 500 else
                                                           "server_error"), "param": None, "code": None}}


def as_chat(api: str, request: Any, response: Any) -> tuple[Any, Any]:
    """A recorded Responses / Messages call (the agent's request and the body it got) as the
    chat/completions request and response it stands for, for display (``lgt-train show``); a part that
    cannot be read comes back as None."""
    try:
        chat_req = to_chat(api, request) if isinstance(request, dict) else None
    except (BadRequest, ValueError, TypeError, KeyError):
        chat_req = None
    if not isinstance(response, dict):
        return chat_req, None
    text, calls, reasoning = [], [], []
    items = response.get("output") if api == RESPONSES else response.get("content")
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            text += [p.get("text", "") for p in item.get("content") or () if isinstance(p, dict)]
        elif kind == "text":
            text.append(str(item.get("text", "")))
        elif kind in ("function_call", "tool_use"):
            args = item.get("arguments") if kind == "function_call" else json.dumps(item.get("input"))
            calls.append({"id": item.get("call_id") or item.get("id"), "type": "function",
                          "function": {"name": item.get("name"), "arguments": args}})
        elif kind == "reasoning":
            reasoning += [p.get("text", "") for p in item.get("content") or () if isinstance(p, dict)]
        elif kind == "thinking":
            reasoning.append(str(item.get("thinking", "")))
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return chat_req, {"choices": [{"index": 0, "message": msg}]}
