"""Recording a hosted model's calls (issue 30): the official SDKs aim at the providers' own hosts
(``api.anthropic.com``, ``api.openai.com``, ``generativelanguage.googleapis.com``) through the real
``lgt-proxy``; its ``--resolve`` sends those connections to a stand-in on 127.0.0.1 that speaks each
provider's wire format (streams included) under a certificate for their names, trusted through
``--upstream-ca``. Observe-only mode records every dialect; with ``--upstream``, ``--hosted-model``
mixes the teacher's calls with the engine's in one rollout.

The stand-in holds each stream half-way until the agent has read its first event: a proxy that
buffered a stream whole would never deliver that event, and the stand-in says so (``held_too_long``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from lgt.proxy.dialects import as_chat, hosted
from lgt.testing.fake_upstream import FakeUpstream
from lgt.testing.proxy import ProxyProc
from lgt.testing.threaded import serve_app
from lgt.testing.tls import make_certs

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
genai = pytest.importorskip("google.genai")

HOSTS = ("api.anthropic.com", "api.openai.com", "generativelanguage.googleapis.com")
CLAUDE, GPT, GEMINI_MODEL = "claude-sonnet-4-5-20250929", "gpt-5-2025-08-07", "gemini-2.5-flash"
TOOL = {"name": "get_weather", "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}

# -- the providers' answers, as they write them --------------------------------------------------------

MESSAGE = {"id": "msg_01", "type": "message", "role": "assistant", "model": CLAUDE,
           "content": [{"type": "thinking", "thinking": "Weather: ask the tool.", "signature": "sig=="},
                       {"type": "text", "text": "Let me look."},
                       {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
                        "input": {"city": "Paris"}}],
           "stop_reason": "tool_use", "stop_sequence": None,
           "usage": {"input_tokens": 21, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4,
                     "output_tokens": 12}}


def message_events() -> list[dict[str, Any]]:
    """MESSAGE as Anthropic streams it."""
    start = {**MESSAGE, "content": [], "stop_reason": None,
             "usage": {**MESSAGE["usage"], "output_tokens": 1}}
    return [
        {"type": "message_start", "message": start},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "thinking_delta", "thinking": "Weather: ask the tool."}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "signature_delta", "signature": "sig=="}},
        {"type": "content_block_stop", "index": 0},
        {"type": "ping"},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Let me"}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": " look."}},
        {"type": "content_block_stop", "index": 1},
        {"type": "content_block_start", "index": 2,
         "content_block": {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {}}},
        {"type": "content_block_delta", "index": 2,
         "delta": {"type": "input_json_delta", "partial_json": "{\"city\": "}},
        {"type": "content_block_delta", "index": 2,
         "delta": {"type": "input_json_delta", "partial_json": "\"Paris\"}"}},
        {"type": "content_block_stop", "index": 2},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
         "usage": {"output_tokens": 12}},
        {"type": "message_stop"},
    ]


def done_message(req: dict[str, Any]) -> dict[str, Any]:
    """A plain final answer, "Done.", for any other Messages request (a harness's)."""
    return {**MESSAGE, "model": req.get("model", CLAUDE), "content": [{"type": "text", "text": "Done."}],
            "stop_reason": "end_turn", "usage": {"input_tokens": 9, "output_tokens": 2}}


def done_events(req: dict[str, Any]) -> list[dict[str, Any]]:
    done = done_message(req)
    return [{"type": "message_start", "message": {**done, "content": [], "stop_reason": None}},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Done."}},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
             "usage": {"output_tokens": 2}},
            {"type": "message_stop"}]


RESPONSE = {
    "id": "resp_01", "object": "response", "created_at": 1764800000, "status": "completed", "model": GPT,
    "output": [
        {"type": "reasoning", "id": "rs_01", "summary": [{"type": "summary_text", "text": "Use the tool."}]},
        {"type": "message", "id": "msg_01", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_01", "call_id": "call_01", "name": "get_weather",
         "arguments": "{\"city\":\"Paris\"}", "status": "completed"},
    ],
    "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
    "incomplete_details": None, "instructions": None, "metadata": {}, "temperature": 1.0, "top_p": 1.0,
    "usage": {"input_tokens": 30, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 20,
              "output_tokens_details": {"reasoning_tokens": 8}, "total_tokens": 50},
}


def response_events() -> list[dict[str, Any]]:
    """RESPONSE as OpenAI streams it (the events a client needs; each numbered)."""
    begun = {**RESPONSE, "status": "in_progress", "output": [], "usage": None}
    out: list[dict[str, Any]] = [{"type": "response.created", "response": begun},
                                 {"type": "response.in_progress", "response": begun}]
    for i, item in enumerate(RESPONSE["output"]):
        out.append({"type": "response.output_item.added", "output_index": i, "item": item})
        if item["type"] == "message":
            for piece in ("Let me", " look."):
                out.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": i,
                            "content_index": 0, "delta": piece, "logprobs": []})
        out.append({"type": "response.output_item.done", "output_index": i, "item": item})
    out.append({"type": "response.completed", "response": RESPONSE})
    return [{**e, "sequence_number": n} for n, e in enumerate(out)]


GENERATED = {"candidates": [{"content": {"role": "model", "parts": [
    {"text": "Let me look."}, {"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}}]},
    "finishReason": "STOP", "index": 0}],
    "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 8, "thoughtsTokenCount": 5,
                      "totalTokenCount": 23},
    "modelVersion": GEMINI_MODEL, "responseId": "gem_01"}


def gemini_chunks() -> list[dict[str, Any]]:
    """GENERATED as Gemini streams it: text in pieces, the call, then how it ended and the usage."""
    meta = {"modelVersion": GEMINI_MODEL, "responseId": "gem_01"}
    part = [{"text": "Let me"}, {"text": " look."},
            {"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}}]
    out = [{"candidates": [{"content": {"role": "model", "parts": [p]}, "index": 0}],
            "usageMetadata": {"promptTokenCount": 10, "totalTokenCount": 10}, **meta} for p in part]
    out[-1]["candidates"][0]["finishReason"] = "STOP"
    out[-1]["usageMetadata"] = GENERATED["usageMetadata"]
    return out


CHAT_ANSWER = {"id": "chatcmpl-01", "object": "chat.completion", "created": 1764800000,
               "model": "gpt-4.1-2025-04-14",
               "choices": [{"index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "42."}}],
               "usage": {"prompt_tokens": 14, "completion_tokens": 2, "total_tokens": 16}}


def chat_chunks() -> list[dict[str, Any]]:
    head = {k: CHAT_ANSWER[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    return [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "42"}}]},
            {**head, "choices": [{"index": 0, "delta": {"content": "."}, "finish_reason": "stop"}]},
            {**head, "choices": [], "usage": CHAT_ANSWER["usage"]}]


# -- the stand-in provider -----------------------------------------------------------------------------

def anthropic_key(headers: Any) -> str | None:
    """The key an Anthropic SDK sent (``x-api-key``, or ``Authorization: Bearer`` in newer ones)."""
    bearer = headers.get("authorization") or headers.get("Authorization") or ""
    return headers.get("x-api-key") or bearer.removeprefix("Bearer ") or None


class Received(NamedTuple):
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class StandIn:
    """The three providers on one HTTPS port: what each received (``received``), and whether a stream
    held half-way was let go by the agent reading its first event (``read_first``) or only when the wait
    ran out (``held_too_long``)."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.read_first = threading.Event()
        self.held_too_long = False

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses", self.socket)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1beta/models/{call}", self.gemini)
        app.router.add_post("/v1/models/{call}", self.gemini)  # google-genai 3 asks v1
        app.router.add_route("*", "/{tail:.*}", self.unknown)
        return app

    async def _keep(self, request: web.Request) -> bytes:
        body = await request.read()
        self.received.append(Received(request.method, request.path_qs,
                                     {k.lower(): v for k, v in request.headers.items()}, body))
        return body

    async def _take(self, request: web.Request) -> dict[str, Any]:
        return json.loads(await self._keep(request))

    async def _stream(self, request: web.Request, events: list[Any], typed: bool,
                      ctype: str = "text/event-stream") -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": ctype})
        await resp.prepare(request)
        half = len(events) // 2
        for n, e in enumerate(events):
            if n == half and self.read_first is not None:
                released = await asyncio.get_running_loop().run_in_executor(None, self.read_first.wait, 20)
                self.held_too_long = self.held_too_long or not released
            data = e if isinstance(e, str) else json.dumps(e)  # "[DONE]" as it is
            head = f"event: {e['type']}\n" if typed else ""
            await resp.write(f"{head}data: {data}\n\n".encode())
        await resp.write_eof()
        return resp

    async def unknown(self, request: web.Request) -> web.Response:
        await self._keep(request)
        return web.json_response({"error": f"no {request.method} {request.path_qs} here"}, status=404)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        req = await self._take(request)
        if (anthropic_key(request.headers) or "").startswith("sk-ant-wrong"):
            return web.json_response({"type": "error", "error": {"type": "authentication_error",
                                                                 "message": "invalid x-api-key"}}, status=401)
        if not any(t.get("name") == "get_weather" for t in req.get("tools") or ()):  # a harness: done
            return await self._stream(request, done_events(req), typed=True) if req.get("stream") else (
                web.json_response(done_message(req)))
        if req.get("stream"):
            return await self._stream(request, message_events(), typed=True)
        return web.json_response(MESSAGE)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        req = await self._take(request)
        if req.get("stream"):
            return await self._stream(request, response_events(), typed=True)
        return web.json_response(RESPONSE)

    async def socket(self, request: web.Request) -> web.WebSocketResponse:
        """The Responses API over WebSocket: a prewarm answered empty, a call with RESPONSE's events, a
        call for model "nope" with an error event."""
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.received.append(Received("GET", request.path_qs, headers, b""))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            body = json.loads(msg.data)
            self.received.append(Received("WS", request.path_qs, {}, msg.data.encode()))
            if body.get("generate") is False:
                empty = {**RESPONSE, "id": "resp_warm", "output": [], "usage": None}
                await ws.send_json({"type": "response.created", "response": empty})
                await ws.send_json({"type": "response.completed", "response": empty})
            elif body.get("model") == "nope":
                await ws.send_json({"type": "error", "status": 404, "error": {
                    "type": "invalid_request_error", "code": "model_not_found",
                    "message": "The model `nope` does not exist."}})
            else:
                for e in response_events():
                    await ws.send_json(e)
        return ws

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await self._take(request)
        if req.get("stream"):
            return await self._stream(request, [*chat_chunks(), "[DONE]"], typed=False)
        return web.json_response(CHAT_ANSWER)

    async def gemini(self, request: web.Request) -> web.StreamResponse:
        await self._take(request)
        call = request.match_info["call"]
        if call.endswith(":streamGenerateContent") and request.query.get("alt") == "sse":
            return await self._stream(request, gemini_chunks(), typed=False)
        if call.endswith(":streamGenerateContent"):  # without alt=sse: one JSON array, written as it grows
            resp = web.StreamResponse(headers={"content-type": "application/json"})
            await resp.prepare(request)
            for n, chunk in enumerate(gemini_chunks()):
                await resp.write((b"[" if n == 0 else b",\r\n") + json.dumps(chunk).encode())
            await resp.write(b"]")
            await resp.write_eof()
            return resp
        return web.json_response(GENERATED)


@contextlib.contextmanager
def stand_in(certs: tuple[Path, Path, Path]) -> Iterator[tuple[StandIn, int]]:
    """The stand-in served over TLS on a free loopback port, from a thread with its own loop."""
    provider = StandIn()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs[1], certs[2])
    with serve_app(provider.app(), ssl_context=ctx) as port:
        yield provider, port


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"), names=HOSTS)


@pytest.fixture(scope="module")
def provider(certs) -> Iterator[tuple[StandIn, int]]:
    with stand_in(certs) as p:
        yield p


def resolving(port: int, certs: tuple[Path, Path, Path]) -> list[str]:
    return [*(a for h in HOSTS for a in ("--resolve", f"{h}:443=127.0.0.1:{port}")),
            "--upstream-ca", str(certs[0])]


@pytest.fixture(scope="module")
def observer(tmp_path_factory, provider, certs) -> Iterator[ProxyProc]:
    p = ProxyProc(tmp_path_factory.mktemp("observe") / "store", None, *resolving(provider[1], certs)).start()
    yield p
    p.stop()


@pytest.fixture
def standin(provider) -> StandIn:
    sp = provider[0]
    sp.received.clear()
    sp.read_first.clear()
    sp.held_too_long = False
    return sp


def as_agent(proxy: ProxyProc, rollout: str, env: pytest.MonkeyPatch) -> None:
    """This process's environment as ``eval "$(lgt-proxy creds ...)"`` sets it for an agent."""
    for k, v in proxy.env(rollout).items():
        env.setenv(k, v)


def rows_of(proxy: ProxyProc, rollout: str) -> list[dict[str, Any]]:
    return proxy.calls("rollout_id = ?", [rollout])


def chat_of(row: dict[str, Any]) -> tuple[Any, Any]:
    return as_chat(row["api"], json.loads(row["request_json"]), json.loads(row["response_json"]))


# -- observe-only: every dialect recorded ----------------------------------------------------------------

def test_anthropic_messages_are_recorded_as_sent_and_answered(observer, standin, clean_env, rollout):
    as_agent(observer, rollout, clean_env)
    sdk = anthropic.Anthropic(api_key="sk-ant-agent", max_retries=0, timeout=30)
    ask = {"model": CLAUDE, "max_tokens": 256, "tools": [TOOL],
           "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    whole = sdk.messages.create(**ask)
    assert (whole.id, whole.stop_reason, whole.content[2].input) == ("msg_01", "tool_use", {"city": "Paris"})
    seen = []
    with sdk.messages.create(**ask, stream=True) as stream:
        for event in stream:
            seen.append(event.type)
            standin.read_first.set()
    assert not standin.held_too_long, "the proxy held the stream back until it was whole"
    assert seen == [e["type"] for e in message_events() if e["type"] != "ping"]  # the SDK skips pings
    # the provider got the agent's request byte for byte, with the agent's own key
    assert [json.loads(r.body)["model"] for r in standin.received] == [CLAUDE, CLAUDE]
    assert all(r.path == "/v1/messages" and anthropic_key(r.headers) == "sk-ant-agent"
               for r in standin.received)
    assert json.loads(standin.received[1].body) == {**ask, "stream": True}

    rows = rows_of(observer, rollout)
    assert [(r["api"], r["status"], r["streamed"]) for r in rows] == [("messages", "ok", False),
                                                                      ("messages", "ok", True)]
    for row, sent in zip(rows, standin.received):
        assert row["request_json"].encode() == sent.body
        assert json.loads(row["response_json"]) == MESSAGE  # the stream re-assembled into the same body
        assert (row["served_model"], row["requested_model"], row["upstream"]) == (
            CLAUDE, CLAUDE, "https://api.anthropic.com")
        assert (row["capture"], row["capture_reason"], row["finish_reason"]) == ("no_tokens", "hosted",
                                                                                 "tool_calls")
        assert (row["usage_prompt_tokens"], row["usage_completion_tokens"], row["usage_total_tokens"]) == (
            25, 12, 37)
        assert row["http_status"] == 200 and row["prompt_token_ids"] is None
        assert "sk-ant-agent" not in json.dumps(row, default=str)
        req, resp = chat_of(row)
        assert req["messages"][-1] == {"role": "user", "content": "Weather in Paris?"}
        msg = resp["choices"][0]["message"]
        assert (msg["content"], msg["reasoning"]) == ("Let me look.", "Weather: ask the tool.")
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
        assert calls == [("get_weather", {"city": "Paris"})]


def test_a_providers_error_reaches_the_agent_and_the_record(observer, standin, clean_env, rollout):
    as_agent(observer, rollout, clean_env)
    sdk = anthropic.Anthropic(api_key="sk-ant-wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as e:
        sdk.messages.create(model=CLAUDE, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "invalid x-api-key"}}
    (row,) = rows_of(observer, rollout)
    assert (row["status"], row["http_status"], row["error"]) == ("http_error", 401, "invalid x-api-key")
    assert row["upstream"] == "https://api.anthropic.com" and row["capture_reason"] is None


def test_openai_responses_are_recorded_as_sent_and_answered(observer, standin, clean_env, rollout):
    as_agent(observer, rollout, clean_env)
    sdk = openai.OpenAI(api_key="sk-openai-agent", max_retries=0, timeout=30)
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOL["input_schema"]}]
    whole = sdk.responses.create(model=GPT, input="Weather in Paris?", tools=tools)
    assert whole.output_text == "Let me look." and whole.output[2].arguments == "{\"city\":\"Paris\"}"
    seen = []
    for event in sdk.responses.create(model=GPT, input="Weather in Paris?", tools=tools, stream=True):
        seen.append((event.type, event.sequence_number))
        standin.read_first.set()
    assert not standin.held_too_long
    assert seen == [(e["type"], e["sequence_number"]) for e in response_events()]
    assert all(r.headers["authorization"] == "Bearer sk-openai-agent" for r in standin.received)

    rows = rows_of(observer, rollout)
    assert [(r["api"], r["streamed"]) for r in rows] == [("responses", False), ("responses", True)]
    for row, sent in zip(rows, standin.received):
        assert row["request_json"].encode() == sent.body
        assert json.loads(row["response_json"]) == RESPONSE
        assert (row["served_model"], row["upstream"], row["capture_reason"]) == (
            GPT, "https://api.openai.com", "hosted")
        assert (row["finish_reason"], row["usage_prompt_tokens"], row["usage_completion_tokens"],
                row["usage_total_tokens"]) == ("tool_calls", 30, 20, 50)
        req, resp = chat_of(row)
        assert req["messages"] == [{"role": "user", "content": "Weather in Paris?"}]
        msg = resp["choices"][0]["message"]
        assert (msg["content"], msg["reasoning"]) == ("Let me look.", "Use the tool.")
        assert msg["tool_calls"][0]["id"] == "call_01"


def test_gemini_calls_are_recorded_as_sent_and_answered(observer, standin, clean_env, rollout):
    as_agent(observer, rollout, clean_env)
    client = genai.Client(api_key="google-agent-key")
    whole = client.models.generate_content(model=GEMINI_MODEL, contents="Weather in Paris?")
    assert whole.function_calls[0].args == {"city": "Paris"}
    pieces = []
    for chunk in client.models.generate_content_stream(model=GEMINI_MODEL, contents="Weather in Paris?"):
        pieces.append(chunk.candidates[0].content.parts[0])
        standin.read_first.set()
    assert not standin.held_too_long
    assert [p.text or p.function_call.name for p in pieces] == ["Let me", " look.", "get_weather"]
    assert all(r.headers["x-goog-api-key"] == "google-agent-key" for r in standin.received)
    assert standin.received[1].path.endswith(":streamGenerateContent?alt=sse")

    rows = rows_of(observer, rollout)
    assert [(r["api"], r["streamed"], r["requested_model"]) for r in rows] == [
        ("gemini", False, GEMINI_MODEL), ("gemini", True, GEMINI_MODEL)]
    for row, sent in zip(rows, standin.received):
        assert row["request_json"].encode() == sent.body
        assert json.loads(row["response_json"]) == GENERATED  # the stream's parts merged
        assert (row["served_model"], row["upstream"], row["finish_reason"]) == (
            GEMINI_MODEL, "https://generativelanguage.googleapis.com", "tool_calls")
        assert (row["usage_prompt_tokens"], row["usage_completion_tokens"], row["usage_total_tokens"]) == (
            10, 13, 23)
        req, resp = chat_of(row)
        assert req["messages"][-1]["content"] == "Weather in Paris?"
        msg = resp["choices"][0]["message"]
        assert msg["content"] == "Let me look." and msg["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_gemini_stream_without_sse_is_recorded(observer, standin, clean_env, rollout):
    """``:streamGenerateContent`` without ``alt=sse``: one JSON array, passed on as it grows."""
    import httpx

    as_agent(observer, rollout, clean_env)
    standin.read_first.set()
    url = f"https://generativelanguage.googleapis.com/v1beta/models/{GEMINI_MODEL}:streamGenerateContent"
    body = {"contents": [{"role": "user", "parts": [{"text": "Weather in Paris?"}]}]}
    with httpx.Client(timeout=30) as http:  # the environment's proxy and CA, as an agent has them
        r = http.post(url, json=body, headers={"x-goog-api-key": "google-agent-key"})
    assert r.status_code == 200 and r.json() == gemini_chunks()
    (row,) = rows_of(observer, rollout)
    assert (row["status"], row["streamed"], row["served_model"]) == ("ok", True, GEMINI_MODEL)
    assert json.loads(row["response_json"]) == GENERATED
    assert row["request_json"].encode() == standin.received[-1].body


def test_a_body_the_proxy_cannot_read_passes_through_and_is_counted(observer, standin, clean_env, rollout):
    import httpx

    as_agent(observer, rollout, clean_env)
    before = _unread(observer)
    with httpx.Client(timeout=30) as http:  # the environment's proxy and CA, as an agent has them
        r = http.post("https://api.anthropic.com/v1/messages", content=b"{not json",
                      headers={"x-api-key": "sk-ant-agent", "content-type": "application/json"})
    assert r.status_code == 500 and standin.received[-1].body == b"{not json"  # the stand-in's own answer
    assert rows_of(observer, rollout) == []
    assert _unread(observer) == before + 1


def _unread(proxy: ProxyProc) -> int:
    text = proxy.client.metrics()
    for line in text.splitlines():
        if line.startswith("lgt_proxy_passed_unread_total "):
            return int(float(line.split()[1]))
    raise AssertionError("GET /metrics does not say lgt_proxy_passed_unread_total")


def test_responses_over_websocket_are_recorded_in_observe_only_mode(observer, standin, clean_env, rollout):
    websockets = pytest.importorskip("websockets.sync.client")
    env = observer.env(rollout)
    ctx = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
    create = {"type": "response.create", "model": GPT, "input": "Weather in Paris?", "stream": True}
    got: list[list[str]] = []
    key = {"authorization": "Bearer sk-openai-agent"}
    with websockets.connect("wss://api.openai.com/v1/responses", proxy=env["HTTPS_PROXY"], ssl=ctx,
                            open_timeout=10, additional_headers=key) as ws:
        for body in ({**create, "generate": False}, create, {**create, "model": "nope"}):
            ws.send(json.dumps(body))
            events = [json.loads(ws.recv(timeout=10))]
            while events[-1]["type"] not in ("response.completed", "error"):
                events.append(json.loads(ws.recv(timeout=10)))
            got.append([e["type"] for e in events])
    assert got[1] == [e["type"] for e in response_events()] and got[2] == ["error"]
    assert standin.received[0].headers["authorization"] == "Bearer sk-openai-agent"
    assert [json.loads(r.body) for r in standin.received[1:]] == [{**create, "generate": False}, create,
                                                                  {**create, "model": "nope"}]
    rows = rows_of(observer, rollout)  # the prewarm generated nothing: no row
    assert [(r["api"], r["status"], r["http_status"], r["streamed"]) for r in rows] == [
        ("responses", "ok", 200, True), ("responses", "http_error", 404, True)]
    ok, refused = rows
    assert json.loads(ok["request_json"]) == create and json.loads(ok["response_json"]) == RESPONSE
    assert (ok["served_model"], ok["upstream"], ok["capture_reason"], ok["finish_reason"]) == (
        GPT, "https://api.openai.com", "hosted", "tool_calls")
    assert chat_of(ok)[1]["choices"][0]["message"]["content"] == "Let me look."
    assert refused["error"] == "The model `nope` does not exist."


def test_claude_code_recorded_on_the_hosted_api(observer, standin, tmp_path, rollout):
    """The real Claude Code binary, unmodified, aims at api.anthropic.com; every call it made is a row."""
    from lgt.testing import harnesses

    h = harnesses.HARNESSES["claude_code"]["minimal"]
    if not harnesses.installed(h):
        pytest.skip("Claude Code is not installed (npm ci in examples/claude_code)")
    standin.read_first.set()  # nothing held back: the harness reads its streams itself
    place = harnesses.Place("Say hello.", tmp_path / "work", tmp_path / "home")
    harnesses.prepare(h, place)
    done = harnesses.run(h, place, harnesses.environment(h, place, observer.env(rollout)), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["result"] == "Done."
    calls = [r for r in standin.received if r.path.startswith("/v1/messages")]
    rows = rows_of(observer, rollout)
    assert calls and len(rows) == len(calls)
    for row, sent in zip(rows, calls):
        assert (row["api"], row["status"], row["capture_reason"]) == ("messages", "ok", "hosted")
        assert row["request_json"].encode() == sent.body and row["upstream"] == "https://api.anthropic.com"
        assert row["served_model"] == json.loads(sent.body)["model"]
    assert chat_of(rows[-1])[1]["choices"][0]["message"]["content"] == "Done."


# -- with an upstream: a teacher and the policy in one rollout --------------------------------------------

def test_hosted_model_calls_mix_with_the_engines(tmp_path, provider, certs, clean_env, rollout):
    standin = provider[0]
    standin.received.clear()
    standin.read_first.set()  # nothing to hold back here
    with FakeUpstream.in_thread(port=0) as engine:
        proxy = ProxyProc(tmp_path / "store", engine.url, "--hosted-model", "claude-*",
                          "--hosted-model", "gpt-4.1*", *resolving(provider[1], certs)).start()
        try:
            as_agent(proxy, rollout, clean_env)
            sdk = anthropic.Anthropic(api_key="sk-ant-agent", max_retries=0, timeout=30)
            ask = {"max_tokens": 64, "messages": [{"role": "user", "content": "What is 6*7?"}]}
            teacher = sdk.messages.create(model=CLAUDE, tools=[TOOL], **ask)
            policy = sdk.messages.create(model="local-policy", **ask)
            with sdk.messages.stream(model=CLAUDE, tools=[TOOL], **ask) as s:
                streamed = s.get_final_message()
            oai = openai.OpenAI(api_key="sk-openai-agent", max_retries=0, timeout=30)
            chat = oai.chat.completions.create(model="gpt-4.1", messages=ask["messages"])
            pieces = list(oai.chat.completions.create(model="gpt-4.1", messages=ask["messages"], stream=True,
                                                      stream_options={"include_usage": True}))
            rows = rows_of(proxy, rollout)
        finally:
            proxy.stop()
    assert teacher.model == CLAUDE and streamed.content[2].input == {"city": "Paris"}
    assert policy.model == "local-policy"
    assert [r.path for r in engine.requests if r.method == "POST"] == ["/v1/chat/completions"]  # the policy's
    assert chat.choices[0].message.content == "42." and "".join(
        c.choices[0].delta.content or "" for c in pieces if c.choices) == "42."
    assert [json.loads(r.body)["model"] for r in standin.received] == [CLAUDE, CLAUDE, "gpt-4.1", "gpt-4.1"]
    gpt = "gpt-4.1-2025-04-14"
    assert [(r["api"], r["requested_model"], r["served_model"], r["upstream"], r["capture"],
             r["capture_reason"]) for r in rows] == [
        ("messages", CLAUDE, CLAUDE, "https://api.anthropic.com", "no_tokens", "hosted"),
        ("messages", "local-policy", "policy", engine.url, "full", None),
        ("messages", CLAUDE, CLAUDE, "https://api.anthropic.com", "no_tokens", "hosted"),
        ("chat/completions", "gpt-4.1", gpt, "https://api.openai.com", "no_tokens", "hosted"),
        ("chat/completions", "gpt-4.1", gpt, "https://api.openai.com", "no_tokens", "hosted")]
    assert json.loads(rows[2]["response_json"]) == MESSAGE
    assert all(r["request_json"].encode() == sent.body for r, sent in zip(rows[3:], standin.received[2:]))
    for row in rows[3:]:
        assert (row["finish_reason"], row["usage_total_tokens"]) == ("stop", 16)
        assert json.loads(row["response_json"])["choices"][0]["message"]["content"] == "42."
        assert chat_of(row)[1]["choices"][0]["message"]["content"] == "42."


# -- the re-assembler, on its own --------------------------------------------------------------------

def test_each_stream_reassembles_to_its_unstreamed_body():
    for api, events, body in (("messages", message_events(), MESSAGE), ("gemini", gemini_chunks(), GENERATED),
                              ("responses", response_events(), RESPONSE)):
        a = hosted.Assembler(api)
        for e in events:
            a.feed(json.loads(json.dumps(e)))
        assert a.body() == body, api
        assert a.done == (api != "gemini")


@pytest.mark.parametrize("api,body,want", [
    ("messages", {**MESSAGE, "stop_reason": "max_tokens"}, "length"),
    ("responses", {**RESPONSE, "status": "incomplete",
                   "incomplete_details": {"reason": "max_output_tokens"}}, "length"),
    ("gemini", {"candidates": [{"finishReason": "SAFETY"}]}, "content_filter"),
    ("gemini", {"candidates": [{"finishReason": "STOP", "content": {"parts": [{"text": "x"}]}}]}, "stop"),
    ("chat/completions", {"choices": [{"finish_reason": "stop"}], "model": "gpt-4o"}, "stop"),
])
def test_finish_reasons_in_chat_words(api, body, want):
    assert hosted.columns(api, body)["finish_reason"] == want


@pytest.mark.parametrize("junk", [None, [], "x", {"candidates": "no"}, {"usage": {"input_tokens": "1"}},
                                  {"output": [1, None]}])
def test_columns_of_strange_answers_never_raise(junk):
    for api in ("messages", "responses", "gemini", "chat/completions"):
        facts = hosted.columns(api, junk)
        assert set(facts) == {"served_model", "finish_reason", "usage_prompt_tokens",
                              "usage_completion_tokens", "usage_total_tokens"}


@pytest.mark.parametrize("encoding", ["", "identity", "gzip", "deflate", "br", "zstd"])
def test_a_compressed_stream_is_read_piece_by_piece(encoding):
    import gzip
    import zlib

    import brotli
    from mitmproxy.net.encoding import zstd

    from lgt.proxy.addons.capture import stream_decoder

    data = b"".join(b"event: x\ndata: " + json.dumps(e).encode() + b"\n\n" for e in message_events())
    packed = {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress,
              "zstd": zstd.compress}.get(encoding, lambda d: d)(data)
    decode = stream_decoder(encoding)
    assert b"".join(decode(packed[i:i + 5]) for i in range(0, len(packed), 5)) == data
    assert stream_decoder("compress") is None


def sse_bytes(api: str) -> bytes:
    if api == "gemini":
        return b"".join(b"data: " + json.dumps(c).encode() + b"\r\n\r\n" for c in gemini_chunks())
    events = message_events() if api == "messages" else response_events()
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


@given(api=st.sampled_from(["messages", "responses", "gemini"]), gzipped=st.booleans(),
       cuts=st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=12))
@settings(max_examples=60, deadline=None)
def test_a_hosted_stream_passes_every_byte_on_and_reads_the_answer(api, gzipped, cuts):
    """However the provider's stream is cut into reads, the agent gets each read as it came, and the
    record is the unstreamed body, taken before the read holding the last event is passed on."""
    import gzip

    from lgt.proxy.addons import Call
    from lgt.proxy.addons.capture import HostedStream
    from lgt.proxy.auth import Identity

    data = sse_bytes(api)
    wire_bytes = gzip.compress(data) if gzipped else data
    bounds = sorted({c % (len(wire_bytes) + 1) for c in cuts} | {0, len(wire_bytes)})
    reads = [wire_bytes[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    call = Call(Identity("r"), "chat/completions", api, "example.invalid")
    recorded: list[int] = []
    call.finish = lambda: recorded.append(len(passed)) or True
    stream = HostedStream(call, api, sse=True, encoding="gzip" if gzipped else "")
    passed: list[bytes] = []
    for piece in reads:
        passed += stream(piece)
    passed += stream(b"")
    assert passed == reads
    assert stream.assembler.body() == {"messages": MESSAGE, "responses": RESPONSE, "gemini": GENERATED}[api]
    assert stream.saw_done and stream.broken == 0
    if api != "gemini":  # recorded once, before the read that ends the stream went on (compressed: the
        assert len(recorded) == 1 and recorded[0] <= len(reads) - 1  # end may decode before the trailer)
        assert gzipped or recorded == [len(reads) - 1]


@pytest.mark.parametrize("kw,says", [
    ({"hosted_models": ("claude-*",)}, "--hosted-model needs --upstream"),
    ({"resolve": ("api.anthropic.com=127.0.0.1:9",)}, "is not HOST:PORT=ADDR:PORT"),
])
def test_bad_options_are_named(tmp_path, kw, says):
    from lgt.proxy.server import ConfigError, ProxyConfig

    with pytest.raises(ConfigError, match=says):
        ProxyConfig(store=tmp_path, **kw).checked()


def test_resolve_entries_are_read_as_curl_reads_them():
    from lgt.proxy.addons.route import parse_resolve

    assert parse_resolve(["API.anthropic.com:443=127.0.0.1:8443", "[::1]:80=[::1]:8080"]) == {
        ("api.anthropic.com", 443): ("127.0.0.1", 8443), ("::1", 80): ("::1", 8080)}
