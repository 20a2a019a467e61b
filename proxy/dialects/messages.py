"""The Anthropic Messages API → chat/completions (the request side; answers: :mod:`.stream`).

Liberal: whatever the hosted API takes is sent, each field, role, block and tool at its nearest
chat/completions form, carried as text, or ignored; what changes what the policy sees or how it
decodes is appended to ``notes``. Only input that is not a Messages request at all (no ``messages``
list, a message or block that is not an object, a ``tool_use`` without id and name) is a BadRequest.
The table of every decision is docs/dialects/messages.md.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..wire import BadRequest
from .common import Approx, chat_tool, place_system

BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's system block with a per-request hash
CARRY_LIMIT = 4096  # an unknown block is carried as its JSON text up to this many characters
COUNT_TOKENS = "/v1/messages/count_tokens"

# Anthropic-defined tools that the client runs: offered as functions with these schemas, under the
# name the agent gave (bash, str_replace_based_edit_tool, memory), so its calls reach the agent.
_EDIT = {"type": "string"}
_LINES = {"type": "array", "items": {"type": "integer"}}
CLIENT_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "bash": ("Run a command in a persistent bash shell.", {
        "type": "object", "properties": {"command": {"type": "string"}, "restart": {"type": "boolean"}}}),
    "text_editor": ("View, create and edit files: command view, create, str_replace, insert or undo_edit.", {
        "type": "object", "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
            "path": _EDIT, "file_text": _EDIT, "old_str": _EDIT, "new_str": _EDIT, "insert_text": _EDIT,
            "insert_line": {"type": "integer"}, "view_range": _LINES},
        "required": ["command", "path"]}),
    "memory": ("Keep notes in a /memories directory: command view, create, str_replace, insert, delete or "
               "rename.", {
        "type": "object", "properties": {
            "command": {"type": "string",
                        "enum": ["view", "create", "str_replace", "insert", "delete", "rename"]},
            "path": _EDIT, "file_text": _EDIT, "old_str": _EDIT, "new_str": _EDIT, "insert_text": _EDIT,
            "insert_line": {"type": "integer"}, "old_path": _EDIT, "new_path": _EDIT,
            "view_range": _LINES},
        "required": ["command"]}),
}
_VERSIONED = re.compile(r"^(.*?)_(\d{8})$")  # bash_20250124 → bash


def is_count_tokens(method: str, path: str) -> bool:
    """``POST …/v1/messages/count_tokens`` (any host or prefix, any query)."""
    return method.upper() == "POST" and path.split("?", 1)[0].rstrip("/").endswith(COUNT_TOKENS)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(f"{where}[{i}] is not a content block (an object with a 'type')")
    return content


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "" if value is None else json.dumps(value, ensure_ascii=False)


def _carried(b: dict[str, Any], where: str, ap: Approx) -> dict[str, Any] | None:
    """A block with no chat form: its JSON as text, or left out when longer than CARRY_LIMIT."""
    text = json.dumps(b, ensure_ascii=False, separators=(",", ":"))
    if len(text) > CARRY_LIMIT:
        ap.add(f"a {b['type']!r} block (no chat form) left out: its JSON is over {CARRY_LIMIT} characters",
               where)
        return None
    ap.add(f"a {b['type']!r} block (no chat form) sent as the text of its JSON", where)
    return {"type": "text", "text": text}


def _image(b: dict[str, Any], where: str, ap: Approx) -> dict[str, Any]:
    src = b.get("source") if isinstance(b.get("source"), dict) else {}
    if src.get("type") == "base64" and isinstance(src.get("data"), str):
        media = src.get("media_type") if isinstance(src.get("media_type"), str) else "image/png"
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{src['data']}"}}
    if src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    ap.add("an image the engine cannot fetch (a Files API or unknown source) sent as a placeholder text",
           where)
    return {"type": "text", "text": f"[image: {src.get('file_id') or src.get('type') or 'unknown source'}]"}


def _document(b: dict[str, Any], where: str, ap: Approx) -> dict[str, Any]:
    src = b.get("source") if isinstance(b.get("source"), dict) else {}
    title = b.get("title") if isinstance(b.get("title"), str) else None
    kind = src.get("type")
    if kind == "text" and isinstance(src.get("data"), str):
        body = src["data"]
    elif kind == "content":
        inner = src.get("content")
        parts = _blocks(inner, f"{where}.source.content") if isinstance(inner, (str, list)) else []
        body = "\n".join(_text(p.get("text")) for p in parts if p.get("type") == "text")
    else:
        ap.add("a document the policy cannot read (a PDF, URL or Files API source) sent as a placeholder "
               "text", where)
        name = title or src.get("url") or src.get("file_id") or src.get("media_type") or kind or "document"
        return {"type": "text", "text": f"[document: {name}]"}
    ap.add("a document block sent as its text", where)
    return {"type": "text", "text": f"{title}\n\n{body}" if title else body}


def _search_result(b: dict[str, Any], where: str, ap: Approx) -> dict[str, Any]:
    inner = b.get("content")
    parts = _blocks(inner, f"{where}.content") if isinstance(inner, (str, list)) else []
    head = [x for x in (b.get("title"), b.get("source")) if isinstance(x, str) and x]
    ap.add("a search_result block sent as its title, source and text", where)
    return {"type": "text", "text": "\n".join([*head, *(_text(p.get("text")) for p in parts
                                                         if p.get("type") == "text")])}


def _user_part(b: dict[str, Any], where: str, ap: Approx) -> dict[str, Any] | None:
    """One block of a user turn (or of a tool result) as a chat content part; None: left out."""
    kind = b["type"]
    if kind == "text":
        return {"type": "text", "text": _text(b.get("text"))}
    if kind == "image":
        return _image(b, where, ap)
    if kind == "document":
        return _document(b, where, ap)
    if kind == "search_result":
        return _search_result(b, where, ap)
    if kind == "container_upload":
        ap.add("a container_upload block left out: it feeds Anthropic's hosted code execution", where)
        return None
    if kind in ("thinking", "redacted_thinking"):
        ap.add(f"a {kind} block in a user turn left out", where)
        return None
    return _carried(b, where, ap)


def _joined(parts: list[dict[str, Any]]) -> Any:
    """User content: one string when every part is text (the parts joined by newlines), else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _system_text(content: Any, where: str, ap: Approx) -> str:
    """The text of a system prompt (top-level ``system`` or a ``role: "system"`` message)."""
    texts = []
    for i, b in enumerate(_blocks(content, where)):
        if b["type"] == "text" and isinstance(b.get("text"), str) and b["text"].startswith(BILLING_HEADER):
            ap.add(f"Claude Code's {BILLING_HEADER} system block (a per-request hash) left out, so each "
                   "turn's prompt extends the last", f"{where}[{i}]")
            continue
        part = _user_part(b, f"{where}[{i}]", ap)
        if part is not None:
            texts.append(part["text"] if part["type"] == "text" else "[image]")
    return "\n".join(texts)


def _assistant(blocks: list[dict[str, Any]], where: str, ap: Approx) -> dict[str, Any]:
    text: list[str] = []
    carried = False
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        kind, at = b["type"], f"{where}.content[{j}]"
        if kind == "text":
            text.append(_text(b.get("text")))
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise BadRequest(f"{at} (tool_use) needs an id and a name")
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
        elif kind == "thinking":
            if _text(b.get("thinking")):
                ap.add("the assistant's thinking passed back left out: chat templates render no reasoning "
                       "history", at)
        elif kind == "redacted_thinking":
            ap.add("a redacted_thinking block left out: it is Anthropic's encrypted reasoning", at)
        else:  # hosted tool calls and their results (server_tool_use, web_search_tool_result, …) and others
            part = _user_part(b, at, ap) if kind in ("image", "document", "search_result") else _carried(
                b, at, ap)
            if part is not None:
                text.append(part["text"] if part["type"] == "text" else "[image]")
                carried = True
    joined = ("\n" if carried else "").join(text)
    msg: dict[str, Any] = {"role": "assistant", "content": joined if text else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list[dict[str, Any]], where: str, ap: Approx) -> list[dict[str, Any]]:
    """A user turn: a ``tool`` message per tool result, then a user message with the other parts (and
    images the tool results held, which a chat ``tool`` message cannot carry)."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if b["type"] != "tool_result":
            part = _user_part(b, at, ap)
            if part is not None:
                pending.append(part)
            continue
        if not isinstance(b.get("tool_use_id"), str):
            raise BadRequest(f"{at} (tool_result) has no 'tool_use_id'")
        content = b.get("content")
        if content is None or isinstance(content, str):
            text = content or ""
        else:
            parts = [p for k, x in enumerate(_blocks(content, f"{at}.content"))
                     if (p := _user_part(x, f"{at}.content[{k}]", ap)) is not None]
            text = "\n".join(p["text"] for p in parts if p["type"] == "text")
            images = [p for p in parts if p["type"] != "text"]
            if images:
                ap.add("images of a tool result sent in the user turn after it: a chat tool message holds "
                       "text only", at)
                pending += images
        if b.get("is_error") is True:
            ap.add("a tool result's is_error flag not shown to the policy, only its text", at)
        out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
    if pending:
        out.append({"role": "user", "content": _joined(pending)})
    return out


def _referenced(messages: list[Any]) -> set[str]:
    """The tools that ``tool_reference`` blocks (in turns or in tool results) load: a deferred tool is
    shown to the model once one names it."""
    names: set[str] = set()
    todo = [m.get("content") for m in messages if isinstance(m, dict)]
    while todo:
        content = todo.pop()
        for b in content if isinstance(content, list) else ():
            if isinstance(b, dict) and b.get("type") == "tool_reference":
                names.add(_text(b.get("tool_name") or b.get("name")))
            elif isinstance(b, dict) and b.get("type") == "tool_result":
                todo.append(b.get("content"))
    return names


def _tool(t: Any, i: int, loaded: set[str], ap: Approx) -> dict[str, Any] | None:
    """A chat function tool for one of the request's tools; None for a tool Anthropic runs itself, or
    a deferred one (``defer_loading``) that no ``tool_reference`` has loaded yet."""
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise BadRequest(f"tools[{i}] must be an object with a 'name'")
    if t.get("defer_loading") is True:
        if t["name"] not in loaded:
            return None
        ap.add("a deferred tool that a tool_reference loaded offered with the others; the hosted API shows "
               "it where it was referenced", f"tools[{i}] ({t['name']})")
    kind = t.get("type")
    if kind in (None, "custom") or isinstance(t.get("input_schema"), dict):
        if kind not in (None, "custom"):
            ap.add("a typed tool with an input_schema offered as a function", f"tools[{i}] ({kind})")
        schema = t.get("input_schema") if isinstance(t.get("input_schema"), dict) else None
        return chat_tool(t["name"], schema, t.get("description"), t.get("strict"))
    family = m[1] if isinstance(kind, str) and (m := _VERSIONED.match(kind)) else kind
    if family in CLIENT_TOOLS:
        description, schema = CLIENT_TOOLS[family]
        ap.add("an Anthropic-defined client tool offered as a function with lgt's schema for it",
               f"tools[{i}] ({kind})")
        return chat_tool(t["name"], schema, description)
    ap.add("a tool that Anthropic's servers run (or one lgt does not know) not offered to the policy",
           f"tools[{i}] ({kind})")
    return None


def _tool_choice(choice: Any, names: list[str], ap: Approx) -> dict[str, Any]:
    if not isinstance(choice, dict):
        return {}
    out: dict[str, Any] = {}
    kind = choice.get("type")
    if kind in ("auto", "none"):
        out["tool_choice"] = kind
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "tool" and choice.get("name") in names:
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        ap.add("a tool_choice the policy's tools cannot honour sent as 'auto'", f"tool_choice {kind!r}")
        out["tool_choice"] = "auto"
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def _thinking(thinking: Any, ap: Approx) -> dict[str, Any]:
    """``thinking`` as the chat template's ``enable_thinking`` switch (Qwen3's, Gemma's …; templates
    without it ignore it): ``disabled`` → false, ``enabled`` / ``adaptive`` → true."""
    if not isinstance(thinking, dict):
        return {}
    kind = thinking.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind in ("enabled", "adaptive"):
        return {"enable_thinking": True}
    ap.add("a thinking setting lgt does not know left to the chat template's default", f"thinking {kind!r}")
    return {}


def _response_format(req: dict[str, Any]) -> dict[str, Any] | None:
    """``output_config.format`` (or the older top-level ``output_format``) as chat's json_schema."""
    config = req.get("output_config") if isinstance(req.get("output_config"), dict) else {}
    fmt = config.get("format") if isinstance(config.get("format"), dict) else req.get("output_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return None


def _ignored_with_effect(req: dict[str, Any], ap: Approx) -> None:
    """Top-level fields the hosted API acts on in ways that change what the model sees."""
    servers = req.get("mcp_servers")
    if isinstance(servers, list) and servers:
        ap.add("MCP servers the hosted API would connect are not connected: their tools are not offered",
               f"mcp_servers ({len(servers)})")
    cm = req.get("context_management") if isinstance(req.get("context_management"), dict) else {}
    for k, edit in enumerate(cm.get("edits") or () if isinstance(cm.get("edits"), list) else ()):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if isinstance(kind, str) and not kind.startswith("clear_thinking"):  # thinking is never sent anyway
            ap.add("a context_management edit not applied: the policy sees the whole conversation",
                   f"context_management.edits[{k}] ({kind})")


def messages_to_chat(req: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """The chat/completions request for a Messages request; ``notes`` gets what was approximated."""
    notes = [] if notes is None else notes
    if not isinstance(req, dict):
        raise BadRequest("a /v1/messages request must be a JSON object")
    ap = Approx()
    msgs: list[dict[str, Any]] = []
    if req.get("system") is not None:
        msgs.append({"role": "system", "content": _system_text(req["system"], "system", ap)})
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("this /v1/messages request has no 'messages' list")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"{where} must be an object with a 'role'")
        role = m["role"]
        if role == "system":
            msgs.append({"role": "system", "content": _system_text(m.get("content"), f"{where}.content", ap)})
            continue
        blocks = _blocks(m.get("content"), f"{where}.content")
        if role == "assistant":
            msgs.append(_assistant(blocks, where, ap))
            continue
        if role != "user":
            ap.add("a message of a role the API does not define sent as a user turn", f"{where} ({role!r})")
        msgs += _user(blocks, where, ap)
    if not any(m["role"] != "system" for m in msgs):
        ap.add("a conversation with nothing the policy can read sent as one empty user turn", "messages")
        msgs.append({"role": "user", "content": ""})
    out: dict[str, Any] = {"messages": place_system(msgs, notes)}
    last = out["messages"][-1]
    if last["role"] == "assistant" and last["content"] and "tool_calls" not in last:
        out.update(continue_final_message=True, add_generation_prompt=False)  # a prefilled answer
    if isinstance(req.get("model"), str):
        out["model"] = req["model"]
    if req.get("max_tokens") is not None:
        out["max_tokens"] = req["max_tokens"]
    for key in ("temperature", "top_p", "top_k"):
        if req.get(key) is not None:
            out[key] = req[key]
    if req.get("stop_sequences"):
        out["stop"] = req["stop_sequences"]
    tools = req.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("'tools' must be a list")
    loaded = _referenced(messages)
    offered = [ft for i, t in enumerate(tools or ()) if (ft := _tool(t, i, loaded, ap)) is not None]
    if offered:
        out["tools"] = offered
        out.update(_tool_choice(req.get("tool_choice"), [t["function"]["name"] for t in offered], ap))
    kwargs = _thinking(req.get("thinking"), ap)
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    fmt = _response_format(req)
    if fmt is not None:
        out["response_format"] = fmt
    _ignored_with_effect(req, ap)
    if req.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    ap.flush(notes)
    return out
