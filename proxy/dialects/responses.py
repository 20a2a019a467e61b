"""The OpenAI Responses API → chat/completions (the request side; answers: :mod:`.stream`)."""

from __future__ import annotations

import json
from typing import Any

from ..wire import BadRequest
from .common import chat_tool, text_of

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
                text = text_of(item.get("content"), f"{where}.content",
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
            text = out if isinstance(out, str) else text_of(out, f"{where}.output",
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
        out.append(chat_tool(tool["name"], tool.get("parameters"), tool.get("description"),
                              tool.get("strict")))
    return out


def _responses_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" and choice.get("mode") in (
            "auto", "required"):
        return choice["mode"]
    raise BadRequest(f"tool_choice {choice!r} cannot be sent to the policy engine")


def responses_to_chat(req: dict[str, Any], history: list[dict[str, Any]] | None = None,
                      notes: list[str] | None = None) -> dict[str, Any]:
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


def text_logprobs(content: Any, text: str) -> list[dict[str, Any]]:
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
