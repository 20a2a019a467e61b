"""The Substitute and Route addons: what the engine is asked, and where (a host's address too)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import ctx, http
from mitmproxy.exceptions import OptionsError

from .. import dialects, resources
from .capture import is_hosted
from .runtime import Runtime
from .state import CALL, IDENT, REVERSE, ROUTED, SECRET_HEADERS, forwarding, json_response, or_refuse


class Substitute:
    """A call under way from a rollout attempt the trainer delivered a prompt to (``POST /resources``;
    see ``resources.py``) asks the engine with that prompt in place of the agent's. The record keeps
    the agent's request as sent; a span no request holds is counted, never guessed at."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def request(self, flow: http.HTTPFlow) -> None:
        call = forwarding(flow)
        if call is None or is_hosted(call):  # a hosted model is asked what the agent asked
            return
        subs = self.rt.resources.get(call.identity.rollout_id, call.identity.attempt)
        if not subs:
            return
        with or_refuse(flow, call):
            sent, misses = resources.apply(call.request, subs)
            self.rt.resources.misses += misses
            call.rewrite = call.rewrite or sent != call.request
            call.request = sent


class Route:
    """With an upstream, a call under way goes to ``<upstream>/<endpoint>`` whatever host the agent
    aimed at, the agent's keys replaced by the upstream's (``--upstream-api-key``, or none); on a
    reverse-mode path everything else goes to the upstream too. Without one (observe-only), and for a
    hosted model's call, calls go where the agent sent them, with its own keys (``call.upstream`` says
    the origin). Routed flows are marked ``flow.metadata[ROUTED]``.

    ``--resolve HOST:PORT=ADDR:PORT`` (``lgt_resolve``), as curl's: a connection the proxy opens to
    HOST:PORT goes to ADDR:PORT instead, the TLS name (SNI, the certificate checked) still HOST — for
    private gateways, and for tests that stand a provider in on loopback."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.upstream = urlsplit(rt.upstream) if rt.upstream else None
        self.resolve: dict[tuple[str, int], tuple[str, int]] = {}

    def load(self, loader: Any) -> None:
        loader.add_option("lgt_resolve", Sequence[str], [],
                          "HOST:PORT=ADDR:PORT: connections to HOST:PORT are made to ADDR:PORT instead.")

    def configure(self, updated: set[str]) -> None:
        if "lgt_resolve" in updated:
            try:
                self.resolve = parse_resolve(ctx.options.lgt_resolve)
            except ValueError as e:
                raise OptionsError(str(e)) from None

    def server_connect(self, data: Any) -> None:
        """Every connection the proxy opens (LLM calls, other traffic, WebSockets): ``--resolve``."""
        address = data.server.address
        if address is not None and (to := self.resolve.get((str(address[0]).lower(), address[1]))):
            data.server.address = to

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or IDENT not in flow.metadata:
            return
        if CALL not in flow.metadata:
            if flow.metadata.get(REVERSE):  # base_url= agents: everything else goes upstream too
                self._reverse(flow)
            return
        call = forwarding(flow)
        if call is None:
            return
        with or_refuse(flow, call):
            if is_hosted(call):
                call.upstream = origin(flow)
                return
            self.rt.saw_model(call.requested_model)
            if self.upstream is not None:  # Gemini's ?alt=sse&key=… is not the engine's
                policy = call.policy or self.rt.policies.default
                own = self.rt.policies.upstream_of(policy)  # a policy served by another engine
                up = urlsplit(own) if own else self.upstream
                self.route(flow, f"{up.path.rstrip('/')}/{call.endpoint}",
                           keep_query=call.api != dialects.GEMINI, up=up)
                call.upstream = own or self.rt.upstream
                call.served_model = self.rt.policies.served_as(policy, self.rt.served_model)

    def _reverse(self, flow: http.HTTPFlow) -> None:
        if self.upstream is None:
            self.rt.metrics.bad_requests += 1
            flow.response = json_response(502, "lgt-proxy: reverse-mode paths need the proxy's --upstream",
                                          "invalid_request_error")
            return
        self.route(flow, flow.request.path.partition("?")[0])

    def route(self, flow: http.HTTPFlow, path: str, keep_query: bool = True, up: Any = None) -> None:
        up = up or self.upstream
        assert up is not None
        query = flow.request.path.partition("?")[2] if keep_query else ""
        flow.request.scheme = up.scheme
        flow.request.host = up.hostname or "127.0.0.1"
        flow.request.port = up.port or (443 if up.scheme == "https" else 80)
        flow.request.path = path + (f"?{query}" if query else "")
        flow.request.host_header = up.netloc
        for h in SECRET_HEADERS:
            flow.request.headers.pop(h, None)
        if self.rt.upstream_api_key:
            flow.request.headers["authorization"] = f"Bearer {self.rt.upstream_api_key}"
        flow.metadata[ROUTED] = True


def origin(flow: http.HTTPFlow) -> str:
    """``scheme://host[:port]`` of where the agent sent a request (the port when not the scheme's own)."""
    req = flow.request
    default = 443 if req.scheme == "https" else 80
    return f"{req.scheme}://{req.pretty_host}" + ("" if req.port == default else f":{req.port}")


def parse_resolve(entries: list[str]) -> dict[tuple[str, int], tuple[str, int]]:
    """``--resolve HOST:PORT=ADDR:PORT`` entries as {(host, port): (addr, port)}; ValueError names the
    first one that is not of that form."""
    out: dict[tuple[str, int], tuple[str, int]] = {}
    for entry in entries:
        name, _, target = entry.partition("=")
        host, _, port = name.rpartition(":")
        addr, _, to_port = target.rpartition(":")
        if not (host and addr and port.isdigit() and to_port.isdigit()):
            raise ValueError(f"--resolve {entry!r} is not HOST:PORT=ADDR:PORT (e.g. "
                             "api.anthropic.com:443=10.0.0.5:8443)")
        out[(host.lower().strip("[]"), int(port))] = (addr.strip("[]"), int(to_port))
    return out
