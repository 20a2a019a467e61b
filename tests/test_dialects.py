"""OpenAI Responses and Anthropic Messages through the proxy, with the official SDKs as the agents.

The proxy asks the engine through chat/completions and answers in the API the agent called. Each test
checks the agent's side with the SDK's own types and streaming helpers (a stream must add up to the
same answer as the whole body), and the store's side: the call recorded with ``api`` = the API the agent
called, ``endpoint`` = chat/completions, and the token ids and logprobs the engine produced for the
equivalent chat request (read from the fake upstream directly).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lgt.proxy import dialects
from lgt.proxy.wire import BadRequest, Capture
from lgt.testing.clients import (
    CHAT,
    SERVED,
    anthropic_client,
    event_types,
    post_direct,
    ref_tokens,
    sse_events,
)
from lgt.testing.fake_upstream import FakeUpstream

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

MODEL = "gpt-5-mini"
CLAUDE = "claude-sonnet-4-5"
OPENAI_BASE = "https://api.openai.invalid/v1"
FN_TOOL = {"type": "function", "name": "calculator", "description": "Evaluate an expression.",
           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                          "required": ["expression"]}}
ANTHROPIC_TOOL = {"name": "calculator", "description": "Evaluate an expression.",
                  "input_schema": FN_TOOL["parameters"]}


def chat_ref(up: FakeUpstream, chat: dict[str, Any]) -> dict[str, Any]:
    """The engine's whole answer to the chat request the proxy sends for the agent's call."""
    body = {k: v for k, v in chat.items() if k not in ("stream", "stream_options")}
    body.update(model=SERVED, return_token_ids=True, logprobs=True)
    return post_direct(f"{up.url}/{CHAT}", body)


def recorded(proxy, rollout: str) -> list[dict[str, Any]]:
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert all(r["status"] == "ok" for r in rows), [(r["status"], r["error"]) for r in rows]
    return rows


def check_tokens(row: dict[str, Any], ref: dict[str, Any], api: str) -> None:
    assert (row["api"], row["endpoint"]) == (api, CHAT)
    prompt, ids, logprobs = ref_tokens(CHAT, ref)
    assert row["prompt_token_ids"] == prompt and row["response_token_ids"] == ids
    assert row["response_logprobs"] == pytest.approx(logprobs, abs=1e-6)
    assert row["capture"] == "full"


def openai_client():
    return openai.OpenAI(base_url=OPENAI_BASE, api_key="sk-test", max_retries=0, timeout=20)


# --- the translations alone ------------------------------------------------------------------------

def test_responses_input_becomes_chat_messages() -> None:
    req = {"model": MODEL, "instructions": "Be brief.", "max_output_tokens": 40, "temperature": 0.5,
           "tools": [FN_TOOL], "tool_choice": {"type": "function", "name": "calculator"},
           "input": [
               {"role": "user", "content": [{"type": "input_text", "text": "What is 2+3?"}]},
               {"type": "reasoning", "id": "rs_1", "summary": []},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me"}]},
               {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": '{"e": 1}'},
               {"type": "function_call_output", "call_id": "c1", "output": "5"},
               {"role": "developer", "content": "Answer in words."}]}
    chat = dialects.to_chat(dialects.RESPONSES, req)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "Let me", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"e": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "user", "content": "<system>\nAnswer in words.\n</system>"}]  # a later developer message
    assert chat["max_tokens"] == 40 and chat["temperature"] == 0.5 and chat["model"] == MODEL
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "calculator", "parameters": FN_TOOL["parameters"], "description": "Evaluate an expression."}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "calculator"}}
    stream = dialects.to_chat(dialects.RESPONSES, {"input": "hi", "stream": True})
    assert stream["stream_options"] == {"include_usage": True}


def test_messages_become_chat_messages() -> None:
    req = {"model": CLAUDE, "max_tokens": 64, "system": [{"type": "text", "text": "You add."}],
           "stop_sequences": ["END"], "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "any"},
           "messages": [
               {"role": "user", "content": "What is 2+3?"},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "hmm", "signature": "x"},
                   {"type": "text", "text": "Using the tool."},
                   {"type": "tool_use", "id": "toolu_1", "name": "calculator",
                    "input": {"expression": "2+3"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "5"}]},
                   {"type": "text", "text": "Thanks."}]}]}
    chat = dialects.to_chat(dialects.MESSAGES, req)
    assert chat["messages"] == [
        {"role": "system", "content": "You add."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "Using the tool.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
        {"role": "user", "content": "Thanks."}]
    assert (chat["max_tokens"], chat["stop"], chat["tool_choice"]) == (64, ["END"], "required")
    assert chat["tools"][0]["function"]["parameters"] == ANTHROPIC_TOOL["input_schema"]


@pytest.mark.parametrize(("api", "req", "message"), [
    ("responses", {"instructions": "only this"}, "has no input"),
    ("responses", {"input": ["not an item"]}, "input[0] is not an object"),
    ("messages", {"max_tokens": 5, "messages": "hi"}, "has no 'messages' list"),
    ("messages", {"max_tokens": 5, "messages": [{"content": "x"}]},
     "messages[0] must be an object with a 'role'"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages[0].content[0] is not a content block"),
])
def test_what_cannot_be_translated_is_named(api: str, req: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        dialects.to_chat(api, req)


@pytest.mark.parametrize(("req", "chat", "note"), [
    ({"messages": [{"role": "user", "content": [{"type": "document", "title": "T", "source": {
        "type": "text", "media_type": "text/plain", "data": "x"}}]}]},
     {"messages": [{"role": "user", "content": "T\n\nx"}]}, "a document block sent as its text"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "web_search_20250305", "name": "web_search"}, ANTHROPIC_TOOL]},
     {"messages": [{"role": "user", "content": "x"}], "tools": [dialects.chat_tool(
         "calculator", ANTHROPIC_TOOL["input_schema"], ANTHROPIC_TOOL["description"])]},
     "a tool that Anthropic's servers run (or one lgt does not know) not offered to the policy"),
])
def test_what_the_hosted_messages_api_takes_is_sent_and_noted(req: dict[str, Any], chat: dict[str, Any],
                                                              note: str) -> None:
    """Messages the hosted API takes are never refused: mapped to their nearest chat form, and noted."""
    notes: list[str] = []
    assert dialects.to_chat(dialects.MESSAGES, req, None, notes) == chat
    assert len(notes) == 1 and notes[0].startswith(note)


# chat answers: text, tool calls (0-2), reasoning, finish reasons; split into stream chunks anyhow
_text = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), max_size=40)
_call = st.tuples(st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
                  st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), st.integers(), max_size=3))


@st.composite
def chat_answers(draw) -> dict[str, Any]:
    calls = draw(st.lists(_call, max_size=2))
    finish = "tool_calls" if calls else draw(st.sampled_from(["stop", "length"]))
    msg: dict[str, Any] = {"role": "assistant", "content": draw(_text) or None,
                           "reasoning": draw(st.one_of(st.none(), _text.filter(bool)))}
    if calls:
        msg["tool_calls"] = [{"id": f"chatcmpl-tool-{i}", "type": "function",
                              "function": {"name": n, "arguments": json.dumps(a)}}
                             for i, (n, a) in enumerate(calls)]
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": SERVED,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}}


def _pieces(draw, s: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(1, max(len(s) - 1, 1)), max_size=4))) if len(s) > 1 else []
    return [s[a:b] for a, b in zip([0, *cuts], [*cuts, len(s)]) if s[a:b]]


@st.composite
def streamed(draw) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    ans = draw(chat_answers())
    msg, chunks = ans["choices"][0]["message"], [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    for piece in _pieces(draw, msg["reasoning"] or ""):
        chunks.append({"choices": [{"index": 0, "delta": {"reasoning": piece}}]})
    for piece in _pieces(draw, msg["content"] or ""):
        chunks.append({"choices": [{"index": 0, "delta": {"content": piece}}]})
    for i, tc in enumerate(msg.get("tool_calls") or ()):
        chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "id": tc["id"], "type": "function",
             "function": {"name": tc["function"]["name"]}}]}}]})
        for piece in _pieces(draw, tc["function"]["arguments"]):
            chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": i, "function": {"arguments": piece}}]}}]})
    finish = ans["choices"][0]["finish_reason"]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({"choices": [], "usage": ans["usage"]})
    return ans, chunks


def without_ids(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: without_ids(v) for k, v in obj.items() if k not in ("id", "created_at")}
    if isinstance(obj, list):
        return [without_ids(v) for v in obj]
    return obj


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streamed(), st.sampled_from([dialects.RESPONSES, dialects.MESSAGES]))  # Gemini's: its own file
def test_a_stream_adds_up_to_the_whole_answer(case, api: str) -> None:
    """However the chat answer is split into chunks, the API's events are well formed (SDK types),
    and the answer they add up to equals the translation of the whole chat body."""
    ans, chunks = case
    req = {"model": MODEL, "input": "q"} if api == dialects.RESPONSES else {
        "model": CLAUDE, "max_tokens": 9, "messages": [{"role": "user", "content": "q"}]}
    cap = Capture(CHAT)
    tr = dialects.Translator(api, req, model=req["model"])
    data = b""
    for c in chunks:
        cap.add_chunk(c)
        data += tr.chunk(c)
    data += tr.finish(cap)
    whole = dialects.Translator(api, req, model=req["model"])
    body = whole.body(ans, cap)
    events = sse_events(data)
    if api == dialects.RESPONSES:
        from openai.types.responses import Response, ResponseStreamEvent

        classes = event_types(ResponseStreamEvent)
        for kind, e in events:
            classes[kind].model_validate(e)
        assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
        assert events[0][0] == "response.created" and events[-1][0] in ("response.completed",
                                                                         "response.incomplete")
        final = Response.model_validate(events[-1][1]["response"])
        assert Response.model_validate(body).output_text == final.output_text == (
            ans["choices"][0]["message"]["content"] or "")
        assert without_ids(events[-1][1]["response"]) == without_ids(body)
        calls = [(o.name, json.loads(o.arguments)) for o in final.output if o.type == "function_call"]
    else:
        from anthropic.types import Message, RawMessageStreamEvent

        classes = event_types(RawMessageStreamEvent)
        for kind, e in events:
            classes[kind].model_validate(e)
        assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
        msg = Message.model_validate(body)
        text = "".join(b.text for b in msg.content if b.type == "text")
        assert text == (ans["choices"][0]["message"]["content"] or "")
        calls = [(b.name, b.input) for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}[
            ans["choices"][0]["finish_reason"]]
        assert events[-2][1]["delta"]["stop_reason"] == msg.stop_reason
    want = [(tc["function"]["name"], json.loads(tc["function"]["arguments"]))
            for tc in ans["choices"][0]["message"].get("tool_calls") or ()]
    assert calls == want


def test_kept_conversations_are_one_rollouts_and_bounded() -> None:
    from lgt.proxy.addons import Conversations
    from lgt.proxy.auth import Identity

    kept, a, b = Conversations(limit=3, max_bytes=100), Identity("r1"), Identity("r2")
    kept.put(a, "resp_x", [{"role": "user", "content": "hi"}], 10)
    assert kept.get(a, "resp_x") == [{"role": "user", "content": "hi"}]
    assert kept.get(b, "resp_x") is None and kept.get(Identity("r1", 1), "resp_x") is None
    for i in range(3):
        kept.put(a, f"resp_{i}", [], 10)
    assert len(kept) == 3 and kept.get(a, "resp_x") is None and kept.bytes == 30  # the oldest went first
    kept.put(b, "resp_big", [], 95)
    assert len(kept) == 1 and kept.get(b, "resp_big") == [] and kept.bytes == 95  # bounded by size too


# --- through the proxy, with the official SDKs --------------------------------------------------------

def test_responses_text_whole_and_streamed(proxy, upstream, agent_env, rollout):
    req = {"model": MODEL, "instructions": "You add numbers.", "input": "What is 6 times 7?",
           "max_output_tokens": 64}
    ref = chat_ref(upstream, dialects.to_chat(dialects.RESPONSES, req))
    with openai_client() as client:
        r = client.responses.create(**req)
        with client.responses.stream(**req) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
    want = ref["choices"][0]["message"]["content"]
    assert r.output_text == final.output_text == want and r.model == final.model == MODEL
    assert r.status == "completed" and r.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == ref["usage"]["completion_tokens"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    rows = recorded(proxy, rollout)
    assert [r_["streamed"] for r_ in rows] == [False, True]
    for row in rows:
        check_tokens(row, ref, "responses")
        assert json.loads(row["request_json"])["instructions"] == "You add numbers."  # the agent's own
        assert json.loads(row["response_json"])["output"][0]["content"][0]["text"] == want


def test_responses_function_call_and_its_output(proxy, upstream, agent_env, rollout):
    req = {"model": MODEL, "input": [{"role": "user", "content": "2+3"}], "tools": [FN_TOOL]}
    with openai_client() as client:
        first = client.responses.create(**req)
        call = next(o for o in first.output if o.type == "function_call")
        assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "2+3"}
        follow = [*req["input"], call.model_dump(exclude_none=True),
                  {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
        second = client.responses.create(model=MODEL, input=follow, tools=[FN_TOOL])
        chained = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[FN_TOOL],
                                          input=[{"type": "function_call_output", "call_id": call.call_id,
                                                  "output": "5"}])
        with client.responses.stream(model=MODEL, input=req["input"], tools=[FN_TOOL]) as stream:
            kinds = [event.type for event in stream]
            streamed_call = next(o for o in stream.get_final_response().output if o.type == "function_call")
    assert second.output_text == chained.output_text == "The result is 5."
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(kinds)
    assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)
    rows = recorded(proxy, rollout)
    assert len(rows) == 4
    check_tokens(rows[0], chat_ref(upstream, dialects.to_chat(dialects.RESPONSES, req)), "responses")
    # the conversation rebuilt from previous_response_id is the one sent in full: same prompt tokens
    assert rows[2]["prompt_token_ids"] == rows[1]["prompt_token_ids"]
    assert rows[1]["prompt_token_ids"][:len(rows[0]["prompt_token_ids"])] == rows[0]["prompt_token_ids"]


def test_responses_logprobs_the_agent_asks_for_are_the_engines(proxy, upstream, agent_env, rollout):
    """``include: ["message.output_text.logprobs"]`` (+ ``top_logprobs``): the output text carries one
    logprob per generated token, the engine's own (the ones recorded), whole and streamed; without the
    include the agent gets none, as from OpenAI."""
    req = {"model": MODEL, "input": "What is 6 times 7?", "max_output_tokens": 32,
           "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    with openai_client() as client:
        whole = client.responses.create(**req)
        deltas = []
        with client.responses.stream(**req) as stream:
            for event in stream:
                if event.type == "response.output_text.delta":
                    deltas += event.logprobs
            final = stream.get_final_response()
        plain = client.responses.create(model=MODEL, input="What is 6 times 7?", max_output_tokens=32)
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(**{**req, "top_logprobs": 21})
        assert "'top_logprobs' must be an integer from 0 to 20, not 21" in str(bad.value)
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [(r["status"], r["http_status"]) for r in rows[3:]] == [("rejected", 400)]  # refused, recorded
    rows = rows[:3]
    want = rows[0]["response_logprobs"]
    for got in (whole.output[0].content[0].logprobs, final.output[0].content[0].logprobs, deltas):
        assert [lp.logprob for lp in got] == pytest.approx(want, abs=1e-6) and len(want) > 3
        assert "".join(lp.token for lp in got) == whole.output_text
        assert all(len(lp.top_logprobs) == 2 for lp in got)
    assert whole.output[0].content[0].logprobs[0].bytes == list(whole.output[0].content[0].logprobs[0]
                                                                 .token.encode())
    assert plain.output[0].content[0].logprobs == []
    assert [r["capture"] for r in rows] == ["full"] * 3  # the agent's own ask still fills the record


def test_responses_errors_in_the_apis_shape(proxy, agent_env, rollout):
    with openai_client() as client:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
        assert "previous_response_id 'resp_unknown' is not one of this rollout's recent" in str(e.value)
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input=[42])  # not the API's shape: OpenAI refuses it too
        assert "input[0] is not an object" in str(e.value)
        # a tool OpenAI runs is taken, as the hosted API takes it: not offered to the policy, and noted
        assert client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}]).output_text
    rows = proxy.calls("rollout_id = ?", [rollout])  # refused before reaching the engine: on the record
    assert [(r["api"], r["status"], r["http_status"], r["prompt_token_ids"] is None) for r in rows] == [
        ("responses", "rejected", 400, True)] * 2 + [("responses", "ok", 200, False)]
    assert "previous_response_id 'resp_unknown'" in rows[0]["error"] and "input[0]" in rows[1]["error"]
    assert any("tools[0] (a 'web_search' tool" in n for n in rows[2]["translation"])


def test_anthropic_messages_text_whole_and_streamed(proxy, upstream, agent_env, rollout):
    req = {"model": CLAUDE, "max_tokens": 64, "system": "You add numbers.",
           "messages": [{"role": "user", "content": "What is 6 times 7?"}]}
    ref = chat_ref(upstream, dialects.to_chat(dialects.MESSAGES, req))
    with anthropic_client() as client:
        m = client.messages.create(**req)
        with client.messages.stream(**req) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
    want = ref["choices"][0]["message"]["content"]
    assert m.content[0].text == final.content[0].text == want and m.model == final.model == CLAUDE
    assert m.stop_reason == final.stop_reason == "end_turn"
    assert m.usage.input_tokens == ref["usage"]["prompt_tokens"] == final.usage.input_tokens
    assert m.usage.output_tokens == ref["usage"]["completion_tokens"] == final.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    rows = recorded(proxy, rollout)
    assert [r["streamed"] for r in rows] == [False, True]
    for row in rows:
        check_tokens(row, ref, "messages")
        assert json.loads(row["response_json"])["content"][0]["text"] == want


def test_anthropic_tool_use_and_tool_result(proxy, upstream, agent_env, rollout):
    req = {"model": CLAUDE, "max_tokens": 128, "tools": [ANTHROPIC_TOOL],
           "messages": [{"role": "user", "content": "2+3"}]}
    with anthropic_client() as client:
        first = client.messages.create(**req)
        use = next(b for b in first.content if b.type == "tool_use")
        with client.messages.stream(**req) as stream:
            streamed_use = next(b for b in stream.get_final_message().content if b.type == "tool_use")
        second = client.messages.create(**{**req, "messages": [
            *req["messages"], {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]})
    assert first.stop_reason == "tool_use" and use.name == "calculator" and use.input == {"expression": "2+3"}
    assert (streamed_use.name, streamed_use.input) == (use.name, use.input)
    assert second.stop_reason == "end_turn" and second.content[0].text == "The result is 5."
    rows = recorded(proxy, rollout)
    assert [r["api"] for r in rows] == ["messages"] * 3
    # `lgt-train show` reads a recorded call as the chat call it was translated into
    req_chat, resp_chat = dialects.as_chat("messages", json.loads(rows[0]["request_json"]),
                                           json.loads(rows[0]["response_json"]))
    assert req_chat["messages"] == [{"role": "user", "content": "2+3"}]
    call = resp_chat["choices"][0]["message"]["tool_calls"][0]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("calculator", use.input)
    assert rows[2]["prompt_token_ids"][:len(rows[0]["prompt_token_ids"])] == rows[0]["prompt_token_ids"]


def test_anthropic_errors_in_the_apis_shape(proxy, agent_env, rollout):
    with anthropic_client() as client:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=CLAUDE, max_tokens=5, messages=[
                {"role": "user", "content": [{"text": "a block without its type"}]}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert "messages[0].content[0] is not a content block" in e.value.body["error"]["message"]
        with pytest.raises(anthropic.InternalServerError) as e:  # the engine's error, in Anthropic's shape
            client.messages.create(model=CLAUDE, max_tokens=5,
                                   messages=[{"role": "user", "content": "__status:500__"}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [(r["api"], r["status"], r["http_status"]) for r in rows] == [("messages", "rejected", 400),
                                                                         ("messages", "http_error", 500)]


def test_model_listings_name_the_policy(proxy, agent_env, rollout):
    """SDKs that list or look up models before working get the served model, and whatever name they
    ask about, from any host (nothing leaves for the hosted API)."""
    with openai_client() as client:
        client.responses.create(model=MODEL, input="What is 1+1?", max_output_tokens=8)
        listed = [m.id for m in client.models.list()]
        assert listed[0] == SERVED and MODEL in listed
        assert client.models.retrieve("gpt-4.1").id == "gpt-4.1"
    with anthropic_client() as client:
        page = client.models.list()
        assert [m.id for m in page.data][0] == SERVED and page.has_more is False
        info = client.models.retrieve(CLAUDE)
        assert (info.id, info.type) == (CLAUDE, "model")
    assert [r["api"] for r in recorded(proxy, rollout)] == ["responses"]  # listings are not LLM calls


# conversations as chat messages; written in each API's own request shape, translating back gives them
_words = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=20)


@st.composite
def conversations(draw) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for turn in range(draw(st.integers(1, 4))):
        msgs.append({"role": "user", "content": draw(_words)})
        calls = draw(st.lists(_call, max_size=2))
        text = draw(st.one_of(st.none(), _words)) if calls else draw(_words)
        if calls:
            msgs.append({"role": "assistant", "content": text, "tool_calls": [
                {"id": f"toolu_{turn}{i}", "type": "function",
                 "function": {"name": n, "arguments": json.dumps(a)}} for i, (n, a) in enumerate(calls)]})
            msgs += [{"role": "tool", "tool_call_id": f"toolu_{turn}{i}", "content": draw(_words)}
                     for i in range(len(calls))]
        else:
            msgs.append({"role": "assistant", "content": text})
    return msgs


def as_responses_input(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for m in msgs:
        if m["role"] == "user":
            items.append({"role": "user", "content": [{"type": "input_text", "text": m["content"]}]})
        elif m["role"] == "assistant":
            if m["content"] is not None:
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": m["content"]}]})
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in m.get("tool_calls") or ()]
        else:
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
    return items


def as_anthropic_messages(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in msgs:
        if m["role"] == "user":
            out.append({"role": "user", "content": m["content"]})
        elif m["role"] == "assistant":
            blocks = [{"type": "text", "text": m["content"]}] if m["content"] is not None else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])} for c in m.get("tool_calls") or ()]
            out.append({"role": "assistant", "content": blocks})
        else:  # tool results travel in one user message, before the next user text
            result = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(result)
            else:
                out.append({"role": "user", "content": [result]})
    return out


@settings(max_examples=200, deadline=None)
@given(conversations())
def test_requests_in_either_api_translate_to_the_same_chat(msgs: list[dict[str, Any]]) -> None:
    responses = dialects.to_chat(dialects.RESPONSES, {"input": as_responses_input(msgs),
                                                      "instructions": "Sys"})
    assert responses["messages"] == [{"role": "system", "content": "Sys"}, *msgs]
    messages = dialects.to_chat(dialects.MESSAGES, {"max_tokens": 8, "system": "Sys",
                                                    "messages": as_anthropic_messages(msgs)})
    for m in msgs:  # Anthropic carries arguments as objects: the same JSON, re-serialised
        for c in m.get("tool_calls") or ():
            args = json.loads(c["function"]["arguments"])
            c["function"]["arguments"] = json.dumps(args, ensure_ascii=False)
    assert messages["messages"] == [{"role": "system", "content": "Sys"}, *msgs]


@pytest.mark.parametrize("fault", ["__drop__", "__broken_sse__"])
def test_a_stream_cut_short_is_an_error_for_the_sdk_and_a_stream_error_on_record(
        proxy, agent_env, rollout, fault):
    """The engine's stream ends mid-way (connection dropped; a broken event and no [DONE]): the agent's
    SDK never gets a completed answer — its API's failure event where the body ended cleanly
    (``response.failed``; Anthropic's ``error`` event, which its SDK raises), a cut connection otherwise
    — the call is recorded as a stream error, and the proxy keeps serving."""
    with openai_client() as client:
        kinds = []
        with pytest.raises(Exception) as cut:
            with client.responses.stream(model=MODEL, input=f"cut {fault}") as stream:
                kinds += [event.type for event in stream]
                stream.get_final_response()
        assert "response.completed" not in kinds
        if fault == "__broken_sse__":  # the body ended: the API's own failure event
            assert kinds[-1] == "response.failed" and "response.completed" in str(cut.value)
        else:  # the connection was cut: the SDK says so (before or after the response began)
            assert isinstance(cut.value, openai.APIConnectionError) or "incomplete chunked read" in str(
                cut.value)
    with anthropic_client() as client:
        with pytest.raises(Exception) as cut:
            with client.messages.stream(model=CLAUDE, max_tokens=32,
                                        messages=[{"role": "user", "content": f"cut {fault}"}]) as stream:
                stream.get_final_message()
        if fault == "__broken_sse__":
            assert isinstance(cut.value, anthropic.APIStatusError) and "stream ended" in str(cut.value)
        else:
            assert isinstance(cut.value, anthropic.APIConnectionError) or "incomplete chunked read" in str(
                cut.value)
        assert client.messages.create(model=CLAUDE, max_tokens=16, messages=[
            {"role": "user", "content": "still there?"}]).content[0].text  # the proxy still answers
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [(r["api"], r["status"]) for r in rows] == [("responses", "stream_error"),
                                                       ("messages", "stream_error"), ("messages", "ok")]


def test_system_text_goes_where_a_chat_template_can_render_it() -> None:
    from lgt.proxy.dialects.common import place_system

    notes: list[str] = []
    got = place_system([{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                        {"role": "user", "content": "q"}, {"role": "system", "content": "mid"},
                        {"role": "assistant", "content": "x"},
                        {"role": "system", "content": [{"type": "text", "text": "late"}]}], notes)
    # leading ones joined first; later ones as user text (joined to the user turn they follow)
    assert got == [{"role": "system", "content": "a\n\nb"},
                   {"role": "user", "content": "q\n\n<system>\nmid\n</system>"},
                   {"role": "assistant", "content": "x"},
                   {"role": "user", "content": "<system>\nlate\n</system>"}]
    assert notes == [f"system message {i} (after the conversation began) sent as user text in <system> tags"
                     for i in (3, 5)]
