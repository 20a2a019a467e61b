"""What the dialects share: ids, text of content parts, chat/completions tools, tool arguments.

A dialect translates one API an agent speaks to the engine's chat/completions and back. What a
translation approximates — a field mapped to its nearest chat form, carried as text, or ignored — is
appended to ``notes`` (one sentence each) and lands in the call's ``translation`` column.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ..wire import BadRequest

RESPONSES = "responses"
MESSAGES = "messages"
EMPTY_SCHEMA = {"type": "object", "properties": {}}
Notes = list  # list[str]: what a translation approximated, one sentence each


class Approx:
    """What a translation approximated, one sentence per kind naming where (the first three places):
    ``add(what, where)`` as it goes, ``flush(notes)`` at the end."""

    def __init__(self) -> None:
        self.seen: dict[str, list[str]] = {}

    def add(self, what: str, where: str) -> None:
        self.seen.setdefault(what, []).append(where)

    def flush(self, notes: list[str]) -> None:
        for what, wheres in self.seen.items():
            more = f" and {len(wheres) - 3} more" if len(wheres) > 3 else ""
            notes.append(f"{what} ({', '.join(wheres[:3])}{more})")
        self.seen = {}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
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


def chat_tool(name: str, parameters: Any, description: Any, strict: Any = None) -> dict[str, Any]:
    """A chat/completions function tool."""
    fn = {"name": name, "parameters": parameters or EMPTY_SCHEMA}
    if description is not None:
        fn["description"] = description
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"_unparsed_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def plain_text(content: Any) -> str:
    """A chat message's content as text (the text parts of a list; other parts dropped)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def place_system(msgs: list[dict[str, Any]], notes: list[str]) -> list[dict[str, Any]]:
    """Chat messages whose system text a chat template can render: one system message, first.

    System (and developer) messages before the conversation's first other message are joined into
    it. One that comes later — Claude Code's mid-list ``role: "system"``, Codex's later ``developer``
    messages — becomes user text wrapped in ``<system>…</system>``, joined to the user turn it
    follows (or opening one), and a note says so: many templates (Qwen's among them) refuse a system
    message anywhere but first, and the rest render it where no model was trained to read it."""
    out: list[dict[str, Any]] = []
    head: list[str] = []
    for i, m in enumerate(msgs):
        if m.get("role") != "system":
            out.append(m)
            continue
        text = plain_text(m.get("content"))
        if not out:
            head.append(text)
            continue
        wrapped = f"<system>\n{text}\n</system>"
        notes.append(f"system message {i} (after the conversation began) sent as user text in <system> tags")
        last = out[-1]
        if last.get("role") == "user" and isinstance(last.get("content"), str):
            out[-1] = {**last, "content": f"{last['content']}\n\n{wrapped}"}
        elif last.get("role") == "user" and isinstance(last.get("content"), list):
            out[-1] = {**last, "content": [*last["content"], {"type": "text", "text": wrapped}]}
        else:
            out.append({"role": "user", "content": wrapped})
    if head:
        out.insert(0, {"role": "system", "content": "\n\n".join(head)})
    return out
