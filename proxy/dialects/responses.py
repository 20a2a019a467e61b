"""The OpenAI Responses API → chat/completions (the request side; answers: :mod:`.stream`).

Liberal, as real clients need (Codex, opencode, pi, the Agents SDK): whatever the hosted API takes is
translated, never refused. What has a chat form gets it — function tools, ``custom`` tools (a function
with one string argument ``input``), ``namespace`` tools and ``additional_tools`` items (flattened into
the request's functions), later ``developer`` messages (``place_system``), ``configuration_update``'s
text format; what has none is carried as text (``local_shell_call``, ``mcp_call``, … items, file and
audio parts) or left out (hosted tools, reasoning items, opaque compaction items); each such
approximation is one sentence in ``notes``. Only what the hosted API would refuse too — a body that is
not the API's shape — raises ``BadRequest``. ``docs/dialects/responses.md`` lists every field.

A ``previous_response_id`` is resolved by the caller into ``history``: the input and output items of
the conversation it names (:func:`carried_history` + the answer's output items), prepended to
``input`` — the API's own meaning — so a chained call and the same conversation sent whole translate
to the same chat request.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..wire import BadRequest
from .common import chat_tool, place_system

_RESPONSES_KEEP = ("temperature", "top_p", "parallel_tool_calls", "user", "seed", "stop", "top_k",
                   "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
CUSTOM_ARG = "input"  # the one string argument a custom tool is offered with
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
# items that only OpenAI's servers can read (stored items by id, encrypted compaction): left out
_OPAQUE = ("item_reference", "compaction", "compaction_trigger", "context_compaction")
# model-side items without a chat form (the calls of tools the client or OpenAI ran): assistant text
_MODEL_ITEMS = ("mcp_list_tools", "mcp_approval_request", "program")


@dataclass(frozen=True)
class Route:
    """What a chat function offered to the policy stands for: a Responses ``function`` or ``custom``
    tool, its own name and its namespace — restored on the output item the agent gets."""

    kind: str  # "function" | "custom"
    name: str
    namespace: str | None = None


# -- tools --------------------------------------------------------------------------------------------

def _offered(req: dict[str, Any], notes: list[str]) -> list[tuple[Route, dict[str, Any]]]:
    """Every function and custom tool the request offers, in order — its ``tools``, then each
    ``additional_tools`` item of its input — with namespaces opened; a tool defined again replaces the
    earlier definition in place. Tools OpenAI runs (web search, file search, computer use, code
    interpreter, image generation, MCP, local shell …) are left out, noted."""
    found: dict[tuple[str | None, str], tuple[Route, dict[str, Any]]] = {}
    spaces: Counter[str] = Counter()
    customs: list[str] = []

    def add(tool: Any, where: str, namespace: str | None) -> None:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function" and "name" not in tool and isinstance(tool.get("function"), dict):
            tool = tool["function"]  # a chat/completions tool sent to the Responses API: its function
        if kind == "namespace" and isinstance(tool.get("tools"), list) and isinstance(tool.get("name"), str):
            for j, inner in enumerate(tool["tools"]):
                add(inner, f"{where}.tools[{j}]", tool["name"])
            return
        if kind in ("function", "custom") and isinstance(tool.get("name"), str) and tool["name"]:
            route = Route(kind, tool["name"], namespace)
            found[(namespace, tool["name"])] = (route, tool)
            if namespace is not None:
                spaces[namespace] += 1
            if kind == "custom":
                customs.append(tool["name"])
            return
        what = f"a {kind!r} tool" if isinstance(kind, str) else "not a tool object"
        notes.append(f"{where} ({what}, run by OpenAI or unknown to lgt) not offered to the policy: it can "
                     "only call function tools")

    tools = req.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("'tools' must be a list")
    for i, tool in enumerate(tools or ()):
        add(tool, f"tools[{i}]", None)
    items = req.get("input")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            extra = item.get("tools")
            if not isinstance(extra, list):
                raise BadRequest(f"input[{i}] (additional_tools) has no 'tools' list")
            for j, tool in enumerate(extra):
                add(tool, f"input[{i}].tools[{j}]", None)
            notes.append(f"the tools of input[{i}] (additional_tools) offered with the request's own: a chat "
                         "template renders every tool before the conversation")
    if spaces:
        notes.append("namespace tools offered as plain functions (" +
                     ", ".join(f"{ns}: {n}" for ns, n in spaces.items()) + "); a name two of them share "
                     "is offered as <namespace>__<name>")
    for name in dict.fromkeys(customs):
        notes.append(f"custom tool {name!r} offered as a function with one string argument "
                     f"{CUSTOM_ARG!r}, its input format in the description")
    return list(found.values())


def _chat_names(routes: list[Route]) -> list[str]:
    """The chat function name of each route: its own name, or ``<namespace>__<name>`` where tools of
    different namespaces share a name."""
    count = Counter(r.name for r in routes)
    return [r.name if count[r.name] == 1 or r.namespace is None else f"{r.namespace}__{r.name}"
            for r in routes]


def _custom_tool(name: str, tool: dict[str, Any]) -> dict[str, Any]:
    desc = tool.get("description") if isinstance(tool.get("description"), str) else ""
    fmt = tool.get("format") if isinstance(tool.get("format"), dict) else {}
    how = f"Call it with its whole input as the string argument `{CUSTOM_ARG}` (free-form text)."
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        syntax = f"{fmt['syntax']} " if isinstance(fmt.get("syntax"), str) else ""
        how += f" The input follows this {syntax}grammar:\n{fmt['definition']}"
    params = {"type": "object", "required": [CUSTOM_ARG], "additionalProperties": False,
              "properties": {CUSTOM_ARG: {"type": "string", "description": "The tool's input."}}}
    return chat_tool(name, params, f"{desc}\n\n{how}" if desc else how)


def _chat_tools(offered: list[tuple[Route, dict[str, Any]]]) -> tuple[list[dict[str, Any]], dict[str, Route]]:
    names = _chat_names([r for r, _ in offered])
    tools, routes = [], {}
    for name, (route, tool) in zip(names, offered):
        if name in routes:
            continue  # a namespaced name equal to a plain one: the first stays
        routes[name] = route
        if route.kind == "custom":
            tools.append(_custom_tool(name, tool))
        else:
            tools.append(chat_tool(name, tool.get("parameters"), tool.get("description"), tool.get("strict")))
    return tools, routes


def tool_routes(req: dict[str, Any]) -> dict[str, Route]:
    """Chat function name → the Responses tool it stands for, for the answer's output items (never
    raises: a request that cannot be read offers nothing)."""
    try:
        return _chat_tools(_offered(req, []))[1]
    except (BadRequest, TypeError, AttributeError):
        return {}


def custom_input(arguments: str) -> tuple[str, str | None]:
    """A custom tool call's text input from the policy's chat arguments (``{"input": "<text>"}``), and
    a note when they were something else (one other string argument, not JSON: taken as they are)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments, "the policy's arguments are not JSON: sent verbatim as its input"
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_ARG), str):
        extra = [k for k in value if k != CUSTOM_ARG]
        return value[CUSTOM_ARG], (f"arguments other than {CUSTOM_ARG!r} dropped: {extra}" if extra else None)
    if isinstance(value, dict) and not value:
        return "", None
    strings = [(k, v) for k, v in value.items() if isinstance(v, str)] if isinstance(value, dict) else []
    if len(strings) == 1 and len(value) == 1:
        return strings[0][1], f"its input came as the argument {strings[0][0]!r}, not {CUSTOM_ARG!r}"
    if isinstance(value, str):
        return value, "its input came as a JSON string, not an object"
    return arguments, f"the policy's arguments have no {CUSTOM_ARG!r} string: sent verbatim as its input"


def _tool_choice(choice: Any, names: dict[tuple[str | None, str], str], notes: list[str]) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        name = names.get((choice.get("namespace"), choice["name"])) or _any_name(names, choice["name"])
        if name is not None:
            return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required"):
        notes.append("tool_choice allowed_tools: its mode kept; the policy may call any offered tool")
        return choice["mode"]
    notes.append(f"tool_choice {json.dumps(choice)[:120]} has no chat form here: 'auto' instead")
    return "auto"


def _any_name(names: dict[tuple[str | None, str], str], name: str) -> str | None:
    hits = [chat for (_, n), chat in names.items() if n == name]
    return hits[0] if len(hits) == 1 else None


# -- content and items ----------------------------------------------------------------------------------

def _placeholder(part: dict[str, Any], kind: Any) -> str:
    name = next((part[k] for k in ("filename", "file_url", "image_url", "file_id")
                 if isinstance(part.get(k), str) and not part[k].startswith("data:")), None)
    return f"[{kind}{': ' + name if name else ''}]"


def _content(content: Any, where: str, notes: list[str], images: bool) -> Any:
    """A message's (or a tool output's) content for chat: a string when it is all text; image URLs as
    image parts where ``images``; other parts (files, audio, images elsewhere) as a bracketed line."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part, dict):
            raise BadRequest(f"{where}[{i}] is not a content part object")
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str) or (kind is None and isinstance(
                part.get("text"), str)):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and images and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            notes.append(f"{where}[{i}] (a {kind!r} part) sent as a line of text naming it")
            parts.append({"type": "text", "text": _placeholder(part, kind)})
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _as_text(item: dict[str, Any], kind: str) -> str:
    body = {k: v for k, v in item.items() if k not in ("type", "id", "status")}
    return f"<{kind}>\n{json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n</{kind}>"


def _append_text(msgs: list[dict[str, Any]], role: str, text: str) -> None:
    last = msgs[-1] if msgs else None
    if last is not None and last["role"] == role and isinstance(last.get("content"), str) and not last.get(
            "tool_calls"):
        msgs[-1] = {**last, "content": f"{last['content']}\n\n{text}" if last["content"] else text}
    else:
        msgs.append({"role": role, "content": text})


def _call(msgs: list[dict[str, Any]], call: dict[str, Any]) -> None:
    last = msgs[-1] if msgs else None
    if last is not None and last["role"] == "assistant":  # the same turn: text, then its calls
        msgs[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or ()), call]}
    else:
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _input_messages(items: list[Any], names: dict[tuple[str | None, str], str],
                    notes: list[str]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    carried: Counter[str] = Counter()
    left_out: Counter[str] = Counter()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} is not an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role == "assistant":
                content = _content(item.get("content"), f"{where}.content", notes, images=False)
                msgs.append({"role": "assistant", "content": content})
            elif role in ("system", "developer"):
                msgs.append({"role": "system", "content": _content(item.get("content"), f"{where}.content",
                                                                  notes, images=False)})
            else:
                if role != "user":
                    notes.append(f"{where} has role {role!r}: sent as a user message")
                msgs.append({"role": "user", "content": _content(item.get("content"), f"{where}.content",
                                                                notes, images=True)})
        elif kind in ("function_call", "custom_tool_call") and isinstance(item.get("name"), str):
            ns = item.get("namespace") if isinstance(item.get("namespace"), str) else None
            name = names.get((ns, item["name"])) or _any_name(names, item["name"]) or item["name"]
            if kind == "custom_tool_call":
                text = item.get("input") if isinstance(item.get("input"), str) else ""
                args = json.dumps({CUSTOM_ARG: text}, ensure_ascii=False)
            else:
                args = item.get("arguments", "")
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            call_id = item.get("call_id") or item.get("id") or f"call_{i}"
            _call(msgs, {"id": str(call_id), "type": "function",
                         "function": {"name": name, "arguments": args}})
        elif kind in ("function_call_output", "custom_tool_call_output") and isinstance(
                item.get("call_id"), str):
            out = _content(item.get("output", ""), f"{where}.output", notes, images=False)
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": out})
        elif kind == "reasoning":
            left_out["reasoning"] += 1  # the model's own reasoning, passed back: chat templates render none
        elif kind in ("additional_tools", "configuration_update"):
            continue  # read with the request's tools / text format
        elif kind in _OPAQUE:
            left_out[kind] += 1
        else:
            kind = kind if isinstance(kind, str) else "item"
            model_side = kind.endswith("_call") or kind in _MODEL_ITEMS
            _append_text(msgs, "assistant" if model_side else "user", _as_text(item, kind))
            carried[kind] += 1
    if carried:
        notes.append("input items without a chat form carried as text: " +
                     ", ".join(f"{k} ×{n}" for k, n in carried.items()))
    if left_out:
        notes.append("input items left out of the prompt: " +
                     ", ".join(f"{k} ×{n}" for k, n in left_out.items()) +
                     " (reasoning has no place in a chat template; the others only OpenAI can read)")
    return msgs


def _text_format(req: dict[str, Any], items: list[Any], notes: list[str]) -> Any:
    """The text format in force: the request's own, else the last ``configuration_update``'s."""
    text = req.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    updates = [it for it in items if isinstance(it, dict) and it.get("type") == "configuration_update"]
    if updates:
        notes.append("configuration_update items: their text format applied as the chat response format, "
                     "their reasoning effort ignored")
    for update in updates:
        upd = update.get("text")
        if fmt is None and isinstance(upd, dict) and isinstance(upd.get("format"), dict):
            fmt = upd["format"]
    return fmt


def _request_notes(req: dict[str, Any], notes: list[str]) -> None:
    if req.get("background"):
        notes.append("background: true answered as an ordinary response (the proxy runs no background jobs)")
    if req.get("prompt") is not None:
        notes.append("'prompt' (a prompt template kept by OpenAI) not applied")
    if req.get("conversation") is not None:
        notes.append("'conversation' (a conversation kept by OpenAI) not applied: only its new input is sent")


# -- the request ----------------------------------------------------------------------------------------

def responses_to_chat(req: dict[str, Any], history: list[dict[str, Any]] | None = None,
                      notes: list[str] | None = None) -> dict[str, Any]:
    """The chat/completions request for a Responses request; ``history`` is the items of the
    conversation its ``previous_response_id`` names (prepended to its input). BadRequest only for
    what is not the API's shape; what is approximated goes to ``notes``."""
    notes = [] if notes is None else notes
    if history:
        req = with_history(req, history)
    _request_notes(req, notes)
    inp = req.get("input")
    if isinstance(inp, str):
        items: list[Any] = [{"role": "user", "content": inp}]
    elif isinstance(inp, list):
        items = inp
    elif inp is None:
        items = []
    else:
        raise BadRequest("'input' must be a string or a list of items")
    offered = _offered(req, notes)
    tools, routes = _chat_tools(offered)
    names = {(r.namespace, r.name): chat for chat, r in routes.items()}
    msgs: list[dict[str, Any]] = []
    instructions = req.get("instructions")
    if isinstance(instructions, str):
        msgs.append({"role": "system", "content": instructions})
    elif isinstance(instructions, list):  # instructions as input items (developer messages)
        msgs += _input_messages(instructions, names, notes)
    elif instructions is not None:
        raise BadRequest("'instructions' must be a string")
    msgs += _input_messages(items, names, notes)
    msgs = place_system(msgs, notes)
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
    if tools:
        out["tools"] = tools
        if req.get("tool_choice") is not None:
            out["tool_choice"] = _tool_choice(req["tool_choice"], names, notes)
    fmt = _text_format(req, items, notes)
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    if req.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


def with_history(req: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """``req`` with the items of the conversation its ``previous_response_id`` names before its own
    input (the API's meaning of the field; ``instructions`` and ``tools`` are never carried)."""
    inp = req.get("input")
    own = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp if isinstance(inp, list) else []
    return {**req, "input": [*history, *own]}


def carried_history(req: dict[str, Any]) -> list[dict[str, Any]]:
    """The input items of a Responses call (its history already resolved into ``input``), which a
    later ``previous_response_id`` continues with this call's output items appended."""
    inp = req.get("input")
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    return list(inp) if isinstance(inp, list) else []


def wants_logprobs(req: dict[str, Any]) -> bool:
    """A Responses request that asks for its output text's logprobs."""
    include = req.get("include")
    return isinstance(include, list) and "message.output_text.logprobs" in include


def wants_encrypted_reasoning(req: dict[str, Any]) -> bool:
    """A Responses request that asks reasoning items to carry ``encrypted_content`` (stateless
    clients — Codex, opencode, pi — pass them back instead of a stored response)."""
    include = req.get("include")
    return isinstance(include, list) and "reasoning.encrypted_content" in include


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
