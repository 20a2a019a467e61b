"""The Identify addon: the rollout behind each request, from its proxy credentials or its path."""

from __future__ import annotations

import logging
import re

from mitmproxy import http
from mitmproxy.proxy.mode_specs import ReverseMode

from ..auth import AuthError, Identity, parse_basic, verify
from .runtime import Runtime
from .state import IDENT, REVERSE, json_response

log = logging.getLogger("lgt.proxy")
REVERSE_PATH = re.compile(r"^/r/([^/?]+)/([^/?]+)(.*)$")


class Identify:
    """Who is calling: proxy credentials (on the CONNECT for HTTPS, on each request for plain HTTP) or
    the reverse-mode path prefix ``/r/<rollout>/<token>``, verified against the secret; the identity is
    ``flow.metadata[IDENT]``. Anything else gets 407 (401 on a reverse-mode path) and is never forwarded."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.tunnels = rt.tunnels

    def _from_header(self, value: str | None) -> Identity:
        if not value:
            raise AuthError("proxy credentials required (HTTPS_PROXY=http://<rollout>:<token>@host:port)")
        user, token = parse_basic(value)
        return verify(self.rt.secret, user, token)

    def _refuse(self, flow: http.HTTPFlow, reason: str, reverse: bool) -> None:
        self.rt.metrics.auth_failures += 1
        log.warning("refused %s: %s", flow.client_conn.peername, reason)
        if reverse:
            flow.response = json_response(401, f"lgt-proxy: {reason}", "authentication_error")
        else:
            flow.response = http.Response.make(
                407, f"lgt-proxy: {reason}\n",
                {"Proxy-Authenticate": 'Basic realm="lgt"', "content-type": "text/plain"},
            )

    def http_connect(self, flow: http.HTTPFlow) -> None:
        try:
            identity = self._from_header(flow.request.headers.get("proxy-authorization"))
        except AuthError as e:
            return self._refuse(flow, str(e), reverse=False)
        self.tunnels[flow.client_conn] = identity
        flow.metadata[IDENT] = identity

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        headers = flow.request.headers
        reverse_mode = isinstance(flow.client_conn.proxy_mode, ReverseMode)
        m = REVERSE_PATH.match(flow.request.path)
        in_tunnel = flow.client_conn in self.tunnels
        try:
            if m and (reverse_mode or ("proxy-authorization" not in headers and not in_tunnel)):
                identity = verify(self.rt.secret, m[1], m[2])
                flow.request.path = m[3] or "/"
                flow.metadata[REVERSE] = True
            elif reverse_mode:
                raise AuthError("reverse-mode paths must start with /r/<rollout>/<token>/")
            elif in_tunnel:
                identity = self.tunnels[flow.client_conn]
            else:
                identity = self._from_header(headers.get("proxy-authorization"))
        except AuthError as e:
            return self._refuse(flow, str(e), reverse=bool(m) or reverse_mode)
        headers.pop("proxy-authorization", None)
        flow.metadata[IDENT] = identity
