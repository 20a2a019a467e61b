"""The Anthropic Messages dialect as Claude Code uses it: what it sends (recorded in
tests/fixtures/harnesses/claude_code*, the seeds of the property tests) is never refused, each field
lands at its nearest chat/completions form with a note for what was approximated, the answers have the
shape Claude Code was given by the recording's fake Anthropic, and ``count_tokens`` counts the prompt the
call itself gets. The table of decisions is docs/dialects/messages.md.
"""

from __future__ import annotations

import copy
import json
import ssl
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lgt.proxy import dialects
from lgt.proxy.dialects.messages import CLIENT_TOOLS
from lgt.proxy.wire import CHAT, BadRequest, Capture
from lgt.testing.clients import anthropic_client, event_types, sse_events
from lgt.testing.fake_upstream import render_chat, tokenize

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "harnesses"
RECORDED = sorted(FIXTURES.glob("claude_code*/*-anthropic-messages.json"))
BODIES = {f"{p.parent.name}/{p.name[:2]}": json.loads(p.read_text())["body"] for p in RECORDED}
BILLING = ("Claude Code's x-anthropic-billing-header system block (a per-request hash) left out, so each "
           "turn's prompt extends the last (system[0])")
MID_SYSTEM = "system message 2 (after the conversation began) sent as user text in <system> tags"
EVENTS = event_types(RawMessageStreamEvent)
MESSAGE_LIST = TypeAdapter(list[ChatCompletionMessageParam])
TOOL_LIST = TypeAdapter(list[ChatCompletionToolParam])
URL = "https://api.anthropic.invalid/v1/messages"


def translate(req: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    return dialects.to_chat(dialects.MESSAGES, req, None, notes), notes


def check_chat(chat: dict[str, Any]) -> None:
    """A chat/completions request a chat template can render: one system message, first; user,
    assistant and tool messages of the OpenAI types; function tools; JSON all through."""
    json.dumps(chat, allow_nan=False)
    msgs = chat["messages"]
    MESSAGE_LIST.validate_python(msgs)
    assert msgs and all(m["role"] in ("system", "user", "assistant", "tool") for m in msgs)
    assert all(m["role"] != "system" for m in msgs[1:]) and any(m["role"] != "system" for m in msgs)
    for m in msgs:
        if m["role"] == "tool":
            assert isinstance(m["content"], str) and isinstance(m["tool_call_id"], str)
        elif m["role"] == "user" and not isinstance(m["content"], str):
            assert all(p["type"] in ("text", "image_url") for p in m["content"])
    names = [t["function"]["name"] for t in chat.get("tools", ())]
    if "tools" in chat:
        TOOL_LIST.validate_python(chat["tools"])
        assert all(t["type"] == "function" and isinstance(t["function"]["parameters"], dict)
                   for t in chat["tools"])
    choice = chat.get("tool_choice")
    assert choice is None or choice in ("auto", "none", "required") or choice["function"]["name"] in names


# --- what Claude Code sends --------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(BODIES))
def test_recorded_claude_code_bodies_translate(name: str) -> None:
    chat, notes = translate(BODIES[name])
    check_chat(chat)
    body = BODIES[name]
    assert chat["model"] == "claude-opus-5-5" and chat["max_tokens"] == 128000 and chat["stream"] is True
    assert chat["messages"][0]["role"] == "system"
    assert "billing-header" not in chat["messages"][0]["content"]
    deferred = [t["name"] for t in body["tools"] if t.get("defer_loading")]
    assert [t["function"]["name"] for t in chat["tools"]] == [
        t["name"] for t in body["tools"] if t["name"] not in deferred]  # deferred and never referenced
    if name.startswith("claude_code/"):  # thinking adaptive, a mid-list system message, the billing block
        assert chat["chat_template_kwargs"] == {"enable_thinking": True}
        assert notes == [MID_SYSTEM, BILLING]
        assert chat["messages"][1]["content"].endswith("Today's date is 2026-12-04.\n</system>")
    else:
        assert "chat_template_kwargs" not in chat and notes == []
    for key in ("metadata", "output_config", "context_management", "diagnostics", "thinking"):
        assert key not in chat


@pytest.mark.parametrize("profile", ["claude_code", "claude_code.minimal"])
def test_each_turn_extends_the_last(profile: str) -> None:
    """The second call's chat messages begin with the first call's (the billing block, whose hash
    changes every call, is left out), so its prompt extends the first call's prompt and answer."""
    first, _ = translate(BODIES[f"{profile}/03"])
    second, _ = translate(BODIES[f"{profile}/04"])
    assert second["messages"][:len(first["messages"])] == first["messages"]
    assert [m["role"] for m in second["messages"][len(first["messages"]):]] == ["assistant", "tool"]


THINKING, NOT_THINKING = {"chat_template_kwargs": {"enable_thinking": True}}, {
    "chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "json_schema", "schema": {"type": "object"}}
JSON_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": {"type": "object"}}}}


@pytest.mark.parametrize(("fields", "want"), [
    ({"thinking": {"type": "disabled"}}, NOT_THINKING),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, THINKING),
    ({"thinking": {"type": "adaptive", "display": "omitted"}}, THINKING),
    ({"output_config": {"effort": "medium", "format": SCHEMA}}, JSON_FORMAT),
    ({"output_format": SCHEMA}, JSON_FORMAT),
    ({"top_k": 5, "temperature": 0.5, "top_p": 0.9, "stop_sequences": ["END"], "service_tier": "auto",
      "metadata": {"user_id": "{\"device_id\": \"x\"}"}, "diagnostics": {"previous_message_id": None},
      "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
      "cache_control": {"type": "ephemeral"}, "container": "c1", "inference_geo": "us"},
     {"top_k": 5, "temperature": 0.5, "top_p": 0.9, "stop": ["END"]}),
])
def test_top_level_fields(fields: dict[str, Any], want: dict[str, Any]) -> None:
    """Mapped fields take their chat form; advisory ones (effort, budget, tier, metadata, caching,
    diagnostics, clearing thinking that is never sent) are ignored without a note."""
    chat, notes = translate({"model": "m", "messages": [{"role": "user", "content": "q"}], **fields})
    assert chat == {"messages": [{"role": "user", "content": "q"}], "model": "m", **want} and notes == []


TOOL = {"name": "calc", "input_schema": {"type": "object", "properties": {"e": {"type": "string"}}}}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
CALL = {"id": "toolu_1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {}}]}


def user(*blocks: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


# (request fields, the chat messages or fields expected (a subset), the start of the one note or None)
ACCEPTED = [
    ({"messages": [user({"type": "document", "title": "Spec", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "JVBE"}})]},
     {"messages": [{"role": "user", "content": "[document: Spec]"}]}, "a document the policy cannot read"),
    ({"messages": [user({"type": "document", "source": {"type": "content", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}})]},
     {"messages": [{"role": "user", "content": "a\nb"}]}, "a document block sent as its text"),
    ({"messages": [user({"type": "search_result", "source": "https://x.invalid", "title": "X", "content": [
        {"type": "text", "text": "found"}], "citations": {"enabled": True}})]},
     {"messages": [{"role": "user", "content": "X\nhttps://x.invalid\nfound"}]}, "a search_result block"),
    ({"messages": [user({"type": "container_upload", "file_id": "f1"}, {"type": "text", "text": "q"})]},
     {"messages": [{"role": "user", "content": "q"}]}, "a container_upload block left out"),
    ({"messages": [user({"type": "text", "text": "q", "citations": [], "cache_control": {"type": "x"}}),
                   {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xyz"},
                                                     {"type": "text", "text": "a"}]}]},
     {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "a redacted_thinking block left out"),
    ({"messages": [user({"type": "text", "text": "q"}), {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "s"}, *USE["content"]]}]},
     {"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": None, "tool_calls": [CALL]}]},
     "the assistant's thinking passed back left out"),
    ({"messages": [user({"type": "text", "text": "q"}), USE, user({
        "type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "seen"},
                                                                     IMAGE]})]},
     {"messages": [{"role": "user", "content": "q"}, {**USE, "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "toolu_1", "content": "seen"},
                   {"role": "user", "content": [IMAGE_URL]}]},
     "images of a tool result sent in the user turn after it"),
    ({"messages": [user({"type": "image", "source": {"type": "file", "file_id": "file_1"}})]},
     {"messages": [{"role": "user", "content": "[image: file_1]"}]}, "an image the engine cannot fetch"),
    ({"messages": [user({"type": "text", "text": "q"})], "tools": [TOOL], "tool_choice": {"type": "none"}},
     {"tool_choice": "none"}, None),
    ({"messages": [user({"type": "text", "text": "q"})], "tools": [TOOL],
      "tool_choice": {"type": "tool", "name": "web_search"}}, {"tool_choice": "auto"}, "a tool_choice"),
    ({"messages": [user({"type": "text", "text": "q"})], "mcp_servers": [{"type": "url", "url": "m"}]},
     {}, "MCP servers the hosted API would connect"),
    ({"messages": [user({"type": "text", "text": "q"})],
      "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, {},
     "a context_management edit"),
    ({"messages": [user({"type": "mystery_block", "payload": [1, 2]})]},
     {"messages": [{"role": "user", "content": '{"type":"mystery_block","payload":[1,2]}'}]},
     "a 'mystery_block' block (no chat form) sent as the text of its JSON"),
    ({"messages": [user({"type": "mystery_block", "payload": "x" * 5000}, {"type": "text", "text": "q"})]},
     {"messages": [{"role": "user", "content": "q"}]}, "a 'mystery_block' block (no chat form) left out"),
    ({"messages": [user({"type": "text", "text": "q"}), {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}}]}]},
     {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": json.dumps(
         {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
         separators=(",", ":"))}]}, "a 'server_tool_use' block"),
    ({"messages": [{"role": "developer", "content": "be brief"}, user({"type": "text", "text": "q"})]},
     {"messages": [{"role": "user", "content": "be brief"}, {"role": "user", "content": "q"}]},
     "a message of a role the API does not define"),
    ({"messages": [{"role": "system", "content": "only this"}]},
     {"messages": [{"role": "system", "content": "only this"}, {"role": "user", "content": ""}]},
     "a conversation with nothing the policy can read"),
    ({"messages": [user({"type": "text", "text": "q"}), {"role": "assistant", "content": "The answer is"}]},
     {"continue_final_message": True, "add_generation_prompt": False}, None),
    ({"messages": [user({"type": "text", "text": "q"})], "tools": [
        {"type": "bash_20250124", "name": "bash"}, {"type": "text_editor_20250728", "name": "edit"},
        {"type": "web_search_20250305", "name": "web_search"},
        {"type": "code_execution_20250825", "name": "x"}]},
     {"tools": [dialects.chat_tool("bash", *reversed(CLIENT_TOOLS["bash"])),
                dialects.chat_tool("edit", *reversed(CLIENT_TOOLS["text_editor"]))]},
     "an Anthropic-defined client tool offered as a function"),
    ({"messages": [user({"type": "text", "text": "q"}), USE, user({
        "type": "tool_result", "tool_use_id": "toolu_1",
        "content": [{"type": "tool_reference", "tool_name": "deep"}]})],
      "tools": [TOOL, {**TOOL, "name": "deep", "defer_loading": True},
                {**TOOL, "name": "no", "defer_loading": True}]},
     {"tools": [dialects.chat_tool("calc", TOOL["input_schema"], None),
                dialects.chat_tool("deep", TOOL["input_schema"], None)]}, "a 'tool_reference' block"),
]


@pytest.mark.parametrize(("req", "want", "note"), ACCEPTED)
def test_what_the_hosted_api_takes_is_never_refused(req: dict[str, Any], want: dict[str, Any],
                                                    note: str | None) -> None:
    chat, notes = translate({"model": "m", "max_tokens": 9, **req})
    check_chat(chat)
    assert {k: chat.get(k) for k in want} == want
    if note is None:
        assert notes == []
    else:
        assert notes and notes[0].startswith(note), notes


# --- property tests seeded with the recorded bodies ------------------------------------------------------

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                     max_leaves=6)
_words = st.text(max_size=12)
_well_formed_blocks = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t, "cache_control": {"type": "ephemeral"}}, _words),
    st.builds(lambda k, v: {"type": k, "value": v}, st.from_regex(r"[a-z_]{3,12}", fullmatch=True), _json),
    st.builds(lambda t: {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                        "data": t}}, _words),
    st.just({"type": "document", "source": {"type": "url", "url": "https://x.invalid/a.pdf"}}),
    st.builds(lambda t: {"type": "search_result", "source": "s", "title": t,
                         "content": [{"type": "text", "text": t}]}, _words),
    st.just({"type": "container_upload", "file_id": "file_1"}),
    st.just({"type": "redacted_thinking", "data": "abc"}),
    st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "sig"}, _words),
    st.just(IMAGE),
    st.builds(lambda n: {"type": "tool_reference", "tool_name": n}, _words),
)
_typed_tools = st.sampled_from([{"type": "bash_20250124", "name": "bash"},
                                {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
                                {"type": "memory_20250818", "name": "memory"},
                                {"type": "mcp_toolset", "mcp_server_name": "m", "name": "mcp"},
                                {**TOOL, "type": "custom", "defer_loading": True, "strict": True}])
OPTIONAL = ("system", "tools", "thinking", "metadata", "output_config", "context_management",
            "diagnostics", "stream", "max_tokens", "temperature", "tool_choice")


@st.composite
def well_formed(draw) -> dict[str, Any]:
    """A recorded body with what the hosted API also takes: unknown top-level keys, blocks of other
    kinds, mid-list system messages, typed tools, optional fields dropped or varied."""
    req = copy.deepcopy(draw(st.sampled_from(list(BODIES.values()))))
    for key in draw(st.lists(st.sampled_from(OPTIONAL), max_size=3)):
        req.pop(key, None)
    req.update(draw(st.dictionaries(st.from_regex(r"x_[a-z]{1,8}", fullmatch=True), _json, max_size=2)))
    if draw(st.booleans()):
        req["thinking"] = draw(st.sampled_from([
            {"type": "disabled"}, {"type": "enabled", "budget_tokens": 9},
            {"type": "adaptive", "display": "summarized"}, {"type": "new"}]))
    msgs = req["messages"]
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(msgs) - 1))
        if msgs[i]["role"] in ("user", "assistant"):
            content = msgs[i]["content"]
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            blocks.insert(draw(st.integers(0, len(blocks))), draw(_well_formed_blocks))
            msgs[i] = {**msgs[i], "content": blocks}
    for _ in range(draw(st.integers(0, 2))):
        msgs.insert(draw(st.integers(0, len(msgs))), {"role": "system", "output_config": {"effort": "low"},
                                                     "content": draw(st.one_of(_words, st.just([
                                                         {"type": "text", "text": "reminder"}])))})
    if draw(st.booleans()):
        req["tools"] = [*req.get("tools", []), *draw(st.lists(_typed_tools, max_size=3))]
    return req


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(well_formed())
def test_well_formed_variations_are_never_refused(req: dict[str, Any]) -> None:
    chat, notes = translate(req)
    check_chat(chat)
    assert all(isinstance(n, str) and n for n in notes)


def _mangle(draw, req: dict[str, Any]) -> None:
    """One change that may make the body malformed (a wrong JSON type somewhere)."""
    where = draw(st.sampled_from(["top", "message", "block", "tool"]))
    if where == "top":
        key = draw(st.sampled_from(["messages", "system", "tools", "tool_choice", "thinking",
                                    "output_config"]))
        req[key] = draw(_json)
    elif not isinstance(req.get("messages"), list) or not req["messages"]:
        return  # an earlier change replaced the list itself
    elif where == "message":
        msgs = req["messages"]
        msgs[draw(st.integers(0, len(msgs) - 1))] = draw(st.one_of(_json, st.fixed_dictionaries(
            {"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), _json), "content": _json})))
    elif where == "block":
        m = draw(st.sampled_from(req["messages"]))
        if isinstance(m, dict) and isinstance(m.get("content"), list) and m["content"]:
            k = draw(st.integers(0, len(m["content"]) - 1))
            m["content"][k] = draw(st.one_of(_json, st.builds(
                lambda kind, extra: {**extra, "type": kind},
                st.sampled_from(["tool_use", "tool_result", "image", "document", "search_result", "text"]),
                st.dictionaries(st.sampled_from(["id", "name", "input", "tool_use_id", "content", "source",
                                                 "text", "is_error"]), _json, max_size=4))))
    elif isinstance(req.get("tools"), list) and req["tools"]:
        req["tools"][draw(st.integers(0, len(req["tools"]) - 1))] = draw(_json)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(well_formed(), st.data())
def test_any_mutation_raises_nothing_but_bad_request(req: dict[str, Any], data: st.DataObject) -> None:
    for _ in range(data.draw(st.integers(1, 3))):
        _mangle(data.draw, req)
    try:
        chat, _ = translate(req)
    except BadRequest as e:
        assert str(e) and "\n" not in str(e)
        return
    check_chat(chat)


# --- the answers -------------------------------------------------------------------------------------

def stream_of(req: dict[str, Any], chunks: list[dict[str, Any]]) -> tuple[list[tuple[str, dict]], Any]:
    cap, tr = Capture(CHAT), dialects.Translator(dialects.MESSAGES, req, model=req.get("model"))
    data = b""
    for c in chunks:
        cap.add_chunk(c)
        data += tr.chunk(c)
    data += tr.finish(cap)
    events = sse_events(data)
    for kind, e in events:
        EVENTS[kind].model_validate(e)
    return events, tr


def chunks_of(delta: dict[str, Any], finish: str) -> list[dict[str, Any]]:
    return [{"choices": [{"index": 0, "delta": {"role": "assistant"}}], "prompt_token_ids": [1, 2]},
            {"choices": [{"index": 0, "delta": delta}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
            {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 12, "total_tokens": 14}}]


def _shape(obj: Any) -> Any:
    """An event without its ids (and its values' text)."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items() if k not in ("id", "model")}
    if isinstance(obj, list):
        return [_shape(v) for v in obj]
    return obj if isinstance(obj, (bool, type(None))) else type(obj).__name__


@pytest.mark.parametrize("name", ["claude_code/03", "claude_code/04"])
def test_answers_have_the_shape_claude_code_was_given(name: str) -> None:
    """Streamed like the recording's fake Anthropic answered (the answers Claude Code completed the
    task with): tool input only through one input_json_delta, text through text_delta."""
    path = next(p for p in RECORDED if f"{p.parent.name}/{p.name[:2]}" == name)
    recorded = [(e["event"], e["data"]) for e in json.loads(path.read_text())["response"]["events"]]
    start = next(d["content_block"] for k, d in recorded if k == "content_block_start")
    if start["type"] == "tool_use":
        delta = next(d["delta"] for k, d in recorded if k == "content_block_delta")
        args = json.loads(delta["partial_json"])
        events, _ = stream_of(BODIES[name], chunks_of({"tool_calls": [
            {"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": start["name"]}},
            {"index": 0, "function": {"arguments": json.dumps(args)[:5]}},
            {"index": 0, "function": {"arguments": json.dumps(args)[5:]}}]}, "tool_calls"))
        got = next(e["delta"] for k, e in events if k == "content_block_delta")
        assert json.loads(got["partial_json"]) == args
    else:
        events, _ = stream_of(BODIES[name], chunks_of({"content": "Done."}, "stop"))
    assert [_shape(e) for _, e in events] == [_shape(d) for _, d in recorded]


def test_thinking_comes_with_a_signature_and_as_the_agent_asked_to_see_it() -> None:
    chunks = chunks_of({"reasoning": "let me think"}, "stop")
    chunks.insert(2, {"choices": [{"index": 0, "delta": {"content": "42"}}]})
    base = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "q"}]}
    for display, shown in ((None, "let me think"), ("omitted", "")):
        req = {**base, "thinking": {"type": "adaptive", **({"display": display} if display else {})}}
        events, tr = stream_of(req, chunks)
        thinking = [e["delta"]["thinking"] for k, e in events if k == "content_block_delta"
                    and e["delta"]["type"] == "thinking_delta"]
        assert "".join(thinking) == shown
        signature = next(e["delta"]["signature"] for k, e in events if k == "content_block_delta"
                         and e["delta"]["type"] == "signature_delta")
        final = Message.model_validate(tr.final(Capture(CHAT)))
        assert final.content[0].type == "thinking" and final.content[0].signature == signature != ""
        assert final.content[0].thinking == shown and final.content[1].text == "42"


def test_arguments_that_are_not_an_object_still_give_the_agent_an_object() -> None:
    req = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "q"}]}
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{oops"}}
    events, tr = stream_of(req, chunks_of({"tool_calls": [call]}, "tool_calls"))
    got = json.loads(next(e["delta"]["partial_json"] for k, e in events if k == "content_block_delta"))
    whole = dialects.Translator(dialects.MESSAGES, req, model="m")
    body = whole.body({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [call]}}]}, Capture(CHAT))
    assert got == body["content"][0]["input"] == {"_unparsed_arguments": "{oops"}
    assert tr.notes == whole.notes == ["tool call 'calc': the policy's arguments are not a JSON object; sent "
                                       "to the agent under '_unparsed_arguments'"]


def test_an_empty_answer_has_one_empty_text_block() -> None:
    req = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "q"}]}
    events, tr = stream_of(req, chunks_of({}, "stop"))
    assert [k for k, _ in events] == ["message_start", "content_block_start", "content_block_stop",
                                      "message_delta", "message_stop"]
    whole = dialects.Translator(dialects.MESSAGES, req, model="m").body(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": None},
                      "finish_reason": "stop"}]}, Capture(CHAT))
    assert whole["content"] == tr.final(Capture(CHAT))["content"] == [{"type": "text", "text": ""}]


# --- through the proxy ----------------------------------------------------------------------------

def agent(proxy, rollout: str, timeout: float = 20) -> Any:
    """An HTTP client aimed at the hosted API through the proxy, as Claude Code connects."""
    return httpx.Client(proxy=proxy.proxy_url(rollout), timeout=timeout,
                        verify=ssl.create_default_context(cafile=proxy.ca_bundle))


def headers_of(name: str) -> dict[str, str]:
    path = next(p for p in RECORDED if f"{p.parent.name}/{p.name[:2]}" == name)
    recorded = json.loads(path.read_text())["headers"]
    drop = ("host", "content-length", "connection", "accept-encoding", "x-api-key")
    return {k: v for k, v in recorded.items() if k.lower() not in drop} | {"x-api-key": "sk-ant-test"}


def prompt_ids(chat: dict[str, Any]) -> list[int]:
    """The prompt the fake upstream renders for a chat request."""
    return tokenize(render_chat(chat["messages"], chat.get("tools")))


def rows_of(proxy, rollout: str, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while len(rows := proxy.calls("rollout_id = ?", [rollout])) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    return rows


@pytest.mark.parametrize("name", list(BODIES))
def test_recorded_claude_code_calls_answered_and_recorded(proxy, upstream, rollout, name: str) -> None:
    body = BODIES[name]
    with agent(proxy, rollout) as client:
        r = client.post(f"{URL}?beta=true", json=body, headers=headers_of(name))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = sse_events(r.content)
    for kind, e in events:
        EVENTS[kind].model_validate(e)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    starts = [e["content_block"] for k, e in events if k == "content_block_start"]
    assert all(b.get("input") in (None, {}) for b in starts)  # tool input only through input_json_delta
    chat, notes = translate(body)
    (row,) = proxy.calls("rollout_id = ?", [rollout])
    assert (row["status"], row["api"], row["endpoint"], row["capture"]) == ("ok", "messages", CHAT, "full")
    assert row["prompt_token_ids"] == prompt_ids(chat) and row["response_token_ids"]
    assert len(row["response_logprobs"]) == len(row["response_token_ids"])
    assert list(row["translation"] or ()) == notes  # the fake's context holds Claude Code's 128000
    assert json.loads(row["response_json"])["stop_reason"] == events[-2][1]["delta"]["stop_reason"]


def test_count_tokens_is_the_prompt_of_the_call(proxy, rollout, agent_env) -> None:
    """``count_tokens`` (as Claude Code sends it, and through the official SDK) equals the prompt token
    count the same request gets as a call; it is answered by the proxy, not recorded as a call."""
    body = BODIES["claude_code/04"]
    counted = {k: v for k, v in body.items() if k in ("model", "messages", "system", "tools", "thinking")}
    headers = headers_of("claude_code/04")
    with agent(proxy, rollout) as client:
        count = client.post(f"{URL}/count_tokens?beta=true", json=counted, headers=headers)
        call = client.post(f"{URL}?beta=true", json={**body, "stream": False}, headers=headers)
    assert count.status_code == 200 and call.status_code == 200, (count.text, call.text)
    assert count.json() == {"input_tokens": call.json()["usage"]["input_tokens"]}
    req = {"model": "claude-sonnet-4-5", "system": "Add.", "messages": [{"role": "user", "content": "2+3"}]}
    with anthropic_client() as sdk:
        assert sdk.messages.count_tokens(**req).input_tokens == sdk.messages.create(
            **req, max_tokens=9).usage.input_tokens
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [(r["status"], len(r["prompt_token_ids"])) for r in rows] == [
        ("ok", count.json()["input_tokens"]), ("ok", len(prompt_ids(translate(req)[0])))]


def test_count_tokens_errors_in_anthropics_shape(proxy, rollout, agent_env) -> None:
    with anthropic_client() as sdk, pytest.raises(anthropic.BadRequestError) as bad:
        sdk.messages.count_tokens(model="m", messages=[{"role": "user", "content": [{"text": "no type"}]}])
    assert bad.value.body["error"] == {"type": "invalid_request_error", "message": "lgt-proxy: messages[0]."
                                       "content[0] is not a content block (an object with a 'type')"}
    with anthropic_client() as sdk, pytest.raises(anthropic.APIStatusError) as failed:  # the tokenizer fails
        sdk.messages.count_tokens(model="m", messages=[{"role": "user", "content": "__status:503__"}])
    error = failed.value.body["error"]
    assert failed.value.status_code == 502 and failed.value.body["type"] == "error"
    assert error["type"] == "api_error" and "HTTP 503" in error["message"]
    assert proxy.calls("rollout_id = ?", [rollout]) == []  # neither is an LLM call


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"messages": 5}',
                                  b'{"messages": [{"role": "user", "content": [7]}]}',
                                  b'{"messages": [{"role": "user", "content": "q"}], "tools": {}}'])
def test_malformed_bodies_are_refused_in_anthropics_shape(proxy, rollout, body: bytes) -> None:
    with agent(proxy, rollout) as client:
        r = client.post(URL, content=body, headers={"content-type": "application/json",
                                                     "anthropic-version": "2023-06-01"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    (row,) = proxy.calls("rollout_id = ?", [rollout])
    assert (row["api"], row["status"], row["http_status"]) == ("messages", "rejected", 400)


def test_a_claude_code_stream_cut_by_the_engine(proxy, rollout) -> None:
    """The engine drops the connection mid-stream, ends it without finishing, or stalls past the
    agent's patience: the agent never gets a finished answer (a cut connection, or Anthropic's
    ``error`` event), each call is on the record once (not half-written), and the proxy goes on."""
    body = copy.deepcopy(BODIES["claude_code.minimal/03"])
    headers, task = headers_of("claude_code.minimal/03"), body["messages"][0]["content"][0]["text"]

    def ask(fault: str, timeout: float = 20) -> str:
        body["messages"][0]["content"][0]["text"] = f"{task} {fault}"
        with agent(proxy, rollout, timeout) as client:
            return client.post(URL, json=body, headers=headers).text

    with pytest.raises(httpx.RemoteProtocolError):  # the connection is cut as the engine cut it
        ask("__drop__")
    events = sse_events(ask("__broken_sse__").encode())
    assert [k for k, _ in events] == ["message_start", "error"]
    assert events[-1][1]["error"] == {"type": "api_error",
                                      "message": "lgt-proxy: the engine's stream ended before it finished"}
    with pytest.raises(httpx.ReadTimeout):
        ask("__stall:1__", timeout=0.3)
    assert "event: message_stop" in ask("still there?")
    rows = rows_of(proxy, rollout, 4)
    assert [r["status"] for r in rows][:2] == ["stream_error", "stream_error"] and rows[3]["status"] == "ok"
    assert rows[2]["status"] in ("client_disconnect", "ok") and len(rows) == 4
