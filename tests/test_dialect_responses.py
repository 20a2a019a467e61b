"""The Responses dialect as real clients send it (Codex 0.171, opencode 1.18, pi 0.73): every recorded
body translates, what the hosted API takes is mapped or noted — never refused — and the answer comes
back under the agent's own tool names, kinds and namespaces. Pure functions; the recorded bodies
(tests/fixtures/harnesses) seed the property tests. Through the proxy over WebSocket:
tests/test_responses_ws.py."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lgt.proxy import codex, dialects, wsbridge
from lgt.proxy.dialects.responses import CUSTOM_ARG, custom_input, tool_routes
from lgt.proxy.wire import CHAT, BadRequest, Capture
from lgt.testing.clients import sdk_events

FIXTURES = Path(__file__).parent / "fixtures" / "harnesses"
RECORDED = sorted(p for p in FIXTURES.glob("*/*-openai-responses.json")
                  if isinstance(json.loads(p.read_text()).get("body"), dict))


@functools.cache
def _recorded(path: Path) -> str:
    return json.dumps({k: v for k, v in json.loads(path.read_text())["body"].items() if k != "type"})


def body_of(path: Path) -> dict[str, Any]:
    """A recorded request as the proxy reads it (a WebSocket message without its ``type``), a fresh copy."""
    return json.loads(_recorded(path))


def events_of(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in data.decode().split("\n") if line.startswith("data: ")]


def answer(msg: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", **msg}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def calling(name: str, args: str, call_id: str = "call_1") -> dict[str, Any]:
    return answer({"content": None, "tool_calls": [{"id": call_id, "type": "function",
                                                    "function": {"name": name, "arguments": args}}]},
                  "tool_calls")


def test_the_recordings_are_there() -> None:
    assert {p.parent.name for p in RECORDED} >= {"codex", "codex.http", "codex.minimal", "opencode",
                                                 "opencode.minimal", "pi", "pi.minimal"}


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: f"{p.parent.name}/{p.name[:2]}")
def test_every_recorded_body_translates(path: Path) -> None:
    """Each body a real client sent becomes a chat request with unique function names; only a prewarm
    (``generate: false``, answered by the WebSocket bridge without the engine) may have no input."""
    req, notes = body_of(path), []
    try:
        chat = dialects.to_chat(dialects.RESPONSES, req, None, notes)
    except BadRequest as e:
        assert req.get("generate") is False and "has no input" in str(e)
        return
    names = [t["function"]["name"] for t in chat.get("tools", ())]
    assert len(names) == len(set(names)) and all(isinstance(n, str) for n in notes)
    assert chat["messages"][0]["role"] in ("system", "user", "tool")
    assert all(m["role"] != "system" for m in chat["messages"][1:])  # system text only first
    assert set(tool_routes(req)) == set(names)


def test_codex_main_call_offers_its_namespaced_and_custom_tools() -> None:
    req = body_of(FIXTURES / "codex" / "03-main-tool-call-ws-openai-responses.json")
    notes: list[str] = []
    chat = dialects.to_chat(dialects.RESPONSES, req, None, notes)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "user"]
    assert chat["messages"][0]["content"].startswith("You are Codex")  # 4 developer messages, joined
    tools = {t["function"]["name"]: t["function"] for t in chat["tools"]}
    assert list(tools)[:3] == ["exec", "wait", "request_user_input"] and "sleep" in tools
    exec_ = tools["exec"]
    assert exec_["parameters"]["properties"] == {
        CUSTOM_ARG: {"type": "string", "description": "The tool's input."}}
    assert "lark grammar:\nstart: pragma_source" in exec_["description"].replace("\n\nstart", "\nstart")
    routes = tool_routes(req)
    assert (routes["exec"].kind, routes["exec"].namespace) == ("custom", "functions")
    assert (routes["sleep"].kind, routes["sleep"].namespace) == ("function", "clock")
    assert any("custom tool 'exec'" in n for n in notes) and any("clock: 1" in n for n in notes)


def test_shared_names_across_namespaces_are_qualified() -> None:
    fn = {"type": "function", "name": "run", "parameters": {"type": "object", "properties": {}}}
    req = {"input": "go", "tools": [fn, {"type": "namespace", "name": "a", "description": "", "tools": [fn]},
                                    {"type": "namespace", "name": "b", "description": "", "tools": [fn]}]}
    chat = dialects.to_chat(dialects.RESPONSES, req)
    assert [t["function"]["name"] for t in chat["tools"]] == ["run", "a__run", "b__run"]
    tr = dialects.Translator(dialects.RESPONSES, req, model="m")
    item = tr.body(calling("b__run", "{}"), Capture(CHAT))["output"][0]
    assert (item["type"], item["name"], item["namespace"]) == ("function_call", "run", "b")


@pytest.mark.parametrize(("req", "notes_have", "chat_has"), [
    ({"input": "x", "tools": [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]},
                              {"type": "computer_use_preview"}, {"type": "image_generation"},
                              {"type": "code_interpreter", "container": {"type": "auto"}},
                              {"type": "mcp", "server_label": "s"}, {"type": "local_shell"}]},
     ["tools[0] (a 'web_search' tool", "tools[6] (a 'local_shell' tool"], {}),
    ({"input": [{"role": "user", "content": "ls"},
                {"type": "local_shell_call", "id": "ls_1", "call_id": "c", "status": "completed",
                 "action": {"type": "exec", "command": ["ls"]}},
                {"type": "local_shell_call_output", "id": "o_1", "call_id": "c", "output": "a.txt"}]},
     ["carried as text: local_shell_call ×1, local_shell_call_output ×1"],
     {"messages": [{"role": "user", "content": "ls"},
                   {"role": "assistant", "content": '<local_shell_call>\n{"call_id":"c","action":{"type":'
                                                    '"exec","command":["ls"]}}\n</local_shell_call>'},
                   {"role": "user", "content": '<local_shell_call_output>\n{"call_id":"c","output":"a.txt"}'
                                               '\n</local_shell_call_output>'}]}),
    ({"input": [{"type": "configuration_update", "reasoning": {"effort": "high"},
                 "text": {"format": {"type": "json_object"}}}, {"role": "user", "content": "x"}]},
     ["configuration_update items"], {"response_format": {"type": "json_object"}}),
    ({"input": "x", "background": True, "prompt": {"id": "pmpt_1"}, "conversation": "conv_1"},
     ["background: true answered", "'prompt'", "'conversation'"], {}),
    ({"input": [{"type": "item_reference", "id": "msg_1"}, {"type": "compaction", "encrypted_content": "e"},
                {"type": "reasoning", "summary": [], "encrypted_content": "z"},
                {"role": "user", "content": "x"}]},
     ["left out of the prompt: item_reference ×1, compaction ×1, reasoning ×1"],
     {"messages": [{"role": "user", "content": "x"}]}),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"},
                                             {"type": "input_file", "filename": "a.pdf", "file_data": "..."},
                                             {"type": "input_image", "file_id": "file_1"}]}]},
     ["input[0].content[1] (a 'input_file' part)", "input[0].content[2] (a 'input_image' part)"],
     {"messages": [{"role": "user", "content": "see\n[input_file: a.pdf]\n[input_image: file_1]"}]}),
    ({"input": [{"role": "critic", "content": "x"}], "tool_choice": {"type": "web_search"},
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     ["has role 'critic'", "tool_choice"], {"tool_choice": "auto"}),
    ({"input": "x", "tools": [{"type": "custom", "name": "sh"}],
      "tool_choice": {"type": "custom", "name": "sh"}},
     ["custom tool 'sh'"], {"tool_choice": {"type": "function", "function": {"name": "sh"}}}),
])
def test_what_the_hosted_api_takes_is_sent_and_noted(req: dict[str, Any], notes_have: list[str],
                                                     chat_has: dict[str, Any]) -> None:
    notes: list[str] = []
    chat = dialects.to_chat(dialects.RESPONSES, req, None, notes)
    for want in notes_have:
        assert any(want in n for n in notes), (want, notes)
    for key, value in chat_has.items():
        assert chat[key] == value


@pytest.mark.parametrize(("arguments", "text", "noted"), [
    ('{"input": "echo hi"}', "echo hi", False), ('{"source": "x = 1"}', "x = 1", True),
    ("console.log(1)", "console.log(1)", True), ('"a"', "a", True), ("", "", False),
    ('{"input": "a", "b": 1}', "a", True), ('{"a": 1, "b": 2}', '{"a": 1, "b": 2}', True)])
def test_a_custom_tool_calls_input(arguments: str, text: str, noted: bool) -> None:
    got, note = custom_input(arguments)
    assert got == text and (note is not None) == noted


def codex_like() -> dict[str, Any]:
    return {"model": "gpt-6.2-sol", "include": ["reasoning.encrypted_content"], "input": [
        {"type": "additional_tools", "role": "developer", "tools": [
            {"type": "namespace", "name": "functions", "description": "", "tools": [
                {"type": "custom", "name": "exec", "description": "Run JavaScript.",
                 "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
                {"type": "function", "name": "wait", "parameters": {"type": "object", "properties": {}}}]},
            {"type": "namespace", "name": "clock", "description": "Time.", "tools": [
                {"type": "function", "name": "sleep", "parameters": {"type": "object", "properties": {}}}]}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Write it."}]}]}


def test_a_custom_tool_call_is_answered_as_one_and_comes_back_as_the_same_chat_call() -> None:
    """The policy calls the flattened ``exec``: the agent gets a ``custom_tool_call`` (whole and
    streamed: ``response.custom_tool_call_input.delta`` / ``.done``) under its namespace; passed back
    (chained by id, or whole as Codex's HTTP fallback sends it) it is the same chat call again."""
    req = {**codex_like(), "stream": True}
    js = 'const r = await tools.exec_command({cmd: "echo PINEAPPLE > answer.txt"});\n'
    chat_answer = calling("exec", json.dumps({CUSTOM_ARG: js}))
    whole = dialects.Translator(dialects.RESPONSES, req, model="gpt-6.2-sol")
    item = whole.body(chat_answer, Capture(CHAT))["output"][0]
    assert {k: item[k] for k in ("type", "name", "input", "namespace", "status")} == {
        "type": "custom_tool_call", "name": "exec", "input": js, "namespace": "functions",
        "status": "completed"}
    tr = dialects.Translator(dialects.RESPONSES, req, model="gpt-6.2-sol")
    first = {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "exec"}}]}}]}
    args = json.dumps({CUSTOM_ARG: js})
    pieces = [{"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": a}}]}}]} for a in (args[:7], args[7:30], args[30:])]
    data = b"".join(tr.chunk(c) for c in [first, *pieces]) + tr.finish(Capture(CHAT))
    events = events_of(data)
    classes = sdk_events()
    for e in events:
        classes[e["type"]].model_validate(e)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
        "response.output_item.done", "response.completed"]
    assert events[2]["item"]["type"] == "custom_tool_call" and events[2]["item"]["input"] == ""
    assert events[3]["delta"] == events[4]["input"] == js
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["custom_tool_call"] and final["output"][0]["input"] == js
    # passed back: chained (history = input items + output items) and whole, the same chat request
    output = {"type": "custom_tool_call_output", "call_id": item["call_id"],
              "output": [{"type": "input_text", "text": "Script completed"},
                         {"type": "input_text", "text": "{}"}]}
    history = dialects.carried_history(req) + whole.history()
    chained = dialects.to_chat(dialects.RESPONSES, {**req, "input": [output]}, history)
    echoed = {**item, "internal_chat_message_metadata_passthrough": {"turn_id": "t"}}
    sent_whole = dialects.to_chat(dialects.RESPONSES, {**req, "input": [*req["input"], echoed, output]})
    assert chained == sent_whole
    assert chained["messages"][-2:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": item["call_id"], "type": "function", "function": {"name": "exec", "arguments": args}}]},
        {"role": "tool", "tool_call_id": item["call_id"], "content": "Script completed\n{}"}]


def test_reasoning_items_carry_an_opaque_encrypted_content_when_asked() -> None:
    reasoned = answer({"content": "done", "reasoning": "think"})
    with_it = dialects.Translator(dialects.RESPONSES, codex_like(), model="m").body(reasoned, Capture(CHAT))
    without = dialects.Translator(dialects.RESPONSES, {"input": "x"}, model="m").body(reasoned, Capture(CHAT))
    assert with_it["output"][0]["encrypted_content"].startswith("lgt-proxy:")
    assert "encrypted_content" not in without["output"][0]


# -- property tests, seeded with the recordings ----------------------------------------------------

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                  max_size=3), max_leaves=8)
_kinds = st.sampled_from(["message", "function_call", "function_call_output", "custom_tool_call",
                          "custom_tool_call_output", "reasoning", "additional_tools", "configuration_update",
                          "local_shell_call", "mcp_call", "item_reference", "compaction", "program",
                          "web_search_call", "apply_patch_call_output", "unheard_of"]) | st.text(max_size=10)
_item = st.builds(lambda kind, extra, role, content: {"type": kind, "role": role, "content": content,
                                                      **extra},
                  _kinds, st.dictionaries(st.sampled_from(["name", "call_id", "input", "output", "arguments",
                                                           "tools", "namespace", "id", "x_new"]), _json,
                                          max_size=3),
                  st.sampled_from(["user", "assistant", "developer", "system", "tool", None]),
                  _json | st.lists(st.fixed_dictionaries({"type": _kinds, "text": st.text(max_size=5)})))
_tool = st.builds(lambda kind, extra: {"type": kind, **extra},
                  st.sampled_from(["function", "custom", "namespace", "web_search", "mcp", "shell", "zz"]),
                  st.dictionaries(st.sampled_from(["name", "tools", "format", "parameters", "description"]),
                                  _json | st.text(min_size=1, max_size=5), max_size=3))


@st.composite
def mutated(draw) -> dict[str, Any]:
    """A recorded body with unknown keys, item types, tools and content parts put in anywhere."""
    req = body_of(draw(st.sampled_from(RECORDED)))
    items = req["input"] if isinstance(req.get("input"), list) else []
    for _ in range(draw(st.integers(0, 3))):
        choice = draw(st.integers(0, 3))
        if choice == 0:
            items.insert(draw(st.integers(0, len(items))), draw(_item))
        elif choice == 1 and items:
            target = items[draw(st.integers(0, len(items) - 1))]
            target[draw(st.text(max_size=8))] = draw(_json)
        elif choice == 2:
            req.setdefault("tools", []).append(draw(_tool))
        else:
            key = draw(st.sampled_from(["tool_choice", "text", "include", "reasoning", "truncation", "new"]))
            req[key] = draw(_json)
    return req


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_unknown_items_keys_and_tools_never_raise_anything_but_bad_request(req: dict[str, Any]) -> None:
    try:
        chat = dialects.to_chat(dialects.RESPONSES, req, None, [])
    except BadRequest:
        return
    assert chat["messages"] and all(isinstance(m, dict) for m in chat["messages"])
    routes = tool_routes(req)
    assert set(routes) == {t["function"]["name"] for t in chat.get("tools", ())}
    tr = dialects.Translator(dialects.RESPONSES, req, model="m")
    name = next(iter(routes), "f")
    body = tr.body(calling(name, '{"input": "x"}'), Capture(CHAT))
    output_items().validate_python(body["output"])  # (the envelope echoes the request's own fields)


@functools.cache
def output_items() -> Any:
    from openai.types.responses import ResponseOutputItem
    from pydantic import TypeAdapter

    return TypeAdapter(list[ResponseOutputItem])


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([p for p in RECORDED if tool_routes(body_of(p))]), st.data())
def test_any_recorded_tool_called_and_passed_back_is_the_same_chat_call(path: Path, data) -> None:
    """Seeded with the recordings: whichever offered tool the policy calls, the agent gets it under
    its own name, kind and namespace, and the item passed back (chained, or echoed whole with unknown
    keys as Codex's HTTP fallback does) is the same chat call again."""
    req = body_of(path)
    routes = tool_routes(req)
    chat_name = data.draw(st.sampled_from(sorted(routes)))
    text = data.draw(st.text(max_size=20))
    args = json.dumps({CUSTOM_ARG: text} if routes[chat_name].kind == "custom" else {"x": text},
                      ensure_ascii=False)
    tr = dialects.Translator(dialects.RESPONSES, req, model="m")
    (item,) = tr.body(calling(chat_name, args), Capture(CHAT))["output"]
    route = routes[chat_name]
    assert item["name"] == route.name and item.get("namespace") == route.namespace
    assert item["type"] == ("custom_tool_call" if route.kind == "custom" else "function_call")
    echoed = {**item, "internal_chat_message_metadata_passthrough": {"turn_id": "t"}}
    back = dialects.to_chat(dialects.RESPONSES, {**req, "input": [echoed]})["messages"][-1]
    chained = dialects.to_chat(dialects.RESPONSES, {"input": [{"role": "user", "content": "go on"}]},
                               dialects.carried_history(req) + tr.history())["messages"][-2]
    for msg in (back, chained):
        (call,) = msg["tool_calls"]
        assert call["function"]["name"] == chat_name and json.loads(call["function"]["arguments"]) == \
            json.loads(args)


_names = st.sampled_from(["exec", "wait", "sleep", "unknown_tool"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(_names, st.text(max_size=30)), min_size=1, max_size=3), st.data())
def test_streamed_tool_calls_add_up_to_the_whole_answer(calls: list[tuple[str, str]], data) -> None:
    """Custom, namespaced and plain calls, their arguments split anyhow: the events validate against
    the SDK's types and the final response equals the whole body's translation."""
    req = codex_like()
    args = [json.dumps({CUSTOM_ARG: text} if name == "exec" else {"t": text}) for name, text in calls]
    chunks = []
    for i, ((name, _), a) in enumerate(zip(calls, args)):
        chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": name}}]}}]})
        cuts = sorted(data.draw(st.sets(st.integers(1, max(len(a) - 1, 1)), max_size=3)))
        for lo, hi in zip([0, *cuts], [*cuts, len(a)]):
            if a[lo:hi]:
                chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [
                    {"index": i, "function": {"arguments": a[lo:hi]}}]}}]})
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    cap = Capture(CHAT)
    tr = dialects.Translator(dialects.RESPONSES, req, model="m")
    out = b""
    for c in chunks:
        cap.add_chunk(c)
        out += tr.chunk(c)
    out += tr.finish(cap)
    events = events_of(out)
    classes = sdk_events()
    for e in events:
        classes[e["type"]].model_validate(e)
    whole = dialects.Translator(dialects.RESPONSES, req, model="m").body(
        answer({"content": None, "tool_calls": [{"id": f"call_{i}", "type": "function",
                                                 "function": {"name": n, "arguments": a}}
                                                for i, ((n, _), a) in enumerate(zip(calls, args))]},
               "tool_calls"), cap)
    strip = lambda o: [{k: v for k, v in i.items() if k != "id"} for i in o["output"]]  # noqa: E731
    assert strip(events[-1]["response"]) == strip(whole)
    for item, (name, text) in zip(whole["output"], calls):
        if name == "exec":
            assert (item["type"], item["input"], item["namespace"]) == ("custom_tool_call", text, "functions")
        else:
            assert item["type"] == "function_call" and item.get("namespace") == {
                "wait": "functions", "sleep": "clock"}.get(name)


# -- the WebSocket bridge's and Codex's pure parts ---------------------------------------------------

def test_a_prewarm_is_a_completed_response_with_no_output() -> None:
    from openai.types.responses import ResponseStreamEvent  # noqa: F401

    body = body_of(FIXTURES / "codex" / "02-prewarm-ws-openai-responses.json")
    response_id, events = wsbridge.prewarm_events(body)
    parsed = [json.loads(e) for e in events]
    assert [e["type"] for e in parsed] == ["response.created", "response.in_progress", "response.completed"]
    classes = sdk_events()
    for e in parsed:
        classes[e["type"]].model_validate(e)
    assert parsed[-1]["response"]["id"] == response_id and parsed[-1]["response"]["output"] == []


def test_a_call_after_a_prewarm_carries_the_prewarms_input() -> None:
    prewarm = {"input": [{"role": "developer", "content": "Be brief."}], "generate": False}
    call = {"previous_response_id": "resp_pre", "input": [{"role": "user", "content": "hi"}]}
    assert wsbridge.fold_prewarm(call, prewarm) == {
        "input": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
    assert wsbridge.fold_prewarm(call, {**prewarm, "previous_response_id": "resp_0"})[
        "previous_response_id"] == "resp_0"


def test_the_proxys_refusals_become_error_events_codex_reads() -> None:
    refusal = json.dumps({"error": {"message": "lgt-proxy: bad", "type": "invalid_request_error",
                                    "code": 400}}).encode()
    assert wsbridge.http_error_event(400, refusal, {}) == {
        "type": "error", "status": 400,
        "error": {"type": "invalid_request_error", "code": None, "message": "lgt-proxy: bad", "param": None}}
    busy = wsbridge.http_error_event(429, b"{}", {"retry-after": "5"})
    assert busy["status"] == 429 and busy["headers"] == {"retry-after": "5"}
    assert wsbridge.http_error_event(502, b"<html>", {})["error"]["message"] == "<html>"


def test_codex_model_catalogue_lists_the_policy_hidden() -> None:
    assert codex.is_models_path("GET", "/backend-api/codex/models?client_version=0.171.0")
    assert not codex.is_models_path("POST", "/backend-api/codex/models")
    (entry,) = codex.models_answer("policy")["models"]
    assert (entry["slug"], entry["visibility"], entry["supported_in_api"]) == ("policy", "hide", True)
    assert codex.models_answer(None) == {"models": []}
