"""The Responses API over WebSocket through the real proxy, as Codex uses it (``HTTPS_PROXY``, then
``wss://api.openai.com/v1/responses``): each ``response.create`` is a recorded call with full token
capture, answered as WebSocket messages; a prewarm is answered without the engine; chaining by
``previous_response_id`` works; a socket closed mid-answer is on the record; a pause holds a call.
Clients: the ``websockets`` library (what the openai SDK's ``responses.connect()`` uses), replaying
what Codex 0.171 sent (tests/fixtures/harnesses/codex*), and the official SDK itself."""

from __future__ import annotations

import json
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lgt.testing.clients import sdk_events

websockets = pytest.importorskip("websockets.sync.client")

FIXTURES = Path(__file__).parent / "fixtures" / "harnesses"
WS_URL = "wss://api.openai.com/v1/responses"
TERMINAL = ("response.completed", "response.failed", "response.incomplete", "error")


def recorded_messages(profile: str) -> list[dict[str, Any]]:
    """The WebSocket messages Codex sent in a recorded session, in order."""
    files = sorted((FIXTURES / profile).glob("*-ws-openai-responses.json"))
    return [json.loads(p.read_text())["body"] for p in files]


def connect(env: dict[str, str]):
    ctx = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
    return websockets.connect(WS_URL, proxy=env["HTTPS_PROXY"], ssl=ctx, open_timeout=30,
                              additional_headers={"openai-beta": "responses_websockets=2026-02-06"})


def answer_of(ws, timeout: float = 10) -> list[dict[str, Any]]:
    """The events of one response, up to its terminal event."""
    events = []
    while not events or events[-1]["type"] not in TERMINAL:
        events.append(json.loads(ws.recv(timeout=timeout)))
    return events


def wait_rows(proxy, rollout: str, n: int, timeout: float = 10) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        rows = proxy.calls("rollout_id = ?", [rollout])
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def test_a_codex_session_replayed_over_websocket(proxy, upstream, rollout):
    """Prewarm, main call (the policy calls Codex's custom ``exec`` tool: a ``custom_tool_call`` in
    its ``functions`` namespace), then the tool's output chained by ``previous_response_id``: two
    recorded calls with every token, the prewarm none."""
    prewarm, main, final = recorded_messages("codex")
    env = proxy.env(rollout)
    classes = sdk_events()
    with connect(env) as ws:
        ws.send(json.dumps(prewarm))
        warm = answer_of(ws)
        assert [e["type"] for e in warm] == ["response.created", "response.in_progress", "response.completed"]
        assert warm[-1]["response"]["output"] == []
        ws.send(json.dumps({**main, "previous_response_id": warm[-1]["response"]["id"]}))
        first = answer_of(ws)
        done = first[-1]["response"]
        out = {**final["input"][0], "call_id": done["output"][0]["call_id"]}
        ws.send(json.dumps({**final, "previous_response_id": done["id"], "input": [out]}))
        second = answer_of(ws)
    for e in first + second:
        classes[e["type"]].model_validate(e)
    assert [e["type"] for e in first] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
        "response.output_item.done", "response.completed"]
    call = first[-1]["response"]["output"][0]
    assert (call["type"], call["name"], call["namespace"]) == ("custom_tool_call", "exec", "functions")
    assert first[3]["delta"] == call["input"] == first[4]["input"]
    assert second[-1]["type"] == "response.completed"
    assert second[-1]["response"]["output"][0]["type"] == "message"
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [(r["api"], r["status"], r["capture"], r["original_host"]) for r in rows] == [
        ("responses", "ok", "full", "api.openai.com")] * 2  # the prewarm generated nothing: no row
    for row in rows:
        assert row["prompt_token_ids"] and row["response_token_ids"] and row["streamed"]
        assert any("WebSocket" in n for n in row["translation"])
    assert "previous_response_id" not in json.loads(rows[0]["request_json"])  # an empty prewarm: dropped
    assert json.loads(rows[1]["request_json"])["previous_response_id"] == first[-1]["response"]["id"]
    assert len(rows[1]["prompt_token_ids"]) > len(rows[0]["prompt_token_ids"])  # the whole conversation


def test_a_prewarms_input_is_sent_with_the_call_after_it(proxy, upstream, rollout):
    """codex.minimal's prewarm carries the developer message and the tools; the main call only the
    user's: the recorded main call holds both, and each turn's prompt extends the last one's."""
    prewarm, main, final = recorded_messages("codex.minimal")
    with connect(proxy.env(rollout)) as ws:
        ws.send(json.dumps(prewarm))
        warm = answer_of(ws)[-1]["response"]["id"]
        ws.send(json.dumps({**main, "previous_response_id": warm}))
        first = answer_of(ws)[-1]["response"]
        call = first["output"][0]
        assert (call["type"], call["name"], call.get("namespace")) == ("function_call", "exec_command", None)
        out = {**final["input"][0], "call_id": call["call_id"]}
        ws.send(json.dumps({**final, "previous_response_id": first["id"], "input": [out]}))
        assert answer_of(ws)[-1]["type"] == "response.completed"
    rows = proxy.calls("rollout_id = ?", [rollout])
    sent = json.loads(rows[0]["request_json"])
    assert [i["role"] for i in sent["input"]] == ["developer", "user"] and "previous_response_id" not in sent
    assert any(n.startswith("the input of prewarm response") for n in rows[0]["translation"])
    prompt = bytes(i - 3 for i in rows[0]["prompt_token_ids"]).decode()  # the fake engine's byte tokens
    assert "You are a coding agent." in prompt
    first_turn = rows[0]["prompt_token_ids"] + rows[0]["response_token_ids"]
    assert rows[1]["prompt_token_ids"][:len(first_turn)] == first_turn


def test_the_official_sdk_over_websocket_with_lanes_and_errors(proxy, upstream, rollout, clean_env):
    """``client.responses.connect()`` of the openai SDK, through ``HTTPS_PROXY``: a text answer, the
    ``stream_id`` echoed on every event, a refusal as an ``error`` event with its status, and an
    unknown event type answered the same way — the socket stays usable."""
    openai = pytest.importorskip("openai")
    for k, v in proxy.env(rollout).items():
        clean_env.setenv(k, v)
    client = openai.OpenAI(base_url="https://api.openai.invalid/v1", api_key="sk-test", max_retries=0)
    with client.responses.connect() as conn:
        conn.response.create(model="gpt-5-mini", input="What is 6 times 7?", stream_id="lane-a")
        kinds = []
        for event in conn:
            kinds.append((event.type, getattr(event, "stream_id", None)))
            if event.type == "response.completed":
                text = event.response.output_text
                break
        assert text and kinds[0] == ("response.created", "lane-a") and {s for _, s in kinds} == {"lane-a"}
        conn.send_raw(json.dumps({"type": "response.create", "model": "m", "input": "x",
                                  "previous_response_id": "resp_unknown"}))
        err = json.loads(conn.recv_bytes())
        assert (err["type"], err["status"]) == ("error", 400) and "resp_unknown" in err["error"]["message"]
        conn.send_raw(json.dumps({"type": "response.rewind"}))
        err = json.loads(conn.recv_bytes())
        assert (err["type"], err["status"], err["error"]["code"]) == ("error", 400, "unknown_event_type")
        conn.send_raw(json.dumps({"type": "response.processed", "response_id": "resp_x"}))  # no answer
        conn.response.create(model="gpt-5-mini", input="And 2+2?")
        assert next(e for e in conn if e.type == "response.completed").response.output_text
    rows = proxy.calls("rollout_id = ?", [rollout])
    assert [(r["status"], r["http_status"]) for r in rows] == [("ok", 200), ("rejected", 400), ("ok", 200)]


def test_a_base_url_agent_opens_the_socket_on_the_proxys_reverse_path(proxy, upstream, rollout):
    """Codex with ``openai_base_url`` at the proxy (``ws://…/r/<rollout>/<token>/v1/responses``)."""
    url = proxy.base_url(rollout).replace("http://", "ws://") + "/responses"
    with websockets.connect(url, proxy=None, open_timeout=10) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "hi"}))
        assert answer_of(ws)[-1]["type"] == "response.completed"
    (row,) = proxy.calls("rollout_id = ?", [rollout])
    assert (row["status"], row["capture"], row["original_host"]) == ("ok", "full", "127.0.0.1")


def test_a_socket_closed_mid_answer_is_recorded_and_the_proxy_goes_on(proxy, upstream, rollout):
    env = proxy.env(rollout)
    with connect(env) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "wait __stall:2__"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "response.created"  # the answer has begun
    rows = wait_rows(proxy, rollout, 1)
    assert [(r["api"], r["status"]) for r in rows] == [("responses", "client_disconnect")]
    with connect(env) as ws:  # the proxy still answers
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "hi"}))
        assert answer_of(ws)[-1]["type"] == "response.completed"


def test_a_pause_holds_a_websocket_call_until_resume(proxy, upstream, rollout):
    ctl = proxy.client
    version = ctl.state()["policy_version"] + 1
    ctl.pause(timeout=10)
    try:
        with connect(proxy.env(rollout)) as ws:
            ws.send(json.dumps({"type": "response.create", "model": "m", "input": "held?"}))
            with pytest.raises(TimeoutError):
                ws.recv(timeout=0.7)  # held, not failed
            assert ctl.state()["held"] == 1
            threading.Timer(0.2, lambda: ctl.resume(policy_version=version)).start()
            events = answer_of(ws)
    finally:
        if ctl.state()["paused"]:
            ctl.resume(policy_version=version)
    assert events[-1]["type"] == "response.completed"
    (row,) = proxy.calls("rollout_id = ?", [rollout])
    assert (row["status"], row["policy_version"]) == ("ok", version)


def test_codex_model_catalogue_is_answered_for_rollouts_only(proxy, rollout):
    httpx = pytest.importorskip("httpx")
    env = proxy.env(rollout)
    url = "https://chatgpt.com/backend-api/codex/models?client_version=0.171.0"
    with httpx.Client(proxy=env["HTTPS_PROXY"], verify=env["SSL_CERT_FILE"], trust_env=False) as client:
        models = client.get(url).json()["models"]
    assert [(m["slug"], m["visibility"]) for m in models] == [("policy", "hide")]
    bad = env["HTTPS_PROXY"].replace(env["HTTPS_PROXY"].split(":")[2].split("@")[0], "0" * 32)
    with httpx.Client(proxy=bad, verify=env["SSL_CERT_FILE"], trust_env=False) as client, \
            pytest.raises(httpx.ProxyError):
        client.get(url)


def test_only_a_rollouts_responses_upgrade_goes_to_the_bridge(tmp_path):
    """The addon's hook on mitmproxy's test flows: an authenticated upgrade of ``…/responses`` is
    pointed at the bridge (the host the agent aimed at kept as ``Host``, its key removed); other
    upgrades, unauthenticated ones and an observe-only proxy's are left alone."""
    from mitmproxy.test import taddons, tflow, tutils

    from lgt.proxy.addons import IDENT, ROUTED, Runtime
    from lgt.proxy.auth import Identity, rollout_token
    from lgt.proxy.gate import Gate
    from lgt.proxy.wsbridge import ResponsesSocket
    from lgt.store.writer import TableWriter

    writer = TableWriter(tmp_path, flush_seconds=3600).open()
    secret, who = b"s", Identity("r1", 2)

    def upgrade(path: bytes = b"/v1/responses", ident: Identity | None = who):
        f = tflow.tflow()
        f.request = tutils.treq(method=b"GET", path=path, host="api.openai.com", port=443, scheme=b"https",
                                authority=b"api.openai.com")
        f.request.headers.update({"upgrade": "websocket", "connection": "Upgrade",
                                  "authorization": "Bearer k", "host": "api.openai.com"})
        if ident:
            f.metadata[IDENT] = ident
        return f

    try:
        for upstream in ("http://127.0.0.1:9/v1", None):
            rt = Runtime(secret=secret, writer=writer, gate=Gate(), upstream=upstream)
            addon = ResponsesSocket(rt, 4242)
            with taddons.context(addon):
                f = upgrade()
                addon.request(f)
                if upstream is None:
                    assert f.request.host == "api.openai.com" and ROUTED not in f.metadata
                    continue
                assert (f.request.scheme, f.request.host, f.request.port) == ("http", "127.0.0.1", 4242)
                assert f.request.path == f"/r/r1~2/{rollout_token(secret, who)}/v1/responses"
                assert f.request.headers["host"] == "api.openai.com"
                assert "authorization" not in f.request.headers
                assert f.metadata[ROUTED]
                for other in (upgrade(b"/v1/realtime"), upgrade(ident=None)):
                    addon.request(other)
                    assert other.request.host == "api.openai.com"
    finally:
        writer.close()


def test_the_bridge_takes_only_a_signed_identity(tmp_path):
    """The bridge listens on loopback, where other local processes could reach it: an upgrade needs the
    same signed identity as a reverse-mode path."""
    import asyncio

    import aiohttp

    from lgt.proxy.addons import Runtime
    from lgt.proxy.auth import rollout_token
    from lgt.proxy.gate import Gate
    from lgt.proxy.wsbridge import Bridge
    from lgt.store.writer import TableWriter

    async def main() -> None:
        writer = TableWriter(tmp_path, flush_seconds=3600).open()
        bridge = Bridge(Runtime(secret=b"s", writer=writer, gate=Gate(), upstream="http://127.0.0.1:9/v1"))
        port = await bridge.start()
        try:
            async with aiohttp.ClientSession() as s:
                with pytest.raises(aiohttp.WSServerHandshakeError) as bad:
                    await s.ws_connect(f"http://127.0.0.1:{port}/r/r1/{'0' * 32}/v1/responses")
                assert bad.value.status == 401
                token = rollout_token(b"s", "r1")
                ws = await s.ws_connect(f"http://127.0.0.1:{port}/r/r1/{token}/v1/responses")
                await ws.send_str("not json")
                assert json.loads((await ws.receive()).data)["status"] == 400
                await ws.close()
        finally:
            await bridge.stop()
            writer.close()

    asyncio.run(main())
