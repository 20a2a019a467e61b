"""--idle-timeout: an agent that stops sending its request body, or never reads its answer, is let go
after that many seconds of silence — nothing it held (a connection, a place in a pause's drain) is held
forever — while every other agent is served as usual."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from lgt.testing.fake_upstream import FakeUpstream
from lgt.testing.proxy import ProxyProc

IDLE = 2
HOST = "api.openai.invalid"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, upstream: FakeUpstream) -> Iterator[ProxyProc]:
    """This module's proxy (overrides conftest's): with --idle-timeout."""
    store = tmp_path_factory.mktemp("idle") / "store"
    p = ProxyProc(store, upstream.url, "--idle-timeout", str(IDLE)).start()
    yield p
    p.stop()


def tunnel(proxy: ProxyProc, rollout: str, rcvbuf: int | None = None) -> ssl.SSLSocket:
    """A raw agent: CONNECT through the proxy with the rollout's credentials, then TLS to the host."""
    url = urlsplit(proxy.proxy_url(rollout))
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # fills fast when never read
    sock.connect(("127.0.0.1", proxy.port))
    basic = base64.b64encode(f"{url.username}:{url.password}".encode()).decode()
    sock.sendall(f"CONNECT {HOST}:443 HTTP/1.1\r\nHost: {HOST}:443\r\n"
                 f"Proxy-Authorization: Basic {basic}\r\n\r\n".encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    ctx = ssl.create_default_context(cafile=proxy.env(rollout)["SSL_CERT_FILE"])
    return ctx.wrap_socket(sock, server_hostname=HOST)


def closed_within(sock: ssl.SSLSocket, seconds: float) -> float | None:
    """Seconds until the proxy closes ``sock`` (reading what arrives), or None if it is still open."""
    t0 = time.monotonic()
    sock.settimeout(0.5)
    while time.monotonic() - t0 < seconds:
        try:
            if not sock.recv(65536):
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except (ssl.SSLError, OSError):
            return time.monotonic() - t0
    return None


def agent_client(proxy: ProxyProc, rollout: str, timeout: float) -> httpx.Client:
    env = proxy.env(rollout)
    return httpx.Client(proxy=env["HTTPS_PROXY"], timeout=timeout,
                        verify=ssl.create_default_context(cafile=env["SSL_CERT_FILE"]))


def call_ok(proxy: ProxyProc, rollout: str) -> bool:
    with agent_client(proxy, rollout, 10) as c:
        return c.post(f"https://{HOST}/v1/chat/completions", json=CHAT).status_code == 200


def test_a_request_body_that_stops_coming_is_let_go(proxy: ProxyProc) -> None:
    body = json.dumps(CHAT).encode()
    with tunnel(proxy, "slow-body") as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body) + 100}\r\n\r\n".encode() + body)  # 100 bytes never come
        t0 = time.monotonic()
        assert call_ok(proxy, "others-1")  # everyone else is served meanwhile
        waited = closed_within(s, IDLE + 8)
    assert waited is not None, "the proxy kept a stalled request open"
    assert IDLE - 1 <= time.monotonic() - t0 <= IDLE + 8
    assert proxy.client.state()["in_flight"] == 0
    assert proxy.calls("rollout_id = ?", ["slow-body"]) == []  # no request, so no call: nothing half-recorded


def test_an_answer_never_read_is_let_go_and_a_pause_still_drains(proxy: ProxyProc) -> None:
    long = "__drip:0.0001__ __long:200000__ an answer of ~50 MB"  # far more than the buffers on the way hold
    body = json.dumps({**CHAT, "stream": True, "max_tokens": 200_000,
                       "messages": [{"role": "user", "content": long}]}).encode()
    with tunnel(proxy, "never-reads", rcvbuf=4096) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 10
        while proxy.client.state()["in_flight"] == 0:  # the call is under way, its answer unread
            assert time.monotonic() < deadline, "the call never started"
            time.sleep(0.05)
        # the pause waits for it: the buffers on the way fill (a few MB), then no byte moves, and the
        # idle timeout lets it go
        paused = proxy.client.pause(timeout=30)
        proxy.client.resume()
        assert paused["drained"] is True and paused["in_flight_at_pause"] == 1
        assert call_ok(proxy, "others-2")
    rows = proxy.calls("rollout_id = ?", ["never-reads"])
    assert [r["status"] for r in rows] == ["client_disconnect"]  # recorded once, as what it was


def test_an_upstream_slower_than_the_idle_timeout_is_cut_too(proxy: ProxyProc) -> None:
    """The documented edge: silence waiting for a non-streamed answer counts as idle (mitmproxy's
    tcp_timeout), so --idle-timeout must exceed the slowest time to an answer's first byte."""
    with agent_client(proxy, "slow-upstream", 30) as c:
        slow = {**CHAT, "messages": [{"role": "user", "content": f"__sleep:{IDLE + 3}__ slow"}]}
        with pytest.raises(httpx.RemoteProtocolError):
            c.post(f"https://{HOST}/v1/chat/completions", json=slow)
        fast = {**CHAT, "messages": [{"role": "user", "content": f"__sleep:{IDLE / 2}__ slow"}]}
        assert c.post(f"https://{HOST}/v1/chat/completions", json=fast).status_code == 200
