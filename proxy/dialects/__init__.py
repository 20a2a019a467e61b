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

What the hosted APIs take is never refused: mapped to its nearest chat form, carried as text, or left
out, and noted (``docs/dialects/``). Reasoning items an agent passes back are dropped from the prompt
(chat templates render no reasoning history); ``previous_response_id`` is resolved by the caller (the
proxy keeps each rollout's recent conversations as Responses items) with ``with_history``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..wire import BadRequest
from . import gemini
from .common import EMPTY_SCHEMA, MESSAGES, RESPONSES, Notes, chat_tool, new_id, text_of, tool_input
from .gemini import GEMINI
from .gemini_answer import GeminiTranslator, answer_as_chat
from .messages import is_count_tokens, messages_to_chat
from .responses import carried_history, responses_to_chat, wants_logprobs, with_history
from .stream import Translator

APIS = (RESPONSES, MESSAGES, GEMINI)
__all__ = ["APIS", "EMPTY_SCHEMA", "GEMINI", "MESSAGES", "RESPONSES", "BadRequest", "GeminiTranslator",
           "Notes", "Translator", "agent_request", "api_of", "as_chat", "carried_history", "chat_tool",
           "count_answer", "count_tokens_api", "error_body", "is_count_tokens", "messages_to_chat",
           "models_answer", "models_path", "models_shape", "new_id", "responses_to_chat", "text_of",
           "to_chat", "tool_input", "translator", "wants_logprobs", "with_history"]


def api_of(method: str, path: str) -> str | None:
    """``responses``, ``messages`` or ``gemini`` for a call of those APIs (whatever the host or prefix),
    else None."""
    if method.upper() != "POST":
        return None
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith("/responses") or p == "responses":
        return RESPONSES
    if p.endswith("/v1/messages") or p in ("messages", "/messages"):
        return MESSAGES
    found = gemini.call_of(p)
    if found is not None and found[1] != gemini.COUNT:
        return GEMINI
    return None


def count_tokens_api(method: str, path: str) -> str | None:
    """The API of a token-count call (Anthropic's ``…/v1/messages/count_tokens``, Gemini's
    ``…/models/<model>:countTokens``), else None."""
    if is_count_tokens(method, path):
        return MESSAGES
    found = gemini.call_of(path) if method.upper() == "POST" else None
    return GEMINI if found is not None and found[1] == gemini.COUNT else None


def count_answer(api: str, count: int) -> dict[str, Any]:
    """A token count in the API's shape."""
    return {"totalTokens": count} if api == GEMINI else {"input_tokens": count}


def agent_request(api: str, path: str, req: dict[str, Any]) -> dict[str, Any]:
    """The agent's request as its dialect reads it: the body, plus what the API says in the URL instead
    (Gemini: the model in the path, streaming in the method and ``alt``); other APIs' bodies as they are."""
    return gemini.agent_request(path, req) if api == GEMINI else req


def models_path(method: str, path: str) -> str | None:
    """For ``GET …/v1/models`` the empty string, for ``GET …/v1/models/<id>`` the id (Gemini's
    ``/v1beta/models`` too); else None."""
    if method.upper() != "GET":
        return None
    m = _MODELS.search(path.split("?", 1)[0].rstrip("/"))
    return None if m is None else m[1] or ""


_MODELS = re.compile(r"/(?:v1|v1beta|v1alpha)/models(?:/([^/]+))?$")


def models_shape(path: str, headers: Mapping[str, str]) -> str | None:
    """Whose shape a model listing is answered in: Anthropic's (``messages``: an ``anthropic-version``
    header), Gemini's (a ``v1beta`` / ``v1alpha`` path, or Google's key or client header), else
    OpenAI's (None)."""
    if "anthropic-version" in headers:
        return MESSAGES
    if re.search(r"/v1(beta|alpha)/", path) or "x-goog-api-key" in headers or "x-goog-api-client" in headers:
        return GEMINI
    return None


def models_answer(shape: str | bool | None, model_id: str, names: list[str]) -> dict[str, Any]:
    """What a model listing (``model_id`` "") or lookup answers: every name in ``names`` (the served
    model, the names agents asked for), or the one asked about, in the shape :func:`models_shape` chose
    (OpenAI's for None; ``True`` is Anthropic's, as before)."""
    if shape == GEMINI:
        return gemini.models_answer(model_id, names)
    ids = [model_id] if model_id else names
    if shape is True or shape == MESSAGES:
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
    if api == GEMINI:
        return gemini.gemini_to_chat(req, notes)
    return messages_to_chat(req, notes)


def translator(api: str, request: dict[str, Any], model: str | None) -> Translator | GeminiTranslator:
    """The object that gives one call's answer in ``api`` (whole: ``body``; streamed: ``chunk`` /
    ``finish`` / ``failure``; ``final``, ``history``, ``notes``, ``response_id``)."""
    if api == GEMINI:
        return GeminiTranslator(request, model=model)
    return Translator(api, request, model=model)


def error_body(api: str, status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """An error in the API's own shape (Responses: OpenAI's; Messages: Anthropic's; Gemini: Google's)."""
    if api == GEMINI:
        return gemini.error_body(status, message)
    if api == MESSAGES:
        kind = kind or {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                        404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                        529: "overloaded_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind or ("invalid_request_error" if status < 500 else
                                                           "server_error"), "param": None, "code": None}}


def as_chat(api: str, request: Any, response: Any) -> tuple[Any, Any]:
    """A recorded Responses / Messages / Gemini call (the agent's request and the body it got) as the
    chat/completions request and response it stands for, for display (``lgt-train show``) and for
    learning from a hosted model (``lgt-train sft``); a part that cannot be read comes back as None.
    A chat/completions call (a hosted model's too) is already what it stands for."""
    if api not in APIS:
        return request, response
    try:
        chat_req = to_chat(api, request) if isinstance(request, dict) else None
    except (BadRequest, ValueError, TypeError, KeyError):
        chat_req = None
    if not isinstance(response, dict):
        return chat_req, None
    if api == GEMINI:
        return chat_req, answer_as_chat(response)
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
        elif kind in ("function_call", "tool_use", "custom_tool_call"):
            args = item.get("arguments") if kind == "function_call" else json.dumps(
                item.get("input") if kind == "tool_use" else {"input": item.get("input")})
            calls.append({"id": item.get("call_id") or item.get("id"), "type": "function",
                          "function": {"name": item.get("name"), "arguments": args}})
        elif kind == "reasoning":  # the reasoning text when given, else its summary (hosted models')
            parts = item.get("content") or item.get("summary") or ()
            reasoning += [str(p.get("text", "")) for p in parts if isinstance(p, dict)]
        elif kind == "thinking":
            reasoning.append(str(item.get("thinking", "")))
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return chat_req, {"choices": [{"index": 0, "message": msg}]}
