"""The addons' hooks called directly on mitmproxy's test flows (mitmproxy's own testing habit): each
addon on its own, then the LLM-call addons in the server's order on one flow."""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import exceptions
from mitmproxy.addonmanager import traverse
from mitmproxy.test import taddons, tflow, tutils

from lgt.proxy import auth, resources
from lgt.proxy.addons import (
    CALL,
    IDENT,
    REVERSE,
    ROUTED,
    Call,
    Capture,
    Deadlines,
    Egress,
    Hold,
    Identify,
    Record,
    Route,
    Runtime,
    Substitute,
    Translate,
)
from lgt.proxy.gate import CONTINUE, DRAIN, REJECT, Gate
from lgt.proxy.server import addons
from lgt.store.writer import TableWriter

SECRET = b"test-secret"
UPSTREAM = "http://127.0.0.1:9/v1"


@pytest.fixture
def rt(tmp_path: Path):
    writer = TableWriter(tmp_path, flush_seconds=3600).open()
    # max_model_len: the engine's context, as if read from its model card (no test asks the upstream)
    yield Runtime(secret=SECRET, writer=writer, gate=Gate(), upstream=UPSTREAM, served_model="policy",
                  max_model_len=1 << 20)
    writer.close()


@pytest.fixture
def rows(rt: Runtime, monkeypatch) -> list[dict[str, Any]]:
    """The rows the addons append to ``calls`` (still written to the store too)."""
    got: list[dict[str, Any]] = []
    append = rt.writer.append

    def spy(row: dict[str, Any]) -> None:
        got.append(row)
        append(row)

    monkeypatch.setattr(rt.writer, "append", spy)
    return got


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def connect_flow(header: str | None):
    f = tflow.tflow()
    f.request = tutils.treq(method=b"CONNECT", path=b"", authority=b"api.openai.invalid:443",
                            host="api.openai.invalid", port=443)
    if header:
        f.request.headers["proxy-authorization"] = header
    return f


def llm_flow(body: dict[str, Any] | bytes, path: str = "/v1/chat/completions", rollout: str = "r1"):
    """A rollout's POST with its proxy credentials, identified as Identify would."""
    f = tflow.tflow()
    f.metadata[IDENT] = auth.Identity(rollout)
    f.request.headers["proxy-authorization"] = basic(rollout, auth.rollout_token(SECRET, rollout))
    f.request.method = "POST"
    f.request.host = "api.openai.invalid"
    f.request.path = path
    f.request.headers["authorization"] = "Bearer sk-agent"
    f.request.content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return f


CHAT = {"model": "gpt-4o", "messages": [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "hi"}]}


async def hook(addons: list[Any], name: str, flow) -> None:
    """Run one hook of each addon (and sub-addon), in order, as mitmproxy does."""
    for addon in traverse(addons):
        fn = getattr(addon, name, None)
        if fn is not None and (res := fn(flow)) is not None and inspect.isawaitable(res):
            await res


def pending(rt: Runtime, body: dict[str, Any] = CHAT) -> tuple[Any, Call]:
    """A flow whose call Translate recognised and Hold let through (neither reads an option)."""
    f = llm_flow(body)
    asyncio.run(hook([Translate(rt), Hold(rt)], "request", f))
    return f, f.metadata[CALL]


# -- Identify ------------------------------------------------------------------------------------
def test_connect_without_or_with_wrong_credentials_gets_407(rt: Runtime) -> None:
    addon = Identify(rt)
    with taddons.context(addon):
        for header in (None, basic("r1", "0" * 32), "Bearer x", "Basic !!!", basic("bad id", "x")):
            f = connect_flow(header)
            addon.http_connect(f)
            assert f.response is not None and f.response.status_code == 407, header
            assert IDENT not in f.metadata
        f = connect_flow(basic("r1~2", auth.rollout_token(SECRET, "r1~2")))
        addon.http_connect(f)
        assert f.response is None and f.metadata[IDENT] == auth.Identity("r1", 2)
    assert rt.metrics.auth_failures == 5


def test_requests_inside_an_authenticated_tunnel_inherit_its_identity(rt: Runtime) -> None:
    addon = Identify(rt)
    with taddons.context(addon):
        c = connect_flow(basic("r1", auth.rollout_token(SECRET, "r1")))
        addon.http_connect(c)
        f = tflow.tflow()
        f.client_conn = c.client_conn
        addon.requestheaders(f)
        assert f.response is None and f.metadata[IDENT] == auth.Identity("r1")


def test_reverse_path_is_verified_and_stripped(rt: Runtime) -> None:
    addon = Identify(rt)
    token = auth.rollout_token(SECRET, "r9")
    with taddons.context(addon):
        f = tflow.tflow()
        f.request.path = f"/r/r9/{token}/v1/chat/completions?x=1"
        addon.requestheaders(f)
        assert f.metadata[IDENT] == auth.Identity("r9") and f.metadata[REVERSE]
        assert f.request.path == "/v1/chat/completions?x=1"
        bad = tflow.tflow()
        bad.request.path = "/r/r9/" + "f" * 32 + "/v1/chat/completions"
        addon.requestheaders(bad)
        assert bad.response.status_code == 401
        assert "wrong proxy token" in bad.response.json()["error"]["message"]


def test_proxy_authorization_is_never_forwarded(rt: Runtime) -> None:
    addon = Identify(rt)
    with taddons.context(addon):
        f = tflow.tflow()
        f.request.headers["proxy-authorization"] = basic("r1", auth.rollout_token(SECRET, "r1"))
        addon.requestheaders(f)
        assert "proxy-authorization" not in f.request.headers
        assert f.metadata[IDENT].rollout_id == "r1"


# -- Translate -----------------------------------------------------------------------------------
def test_translate_reads_llm_calls_and_leaves_other_traffic(rt: Runtime) -> None:
    addon = Translate(rt)
    with taddons.context(addon):
        f = llm_flow(CHAT)
        asyncio.run(addon.request(f))
        call = f.metadata[CALL]
        assert (call.endpoint, call.api, call.requested_model, call.original_host) == (
            "chat/completions", None, "gpt-4o", "api.openai.invalid")
        assert call.request == CHAT and not call.rewrite and not call.under_way
        assert f.response is None and f.request.host == "api.openai.invalid"  # not routed here
        other = llm_flow(b"{}", path="/v1/files")
        asyncio.run(addon.request(other))
        assert CALL not in other.metadata and other.response is None
        messages = llm_flow({"model": "claude", "max_tokens": 10,
                             "messages": [{"role": "user", "content": "hi"}]}, path="/v1/messages")
        asyncio.run(addon.request(messages))
        call = messages.metadata[CALL]
        assert (call.endpoint, call.api, call.rewrite) == ("chat/completions", "messages", True)
        assert call.request["messages"][-1] == {"role": "user", "content": "hi"}


def test_translate_refuses_what_it_cannot_read(rt: Runtime) -> None:
    addon = Translate(rt)
    with taddons.context(addon):
        f = llm_flow(b"{not json")
        asyncio.run(addon.request(f))
        assert f.response.status_code == 400 and "not valid JSON" in f.metadata[CALL].refusal
        big = llm_flow(CHAT)
        big.request.headers["content-length"] = str(rt.max_body_bytes + 1)
        addon.requestheaders(big)
        assert big.response.status_code == 413 and "exceeds the proxy's limit" in big.metadata[CALL].refusal
    assert rt.metrics.bad_requests == 2
    rt.upstream = None  # observe-only: what it cannot read passes through as ordinary traffic
    addon = Translate(rt)
    with taddons.context(addon):
        f = llm_flow(b"{not json")
        asyncio.run(addon.request(f))
        assert f.response is None and CALL not in f.metadata


def test_translate_leaves_out_an_output_limit_past_the_engines_context(rt: Runtime) -> None:
    rt.max_model_len = 4096
    addon = Translate(rt)
    with taddons.context(addon):
        f = llm_flow({**CHAT, "max_tokens": 32000})
        asyncio.run(addon.request(f))
        call = f.metadata[CALL]
        assert "max_tokens" not in call.request and call.rewrite
        assert "more than the engine's context of 4096" in call.translation[0]


def test_translate_caps_a_translated_calls_output_and_notes_it(rt: Runtime) -> None:
    """A harness's Messages call asks for 64,000 tokens; with ``lgt_max_output_tokens`` the engine is
    asked for the cap, and the call's record says the run bounded it."""
    addon = Translate(rt)
    with taddons.context(addon) as tctx:
        tctx.configure(addon, lgt_max_output_tokens=256)
        f = llm_flow({"model": "claude-x", "max_tokens": 64000,
                      "messages": [{"role": "user", "content": "hi"}]}, path="/v1/messages")
        asyncio.run(addon.request(f))
        call = f.metadata[CALL]
        assert call.request["max_tokens"] == 256 and call.agent_request["max_tokens"] == 64000
        assert "max_tokens 64000 lowered to 256 by the proxy's output cap" in " ".join(call.translation)
        with pytest.raises(Exception, match="output cap must be a number of tokens"):
            tctx.configure(addon, lgt_max_output_tokens=-1)


# -- Hold ----------------------------------------------------------------------------------------
def test_hold_lets_calls_through_the_gate_and_release_ends_them(rt: Runtime) -> None:
    f, call = pending(rt)
    assert call.under_way and rt.gate.in_flight == 1 and rt.live[call.call_id] == (call, f)
    call.release()
    call.release()  # once only
    assert rt.gate.in_flight == 0 and not rt.live


def test_a_pause_that_continues_calls_stops_them_and_waits_for_the_rest() -> None:
    """on_update continue: a stoppable call is stopped and parks (the pause does not wait for it) and
    goes on under the resume's version; a call that cannot be stopped is drained as ever; a call that
    becomes stoppable during such a pause is stopped at once; a drain pause stops nothing."""

    async def main() -> None:
        gate = Gate(on_update=DRAIN)
        log: list[str] = []
        parked: list[int] = []

        async def stoppable(name: str) -> None:
            await gate.enter()
            stopped = asyncio.Event()
            gate.stoppable_call(name, lambda: (log.append(name), stopped.set()))
            await stopped.wait()
            gate.not_stoppable(name)
            parked.append(await gate.park())
            gate.exit()

        await gate.enter()  # a call that cannot be stopped: it finishes in 0.2 s
        asyncio.get_running_loop().call_later(0.2, gate.exit)
        task = asyncio.create_task(stoppable("a"))
        await asyncio.sleep(0.01)
        drained, at_pause, seconds = await gate.pause(timeout=5, on_update=CONTINUE)
        assert (drained, at_pause, log, gate.parked) == (True, 2, ["a"], 1)
        assert seconds >= 0.15  # it waited for the unstoppable call, not for the parked one
        gate.stoppable_call("late", lambda: log.append("late"))  # passed the gate before the pause
        assert log == ["a", "late"]
        gate.not_stoppable("late")
        gate.resume(3)
        await task
        assert parked == [3] and gate.parked == 0 and gate.in_flight == 0 and gate.stopped_total == 1
        task = asyncio.create_task(stoppable("b"))
        await asyncio.sleep(0.01)
        drained, _, _ = await gate.pause(timeout=0.3)  # the gate's own mode: drain
        assert drained is False and log == ["a", "late"]  # nothing stopped; it timed out waiting
        gate.stoppable["b"]()
        gate.resume(4)
        await task

    asyncio.run(main())
    with pytest.raises(ValueError, match="on_update must be 'drain' or 'continue'"):
        Gate(on_update="abort")


def test_hold_refuses_while_paused_in_reject_mode_or_the_store_is_full(rt: Runtime) -> None:
    rt.gate = Gate(REJECT)
    addon = Hold(rt)
    chain = [Translate(rt), addon]
    with taddons.context(*chain) as tctx:
        tctx.configure(addon, lgt_retry_after=7)
        asyncio.run(rt.gate.pause(timeout=1))
        f = llm_flow(CHAT)
        asyncio.run(hook(chain, "request", f))
        assert f.response.status_code == 429 and f.response.headers["Retry-After"] == "7"
        assert f.metadata[CALL].refusal and not f.metadata[CALL].under_way
        rt.gate.resume(1)
        rt.store_error, rt.store_probed = "the store cannot be written (disk full)", float("inf")
        full = llm_flow(CHAT)
        asyncio.run(hook(chain, "request", full))
        assert full.response.status_code == 503 and "disk full" in full.response.text
        assert full.metadata[CALL].refusal is None  # no row: the store cannot take one
    assert rt.metrics.rejected == 2 and rt.gate.in_flight == 0


# -- Substitute, Route ---------------------------------------------------------------------------
def test_substitute_puts_the_delivered_prompt_in_what_the_engine_is_asked(rt: Runtime) -> None:
    subs = [{"text": "be thorough"}, {"text": "X", "span": ["<a>", "</a>"]}]  # no request holds <a>…</a>
    rt.resources.put("r1", 0, resources.check(subs))
    f, call = pending(rt)
    addon = Substitute(rt)
    with taddons.context(addon):
        addon.request(f)
    assert call.request["messages"][0] == {"role": "system", "content": "be thorough"} and call.rewrite
    assert call.body == json.dumps(CHAT).encode()  # the record keeps what the agent sent
    assert rt.resources.misses == 1


def test_route_sends_calls_to_the_upstream_with_its_key(rt: Runtime) -> None:
    rt.upstream_api_key = "sk-upstream"
    f, call = pending(rt)
    addon = Route(rt)
    with taddons.context(addon):
        addon.request(f)
        assert f.request.url == f"{UPSTREAM}/chat/completions" and f.metadata[ROUTED]
        assert f.request.headers["authorization"] == "Bearer sk-upstream"
        assert (call.upstream, call.served_model) == (UPSTREAM, "policy") and "gpt-4o" in rt.model_names
        files = llm_flow(b"x", path="/v1/files?purpose=a")
        files.metadata[REVERSE] = True  # reverse mode: everything under the prefix goes upstream
        addon.request(files)
        assert files.request.url == "http://127.0.0.1:9/v1/files?purpose=a"
        assert files.request.headers["authorization"] == "Bearer sk-upstream"
    rt.upstream = None
    addon = Route(rt)
    with taddons.context(addon):
        lost = llm_flow(b"x", path="/v1/files")
        lost.metadata[REVERSE] = True
        addon.request(lost)
        assert lost.response.status_code == 502


# -- Deadlines -----------------------------------------------------------------------------------
def test_deadlines_clock_each_call_and_stop_when_it_ends(rt: Runtime) -> None:
    f, call = pending(rt)
    addon = Deadlines()
    with taddons.context(addon) as tctx:
        with pytest.raises(exceptions.OptionsError):
            tctx.configure(addon, lgt_upstream_timeout=0.0)

        async def run() -> None:
            addon.request(f)  # the option is off: no clock
            assert call.deadline is None
            tctx.configure(addon, lgt_upstream_timeout=30.0)
            addon.request(f)
            assert call.deadline is not None and call.deadline.handle is not None
            call.release()
            assert call.deadline.handle is None and rt.gate.in_flight == 0

        asyncio.run(run())


# -- Capture -------------------------------------------------------------------------------------
def routed(tctx: taddons.context, rt: Runtime, capture: bool = True) -> tuple[Any, Call, Capture]:
    """A call under way, routed and sent by Capture (``lgt_capture_tokens=capture``)."""
    f, call = pending(rt)
    addon = Capture(rt)
    tctx.master.addons.add(addon)
    tctx.configure(addon, lgt_capture_tokens=capture)
    asyncio.run(hook([Route(rt), addon], "request", f))
    return f, call, addon


ANSWER = {"model": "policy", "prompt_token_ids": [1, 2],
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "token_ids": [3],
                       "logprobs": {"content": [{"logprob": -0.1}]}, "finish_reason": "stop"}]}


def test_capture_injects_token_capture_and_strips_it_from_the_answer(rt: Runtime) -> None:
    with taddons.context() as tctx:
        f, call, addon = routed(tctx, rt)
        sent = json.loads(f.request.content)
        assert sent["model"] == "policy" and sent["return_token_ids"] and sent["logprobs"]
        assert call.injected.captures and call.served_model == "policy"
        f.response = tutils.tresp(content=json.dumps(ANSWER).encode())
        addon.responseheaders(f)
        asyncio.run(addon.response(f))
    body = f.response.json()
    assert body["model"] == "gpt-4o" and body["prompt_token_ids"] is None
    assert body["choices"][0]["token_ids"] is None and body["choices"][0]["logprobs"] is None
    assert call.capture.prompt_token_ids == [1, 2] and call.failure is None


def test_capture_off_sends_the_request_as_the_agent_wrote_it(rt: Runtime) -> None:
    with taddons.context() as tctx:
        f, call, _ = routed(tctx, rt, capture=False)
    assert json.loads(f.request.content) == {**CHAT, "model": "policy"} and not call.injected.captures


def test_capture_reads_a_stream_event_by_event(rt: Runtime) -> None:
    with taddons.context() as tctx:
        f, call, addon = routed(tctx, rt)
        call.finish = lambda: True  # Record's, which writes the row at [DONE]
        f.response = tutils.tresp(content=b"")
        f.response.headers["content-type"] = "text/event-stream"
        addon.responseheaders(f)
    events = [{"model": "policy", "choices": [{"index": 0, "delta": {"content": "o"}, "token_ids": [5],
                                                "logprobs": {"content": [{"logprob": -0.5}]}}]},
              {"model": "policy", "choices": [{"index": 0, "delta": {}, "token_ids": [],
                                                "finish_reason": "stop"}]}]
    wire_bytes = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    out = b"".join(f.response.stream(wire_bytes) + f.response.stream(b""))
    assert call.stream.saw_done and call.capture.choices[0].token_ids == [5]
    assert b'"token_ids":null' in out and b"[5]" not in out and b"-0.5" not in out  # stripped
    assert b'"gpt-4o"' in out and out.endswith(b"data: [DONE]\n\n")


def test_capture_gives_an_upstream_error_in_the_agents_api(rt: Runtime) -> None:
    body = {"model": "claude", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    f = llm_flow(body, path="/v1/messages")
    chain = [Translate(rt), Hold(rt), Route(rt), Capture(rt)]
    with taddons.context(*chain):
        asyncio.run(hook(chain, "request", f))
        f.response = tutils.tresp(status_code=404, content=b'{"error": {"message": "no such model"}}')
        asyncio.run(hook(chain, "response", f))
    call = f.metadata[CALL]
    assert call.failure == ("http_error", "no such model")
    assert f.response.json() == {"type": "error",
                                 "error": {"type": "not_found_error", "message": "no such model"}}


def test_capture_asks_again_without_what_the_upstream_refused(rt: Runtime, monkeypatch) -> None:
    asked: list[dict[str, Any]] = []

    async def send(request, body: bytes):
        asked.append(json.loads(body))
        ok = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "token_ids": [3],
                           "finish_reason": "stop"}]}
        return tutils.tresp(content=json.dumps(ok).encode())

    monkeypatch.setattr(rt.resender, "send", send)
    with taddons.context() as tctx:
        f, call, addon = routed(tctx, rt)
        f.response = tutils.tresp(status_code=400, content=b'{"error": {"message": "logprobs NaN"}}')
        f.client_conn.timestamp_end = None  # the agent still waits (a test flow's connection is closed)
        asyncio.run(addon.response(f))
    assert call.failure is None and len(asked) == 1
    assert "logprobs" not in asked[0] and asked[0]["return_token_ids"]
    assert f.response.status_code == 200 and call.capture_reason == "upstream_rejected_logprobs"
    assert call.capture.choices[0].token_ids == [3] and f.response.json()["choices"][0]["token_ids"] is None


# -- Record, and the whole chain -----------------------------------------------------------------
def test_the_chain_routes_captures_and_records_one_row(rt: Runtime, rows: list[dict[str, Any]]) -> None:
    chain = addons(rt, 0)
    f = llm_flow(CHAT)
    with taddons.context(*chain) as tctx:
        tctx.configure(chain[-1], lgt_capture_tokens=True, lgt_upstream_timeout=60.0)

        async def call_through() -> None:
            for name in ("requestheaders", "request"):
                await hook(chain, name, f)
            assert f.request.url == f"{UPSTREAM}/chat/completions"
            assert "authorization" not in f.request.headers and "proxy-authorization" not in f.request.headers
            assert (f.metadata[CALL].seq, rt.gate.in_flight) == (0, 1) and f.metadata[CALL].deadline
            f.response = tutils.tresp(content=json.dumps(ANSWER).encode())
            f.response.headers["content-type"] = "application/json"
            for name in ("responseheaders", "response", "error"):  # a late error hook never records twice
                await hook(chain, name, f)

        asyncio.run(call_through())
    call = f.metadata[CALL]
    assert f.response.json()["model"] == "gpt-4o" and rt.gate.in_flight == 0 and not rt.live
    [row] = rows
    assert (row["status"], row["capture"], row["seq"], row["requested_model"], row["served_model"]) == (
        "ok", "full", 0, "gpt-4o", "policy")
    assert row["prompt_token_ids"] == [1, 2] and row["response_token_ids"] == [3]
    assert json.loads(row["request_json"]) == CHAT and json.loads(row["response_json"])["model"] == "gpt-4o"
    assert call.deadline.handle is None and call.recorded


def test_record_writes_refused_calls_as_rejected_rows(rt: Runtime, rows: list[dict[str, Any]]) -> None:
    chain = addons(rt, 0)
    with taddons.context(*chain):
        big = llm_flow(CHAT)
        big.request.headers["content-length"] = str(rt.max_body_bytes + 1)
        for name in ("requestheaders", "request"):  # mitmproxy still runs request: nothing twice
            asyncio.run(hook(chain, name, big))
        bad = llm_flow(b'{"model": "m", "stream": true, "messages": 3}')
        for name in ("request", "responseheaders", "response"):
            asyncio.run(hook(chain, name, bad))
    assert [(r["status"], r["http_status"], r["seq"]) for r in rows] == [("rejected", 413, 0),
                                                                          ("rejected", 400, 1)]
    assert rows[1]["requested_model"] == "m" and rows[1]["streamed"]
    assert rows[1]["request_json"] == '{"model": "m", "stream": true, "messages": 3}'
    assert rt.gate.in_flight == 0


def test_a_step_that_fails_after_the_gate_refuses_the_call_and_releases_it(
        rt: Runtime, rows: list[dict[str, Any]], monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("lgt.proxy.wire.prepare_request", broken)
    f = llm_flow(CHAT)
    chain = addons(rt, 0)
    with taddons.context(*chain):
        for name in ("request", "responseheaders", "response"):
            asyncio.run(hook(chain, name, f))
    assert f.response.status_code == 500 and "could not forward this call: boom" in f.response.text
    assert rt.gate.in_flight == 0 and not rt.live and f.request.content == json.dumps(CHAT).encode()
    assert [(r["status"], r["http_status"]) for r in rows] == [("rejected", 500)]


def test_record_answers_503_when_the_store_cannot_take_the_row(rt: Runtime, monkeypatch) -> None:
    def full(row: dict[str, Any]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rt.writer, "append", full)
    addon = Record(rt)
    with taddons.context(addon) as tctx:
        f, call, _ = routed(tctx, rt)
        addon.request(f)
        f.response = tutils.tresp(content=b'{"choices": []}')
        addon.response(f)
    assert f.response.status_code == 503 and "could not be recorded" in f.response.text
    assert rt.store_error and "No space left" in rt.store_error and rt.gate.in_flight == 0


def test_record_ends_a_call_whose_flow_failed(rt: Runtime, rows: list[dict[str, Any]]) -> None:
    addon = Record(rt)
    with taddons.context(addon) as tctx:
        f, call, _ = routed(tctx, rt)
        addon.request(f)
        f.error = tflow.terr("peer closed connection")
        addon.error(f)
    assert [(r["status"], r["error"]) for r in rows] == [("upstream_error", "peer closed connection")]
    assert rt.gate.in_flight == 0 and call.recorded


def test_the_server_chain_loads_and_configures_together(rt: Runtime) -> None:
    chain = addons(rt, 0)
    assert [type(a).__name__ for a in traverse(chain)] == [
        "Identify", "Rewards", "CodexModels", "LLMCalls", "ResponsesSocket", "Egress"]
    assert [type(a).__name__ for a in chain[3].parts] == [
        "Answers", "Translate", "Hold", "Substitute", "Route", "Deadlines", "Capture", "Record"]
    with taddons.context(*chain) as tctx:
        with pytest.raises(exceptions.OptionsError):
            tctx.configure(chain[-1], lgt_egress="allowlist")  # an allowlist needs hosts
        tctx.configure(chain[-1], lgt_egress="allowlist", lgt_allow_hosts=["x.org"], lgt_retry_after=9,
                       lgt_upstream_timeout=7.0)
        hold, deadlines = chain[3].parts[2], chain[3].parts[5]  # parts load and configure as if in the chain
        assert chain[-1].allow_hosts == ("x.org",) and isinstance(hold, Hold) and hold.retry_after == 9
        assert deadlines.seconds == 7.0


# -- Egress --------------------------------------------------------------------------------------
def test_egress_policies(rt: Runtime) -> None:
    for mode, hosts, expect in (("deny", (), 403), ("allowlist", ("example.invalid",), None),
                                ("allowlist", (".invalid",), None), ("allowlist", ("x.org",), 403)):
        addon = Egress(rt)
        with taddons.context(addon) as tctx:
            tctx.configure(addon, lgt_egress=mode, lgt_allow_hosts=list(hosts))
            f = tflow.tflow()
            f.metadata[IDENT] = auth.Identity("r1")
            f.request.host = "example.invalid"
            addon.request(f)
            assert (f.response.status_code if f.response else None) == expect, (mode, hosts)
            up = tflow.tflow()
            up.metadata[IDENT] = auth.Identity("r1")
            up.request.host, up.request.port = "127.0.0.1", 9  # the upstream is always reachable ...
            addon.request(up)
            assert up.response is None
            other = tflow.tflow()
            other.metadata[IDENT] = auth.Identity("r1")
            other.request.host, other.request.port = "127.0.0.1", 22  # ... not every port of its machine
            addon.request(other)
            assert other.response is not None and other.response.status_code == 403, (mode, hosts)


def test_egress_leaves_llm_calls_and_routed_flows_alone(rt: Runtime) -> None:
    f, _ = pending(rt)
    addon = Egress(rt)
    with taddons.context(addon) as tctx:
        tctx.configure(addon, lgt_egress="deny")
        routed_flow = llm_flow(b"", path="/v1/files")
        routed_flow.metadata[ROUTED] = True
        for flow in (f, routed_flow):
            addon.request(flow)
            assert flow.response is None


@pytest.mark.parametrize("name,identity", [
    ("r1", auth.Identity("r1")), ("r1~2", auth.Identity("r1", 2)),
    ("r1~0~greedy", auth.Identity("r1", 0, greedy=True)), ("r.x~3~greedy", auth.Identity("r.x", 3, True)),
])
def test_identity_names_round_trip_and_greedy_is_signed(name: str, identity: auth.Identity) -> None:
    assert auth.parse_identity(name) == identity and identity.name == name
    plain = auth.Identity(identity.rollout_id, identity.attempt)
    if identity.greedy:  # a token minted without ~greedy does not let an agent add it, nor drop it
        with pytest.raises(auth.AuthError):
            auth.verify(SECRET, identity.name, auth.rollout_token(SECRET, plain))
        with pytest.raises(auth.AuthError):
            auth.verify(SECRET, plain.name, auth.rollout_token(SECRET, identity))
