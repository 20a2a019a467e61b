"""What an agent (untrusted code) cannot do through lgt-proxy, and what it cannot read: the threat model of
docs/security.md, each claim a test."""

from __future__ import annotations

import base64
import socket
import stat
import threading
from pathlib import Path

import httpx

from lgt.proxy import auth
from lgt.testing.proxy import CHAT, ProxyProc


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_secret_and_the_ca_key_are_owner_only(proxy: ProxyProc) -> None:
    d = auth.proxy_dir(proxy.store)
    assert mode(d / "secret") == 0o600
    keys = [p for p in d.iterdir() if p.name.startswith("mitmproxy-ca.")]  # cert + private key
    assert keys and all(mode(p) == 0o600 for p in keys)
    assert mode(d / "mitmproxy-ca-cert.pem") & 0o044  # the public certificate is for everyone


def test_a_runs_credentials_do_not_open_another_stores_proxy(tmp_path, proxy, upstream) -> None:
    other = ProxyProc(tmp_path / "other-store", upstream.url).start()
    try:
        theirs = other.proxy_url("r1").replace(f":{other.port}", f":{proxy.port}")  # aimed at ours
        with httpx.Client(proxy=theirs, trust_env=False) as c:
            assert c.post(f"{upstream.url}/chat/completions", json=CHAT).status_code == 407
        with httpx.Client(proxy=other.proxy_url("r1"), trust_env=False) as c:  # at their own: fine
            assert c.post(f"{upstream.url}/chat/completions", json=CHAT).status_code == 200
    finally:
        other.stop()


def test_the_control_api_refuses_without_its_token(proxy: ProxyProc) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {proxy.client.token}"}):
        r = httpx.post(f"{proxy.control_url}/pause", json={"timeout": 1}, headers=headers, trust_env=False)
        assert r.status_code == 401, headers
    assert not proxy.client.state()["paused"]
    assert httpx.get(f"{proxy.control_url}/healthz", trust_env=False).status_code == 200  # only this


class Listener:
    """A TCP listener on loopback that counts the connections it gets (a host agents must not reach)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def raw(port: int, data: bytes, read: int = 65536) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(read):
            out += chunk
            if b"\r\n\r\n" in out:
                break
        return out


def test_egress_deny_blocks_a_tunnel_to_any_other_host(tmp_path, upstream) -> None:
    p = ProxyProc(tmp_path / "store", upstream.url, "--egress", "deny").start()
    target = Listener()
    try:
        user = base64.b64encode(f"r1:{p.proxy_url('r1').split(':')[2].split('@')[0]}".encode()).decode()
        answer = raw(p.port, f"CONNECT 127.0.0.1:{target.port} HTTP/1.1\r\nHost: 127.0.0.1:{target.port}\r\n"
                             f"Proxy-Authorization: Basic {user}\r\n\r\n".encode())
        # the tunnel may be accepted (the proxy then reads what the agent sends through it) but nothing
        # reaches the host: an SSH-like banner through it is refused too
        if answer.startswith(b"HTTP/1.1 200"):
            with socket.create_connection(("127.0.0.1", p.port), timeout=10) as s:
                s.sendall(f"CONNECT 127.0.0.1:{target.port} HTTP/1.1\r\nProxy-Authorization: Basic {user}"
                          "\r\n\r\n".encode())
                s.recv(4096)
                s.sendall(b"SSH-2.0-agent\r\n")
                s.settimeout(3)
                try:
                    s.recv(4096)
                except (TimeoutError, OSError):
                    pass
        assert target.accepted == 0
        blocked = p.calls("true") == [] and p.client.state()["blocked_egress"] >= 1
        assert blocked
    finally:
        target.close()
        p.stop()


def test_oversized_headers_and_smuggling_probes_get_4xx_not_a_crash(proxy: ProxyProc) -> None:
    user = base64.b64encode(f"r1:{proxy.proxy_url('r1').split(':')[2].split('@')[0]}".encode()).decode()
    auth_line, big = f"Proxy-Authorization: Basic {user}\r\n".encode(), b"a" * 300_000
    for probe in (  # a 300 kB header, with and without credentials; a body both chunked and sized
            b"GET http://lgt.invalid/ HTTP/1.1\r\nHost: lgt.invalid\r\nX-Big: " + big + b"\r\n\r\n",
            b"GET http://lgt.invalid/ HTTP/1.1\r\nHost: lgt.invalid\r\n" + auth_line + b"X-Big: " + big
            + b"\r\n\r\n",
            b"POST http://lgt.invalid/v1/chat/completions HTTP/1.1\r\nHost: lgt.invalid\r\n" + auth_line
            + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /admin HTTP/1.1\r\n\r\n"):
        answer = raw(proxy.port, probe)
        assert answer.startswith(b"HTTP/1.1 4") or answer == b"", answer[:80]  # refused, or closed
    assert proxy.client.healthz()  # still serving
