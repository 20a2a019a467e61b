"""The Gemini API (``…/models/<model>:generateContent`` / ``:streamGenerateContent``) through the proxy.

The proxy asks the engine through chat/completions and answers in Google's ``GenerateContentResponse``
(whole, as SSE ``data: {json}\\r\\n\\r\\n`` events, or as a JSON array without ``alt=sse``). The request
bodies Gemini CLI 0.61 sends (tests/fixtures/harnesses/gemini*) are translated one by one, seed the
property tests, and are replayed through a real ``lgt-proxy``; the google-genai SDK (when installed)
is an agent too. Each call is checked on both sides: what the agent got, and the row — ``api``
'gemini', full capture, the engine's own token ids.
"""

from __future__ import annotations

import copy
import glob
import json
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lgt.proxy import dialects
from lgt.proxy.dialects import gemini
from lgt.proxy.wire import BadRequest, Capture
from lgt.testing.clients import CHAT, SERVED, post_direct, ref_tokens
from lgt.testing.fake_upstream import FakeUpstream
from lgt.testing.proxy import ProxyProc

FIXTURES = Path(__file__).parent / "fixtures" / "harnesses"
HOST = "https://generativelanguage.googleapis.com"
FLASH = "gemini-2.5-flash"


def recorded_calls() -> list[dict[str, Any]]:
    """Every recorded Gemini API call of every harness fixture (path with its query, and body)."""
    out = []
    for f in sorted(glob.glob(str(FIXTURES / "*" / "[0-9]*.json"))):
        d = json.loads(Path(f).read_text())
        if not isinstance(d.get("body"), dict) or gemini.call_of(d.get("path", "")) is None:
            continue
        query = "&".join(f"{k}={v}" for k, v in (d.get("query") or {}).items())
        out.append({"file": f"{Path(f).parent.name}/{Path(f).name}", "path": d["path"] + (f"?{query}" if query
                                                                                          else ""),
                    "body": d["body"], "kind": d.get("kind")})
    return out


CALLS = recorded_calls()
MAIN_FINAL = next(c for c in CALLS if c["file"].startswith("gemini.minimal/") and c["kind"] == "main-final")
MAIN_FULL = next(c for c in CALLS if c["file"].startswith("gemini/") and c["kind"] == "main-tool-call")
ROUTER = next(c for c in CALLS if c["kind"] == "router")


def translate(path: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(agent request, chat request, notes) as the proxy makes them."""
    api = dialects.api_of("POST", path)
    assert api == dialects.GEMINI
    req = dialects.agent_request(api, path, body)
    notes: list[str] = []
    return req, dialects.to_chat(api, req, None, notes), notes


# --- the translation alone -------------------------------------------------------------------------

def test_gemini_paths_are_recognised() -> None:
    assert gemini.call_of("/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse") == (
        FLASH, "streamGenerateContent")
    assert gemini.call_of("/v1/projects/p/locations/l/publishers/google/models/g:generateContent") == (
        "g", "generateContent")
    assert gemini.call_of("/v1beta/tunedModels/mine:generateContent") == ("tunedModels/mine",
                                                                            "generateContent")
    assert dialects.api_of("POST", "/v1beta/models/x:countTokens") is None
    assert dialects.count_tokens_api("POST", "/v1beta/models/x:countTokens") == dialects.GEMINI
    assert dialects.api_of("GET", "/v1beta/models/x:generateContent") is None
    assert dialects.api_of("POST", "/v1beta/models/x:embedContent") is None
    assert dialects.models_path("GET", "/v1beta/models?pageSize=50") == ""
    assert dialects.models_path("GET", "/v1beta/models/gemini-2.5-flash") == FLASH
    streamed = dialects.agent_request(dialects.GEMINI, "/v1beta/models/m:streamGenerateContent?alt=sse", {})
    plain = dialects.agent_request(dialects.GEMINI, "/v1beta/models/m:streamGenerateContent", {"stream": 1})
    whole = dialects.agent_request(dialects.GEMINI, "/v1beta/models/m:generateContent", {"stream": True})
    assert (streamed, plain, whole) == ({"model": "m", "stream": "sse"}, {"model": "m", "stream": "json"},
                                        {"model": "m"})


@pytest.mark.parametrize("call", CALLS, ids=[c["file"] for c in CALLS])
def test_every_recorded_gemini_cli_body_translates(call: dict[str, Any]) -> None:
    req, chat, notes = translate(call["path"], call["body"])
    body = call["body"]
    assert chat["model"] == req["model"] == gemini.call_of(call["path"])[0]
    assert chat["messages"][0] == {"role": "system", "content": "\n".join(
        p["text"] for p in body["systemInstruction"]["parts"])}
    assert chat.get("stream", False) == call["path"].split("?")[0].endswith(":streamGenerateContent")
    gc = body["generationConfig"]
    assert (chat["temperature"], chat["top_p"], chat["top_k"]) == (gc["temperature"], gc["topP"], gc["topK"])
    decls = [d for t in body.get("tools", ()) for d in t["functionDeclarations"]]
    assert [t["function"]["name"] for t in chat.get("tools", ())] == [d["name"] for d in decls]
    schemas = json.dumps([chat.get("tools"), chat.get("response_format")])
    assert '"OBJECT"' not in schemas and '"STRING"' not in schemas
    # function calls and their responses keep the ids Gemini CLI gave them, in chat's order
    calls = [c for m in chat["messages"] if m["role"] == "assistant" for c in m.get("tool_calls", ())]
    results = [m for m in chat["messages"] if m["role"] == "tool"]
    assert [c["id"] for c in calls] == [r["tool_call_id"] for r in results]
    for c, r in zip(calls, results):
        assert json.loads(c["function"]["arguments"])["content"] == "PINEAPPLE\n"
        assert r["content"].startswith("Successfully created and wrote to new file")
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}  # thinkingLevel / thinkingBudget
    assert notes == []  # nothing Gemini CLI sends needs approximating
    json.dumps(chat)


def test_the_routers_json_schema_becomes_response_format() -> None:
    _, chat, _ = translate(ROUTER["path"], ROUTER["body"])
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "response", "schema": {
        "type": "object", "properties": {
            "complexity_reasoning": {"type": "string", "description": "Brief explanation for the score."},
            "complexity_score": {"type": "integer", "description": "Complexity score from 1-100."}},
        "required": ["complexity_reasoning", "complexity_score"]}}}
    assert "stream" not in chat and [m["role"] for m in chat["messages"]] == ["system", "user", "user"]


def test_googles_schemas_become_json_schema() -> None:
    openapi = {"type": "OBJECT", "propertyOrdering": ["a", "b"], "nullable": False, "properties": {
        "a": {"type": "STRING", "nullable": True, "enum": ["x", "y"], "format": "enum", "example": "x"},
        "b": {"type": "ARRAY", "items": {"type": "INTEGER"}, "minItems": "1", "maxItems": "3"},
        "type": {"type": "TYPE_UNSPECIFIED", "anyOf": [{"type": "NUMBER"}, {"type": "BOOLEAN"}]}},
        "required": ["a"]}
    assert gemini.json_schema(openapi) == {"type": "object", "properties": {
        "a": {"type": ["string", "null"], "enum": ["x", "y", None], "format": "enum", "examples": ["x"]},
        "b": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        "type": {"anyOf": [{"type": "number"}, {"type": "boolean"}]}}, "required": ["a"]}
    standard = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {
        "STRING": {"type": "string", "enum": ["OBJECT"]}}, "additionalProperties": False}
    assert gemini.json_schema(standard) == standard  # names, enums and other keywords kept as they are
    with pytest.raises(BadRequest, match="nested deeper than 64 levels"):
        deep: dict[str, Any] = {"type": "STRING"}
        for _ in range(70):
            deep = {"type": "ARRAY", "items": deep}
        gemini.json_schema(deep)


def test_parts_tools_and_config_map_to_their_nearest_chat_form() -> None:
    png, pdf, txt = "iVBORw0KGgo=", "JVBERi0xLjQ=", "aGVsbG8gd29ybGQ="  # a PNG's head, a PDF's, text
    body = {
        "system_instruction": {"parts": [{"text": "Be brief."}, {"text": "Use tools."}]},  # snake_case too
        "contents": [
            {"role": "user", "parts": [{"text": "Look:"},
                                       {"inlineData": {"mimeType": "image/png", "data": png}},
                                       {"inline_data": {"mime_type": "application/pdf", "data": pdf}},
                                       {"inlineData": {"mimeType": "text/plain", "data": txt}},
                                       {"fileData": {"mimeType": "video/mp4", "fileUri": "gs://b/v.mp4"}}]},
            {"role": "model", "parts": [
                {"text": "planning", "thought": True, "thoughtSignature": "c2ln"},
                {"text": "Let me "}, {"text": "check."},
                {"functionCall": {"name": "ls", "args": {"dir": "."}}, "thoughtSignature": "c2ln"},
                {"functionCall": {"name": "cat", "args": {"f": "a"}}},
                {"functionCall": {"name": "ls", "args": {"dir": "b"}}},
                {"executableCode": {"language": "PYTHON", "code": "print(1)"}},
                {"codeExecutionResult": {"outcome": "OUTCOME_OK", "output": "1"}},
                {"somethingNew": {"x": 1}}]},
            {"role": "user", "parts": [  # answered by name, in order, without ids
                {"functionResponse": {"name": "cat", "response": {"output": "A"}}},
                {"functionResponse": {"name": "ls", "response": {"files": ["x"]}}},
                {"functionResponse": {"name": "ls", "response": {"error": "no b"}}},
                {"text": "Go on."}]}],
        "tools": [{"functionDeclarations": [
            {"name": "ls", "description": "List.", "parameters": {
                "type": "OBJECT", "properties": {"dir": {"type": "STRING"}}}},
            {"name": "cat", "parametersJsonSchema": {"type": "object",
                                                     "properties": {"f": {"type": "string"}}}},
            {"name": "nothing"}]},
            {"googleSearch": {}}, {"codeExecution": {}}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["cat"]}},
        "generationConfig": {"maxOutputTokens": "256", "stopSequences": ["END"], "candidateCount": 2,
                             "presencePenalty": 0.5, "frequencyPenalty": 0.25, "seed": 7,
                             "responseLogprobs": True, "logprobs": 3,
                             "mediaResolution": "MEDIA_RESOLUTION_LOW", "futureKnob": 1,
                             "thinkingConfig": {"thinkingBudget": 0}},
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
        "cachedContent": "cachedContents/abc", "somethingElse": 1}
    notes: list[str] = []
    req = dialects.agent_request(dialects.GEMINI, "/v1beta/models/m:generateContent", body)
    chat = dialects.to_chat(dialects.GEMINI, req, None, notes)
    m = chat["messages"]
    assert m[0] == {"role": "system", "content": "Be brief.\nUse tools."}
    assert m[1]["role"] == "user" and m[1]["content"] == [
        {"type": "text", "text": "Look:"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
        {"type": "text", "text": "[inline application/pdf data, not shown]"},
        {"type": "text", "text": "hello world"},
        {"type": "text", "text": "[file gs://b/v.mp4 (video/mp4), not shown]"}]
    assert m[2]["content"] == "Let me check.```python\nprint(1)\n```Outcome: OUTCOME_OK\n```\n1\n```"
    assert [(c["id"], c["function"]["name"]) for c in m[2]["tool_calls"]] == [
        ("call_1_3", "ls"), ("call_1_4", "cat"), ("call_1_5", "ls")]
    assert [(x["role"], x.get("tool_call_id"), x["content"]) for x in m[3:]] == [
        ("tool", "call_1_4", "A"), ("tool", "call_1_3", '{"files": ["x"]}'),
        ("tool", "call_1_5", '{"error": "no b"}'),
        ("user", None, "Go on.")]
    assert [t["function"]["parameters"] for t in chat["tools"]] == [
        {"type": "object", "properties": {"dir": {"type": "string"}}},
        {"type": "object", "properties": {"f": {"type": "string"}}}, {"type": "object", "properties": {}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "cat"}}
    assert {k: chat[k] for k in ("max_tokens", "stop", "n", "presence_penalty", "frequency_penalty", "seed",
                                 "logprobs", "top_logprobs", "chat_template_kwargs")} == {
        "max_tokens": 256, "stop": ["END"], "n": 2, "presence_penalty": 0.5, "frequency_penalty": 0.25,
        "seed": 7, "logprobs": True, "top_logprobs": 3, "chat_template_kwargs": {"enable_thinking": False}}
    assert notes == [
        "inline data the policy cannot read (audio, video, documents) sent as a placeholder "
        "(contents[0].parts[2]: application/pdf)",
        "inline text data sent as its decoded text (contents[0].parts[3])",
        "files by URI sent as a placeholder (the proxy fetches nothing) (contents[0].parts[4])",
        "thought parts left out (chat templates render no reasoning history) (contents[1].parts[0])",
        "code execution parts sent as text (contents[1].parts[6], contents[1].parts[7])",
        "parts of unknown kinds left out (contents[1].parts[8]: somethingNew)",
        "tools Google runs itself not offered (the policy can call declared functions only) "
        "(tools[1].googleSearch, tools[2].codeExecution)",
        "generationConfig futureKnob unknown to lgt: ignored",
        "cachedContent 'cachedContents/abc' is held by Google: its content is not in the prompt"]


@pytest.mark.parametrize(("config", "choice", "note"), [
    ({"functionCallingConfig": {"mode": "AUTO"}}, "auto", None),
    ({"functionCallingConfig": {"mode": "NONE"}}, "none", None),
    ({"functionCallingConfig": {"mode": "ANY"}}, "required", None),
    ({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["a", "b"]}}, "required",
     "ANY limited to ['a', 'b']"),
    ({"functionCallingConfig": {"mode": "VALIDATED"}}, "auto", "mode VALIDATED sent as tool_choice 'auto'"),
    ({"retrievalConfig": {}}, None, None),  # a location hint for Google's own tools
])
def test_function_calling_modes(config: dict[str, Any], choice: Any, note: str | None) -> None:
    tools = [{"functionDeclarations": [{"name": n} for n in ("a", "b", "c")]}]
    notes: list[str] = []
    chat = gemini.gemini_to_chat({"contents": "hi", "tools": tools, "toolConfig": config}, notes)
    assert chat.get("tool_choice") == choice
    assert (note is None and notes == []) or any(note in n for n in notes)


@pytest.mark.parametrize(("body", "message"), [
    ({}, "has no 'contents' list"),
    ({"contents": [5]}, r"contents\[0\] is not a Content object"),
    ({"contents": [{"parts": "x"}, {"parts": 5}]}, r"contents\[1\].parts must be a list of parts"),
    ({"contents": [{"role": "model", "parts": [{"functionCall": {"args": {}}}]}]}, "needs a 'name' string"),
    ({"contents": "x", "tools": [{"functionDeclarations": [{"description": "no name"}]}]}, "needs a 'name'"),
    ({"contents": "x", "generationConfig": {"temperature": "hot"}}, "temperature must be a number"),
    ({"contents": "x", "generationConfig": {"maxOutputTokens": 1.5}}, "must be a whole number"),
])
def test_what_google_would_refuse_is_named(body: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        gemini.gemini_to_chat(body)


# --- property tests, seeded with what Gemini CLI sent ------------------------------------------------

_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, width=16)
                     | st.text(max_size=6), lambda kids: st.lists(kids, max_size=3)
                     | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=6)
_unknown_key = st.text("abcxyz", min_size=1, max_size=6).map(lambda s: f"futureField_{s}")


def _nodes(obj: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _nodes(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _nodes(v, (*path, i))
    return out


def _at(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


@st.composite
def mutated_calls(draw, unknown_only: bool) -> tuple[str, dict[str, Any]]:
    """A recorded call with unknown keys and parts added (``unknown_only``), or any node below the root
    replaced by any JSON, or removed."""
    call = draw(st.sampled_from(CALLS))
    body = copy.deepcopy(call["body"])
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_nodes(body)))
        node = _at(body, path)
        if unknown_only:
            if isinstance(node, dict):
                node[draw(_unknown_key)] = draw(_json)
            elif path and path[-1] == "parts":
                node.append({draw(_unknown_key): draw(_json)})
        elif not path:
            continue  # a body that is not an object is refused before the dialect sees it
        elif draw(st.booleans()):
            _at(body, path[:-1])[path[-1]] = draw(_json)
        else:
            del _at(body, path[:-1])[path[-1]]
    return call["path"], body


def _chat_answer() -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok", "reasoning": "hm"},
                         "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.data_too_large])
@given(mutated_calls(unknown_only=True))
def test_unknown_keys_and_parts_are_never_refused(case: tuple[str, dict[str, Any]]) -> None:
    """What Gemini CLI sends, with fields and part types this proxy has never seen: translated anyway."""
    path, body = case
    req, chat, notes = translate(path, body)
    assert chat["messages"][0]["role"] == "system" and all(isinstance(n, str) for n in notes)
    json.dumps(chat)
    dialects.translator(dialects.GEMINI, req, req["model"]).body(_chat_answer(), Capture(CHAT))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.data_too_large])
@given(mutated_calls(unknown_only=False))
def test_malformed_bodies_are_refused_in_one_sentence_or_translated(case: tuple[str, dict[str, Any]]) -> None:
    path, body = case
    api = dialects.GEMINI
    try:
        req = dialects.agent_request(api, path, body)
        chat = dialects.to_chat(api, req, None, [])
    except BadRequest as e:
        assert str(e) and "\n" not in str(e)
        assert dialects.error_body(api, 400, str(e))["error"]["status"] == "INVALID_ARGUMENT"
        return
    json.dumps(chat)
    tr = dialects.translator(api, req, req.get("model"))
    tr.body(_chat_answer(), Capture(CHAT))


# chat answers split into stream chunks anyhow: the Gemini events add up to the whole answer
_text = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), max_size=30)
_call = st.tuples(st.from_regex(r"[a-z_]{1,10}", fullmatch=True),
                  st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), st.integers(), max_size=3))


def _pieces(draw, s: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(1, max(len(s) - 1, 1)), max_size=4))) if len(s) > 1 else []
    return [s[a:b] for a, b in zip([0, *cuts], [*cuts, len(s)]) if s[a:b]]


@st.composite
def streamed(draw) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    calls = draw(st.lists(_call, max_size=3))
    finish = "tool_calls" if calls else draw(st.sampled_from(["stop", "length", "abort"]))
    msg: dict[str, Any] = {"role": "assistant", "content": draw(_text) or None,
                           "reasoning": draw(st.one_of(st.none(), _text.filter(bool)))}
    if calls:
        msg["tool_calls"] = [{"id": f"chatcmpl-tool-{i}", "type": "function",
                              "function": {"name": n, "arguments": json.dumps(a)}}
                             for i, (n, a) in enumerate(calls)]
    ans = {"choices": [{"index": 0, "message": msg, "finish_reason": finish}],
           "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}}
    def delta(d: dict[str, Any]) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": d}]}

    chunks = [{**delta({"role": "assistant", "content": ""}), "prompt_token_ids": [1]}]
    chunks += [delta({"reasoning": p}) for p in _pieces(draw, msg["reasoning"] or "")]
    chunks += [delta({"content": p}) for p in _pieces(draw, msg["content"] or "")]
    for i, tc in enumerate(msg.get("tool_calls") or ()):
        fn = tc["function"]
        chunks.append(delta({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                             "function": {"name": fn["name"]}}]}))
        chunks += [delta({"tool_calls": [{"index": i, "function": {"arguments": p}}]})
                   for p in _pieces(draw, fn["arguments"])]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({"choices": [], "usage": ans["usage"]})
    return ans, chunks


def sse_events(data: bytes) -> list[dict[str, Any]]:
    """Gemini's SSE: each event exactly ``data: {json}\\r\\n\\r\\n``, nothing else."""
    assert data.endswith(b"\r\n\r\n")
    events = data.split(b"\r\n\r\n")[:-1]
    assert all(e.startswith(b"data: {") and b"\n" not in e and b"\r" not in e for e in events), data
    return [json.loads(e[6:]) for e in events]


def without_ids(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: without_ids(v) for k, v in obj.items() if k != "responseId"}
    return [without_ids(v) for v in obj] if isinstance(obj, list) else obj


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streamed(), st.booleans(), st.booleans())
def test_a_stream_adds_up_to_the_whole_answer(case, thoughts: bool, sse: bool) -> None:
    """However the chat answer is split, the events are well formed (the SDK's own type, which forbids
    unknown fields), text deltas and whole function calls add up to the translation of the whole body,
    and only the last event carries finishReason and usageMetadata. Without ``alt=sse`` the same
    objects form one JSON array."""
    types = pytest.importorskip("google.genai.types")
    ans, chunks = case
    req = {"contents": "q", "model": FLASH, "stream": "sse" if sse else "json",
           "generationConfig": {"thinkingConfig": {"includeThoughts": thoughts}}}
    cap = Capture(CHAT)
    tr = dialects.translator(dialects.GEMINI, req, FLASH)
    data = b""
    for c in chunks:
        cap.add_chunk(c)
        data += tr.chunk(c)
    final = tr.final(cap)  # the record is made before the last event goes out
    data += tr.finish(cap)
    events = sse_events(data) if sse else json.loads(data)
    whole = dialects.translator(dialects.GEMINI, {**req, "stream": None}, FLASH).body(ans, cap)
    assert without_ids(final) == without_ids(whole)
    for e in events:
        types.GenerateContentResponse.model_validate(e)
    assert [("finishReason" in e["candidates"][0], "usageMetadata" in e) for e in events] == [
        (False, False)] * (len(events) - 1) + [(True, True)]
    parts = [p for e in events for p in e["candidates"][0].get("content", {}).get("parts", ())]
    msg = ans["choices"][0]["message"]
    assert "".join(p["text"] for p in parts if "text" in p and not p.get("thought")) == (msg["content"] or "")
    thought = "".join(p["text"] for p in parts if p.get("thought"))
    assert thought == (msg["reasoning"] or "" if thoughts else "")
    assert [(p["functionCall"]["id"], p["functionCall"]["name"], p["functionCall"]["args"])
            for p in parts if "functionCall" in p] == [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in msg.get("tool_calls", ())]
    finish = events[-1]["candidates"][0]["finishReason"]
    assert finish == {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "abort": "OTHER"}[
        ans["choices"][0]["finish_reason"]]
    assert events[-1]["usageMetadata"] == {"promptTokenCount": 7, "candidatesTokenCount": 9,
                                           "totalTokenCount": 16}
    assert tr.notes == []  # the engine's reasoning, hidden without includeThoughts, is what Google does


def _some(**fields: Any) -> Any:
    """An object with any of ``fields``, or any JSON at all."""
    return st.one_of(_json, st.fixed_dictionaries({}, optional=fields))


_index = st.one_of(st.integers(0, 2), _json)
_tool_delta = _some(index=_index, id=_json, function=_some(name=_json, arguments=_json))
_choice = _some(index=_index, finish_reason=st.one_of(st.sampled_from(["stop", "length"]), _json),
                delta=_some(content=st.one_of(_text, _json), reasoning=_json,
                            tool_calls=st.one_of(_json, st.lists(_tool_delta, max_size=2))),
                logprobs=_json, token_ids=_json)
_chunk = st.one_of(_json, st.fixed_dictionaries({"choices": st.lists(_choice, max_size=2)}))


@settings(max_examples=200, deadline=None)
@given(st.lists(_chunk, max_size=5), st.booleans(), st.booleans())
def test_any_engine_chunks_give_well_formed_events(chunks: list[Any], sse: bool, failed: bool) -> None:
    """Whatever the engine streams (it is vLLM, but a parser must not trust that), the agent gets
    well-formed events and the record a whole answer: nothing raises."""
    req = {"contents": "q", "model": FLASH, "stream": "sse" if sse else "json",
           "generationConfig": {"responseLogprobs": True, "thinkingConfig": {"includeThoughts": True}}}
    tr = dialects.translator(dialects.GEMINI, req, FLASH)
    cap = Capture(CHAT)
    data = b"".join(tr.chunk(c) for c in chunks if isinstance(c, dict))
    json.dumps(tr.final(cap))
    data += tr.failure("cut", cap) if failed else tr.finish(cap)
    events = sse_events(data) if sse else json.loads(data)
    assert ("error" in events[-1]) == failed


def test_logprobs_the_agent_asks_for_come_in_googles_shape() -> None:
    req = {"contents": "q", "model": FLASH, "stream": "sse", "generationConfig": {"responseLogprobs": True}}
    tr = dialects.translator(dialects.GEMINI, req, FLASH)
    chunk = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "token_ids": [5], "logprobs": {"content": [
        {"token": "Hi", "logprob": -0.5, "top_logprobs": [{"token": "Hi", "logprob": -0.5}]}]}}]}
    cap = Capture(CHAT)
    cap.add_chunk(chunk)
    (event,) = sse_events(tr.chunk(chunk))
    assert event["candidates"][0]["logprobsResult"] == {
        "topCandidates": [{"candidates": [{"token": "Hi", "logProbability": -0.5}]}],
        "chosenCandidates": [{"token": "Hi", "logProbability": -0.5, "tokenId": 5}]}
    assert tr.final(cap)["candidates"][0]["avgLogprobs"] == -0.5


# --- through the proxy ---------------------------------------------------------------------------------

def agent(proxy: ProxyProc, rollout: str) -> httpx.Client:
    """An HTTP client aimed at Google through the proxy, as an agent with HTTPS_PROXY would be."""
    ctx = ssl.create_default_context(cafile=proxy.ca_bundle)
    return httpx.Client(proxy=proxy.proxy_url(rollout), verify=ctx, trust_env=False, timeout=30,
                        headers={"x-goog-api-key": "fake-google-key"})


def chat_ref(up: FakeUpstream, chat: dict[str, Any]) -> dict[str, Any]:
    """The engine's whole answer to the chat request the proxy sends for the agent's call."""
    body = {k: v for k, v in chat.items() if k not in ("stream", "stream_options")}
    body.update(model=SERVED, return_token_ids=True, logprobs=True)
    return post_direct(f"{up.url}/{CHAT}", body)


def rows_of(proxy: ProxyProc, rollout: str) -> list[dict[str, Any]]:
    return proxy.calls("rollout_id = ?", [rollout])


@pytest.mark.parametrize("call", [MAIN_FULL, MAIN_FINAL], ids=["gemini-main-call", "gemini.minimal-final"])
def test_a_recorded_main_call_replayed_through_the_proxy(proxy, upstream, rollout, call):
    """Gemini CLI's own body, sent as it sent it: a Gemini SSE stream comes back (a function call whole,
    or text deltas; finishReason and usageMetadata last), and the row holds the engine's token ids."""
    _, chat, notes = translate(call["path"], call["body"])
    ref = chat_ref(upstream, chat)
    with agent(proxy, rollout) as client:
        r = client.post(f"{HOST}{call['path']}&key=query-key-secret", json=call["body"])
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.content)
    want = ref["choices"][0]["message"]
    parts = [p for e in events for p in e["candidates"][0].get("content", {}).get("parts", ())]
    if want.get("tool_calls"):
        (fc,) = [p["functionCall"] for p in parts]
        tc = want["tool_calls"][0]
        assert (fc["id"], fc["name"], fc["args"]) == (tc["id"], tc["function"]["name"],
                                                      json.loads(tc["function"]["arguments"]))
        assert len(events) == 1  # as Gemini CLI was answered: one event with the call, STOP and usage
    else:
        assert "".join(p["text"] for p in parts) == want["content"] and len(events) > 1
    assert events[-1]["candidates"][0]["finishReason"] == "STOP"
    assert events[-1]["usageMetadata"]["promptTokenCount"] == ref["usage"]["prompt_tokens"]
    (row,) = rows_of(proxy, rollout)
    prompt, ids, logprobs = ref_tokens(CHAT, ref)
    assert (row["api"], row["endpoint"], row["status"], row["capture"], row["streamed"]) == (
        "gemini", CHAT, "ok", "full", True)
    assert row["prompt_token_ids"] == prompt and row["response_token_ids"] == ids
    assert row["response_logprobs"] == pytest.approx(logprobs, abs=1e-6)
    assert row["requested_model"] == gemini.call_of(call["path"])[0]
    assert row["translation"] == (notes or None)  # Gemini CLI's calls need nothing approximated
    assert json.loads(row["request_json"]) == call["body"]
    got = json.loads(row["response_json"])
    assert got["candidates"][0]["content"]["parts"] == parts or "".join(
        p["text"] for p in got["candidates"][0]["content"]["parts"]) == want["content"]
    # the engine got chat/completions: no Google key (header or query), no Gemini field
    sent = upstream.requests[-1]
    assert sent.path == f"/v1/{CHAT}" and "x-goog-api-key" not in sent.headers
    assert "contents" not in sent.body and sent.body["model"] == SERVED
    # `lgt-train show` reads the row as the chat call it stands for
    req_chat, resp_chat = dialects.as_chat("gemini", json.loads(row["request_json"]), got)
    assert req_chat["messages"] == chat["messages"]
    assert resp_chat["choices"][0]["message"].get("tool_calls", [{}])[0].get("id") == (
        want.get("tool_calls") or [{}])[0].get("id")


def test_the_router_call_reaches_the_engine_with_its_json_schema(proxy, upstream, rollout):
    with agent(proxy, rollout) as client:
        r = client.post(f"{HOST}{ROUTER['path']}", json=ROUTER["body"])
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["candidates"][0]["content"]["parts"][0]["text"]
    assert body["modelVersion"] == "gemini-3.5-flash-lite"
    assert upstream.requests[-1].body["response_format"]["json_schema"]["schema"]["properties"][
        "complexity_score"] == {"type": "integer", "description": "Complexity score from 1-100."}
    (row,) = rows_of(proxy, rollout)
    assert (row["api"], row["status"], row["capture"], row["streamed"]) == ("gemini", "ok", "full", False)


def test_what_was_approximated_is_on_the_row(proxy, rollout):
    path = f"/v1beta/models/{FLASH}:generateContent"
    audio = {"inlineData": {"mimeType": "audio/wav", "data": "UklGRg=="}}
    body = {"contents": [{"role": "user", "parts": [{"text": "What is 2+2?"}, audio]}],
            "tools": [{"googleSearch": {}}], "generationConfig": {"maxOutputTokens": 64}}
    _, _, notes = translate(path, body)
    with agent(proxy, rollout) as client:
        r = client.post(f"{HOST}{path}", json=body)
    assert r.status_code == 200 and r.json()["candidates"][0]["content"]["parts"][0]["text"]
    (row,) = rows_of(proxy, rollout)
    assert row["translation"] == notes and len(notes) == 2 and "audio/wav" in notes[0]


def test_a_last_model_turn_is_continued_and_an_empty_conversation_still_asks() -> None:
    prefill = gemini.gemini_to_chat({"contents": [{"role": "user", "parts": [{"text": "Name a fruit."}]},
                                                  {"role": "model", "parts": [{"text": "Pine"}]}]})
    assert (prefill["continue_final_message"], prefill["add_generation_prompt"]) == (True, False)
    notes: list[str] = []
    empty = gemini.gemini_to_chat({"systemInstruction": "Sys", "contents": [{"role": "user", "parts": []}]},
                                  notes)
    assert empty["messages"] == [{"role": "system", "content": "Sys"}, {"role": "user", "content": ""}]
    assert notes == ["the contents left nothing to read: one empty user turn sent"]


def test_a_stream_without_alt_sse_is_one_json_array(proxy, rollout):
    with agent(proxy, rollout) as client:
        r = client.post(f"{HOST}/v1beta/models/{FLASH}:streamGenerateContent",
                        json={"contents": [{"role": "user", "parts": [{"text": "What is 6 times 7?"}]}]})
    assert r.headers["content-type"].startswith("application/json")
    events = r.json()
    assert isinstance(events, list) and len(events) > 2
    assert events[-1]["candidates"][0]["finishReason"] == "STOP"
    (row,) = rows_of(proxy, rollout)
    assert (row["status"], row["capture"], row["streamed"]) == ("ok", "full", True)


@pytest.mark.parametrize("fault", ["__drop__", "__broken_sse__"])
def test_a_stream_cut_short_is_an_error_for_the_agent_and_on_record(proxy, rollout, fault):
    """The engine's stream ends mid-way: the agent never gets a finishReason — Google's error object
    where the body ended cleanly, a cut connection otherwise — and the row says stream_error."""
    body = {"contents": [{"role": "user", "parts": [{"text": f"What is 2+2? {fault}"}]}]}
    with agent(proxy, rollout) as client:
        try:
            r = client.post(f"{HOST}/v1beta/models/{FLASH}:streamGenerateContent?alt=sse", json=body)
            data = r.content
        except httpx.HTTPError:
            data = None
    if fault == "__broken_sse__":
        events = sse_events(data)
        error = events[-1]["error"]
        assert error["code"] == 500 and "ended before it finished" in error["message"]
        assert all("finishReason" not in c for e in events[:-1] for c in e["candidates"])
    else:
        assert data is None or b"finishReason" not in data
    (row,) = rows_of(proxy, rollout)
    assert (row["api"], row["status"]) == ("gemini", "stream_error")


def test_a_stalled_stream_ends_with_googles_error_at_the_upstream_timeout(tmp_path, upstream, rollout):
    proxy = ProxyProc(tmp_path / "store", upstream.url, "--upstream-timeout", "0.5").start()
    try:
        body = {"contents": [{"role": "user", "parts": [{"text": "What is 2+2? __stall:1.5__"}]}]}
        with agent(proxy, rollout) as client:
            r = client.post(f"{HOST}/v1beta/models/{FLASH}:streamGenerateContent?alt=sse", json=body)
        (event,) = sse_events(r.content)  # the engine's first chunk (its role) says nothing in Gemini's API
        assert event["error"]["code"] == 500 and "--upstream-timeout" in event["error"]["message"]
        (row,) = rows_of(proxy, rollout)
        assert row["status"] == "upstream_timeout"
    finally:
        proxy.stop()


def test_errors_and_refusals_in_googles_shape(proxy, rollout):
    with agent(proxy, rollout) as client:
        bad = client.post(f"{HOST}/v1beta/models/{FLASH}:generateContent", json={"contents": [{"parts": 5}]})
        not_json = client.post(f"{HOST}/v1beta/models/{FLASH}:generateContent", content=b"{oops")
        engine = client.post(f"{HOST}/v1beta/models/{FLASH}:streamGenerateContent?alt=sse",
                             json={"contents": "__status:503__"})
    assert bad.status_code == 400 and bad.json() == {"error": {
        "code": 400, "status": "INVALID_ARGUMENT",
        "message": "lgt-proxy: contents[0].parts must be a list of parts"}}
    assert not_json.status_code == 400 and not_json.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert engine.status_code == 503 and engine.json()["error"]["status"] == "UNAVAILABLE"
    rows = rows_of(proxy, rollout)
    assert [(r["api"], r["status"], r["http_status"]) for r in rows] == [
        ("gemini", "rejected", 400), ("gemini", "rejected", 400), ("gemini", "http_error", 503)]


def test_the_model_list_names_the_policy(proxy, rollout):
    with agent(proxy, rollout) as client:
        client.post(f"{HOST}/v1beta/models/{FLASH}:generateContent", json={"contents": "What is 1+1?"})
        listed = client.get(f"{HOST}/v1beta/models?pageSize=50").json()
        one = client.get(f"{HOST}/v1beta/models/gemini-3-pro").json()
    names = [m["name"] for m in listed["models"]]
    assert names[0] == f"models/{SERVED}" and f"models/{FLASH}" in names
    assert one["name"] == "models/gemini-3-pro" and "generateContent" in one["supportedGenerationMethods"]
    assert [r["api"] for r in rows_of(proxy, rollout)] == ["gemini"]  # listings are not LLM calls


# --- the google-genai SDK as the agent ---------------------------------------------------------------

def test_the_google_genai_sdk_through_the_proxy(proxy, upstream, agent_env, rollout):
    genai = pytest.importorskip("google.genai")
    types = genai.types
    client = genai.Client(api_key="fake-google-key")
    whole = client.models.generate_content(model=FLASH, contents="What is 6 times 7?")
    stream = client.models.generate_content_stream(model=FLASH, contents="What is 6 times 7?")
    pieces = [c.text for c in stream]
    assert whole.text == "".join(p for p in pieces if p) and whole.candidates[0].finish_reason == "STOP"
    decl = types.FunctionDeclaration(name="calculator", description="Evaluate an expression.",
                                     parameters=types.Schema(type="OBJECT", properties={
                                         "expression": types.Schema(type="STRING")}, required=["expression"]))
    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[decl])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    called = client.models.generate_content(model=FLASH, contents="2+3", config=config)
    (fc,) = called.function_calls
    assert (fc.name, fc.args) == ("calculator", {"expression": "2+3"})
    assert upstream.requests[-1].body["tools"][0]["function"]["parameters"]["properties"] == {
        "expression": {"type": "string"}}
    answered = client.models.generate_content(model=FLASH, config=config, contents=[
        types.Content(role="user", parts=[types.Part(text="2+3")]), called.candidates[0].content,
        types.Content(role="user", parts=[types.Part.from_function_response(name="calculator",
                                                                            response={"output": "5"})])])
    assert answered.text == "The result is 5."
    assert [m.name for m in client.models.list()][0] == f"models/{SERVED}"
    with pytest.raises(genai.errors.ServerError) as e:
        client.models.generate_content(model=FLASH, contents="__status:500__")
    assert e.value.code == 500 and e.value.status == "INTERNAL"
    rows = rows_of(proxy, rollout)
    assert [(r["api"], r["status"], r["capture"]) for r in rows[:4]] == [("gemini", "ok", "full")] * 4
    # the function response answered the call by its id (given back by the SDK)
    assert rows[3]["prompt_token_ids"][:len(rows[2]["prompt_token_ids"])] == rows[2]["prompt_token_ids"]


def test_count_tokens_counts_the_prompt_of_the_call(proxy, upstream, agent_env, rollout):
    genai = pytest.importorskip("google.genai")
    probe = httpx.post(f"{upstream.url.removesuffix('/v1')}/tokenize", json={"model": SERVED, "messages": []})
    if probe.status_code == 404:
        pytest.skip("the fake upstream has no /tokenize")
    client = genai.Client(api_key="fake-google-key")
    counted = client.models.count_tokens(model=FLASH, contents="What is 6 times 7?")
    client.models.generate_content(model=FLASH, contents="What is 6 times 7?")
    (row,) = rows_of(proxy, rollout)
    assert counted.total_tokens == len(row["prompt_token_ids"])
