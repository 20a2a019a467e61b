"""The addons' hooks called directly on mitmproxy's test flows (mitmproxy's own testing habit)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest
from mitmproxy.test import taddons, tflow, tutils

from lgt.proxy import auth
from lgt.proxy.addons import CALL, IDENT, REVERSE, Egress, Identify, Record, Runtime
from lgt.proxy.gate import Gate
from lgt.store.writer import TableWriter

SECRET = b"test-secret"


@pytest.fixture
def rt(tmp_path: Path):
    writer = TableWriter(tmp_path, flush_seconds=3600).open()
    yield Runtime(secret=SECRET, writer=writer, gate=Gate(), upstream="http://127.0.0.1:9/v1",
                  served_model="policy", capture_tokens=True)
    writer.close()


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def connect_flow(header: str | None):
    f = tflow.tflow()
    f.request = tutils.treq(method=b"CONNECT", path=b"", authority=b"api.openai.invalid:443",
                            host="api.openai.invalid", port=443)
    if header:
        f.request.headers["proxy-authorization"] = header
    return f


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


def test_record_routes_rewrites_and_injects(rt: Runtime) -> None:
    addon = Record(rt)
    with taddons.context(addon):
        f = tflow.tflow()
        f.metadata[IDENT] = auth.Identity("r1")
        f.request.method = "POST"
        f.request.host = "api.openai.invalid"
        f.request.path = "/v1/chat/completions"
        f.request.headers["authorization"] = "Bearer sk-agent"
        f.request.content = json.dumps(
            {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).encode()
        asyncio.run(addon.request(f))
        assert f.request.url == "http://127.0.0.1:9/v1/chat/completions"
        assert "authorization" not in f.request.headers
        sent = json.loads(f.request.content)
        assert sent["model"] == "policy" and sent["return_token_ids"] and sent["logprobs"]
        call = f.metadata[CALL]
        assert (call.seq, call.original_host, call.requested_model) == (0, "api.openai.invalid",
                                                                        "gpt-4o")
        assert rt.gate.in_flight == 1
        f.response = tutils.tresp(content=json.dumps({
            "model": "policy", "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "token_ids": [3], "logprobs": {"content": [{"logprob": -0.1}]},
                         "finish_reason": "stop"}]}).encode())
        f.response.headers["content-type"] = "application/json"
        addon.responseheaders(f)
        asyncio.run(addon.response(f))
        body = f.response.json()
        assert body["model"] == "gpt-4o" and body["prompt_token_ids"] is None
        assert body["choices"][0]["token_ids"] is None and body["choices"][0]["logprobs"] is None
        assert rt.gate.in_flight == 0 and call.recorded
        addon.error(f)  # a late error hook never records twice
    assert rt.writer.rows_written == 1


def test_egress_policies(rt: Runtime) -> None:
    for mode, hosts, expect in (("deny", (), 403), ("allowlist", ("example.invalid",), None),
                                ("allowlist", (".invalid",), None), ("allowlist", ("x.org",), 403)):
        rt.egress, rt.allow_hosts = mode, hosts
        addon = Egress(rt)
        with taddons.context(addon):
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
