"""The Gemini API (``…/models/<model>:generateContent`` and ``:streamGenerateContent``) → chat/completions
(the request side; the answer: :mod:`.gemini_answer`).

The model comes from the URL path and streaming from the method, so :func:`agent_request` adds both to
the body before :func:`gemini_to_chat` reads it. Field names are accepted in camelCase (what the SDKs
send) and snake_case (what Google's REST examples use). What each field becomes, and why:
``docs/dialects/gemini.md``. What a translation approximates goes to ``notes`` (``calls.translation``).
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from ..wire import BadRequest
from .common import EMPTY_SCHEMA, Approx, chat_tool, place_system

GEMINI = "gemini"
# …/v1beta/models/gemini-2.5-flash:streamGenerateContent (any prefix: Vertex's …/publishers/google/models/…)
_CALL = re.compile(r"/(?:v1|v1beta|v1alpha|v1beta1)/(?:[^?]*/)?((?:models|tunedModels)/[^/:?]+)"
                   r":(generateContent|streamGenerateContent|countTokens)$")
COUNT = "countTokens"
MAX_DEPTH = 64  # schema nesting the translation follows (Google's own limit is lower)


@functools.cache
def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def get_field(d: dict[str, Any], camel: str) -> Any:
    """``d[camel]``, or its snake_case spelling (``systemInstruction`` / ``system_instruction``)."""
    return d[camel] if camel in d else d.get(_snake(camel))


def _keys(d: dict[str, Any], known: tuple[str, ...]) -> list[str]:
    """The keys of ``d`` that are none of ``known`` in either spelling."""
    names = set(known) | {_snake(k) for k in known}
    return [k for k in d if k not in names]


# -- the URL -----------------------------------------------------------------------------------------
def call_of(path: str) -> tuple[str, str] | None:
    """(model, method) for a Gemini API path (query allowed) of ``generateContent``,
    ``streamGenerateContent`` or ``countTokens``, else None."""
    m = _CALL.search(path.split("?", 1)[0].rstrip("/"))
    if m is None:
        return None
    return m[1].removeprefix("models/"), m[2]


def agent_request(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The agent's request as this dialect reads it: the body, with the ``model`` the path names and, for
    ``:streamGenerateContent``, ``stream``: ``"sse"`` (``alt=sse``, what the SDKs ask) or ``"json"``
    (the default: one JSON array, written as it grows). A ``countTokens`` body's
    ``generateContentRequest``, when it has one, is the request counted."""
    found = call_of(path)
    if found is None:
        return body
    model, method = found
    inner = get_field(body, "generateContentRequest")
    if method == COUNT and isinstance(inner, dict):
        body = inner
    out = {**body, "model": model}
    out.pop("stream", None)
    if method == "streamGenerateContent":
        alt = parse_qs(path.partition("?")[2]).get("alt", ["json"])[-1]
        out["stream"] = "sse" if alt == "sse" else "json"
    return out


# -- schemas -----------------------------------------------------------------------------------------
_TYPES = {"STRING": "string", "NUMBER": "number", "INTEGER": "integer", "BOOLEAN": "boolean",
          "ARRAY": "array", "OBJECT": "object", "NULL": "null"}
_INT64 = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else",
              "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _type(t: Any) -> Any:
    if isinstance(t, str):
        return _TYPES.get(t.upper(), t)  # TYPE_UNSPECIFIED stays as it is: dropped by the caller
    if isinstance(t, list):
        return [_type(x) for x in t]
    return t


def json_schema(s: Any, depth: int = 0) -> Any:
    """Google's schema (the OpenAPI subset of ``parameters`` / ``responseSchema``, or a JSON Schema in
    ``parametersJsonSchema`` / ``responseJsonSchema``, where Gemini CLI still writes ``"OBJECT"``) as a
    standard JSON Schema: lower-case types, ``nullable`` as a ``"null"`` type, ``example`` as
    ``examples``, int64 limits sent as strings as integers; ``propertyOrdering`` dropped. Property
    names, enums and defaults are left as they are."""
    if depth > MAX_DEPTH:
        raise BadRequest(f"a schema is nested deeper than {MAX_DEPTH} levels")
    if isinstance(s, list):
        return [json_schema(x, depth + 1) for x in s]
    if not isinstance(s, dict):
        return s
    out: dict[str, Any] = {}
    for k, v in s.items():
        if k == "type":
            t = _type(v)
            if t != "TYPE_UNSPECIFIED":
                out[k] = t
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: json_schema(sub, depth + 1) for name, sub in v.items()}
        elif k in _SUBSCHEMA or k in _SCHEMA_LISTS:
            out[k] = json_schema(v, depth + 1)
        elif k in ("nullable", "propertyOrdering"):
            continue
        elif k == "example":
            out.setdefault("examples", [v])
        elif k in _INT64 and isinstance(v, str) and v.isdigit():
            out[k] = int(v)
        else:
            out[k] = v
    if s.get("nullable") is True:
        t = out.get("type")
        if isinstance(t, str) and t != "null":
            out["type"] = [t, "null"]
        elif isinstance(t, list) and "null" not in t:
            out["type"] = [*t, "null"]
        if isinstance(out.get("enum"), list) and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
    return out


# -- parts -------------------------------------------------------------------------------------------
_DATA = ("text", "inlineData", "fileData", "functionCall", "functionResponse", "executableCode",
         "codeExecutionResult")
_TEXT_MIME = re.compile(r"^(text/|application/(json|xml|x-yaml|yaml|javascript|x-python|x-sh)\b)")


def _kind(part: dict[str, Any]) -> str | None:
    return next((k for k in _DATA if k in part or _snake(k) in part), None)


def _parts(value: Any, where: str) -> list[dict[str, Any]]:
    """A Content's parts (a single part or a bare string taken too)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"text": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a list of parts")
    for i, p in enumerate(value):
        if not isinstance(p, dict):
            raise BadRequest(f"{where}[{i}] is not a part object")
    return value


def _text(part: dict[str, Any], where: str) -> str:
    if not isinstance(part.get("text"), str):
        raise BadRequest(f"{where}.text must be a string")
    return part["text"]


def _inline(blob: Any, where: str, ap: Approx) -> dict[str, Any]:
    """An inlineData part as a chat content part: an image as a data URL, text (``text/*``, JSON, …) as
    its decoded text, anything else (audio, video, PDF) as a placeholder."""
    if not isinstance(blob, dict):
        raise BadRequest(f"{where}.inlineData must be an object with mimeType and data")
    mime, data = get_field(blob, "mimeType"), get_field(blob, "data")
    mime = mime if isinstance(mime, str) else "application/octet-stream"
    data = data if isinstance(data, str) else ""
    if mime.startswith("image/"):
        return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}
    if _TEXT_MIME.match(mime):
        try:
            text = base64.b64decode(data, validate=False).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            text = None
        if text is not None:
            ap.add("inline text data sent as its decoded text", where)
            return {"type": "text", "text": text}
    ap.add("inline data the policy cannot read (audio, video, documents) sent as a placeholder",
           f"{where}: {mime}")
    return {"type": "text", "text": f"[inline {mime} data, not shown]"}


def _file(ref: Any, where: str, ap: Approx) -> dict[str, Any]:
    ref = ref if isinstance(ref, dict) else {}
    uri, mime = get_field(ref, "fileUri"), get_field(ref, "mimeType")
    ap.add("files by URI sent as a placeholder (the proxy fetches nothing)", where)
    return {"type": "text", "text": f"[file {uri if isinstance(uri, str) else '?'}"
                                    f"{f' ({mime})' if isinstance(mime, str) else ''}, not shown]"}


def _code(part: dict[str, Any], kind: str, where: str, ap: Approx) -> str:
    """executableCode / codeExecutionResult (Google's code execution tool, in history) as text."""
    v = get_field(part, kind)
    v = v if isinstance(v, dict) else {}
    ap.add("code execution parts sent as text", where)
    if kind == "executableCode":
        lang = v.get("language") if isinstance(v.get("language"), str) else ""
        return f"```{lang.lower() if lang != 'LANGUAGE_UNSPECIFIED' else ''}\n{v.get('code', '')}\n```"
    return f"Outcome: {v.get('outcome', 'OUTCOME_OK')}\n```\n{v.get('output', '')}\n```"


def _call_args(fc: dict[str, Any], where: str) -> str:
    args = fc.get("args")
    if args is None:
        return "{}"
    if not isinstance(args, dict):
        raise BadRequest(f"{where}.functionCall.args must be an object")
    return json.dumps(args, ensure_ascii=False)


def _response(fr: dict[str, Any], where: str, ap: Approx) -> tuple[str, list[dict[str, Any]]]:
    """A functionResponse as (the tool message's text, images for the user message after it): the
    string of a lone ``output`` (Gemini CLI's shape), ``content`` or ``result`` field, else ``response``
    as JSON; the text of its ``parts`` (multimodal results) after it; their images apart (a chat tool
    message holds text only)."""
    resp = fr.get("response")
    lone = next(iter(resp.items())) if isinstance(resp, dict) and len(resp) == 1 else None
    if lone is not None and lone[0] in ("output", "content", "result") and isinstance(lone[1], str):
        text = lone[1]
    elif isinstance(resp, str):
        text = resp
    else:
        text = "" if resp is None else json.dumps(resp, ensure_ascii=False)
    extra, images = [], []
    for i, p in enumerate(_parts(fr.get("parts"), f"{where}.parts")):
        kind, at = _kind(p), f"{where}.parts[{i}]"
        if kind == "text":
            extra.append(_text(p, at))
        elif kind == "inlineData":
            c = _inline(get_field(p, "inlineData"), at, ap)
            if c["type"] == "text":
                extra.append(c["text"])
            else:
                images.append(c)
                ap.add("images of function responses sent in the user message after them", at)
        elif kind == "fileData":
            extra.append(_file(get_field(p, "fileData"), at, ap)["text"])
    return ("\n".join([text, *extra]) if extra else text), images


@dataclass
class _Calls:
    """Ids for function calls and their responses. Gemini's ids are optional: a call without one gets
    ``call_<content>_<part>`` (the same on every request that carries the same history, so prompts stay
    stable), and a response without one answers the earliest unanswered call of its name in the model
    turn before it."""

    pending: list[tuple[str, str]] = field(default_factory=list)  # (id, name) of the last model turn

    def call_id(self, fc: dict[str, Any], name: str, c: int, p: int) -> str:
        given = fc.get("id")
        cid = given if isinstance(given, str) and given else f"call_{c}_{p}"
        self.pending.append((cid, name))
        return cid

    def response_id(self, fr: dict[str, Any], name: str, c: int, p: int, ap: Approx) -> str:
        given = fr.get("id")
        if isinstance(given, str) and given:
            self.pending = [x for x in self.pending if x[0] != given]
            return given
        for i, (cid, n) in enumerate(self.pending):
            if n == name:
                del self.pending[i]
                return cid
        ap.add("function responses that answer no call of the model turn before them", f"contents[{c}]"
               f".parts[{p}]")
        return f"call_{c}_{p}"


def _model_turn(parts: list[dict[str, Any]], c: int, ids: _Calls, ap: Approx) -> dict[str, Any]:
    ids.pending = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for p, part in enumerate(parts):
        where, kind = f"contents[{c}].parts[{p}]", _kind(part)
        if part.get("thought") is True:
            continue
        if kind == "text":
            text.append(_text(part, where))
        elif kind == "functionCall":
            fc = get_field(part, "functionCall")
            if not isinstance(fc, dict) or not isinstance(fc.get("name"), str):
                raise BadRequest(f"{where}.functionCall needs a 'name' string")
            args = _call_args(fc, where)
            calls.append({"id": ids.call_id(fc, fc["name"], c, p), "type": "function",
                          "function": {"name": fc["name"], "arguments": args}})
        elif kind in ("executableCode", "codeExecutionResult"):
            text.append(_code(part, kind, where, ap))
        elif kind == "inlineData":
            content = _inline(get_field(part, "inlineData"), where, ap)
            if content["type"] != "text":
                ap.add("images in model turns sent as a placeholder", where)
            text.append(content.get("text", "[image, not shown]"))
        elif kind == "fileData":
            text.append(_file(get_field(part, "fileData"), where, ap)["text"])
        elif kind == "functionResponse":
            ap.add("function responses in model turns left out", where)
        else:
            ap.add("parts of unknown kinds left out", f"{where}: {', '.join(sorted(part))}")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user_turn(parts: list[dict[str, Any]], c: int, ids: _Calls, ap: Approx) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []  # tool messages first (a chat template wants them after the calls)
    pending: list[dict[str, Any]] = []  # then the user message
    for p, part in enumerate(parts):
        where, kind = f"contents[{c}].parts[{p}]", _kind(part)
        if part.get("thought") is True:
            continue
        if kind == "text":
            pending.append({"type": "text", "text": _text(part, where)})
        elif kind == "functionResponse":
            fr = get_field(part, "functionResponse")
            if not isinstance(fr, dict) or not isinstance(fr.get("name"), str):
                raise BadRequest(f"{where}.functionResponse needs a 'name' string")
            text, images = _response(fr, f"{where}.functionResponse", ap)
            out.append({"role": "tool", "tool_call_id": ids.response_id(fr, fr["name"], c, p, ap),
                        "content": text})
            pending += images
        elif kind == "inlineData":
            pending.append(_inline(get_field(part, "inlineData"), where, ap))
        elif kind == "fileData":
            pending.append(_file(get_field(part, "fileData"), where, ap))
        elif kind in ("executableCode", "codeExecutionResult"):
            pending.append({"type": "text", "text": _code(part, kind, where, ap)})
        elif kind == "functionCall":
            fc = get_field(part, "functionCall")
            pending.append({"type": "text", "text": json.dumps({"functionCall": fc}, ensure_ascii=False)})
            ap.add("function calls in user turns sent as their JSON text", where)
        else:
            ap.add("parts of unknown kinds left out", f"{where}: {', '.join(sorted(part))}")
    if pending:
        texts = all(x["type"] == "text" for x in pending)
        out.append({"role": "user", "content": "\n".join(x["text"] for x in pending) if texts else pending})
    return out


def _contents(contents: Any, ap: Approx) -> list[dict[str, Any]]:
    if isinstance(contents, str):
        contents = [{"role": "user", "parts": [{"text": contents}]}]
    elif isinstance(contents, dict):
        contents = [contents]
    if not isinstance(contents, list) or not contents:
        raise BadRequest("this Gemini request has no 'contents' list")
    msgs: list[dict[str, Any]] = []
    ids = _Calls()
    for c, content in enumerate(contents):
        if not isinstance(content, dict):
            raise BadRequest(f"contents[{c}] is not a Content object")
        role = content.get("role") or "user"
        parts = _parts(content.get("parts"), f"contents[{c}].parts")
        for p, part in enumerate(parts):
            if part.get("thought") is True and part.get("text"):
                ap.add("thought parts left out (chat templates render no reasoning history)",
                       f"contents[{c}].parts[{p}]")
        if role == "model":
            msgs.append(_model_turn(parts, c, ids, ap))
        elif role == "system":
            msgs.append({"role": "system", "content": "\n".join(_text(p, f"contents[{c}].parts[{i}]")
                                                                for i, p in enumerate(parts) if "text" in p)})
        else:
            if role not in ("user", "function", "tool"):
                ap.add("roles other than user and model sent as the user's", f"contents[{c}]: {role!r}")
            msgs += _user_turn(parts, c, ids, ap)
    return msgs


def _system(si: Any, ap: Approx) -> str | None:
    if si is None or isinstance(si, str):
        return si
    parts = _parts(si.get("parts") if isinstance(si, dict) else si, "systemInstruction.parts")
    texts = []
    for i, p in enumerate(parts):
        if "text" in p and p.get("thought") is not True:
            texts.append(_text(p, f"systemInstruction.parts[{i}]"))
        else:
            ap.add("system instruction parts that are not text left out", f"systemInstruction.parts[{i}]")
    return "\n".join(texts)


# -- tools -------------------------------------------------------------------------------------------
def _function(fd: Any, where: str, ap: Approx) -> dict[str, Any]:
    if not isinstance(fd, dict) or not isinstance(fd.get("name"), str) or not fd["name"]:
        raise BadRequest(f"{where} needs a 'name' string")
    schema = get_field(fd, "parametersJsonSchema")
    if schema is None:
        schema = fd.get("parameters")
    if schema is not None and not isinstance(schema, dict):
        raise BadRequest(f"{where}.parameters must be a schema object")
    if get_field(fd, "response") is not None or get_field(fd, "responseJsonSchema") is not None:
        ap.add("function result schemas left out (chat tools have none)", where)
    desc = fd.get("description") if isinstance(fd.get("description"), str) else None
    return chat_tool(fd["name"], json_schema(schema) if schema else EMPTY_SCHEMA, desc)


def _tools(tools: Any, ap: Approx) -> list[dict[str, Any]]:
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of Tool objects")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise BadRequest(f"tools[{i}] is not a Tool object")
        for key, value in t.items():
            if key in ("functionDeclarations", "function_declarations"):
                if not isinstance(value, list):
                    raise BadRequest(f"tools[{i}].functionDeclarations must be a list")
                out += [_function(fd, f"tools[{i}].functionDeclarations[{j}]", ap)
                        for j, fd in enumerate(value)]
            else:
                ap.add("tools Google runs itself not offered (the policy can call declared functions only)",
                       f"tools[{i}].{key}")
    return out


def _tool_choice(config: Any, names: list[str], notes: list[str]) -> Any:
    """``toolConfig.functionCallingConfig`` as chat's ``tool_choice`` (None: not given)."""
    fcc = get_field(config, "functionCallingConfig") if isinstance(config, dict) else None
    if not isinstance(fcc, dict):
        return None
    mode = fcc.get("mode")
    mode = mode.upper() if isinstance(mode, str) else "AUTO"
    allowed = get_field(fcc, "allowedFunctionNames")
    allowed = [n for n in allowed if isinstance(n, str)] if isinstance(allowed, list) else []
    if mode == "NONE":
        return "none"
    if mode == "ANY":
        if len(allowed) == 1 and allowed[0] in names:
            return {"type": "function", "function": {"name": allowed[0]}}
        if allowed and set(allowed) != set(names):
            notes.append(f"functionCallingConfig ANY limited to {allowed}: sent as tool_choice 'required' "
                         "over all tools")
        return "required"
    if mode == "VALIDATED":
        notes.append("functionCallingConfig mode VALIDATED sent as tool_choice 'auto'")
    elif mode not in ("AUTO", "MODE_UNSPECIFIED"):
        notes.append(f"functionCallingConfig mode {mode!r} unknown: sent as tool_choice 'auto'")
    if allowed and set(allowed) != set(names):
        notes.append(f"allowedFunctionNames {allowed} not enforced in mode {mode}")
    return "auto"


# -- generationConfig ----------------------------------------------------------------------------------
def _number(v: Any, where: str, integer: bool = False) -> int | float:
    if isinstance(v, str):  # proto's int64 is written as a string
        try:
            v = float(v)
        except ValueError:
            raise BadRequest(f"{where} must be a number, not {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise BadRequest(f"{where} must be a number, not {v!r}")
    if integer:
        if v != int(v):
            raise BadRequest(f"{where} must be a whole number, not {v!r}")
        return int(v)
    return v


_SAMPLING = {"temperature": ("temperature", False), "topP": ("top_p", False), "topK": ("top_k", True),
             "maxOutputTokens": ("max_tokens", True), "presencePenalty": ("presence_penalty", False),
             "frequencyPenalty": ("frequency_penalty", False), "seed": ("seed", True)}
# read below, or ignored without a note: hints, output media and routing, nothing the policy decodes by
_CONFIG = (*_SAMPLING, "stopSequences", "candidateCount", "responseMimeType", "responseSchema",
           "responseJsonSchema", "_responseJsonSchema", "thinkingConfig", "responseLogprobs", "logprobs",
           "responseModalities", "mediaResolution", "speechConfig", "audioTimestamp", "imageConfig",
           "enableAffectiveDialog", "enableEnhancedCivicAnswers", "routingConfig", "modelSelectionConfig")


def _generation(gc: Any, out: dict[str, Any], notes: list[str]) -> None:
    if gc is None:
        return
    if not isinstance(gc, dict):
        raise BadRequest("'generationConfig' must be an object")
    for camel, (key, integer) in _SAMPLING.items():
        v = get_field(gc, camel)
        if v is not None:
            out[key] = _number(v, f"generationConfig.{camel}", integer)
    stops = get_field(gc, "stopSequences")
    if stops:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise BadRequest("generationConfig.stopSequences must be a list of strings")
        out["stop"] = stops
    n = get_field(gc, "candidateCount")
    if n is not None and _number(n, "generationConfig.candidateCount", True) > 1:
        out["n"] = _number(n, "generationConfig.candidateCount", True)
    if get_field(gc, "responseLogprobs") is True:
        out["logprobs"] = True
        top = get_field(gc, "logprobs")
        if top is not None:
            top = _number(top, "generationConfig.logprobs", True)
            if not 0 <= top <= 20:
                raise BadRequest(f"generationConfig.logprobs must be from 0 to 20, not {top}")
            if top:
                out["top_logprobs"] = top
    _format(gc, out, notes)
    _thinking(get_field(gc, "thinkingConfig"), out)
    modalities = get_field(gc, "responseModalities")
    if isinstance(modalities, list) and any(str(m).upper() != "TEXT" for m in modalities):
        notes.append(f"generationConfig.responseModalities {modalities}: the policy answers in text only")
    unknown = [k for k in _keys(gc, _CONFIG) if gc[k] is not None]
    if unknown:
        notes.append(f"generationConfig {', '.join(unknown)} unknown to lgt: ignored")


def _format(gc: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """responseMimeType + responseSchema / responseJsonSchema → response_format (structured output)."""
    mime = get_field(gc, "responseMimeType")
    schema = get_field(gc, "responseJsonSchema")
    for alt in ("_responseJsonSchema", "responseSchema"):
        schema = schema if schema is not None else get_field(gc, alt)
    mime = mime.lower() if isinstance(mime, str) else None
    if mime == "text/x.enum":
        choices = schema.get("enum") if isinstance(schema, dict) else None
        if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
            out["structured_outputs"] = {"choice": choices}  # vLLM's: the answer is one of them, bare
        else:
            notes.append("responseMimeType text/x.enum without an enum of strings: the answer is free text")
        return
    if schema is not None:
        if not isinstance(schema, dict):
            raise BadRequest("generationConfig.responseSchema must be a schema object")
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "response", "schema": json_schema(schema)}}
    elif mime == "application/json":
        out["response_format"] = {"type": "json_object"}
    elif mime not in (None, "text/plain"):
        notes.append(f"responseMimeType {mime!r}: the policy answers in text")


def _thinking(tc: Any, out: dict[str, Any]) -> None:
    """``thinkingConfig`` as the chat template's switch: a budget of 0 turns thinking off
    (``enable_thinking: false``), any other config allows it (``true``); templates without the switch
    ignore it. Budgets and levels are ceilings and hints a chat engine does not enforce: not sent.
    ``includeThoughts`` is the answer's (thought parts)."""
    if isinstance(tc, dict):
        out["chat_template_kwargs"] = {"enable_thinking": get_field(tc, "thinkingBudget") != 0}


def gemini_to_chat(req: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """The chat/completions request for a Gemini ``generateContent`` body (with ``model`` / ``stream``
    from :func:`agent_request`). ``safetySettings``, ``labels``, ``toolConfig.retrievalConfig`` and
    unknown keys are ignored without a note: nothing the policy sees or decodes by."""
    notes = [] if notes is None else notes
    ap = Approx()
    msgs = _contents(get_field(req, "contents"), ap)
    system = _system(get_field(req, "systemInstruction"), ap)
    if system:
        msgs.insert(0, {"role": "system", "content": system})
    tools = _tools(get_field(req, "tools"), ap) if get_field(req, "tools") is not None else []
    ap.flush(notes)
    msgs = place_system(msgs, notes)
    if not any(m["role"] != "system" for m in msgs):
        msgs.append({"role": "user", "content": ""})
        notes.append("the contents left nothing to read: one empty user turn sent")
    out: dict[str, Any] = {"messages": msgs}
    last = msgs[-1]
    if last["role"] == "assistant" and last.get("content") and not last.get("tool_calls"):
        out.update(continue_final_message=True, add_generation_prompt=False)  # the model turn is continued
    if isinstance(req.get("model"), str):
        out["model"] = req["model"]
    if tools:
        out["tools"] = tools
        choice = _tool_choice(get_field(req, "toolConfig"), [t["function"]["name"] for t in tools], notes)
        if choice is not None:
            out["tool_choice"] = choice
    _generation(get_field(req, "generationConfig"), out, notes)
    cached = get_field(req, "cachedContent")
    if cached:
        notes.append(f"cachedContent {cached!r} is held by Google: its content is not in the prompt")
    if req.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


# -- errors and model cards ---------------------------------------------------------------------
STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
          409: "ABORTED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED",
          500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error as Google's APIs write it (what the google-genai SDKs raise from)."""
    kind = STATUS.get(status) or ("FAILED_PRECONDITION" if 400 <= status < 500 else "INTERNAL")
    return {"error": {"code": status, "message": message, "status": kind}}


def models_answer(model_id: str, names: list[str]) -> dict[str, Any]:
    """``GET …/v1beta/models`` (``model_id`` "") or ``…/models/<id>``, in Gemini's shape."""
    def card(m: str) -> dict[str, Any]:
        return {"name": f"models/{m}", "baseModelId": m, "version": "001", "displayName": m,
                "description": "the policy served through lgt-proxy",
                "supportedGenerationMethods": ["generateContent", "streamGenerateContent"]}
    return card(model_id) if model_id else {"models": [card(m) for m in names]}
