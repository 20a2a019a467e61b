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
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .wire import BadRequest, Capture, dumps

RESPONSES = "responses"
MESSAGES = "messages"
APIS = (RESPONSES, MESSAGES)
EMPTY_SCHEMA = {"type": "object", "properties": {}}


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


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """The text of a content given as a string or as a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        ok = isinstance(part, dict) and part.get("type") in kinds and isinstance(part.get("text"), str)
        if not ok:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"{where}[{i}] is a {kind!r} part; only {' / '.join(kinds)} parts can be sent "
                             "to the policy here")
        texts.append(part["text"])
    return "\n".join(texts)


# -- OpenAI Responses → chat --------------------------------------------------------------------------

_RESPONSES_KEEP = ("temperature", "top_p", "parallel_tool_calls", "user", "seed", "stop", "top_k",
                   "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _responses_user_content(content: Any, where: str) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise BadRequest(f"{where}[{i}] is a {kind!r} part, which the policy engine cannot take "
                             "(text and images by URL can)")
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _responses_input(items: list[Any]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} is not an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{where} has role {role!r}; user, assistant, system or developer expected")
            if role == "assistant":
                text = _text_of(item.get("content"), f"{where}.content",
                                ("output_text", "input_text", "text", "refusal"))
                msgs.append({"role": "assistant", "content": text})
            else:
                msgs.append({"role": "system" if role == "developer" else role,
                             "content": _responses_user_content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str):
                    raise BadRequest(f"{where} (a function_call) has no {key!r} string")
            args = item.get("arguments", "")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": args if isinstance(args, str) else
                                 json.dumps(args)}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":  # the same turn: text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where} (a function_call_output) has no 'call_id' string")
            out = item.get("output", "")
            text = out if isinstance(out, str) else _text_of(out, f"{where}.output",
                                                             ("input_text", "output_text", "text"))
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue  # the model's own reasoning, passed back: chat templates render none of it
        else:
            raise BadRequest(f"{where} has type {kind!r}, which cannot be sent to the policy engine "
                             "(messages, function calls and their outputs can)")
    return msgs


def _responses_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        ok = isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("name"), str)
        if not ok:
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadRequest(f"tools[{i}] is a {kind!r} tool, hosted by OpenAI: the policy engine can only "
                             "call function tools")
        out.append(_chat_tool(tool["name"], tool.get("parameters"), tool.get("description"),
                              tool.get("strict")))
    return out


def _chat_tool(name: str, parameters: Any, description: Any, strict: Any = None) -> dict[str, Any]:
    """A chat/completions function tool."""
    fn = {"name": name, "parameters": parameters or EMPTY_SCHEMA}
    if description is not None:
        fn["description"] = description
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def _responses_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" and choice.get("mode") in (
            "auto", "required"):
        return choice["mode"]
    raise BadRequest(f"tool_choice {choice!r} cannot be sent to the policy engine")


def responses_to_chat(req: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if req.get("background"):
        raise BadRequest("background responses cannot be run through the proxy; call without background")
    msgs: list[dict[str, Any]] = []
    instructions = req.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string")
        msgs.append({"role": "system", "content": instructions})
    msgs.extend(history or ())
    inp = req.get("input")
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        msgs.extend(_responses_input(inp))
    elif inp is not None:
        raise BadRequest("'input' must be a string or a list of items")
    if not any(m["role"] != "system" for m in msgs):
        raise BadRequest("this /responses request has no input")
    out: dict[str, Any] = {"messages": msgs}
    if isinstance(req.get("model"), str):
        out["model"] = req["model"]
    for key in _RESPONSES_KEEP:
        if key in req:
            out[key] = req[key]
    if req.get("max_output_tokens") is not None:
        out["max_tokens"] = req["max_output_tokens"]
    if wants_logprobs(req):  # the agent's own: the engine's chat logprobs, passed on in its API
        out["logprobs"] = True
        top = req.get("top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
            raise BadRequest(f"'top_logprobs' must be an integer from 0 to 20, not {top!r}")
        if top:
            out["top_logprobs"] = top
    if req.get("tools"):
        out["tools"] = _responses_tools(req["tools"])
    if req.get("tool_choice") is not None and out.get("tools"):
        out["tool_choice"] = _responses_tool_choice(req["tool_choice"])
    fmt = (req.get("text") or {}).get("format") if isinstance(req.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    if req.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


def wants_logprobs(req: dict[str, Any]) -> bool:
    """A Responses request that asks for its output text's logprobs."""
    include = req.get("include")
    return isinstance(include, list) and "message.output_text.logprobs" in include


def _text_logprobs(content: Any, text: str) -> list[dict[str, Any]]:
    """Responses logprob items for ``text`` from a chat ``logprobs.content`` list: its leading
    entries, as many as spell ``text`` (a whole answer's list also covers tool-call tokens)."""
    out: list[dict[str, Any]] = []
    covered = 0
    def item(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e.get("logprob"),
                "bytes": e.get("bytes") or list(e["token"].encode())}

    for e in content if isinstance(content, list) else ():
        if covered >= len(text) or not isinstance(e, dict) or not isinstance(e.get("token"), str):
            break
        top = [item(t) for t in e.get("top_logprobs") or ()
               if isinstance(t, dict) and isinstance(t.get("token"), str)]
        out.append({**item(e), "top_logprobs": top})
        covered += len(e["token"])
    return out


def carried_history(req: dict[str, Any], chat: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Responses call that a later ``previous_response_id`` continues from: all
    but its ``instructions`` (which, as in OpenAI's API, are not carried over)."""
    return chat["messages"][1 if req.get("instructions") is not None else 0:]


# -- Anthropic Messages → chat ------------------------------------------------------------------------

def _anthropic_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(f"{where}[{i}] is not a content block")
    return content


def _anthropic_image(block: dict[str, Any], where: str) -> dict[str, Any]:
    src = block.get("source") if isinstance(block.get("source"), dict) else {}
    if src.get("type") == "base64":
        url = f"data:{src.get('media_type')};base64,{src.get('data')}"
        return {"type": "image_url", "image_url": {"url": url}}
    if src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    raise BadRequest(f"{where} is an image the policy engine cannot take (base64 or URL sources can)")


def _user_content(parts: list[dict[str, Any]]) -> Any:
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def messages_to_chat(req: dict[str, Any]) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    system = req.get("system")
    if system is not None:
        msgs.append({"role": "system", "content": _text_of(system, "system", ("text",))})
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("this /v1/messages request has no 'messages' list")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"{where} must be an object with role 'user' or 'assistant'")
        blocks = _anthropic_blocks(m.get("content"), f"{where}.content")
        if m["role"] == "assistant":
            text, calls = [], []
            for j, b in enumerate(blocks):
                if b["type"] == "text":
                    text.append(str(b.get("text", "")))
                elif b["type"] == "tool_use":
                    if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                        raise BadRequest(f"{where}.content[{j}] (tool_use) needs an id and a name")
                    calls.append({"id": b["id"], "type": "function", "function": {
                        "name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
                elif b["type"] in ("thinking", "redacted_thinking"):
                    continue  # the model's own thinking, passed back: chat templates render none of it
                else:
                    raise BadRequest(f"{where}.content[{j}] is a {b['type']!r} block, which cannot be sent "
                                     "to the policy engine in an assistant turn")
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text else None}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
            continue
        pending: list[dict[str, Any]] = []  # user parts after the tool results
        for j, b in enumerate(blocks):
            if b["type"] == "tool_result":
                if not isinstance(b.get("tool_use_id"), str):
                    raise BadRequest(f"{where}.content[{j}] (tool_result) has no 'tool_use_id'")
                content = b.get("content", "")
                text = content if isinstance(content, str) else _text_of(
                    content, f"{where}.content[{j}].content", ("text",))
                msgs.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
            elif b["type"] == "text":
                pending.append({"type": "text", "text": str(b.get("text", ""))})
            elif b["type"] == "image":
                pending.append(_anthropic_image(b, f"{where}.content[{j}]"))
            else:
                raise BadRequest(f"{where}.content[{j}] is a {b['type']!r} block, which cannot be sent to "
                                 "the policy engine (text, images, tool_use and tool_result can)")
        if pending:
            msgs.append({"role": "user", "content": _user_content(pending)})
    out: dict[str, Any] = {"messages": msgs}
    if isinstance(req.get("model"), str):
        out["model"] = req["model"]
    if req.get("max_tokens") is not None:
        out["max_tokens"] = req["max_tokens"]
    for key in ("temperature", "top_p", "top_k"):
        if key in req:
            out[key] = req[key]
    if req.get("stop_sequences"):
        out["stop"] = req["stop_sequences"]
    tools = req.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be a list")
        out["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or (
                    t.get("type") not in (None, "custom") and "input_schema" not in t):
                kind = t.get("type") if isinstance(t, dict) else t
                raise BadRequest(f"tools[{i}] ({kind!r}) is a server tool of Anthropic's: the policy engine "
                                 "can only call tools defined by an input_schema")
            out["tools"].append(_chat_tool(t["name"], t.get("input_schema"), t.get("description")))
    choice = req.get("tool_choice")
    if isinstance(choice, dict) and out.get("tools"):
        kind = choice.get("type")
        if kind in ("auto", "none"):
            out["tool_choice"] = kind
        elif kind == "any":
            out["tool_choice"] = "required"
        elif kind == "tool" and isinstance(choice.get("name"), str):
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise BadRequest(f"tool_choice {choice!r} cannot be sent to the policy engine")
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    if req.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


def to_chat(api: str, req: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat/completions request for an agent's ``api`` request; BadRequest names what cannot be sent."""
    if api == RESPONSES:
        return responses_to_chat(req, history)
    return messages_to_chat(req)


def error_body(api: str, status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """An error in the API's own shape (Responses: OpenAI's; Messages: Anthropic's)."""
    if api == MESSAGES:
        kind = kind or {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                        404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                        529: "overloaded_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind or ("invalid_request_error" if status < 500 else
                                                           "server_error"), "param": None, "code": None}}


# -- chat → the agent's API -----------------------------------------------------------------------------

def _usage(capture: Capture) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a call, as the engine counted them."""
    usage = capture.usage_dict() or {}
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (p if isinstance(p, int) else 0), (c if isinstance(c, int) else 0)


@dataclass
class _Tool:
    index: int  # position in the API's output / content list
    item_id: str
    call_id: str
    name: str = ""
    arguments: str = ""
    opened: bool = False


@dataclass
class Translator:
    """One call's answer in the agent's API, from the engine's chat answer (whole or streamed).

    ``request`` is the agent's own request (echoed where the API echoes it); ``model`` the name the
    agent asked for. A stream is translated event by event: ``chunk`` for each chat chunk (its JSON),
    ``finish`` when the chat stream ended (after the call was recorded), ``body`` for a whole answer.
    """

    api: str
    request: dict[str, Any]
    model: str | None
    response_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    seq: int = 0
    started: bool = False
    text_open: bool = False
    text_index: int = -1
    text_id: str = ""
    text: str = ""
    reasoning: str = ""
    reasoning_index: int = -1
    reasoning_id: str = ""
    reasoning_closed: bool = False
    items: int = 0  # output items / content blocks opened so far
    tools: dict[int, _Tool] = field(default_factory=dict)
    text_logprobs: list[dict[str, Any]] = field(default_factory=list)  # when the agent asked for them
    finish_reason: str | None = None
    stop_reason: Any = None

    def __post_init__(self) -> None:
        if not self.response_id:
            self.response_id = _new_id("resp" if self.api == RESPONSES else "msg")

    # -- SSE ------------------------------------------------------------------------------------------
    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        if self.api == RESPONSES:
            data = {"type": kind, "sequence_number": self.seq, **data}
            self.seq += 1
        else:
            data = {"type": kind, **data}
        return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"

    # -- Responses objects ----------------------------------------------------------------------------
    def _envelope(self, status: str, output: list[dict[str, Any]], usage: tuple[int, int] | None,
                  incomplete: str | None = None) -> dict[str, Any]:
        r = self.request
        text = r.get("text") if isinstance(r.get("text"), dict) else {"format": {"type": "text"}}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.get("instructions"), "max_output_tokens": r.get("max_output_tokens"),
            "metadata": r.get("metadata") or {}, "model": self.model or r.get("model") or "",
            "output": output, "parallel_tool_calls": r.get("parallel_tool_calls", True),
            "previous_response_id": r.get("previous_response_id"), "reasoning": r.get("reasoning"),
            "store": r.get("store", True), "temperature": r.get("temperature", 1.0), "text": text,
            "tool_choice": r.get("tool_choice", "auto"), "tools": r.get("tools") or [],
            "top_p": r.get("top_p", 1.0), "truncation": r.get("truncation", "disabled"),
            "user": r.get("user"),
            "usage": None if usage is None else {
                "input_tokens": usage[0],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": usage[1], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage[0] + usage[1]},
        }

    def _message_item(self, status: str) -> dict[str, Any]:
        return {"id": self.text_id, "type": "message", "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [self._text_part()]}

    def _text_part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.text_logprobs}

    def _reasoning_item(self) -> dict[str, Any]:
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": self.reasoning}]}

    def _call_item(self, t: _Tool, status: str) -> dict[str, Any]:
        return {"id": t.item_id, "type": "function_call", "status": status, "call_id": t.call_id,
                "name": t.name, "arguments": t.arguments}

    def _output(self) -> list[tuple[int, dict[str, Any]]]:
        out: list[tuple[int, dict[str, Any]]] = []
        if self.reasoning_index >= 0:
            out.append((self.reasoning_index, self._reasoning_item() if self.api == RESPONSES else
                        {"type": "thinking", "thinking": self.reasoning, "signature": ""}))
        if self.text_index >= 0:
            out.append((self.text_index, self._message_item("completed") if self.api == RESPONSES else
                        {"type": "text", "text": self.text}))
        for t in self.tools.values():
            if self.api == RESPONSES:
                out.append((t.index, self._call_item(t, "completed")))
            else:
                out.append((t.index, {"type": "tool_use", "id": t.call_id, "name": t.name,
                                      "input": _tool_input(t.arguments)}))
        return sorted(out, key=lambda x: x[0])

    # -- Anthropic objects ----------------------------------------------------------------------------
    def _stop_reason(self) -> str:
        if self.finish_reason == "length":
            return "max_tokens"
        if self.tools or self.finish_reason == "tool_calls":
            return "tool_use"
        stops = self.request.get("stop_sequences") or ()
        if isinstance(self.stop_reason, str) and isinstance(stops, list) and self.stop_reason in stops:
            return "stop_sequence"
        return "end_turn"

    def _message(self, content: list[dict[str, Any]], stop: str | None,
                 usage: tuple[int, int]) -> dict[str, Any]:
        return {"id": self.response_id, "type": "message", "role": "assistant",
                "model": self.model or self.request.get("model") or "", "content": content,
                "stop_reason": stop,
                "stop_sequence": self.stop_reason if stop == "stop_sequence" else None,
                "usage": {"input_tokens": usage[0], "output_tokens": usage[1],
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}

    # -- the answer, piece by piece --------------------------------------------------------------------
    def _start(self, prompt_tokens: int) -> list[bytes]:
        self.started = True
        if self.api == RESPONSES:
            head = self._envelope("in_progress", [], None)
            return [self._event("response.created", {"response": head}),
                    self._event("response.in_progress", {"response": head})]
        return [self._event("message_start", {"message": self._message([], None, (prompt_tokens, 0))})]

    def _close_text(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        if self.api == RESPONSES:
            at = {"item_id": self.text_id, "output_index": self.text_index}
            return [self._event("response.output_text.done", {**at, "content_index": 0, "text": self.text,
                                                              "logprobs": self.text_logprobs}),
                    self._event("response.content_part.done", {**at, "content_index": 0,
                                                               "part": self._text_part()}),
                    self._event("response.output_item.done", {"output_index": self.text_index,
                                                              "item": self._message_item("completed")})]
        return [self._event("content_block_stop", {"index": self.text_index})]

    def _reasoning_delta(self, delta: str) -> list[bytes]:
        out = []
        if self.reasoning_index < 0:
            self.reasoning_index, self.reasoning_id = self.items, _new_id("rs")
            self.items += 1
            if self.api == RESPONSES:
                out.append(self._event("response.output_item.added", {
                    "output_index": self.reasoning_index,
                    "item": {**self._reasoning_item(), "content": []}}))
            else:
                out.append(self._event("content_block_start", {
                    "index": self.reasoning_index, "content_block": {"type": "thinking", "thinking": "",
                                                                     "signature": ""}}))
        self.reasoning += delta
        if self.api == RESPONSES:
            out.append(self._event("response.reasoning_text.delta", {
                "item_id": self.reasoning_id, "output_index": self.reasoning_index, "content_index": 0,
                "delta": delta}))
        else:
            out.append(self._event("content_block_delta", {
                "index": self.reasoning_index, "delta": {"type": "thinking_delta", "thinking": delta}}))
        return out

    def _close_reasoning(self) -> list[bytes]:
        if self.reasoning_index < 0 or self.reasoning_closed:
            return []
        self.reasoning_closed = True
        if self.api == RESPONSES:
            return [self._event("response.reasoning_text.done", {
                        "item_id": self.reasoning_id, "output_index": self.reasoning_index,
                        "content_index": 0, "text": self.reasoning}),
                    self._event("response.output_item.done", {"output_index": self.reasoning_index,
                                                              "item": self._reasoning_item()})]
        return [self._event("content_block_delta", {"index": self.reasoning_index,
                                                    "delta": {"type": "signature_delta", "signature": ""}}),
                self._event("content_block_stop", {"index": self.reasoning_index})]

    def _text_delta(self, delta: str, logprobs: list[dict[str, Any]] = ()) -> list[bytes]:
        out = self._close_reasoning()
        if self.text_index < 0:
            self.text_index, self.text_id, self.text_open = self.items, _new_id("msg"), True
            self.items += 1
            if self.api == RESPONSES:
                out.append(self._event("response.output_item.added", {
                    "output_index": self.text_index, "item": self._message_item("in_progress")}))
                out.append(self._event("response.content_part.added", {
                    "item_id": self.text_id, "output_index": self.text_index, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
            else:
                out.append(self._event("content_block_start", {
                    "index": self.text_index, "content_block": {"type": "text", "text": ""}}))
        elif not self.text_open:  # text after a tool call began (a parser's leftovers): kept in the
            self.text += delta      # final answer, not streamed into a closed item
            self.text_logprobs += logprobs
            return out
        self.text += delta
        self.text_logprobs += logprobs
        if self.api == RESPONSES:
            out.append(self._event("response.output_text.delta", {
                "item_id": self.text_id, "output_index": self.text_index, "content_index": 0,
                "delta": delta, "logprobs": [
                    {"token": lp["token"], "logprob": lp["logprob"],
                     "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                                      for t in lp["top_logprobs"]]} for lp in logprobs]}))
        else:
            out.append(self._event("content_block_delta", {
                "index": self.text_index, "delta": {"type": "text_delta", "text": delta}}))
        return out

    def _tool_delta(self, tc: dict[str, Any]) -> list[bytes]:
        index = tc.get("index", 0) if isinstance(tc.get("index"), int) else 0
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
        out: list[bytes] = []
        t = self.tools.get(index)
        if t is None:
            out += self._close_reasoning() + self._close_text()
            for other in self.tools.values():
                out += self._close_tool(other)
            call_id = tc.get("id") if isinstance(tc.get("id"), str) and tc.get("id") else _new_id("call")
            if self.api == MESSAGES and not call_id.startswith("toolu_"):
                call_id = "toolu_" + call_id.removeprefix("call_").removeprefix("chatcmpl-tool-")
            t = self.tools[index] = _Tool(self.items, _new_id("fc"), call_id)
            self.items += 1
        if isinstance(fn.get("name"), str):
            t.name += fn["name"]
        args = fn.get("arguments") if isinstance(fn.get("arguments"), str) else ""
        if not t.opened:
            t.opened = True
            if self.api == RESPONSES:
                out.append(self._event("response.output_item.added", {
                    "output_index": t.index, "item": {**self._call_item(t, "in_progress"), "arguments": ""}}))
            else:
                out.append(self._event("content_block_start", {
                    "index": t.index, "content_block": {"type": "tool_use", "id": t.call_id, "name": t.name,
                                                        "input": {}}}))
        if args:
            t.arguments += args
            if self.api == RESPONSES:
                out.append(self._event("response.function_call_arguments.delta", {
                    "item_id": t.item_id, "output_index": t.index, "delta": args}))
            else:
                out.append(self._event("content_block_delta", {
                    "index": t.index, "delta": {"type": "input_json_delta", "partial_json": args}}))
        return out

    def _close_tool(self, t: _Tool) -> list[bytes]:
        if not t.opened:
            return []
        t.opened = False
        index = t.index
        if self.api == RESPONSES:
            return [self._event("response.function_call_arguments.done", {
                        "item_id": t.item_id, "output_index": index, "name": t.name,
                        "arguments": t.arguments}),
                    self._event("response.output_item.done", {"output_index": index,
                                                              "item": self._call_item(t, "completed")})]
        return [self._event("content_block_stop", {"index": index})]

    def chunk(self, obj: dict[str, Any]) -> bytes:
        """The agent's events for one chat stream chunk (b"" when it says nothing in the API)."""
        out: list[bytes] = []
        if not self.started:
            ids = obj.get("prompt_token_ids")
            out += self._start(len(ids) if isinstance(ids, list) else 0)
        choices = obj.get("choices") if isinstance(obj.get("choices"), list) else []
        for ch in choices:
            if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                continue  # n > 1 has no counterpart in either API: choice 0 is the answer
            delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
            for key in ("reasoning_content", "reasoning"):
                if isinstance(delta.get(key), str) and delta[key]:
                    out += self._reasoning_delta(delta[key])
                    break
            if isinstance(delta.get("content"), str) and delta["content"]:
                lps = ()
                if self.api == RESPONSES and wants_logprobs(self.request):
                    lp = ch.get("logprobs") if isinstance(ch.get("logprobs"), dict) else {}
                    lps = _text_logprobs(lp.get("content"), delta["content"])
                out += self._text_delta(delta["content"], lps)
            for tc in delta.get("tool_calls") or ():
                if isinstance(tc, dict):
                    out += self._tool_delta(tc)
            if ch.get("finish_reason") is not None:
                self.finish_reason = ch["finish_reason"]
                self.stop_reason = ch.get("stop_reason")
        return b"".join(out)

    def finish(self, capture: Capture) -> bytes:
        """The closing events, once the chat stream ended and the call was recorded."""
        out: list[bytes] = [] if self.started else self._start(len(capture.prompt_token_ids or ()))
        out += self._close_reasoning() + self._close_text()
        for t in self.tools.values():
            out += self._close_tool(t)
        usage = _usage(capture)
        if self.api == RESPONSES:
            incomplete = "max_output_tokens" if self.finish_reason == "length" else None
            final = self._envelope("incomplete" if incomplete else "completed",
                                   [item for _, item in self._output()], usage, incomplete)
            out.append(self._event("response.incomplete" if incomplete else "response.completed",
                                   {"response": final}))
        else:
            stop = self._stop_reason()
            out.append(self._event("message_delta", {
                "delta": {"stop_reason": stop,
                          "stop_sequence": self.stop_reason if stop == "stop_sequence" else None},
                "usage": {"output_tokens": usage[1]}}))
            out.append(self._event("message_stop", {}))
        return b"".join(out)

    def failure(self, message: str, capture: Capture) -> bytes:
        """The closing event of a stream the engine did not finish: the API's own failure event
        (``response.failed``; Anthropic's ``error`` event), which the SDKs raise or report."""
        out = [] if self.started else self._start(len(capture.prompt_token_ids or ()))
        if self.api == RESPONSES:
            failed = self._envelope("failed", [item for _, item in self._output()], _usage(capture))
            failed["error"] = {"code": "server_error", "message": message}
            return b"".join([*out, self._event("response.failed", {"response": failed})])
        return b"".join([*out, self._event("error", {"error": {"type": "api_error", "message": message}})])

    def final(self, capture: Capture) -> dict[str, Any]:
        """The whole answer as the API's response object (what a stream's events add up to)."""
        usage = _usage(capture)
        if self.api == RESPONSES:
            incomplete = "max_output_tokens" if self.finish_reason == "length" else None
            return self._envelope("incomplete" if incomplete else "completed",
                                  [item for _, item in self._output()], usage, incomplete)
        return self._message([item for _, item in self._output()], self._stop_reason(), usage)

    def body(self, chat: dict[str, Any], capture: Capture) -> dict[str, Any]:
        """A whole (non-streamed) chat answer as the API's response object."""
        choices = chat.get("choices") if isinstance(chat.get("choices"), list) else []
        first = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None)
        if first is not None:
            msg = first.get("message") if isinstance(first.get("message"), dict) else {}
            delta = {k: msg.get(k) for k in ("reasoning_content", "reasoning", "content")}
            calls = msg.get("tool_calls") if isinstance(msg.get("tool_calls"), list) else []
            delta["tool_calls"] = [{**tc, "index": i} for i, tc in enumerate(calls) if isinstance(tc, dict)]
            self.started = True  # no events: only the state they would build
            self.chunk({"choices": [{"index": 0, "delta": delta, "finish_reason": first.get("finish_reason"),
                                     "stop_reason": first.get("stop_reason"),
                                     "logprobs": first.get("logprobs")}]})
        return self.final(capture)

    def history(self) -> list[dict[str, Any]]:
        """The assistant's turn as chat messages (for a later ``previous_response_id``)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.tools:
            msg["tool_calls"] = [{"id": t.call_id, "type": "function",
                                  "function": {"name": t.name, "arguments": t.arguments}}
                                 for t in sorted(self.tools.values(), key=lambda t: t.index)]
        return [msg]


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


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"_unparsed_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}
