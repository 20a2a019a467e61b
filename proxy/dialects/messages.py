"""The Anthropic Messages API → chat/completions (the request side; answers: :mod:`.stream`)."""

from __future__ import annotations

import json
from typing import Any

from ..wire import BadRequest
from .common import chat_tool, text_of


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


def messages_to_chat(req: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    system = req.get("system")
    if system is not None:
        msgs.append({"role": "system", "content": text_of(system, "system", ("text",))})
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
                text = content if isinstance(content, str) else text_of(
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
            out["tools"].append(chat_tool(t["name"], t.get("input_schema"), t.get("description")))
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
