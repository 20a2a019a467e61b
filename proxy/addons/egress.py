"""The Egress addon: the policy for everything that is not an LLM call, and its table."""

from __future__ import annotations

import logging
import re
import socket
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import ctx, exceptions, http

from lgt.store.schema import EGRESS_HTTP, EGRESS_TCP, EGRESS_TLS_FAILED

from ..auth import Identity
from .runtime import Runtime
from .state import CALL, IDENT, ROUTED, now_us

log = logging.getLogger("lgt.proxy")

SECRET_QUERY = re.compile(r"(?i)(key|token|secret|passw|sig|auth|credential|session|code)")
EGRESS_MODES = ("allow", "allowlist", "deny")
EGRESS = "lgt.egress"  # (started, allowed[, host, port]) of a flow the egress table records


def redact_path(path: str) -> str:
    """``path`` with the values of secret-looking query parameters replaced by ``***``."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    parts = []
    for item in query.split("&"):
        name, eq, _ = item.partition("=")
        parts.append(f"{name}=***" if eq and SECRET_QUERY.search(name) else item)
    return f"{base}?{'&'.join(parts)}"


class Egress:
    """Everything an identified agent reaches through the proxy that is not an LLM call (nor a
    reward report): allowed or blocked by the policy (allow, an allowlist of hosts, or deny), and
    each one a row of the store's ``egress`` table — HTTP requests (plain, or inside a tunnel the
    proxy intercepted), other TCP connections, and tunnels whose TLS the agent refused."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        up = urlsplit(rt.upstream) if rt.upstream else None
        # the engine's own address (host and port: not every service on its machine)
        self.upstream = (up.hostname, up.port or (443 if up.scheme == "https" else 80)) if up else None
        # mitmproxy opens a TCP flow's server connection after tcp_start whatever the hook did (a
        # killed flow included): a blocked one is pointed here instead, a bound port that does not
        # listen, so the connection is refused at once and nothing reaches the host
        self._sink = socket.socket()
        self._sink.bind(("127.0.0.1", 0))
        self.policy, self.allow_hosts = "allow", ()

    def load(self, loader: Any) -> None:
        loader.add_option("lgt_egress", str, "allow", "Policy for traffic that is not an LLM call.",
                          choices=EGRESS_MODES)
        loader.add_option("lgt_allow_hosts", Sequence[str], [],
                          "Hosts lgt_egress=allowlist lets through (.example.org: its subdomains too).")

    def configure(self, updated: set[str]) -> None:
        if "lgt_egress" in updated or "lgt_allow_hosts" in updated:
            if ctx.options.lgt_egress == "allowlist" and not ctx.options.lgt_allow_hosts:
                raise exceptions.OptionsError("lgt_egress=allowlist needs at least one lgt_allow_hosts")
            self.policy, self.allow_hosts = ctx.options.lgt_egress, tuple(ctx.options.lgt_allow_hosts)

    def allowed(self, host: str, port: int | None) -> bool:
        if self.policy == "allow" or (host, port) == self.upstream:
            return True
        if self.policy == "deny":
            return False
        return any(host == h or (h.startswith(".") and host.endswith(h)) for h in self.allow_hosts)

    def _blocked(self, identity: Identity, what: str) -> None:
        self.rt.metrics.blocked_egress += 1
        log.info("egress blocked for rollout %s: %s (egress policy %s)", identity.name, what,
                 self.policy)

    def _write(self, identity: Identity, started_us: int, kind: str, host: str, port: int | None,
               allowed: bool, **cols: Any) -> None:
        if self.rt.egress_log is None:
            return
        row = {"egress_id": uuid.uuid4().hex, "rollout_id": identity.rollout_id,
               "attempt": identity.attempt, "started_at": started_us, "ended_at": now_us(),
               "kind": kind, "host": host, "port": port, "allowed": allowed,
               "policy": self.policy, "proxy_session": self.rt.writer.session, **cols}
        try:
            self.rt.egress_log.append(row)
        except Exception:  # the agent's traffic goes on; the failure is counted and logged
            self.rt.metrics.record_failures += 1
            log.exception("could not record egress to %s for rollout %s", host, identity.name)

    # -- HTTP ------------------------------------------------------------------------------------
    def request(self, flow: http.HTTPFlow) -> None:
        identity = flow.metadata.get(IDENT)
        if flow.response is not None or identity is None:
            return
        if CALL in flow.metadata or flow.metadata.get(ROUTED):
            return
        host = flow.request.pretty_host
        allowed = self.allowed(host, flow.request.port)
        flow.metadata[EGRESS] = (now_us(), allowed)
        if not allowed:
            self._blocked(identity, f"{flow.request.method} {flow.request.scheme}://{host}"
                                    f"{redact_path(flow.request.path)}")
            flow.response = http.Response.make(
                403, f"lgt-proxy: egress to {host} is blocked by the proxy's egress policy "
                     f"({self.policy})\n", {"content-type": "text/plain"},
            )

    def _http_row(self, flow: http.HTTPFlow, error: str | None) -> None:
        mark = flow.metadata.pop(EGRESS, None)
        if mark is None:
            return
        req, resp = flow.request, flow.response
        self._write(flow.metadata[IDENT], mark[0], EGRESS_HTTP, req.pretty_host, req.port, mark[1],
                    scheme=req.scheme, method=req.method, path=redact_path(req.path),
                    status=resp.status_code if resp is not None else None,
                    request_bytes=len(req.raw_content or b""),
                    response_bytes=len(resp.raw_content or b"") if resp is not None else None,
                    error=error)

    def response(self, flow: http.HTTPFlow) -> None:
        self._http_row(flow, None)

    def error(self, flow: http.HTTPFlow) -> None:
        self._http_row(flow, flow.error.msg if flow.error else "unknown error")

    # -- other TCP, refused TLS ------------------------------------------------------------------
    def tcp_start(self, flow: Any) -> None:
        host, port = flow.server_conn.address or ("", None)
        identity = self.rt.tunnels.get(flow.client_conn)
        allowed = self.allowed(host, port)
        if identity is not None:
            flow.metadata[EGRESS] = (now_us(), allowed, host, port)
            if not allowed:
                self._blocked(identity, f"TCP {host}:{port}")
        if not allowed:
            if identity is None:
                self.rt.metrics.blocked_egress += 1
            flow.server_conn.address = self._sink.getsockname()
            flow.kill()

    def _tcp_row(self, flow: Any) -> None:
        mark = flow.metadata.pop(EGRESS, None)
        identity = self.rt.tunnels.get(flow.client_conn)
        if mark is None or identity is None:
            return
        host, port = mark[2], mark[3]  # where the agent aimed (a blocked flow was pointed elsewhere)
        sent = sum(len(m.content) for m in flow.messages if m.from_client)
        got = sum(len(m.content) for m in flow.messages if not m.from_client)
        self._write(identity, mark[0], EGRESS_TCP, host, port, mark[1], request_bytes=sent,
                    response_bytes=got, error=flow.error.msg if flow.error else None)

    def tcp_end(self, flow: Any) -> None:
        self._tcp_row(flow)

    def tcp_error(self, flow: Any) -> None:
        self._tcp_row(flow)

    def tls_failed_client(self, data: Any) -> None:
        identity = self.rt.tunnels.get(data.context.client)
        if identity is None:
            return
        host, port = data.context.server.address or ("", None)
        host = data.context.client.sni or host
        self._write(identity, now_us(), EGRESS_TLS_FAILED, host, port, self.allowed(host, port),
                    error=data.conn.error or "the agent refused the proxy's TLS certificate")
