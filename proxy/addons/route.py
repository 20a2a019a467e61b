"""The Substitute and Route addons: what the engine is asked, and where."""

from __future__ import annotations

from urllib.parse import urlsplit

from mitmproxy import http

from .. import dialects, resources
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
        subs = self.rt.resources.get(call.identity.rollout_id, call.identity.attempt) if call else None
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
    reverse-mode path everything else goes to the upstream too. Without one (observe-only), calls go
    where the agent sent them. Routed flows are marked ``flow.metadata[ROUTED]``."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.upstream = urlsplit(rt.upstream) if rt.upstream else None

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
            self.rt.saw_model(call.requested_model)
            if self.upstream is not None:  # Gemini's ?alt=sse&key=… is not the engine's
                self.route(flow, f"{self.upstream.path.rstrip('/')}/{call.endpoint}",
                           keep_query=call.api != dialects.GEMINI)
                call.upstream, call.served_model = self.rt.upstream, self.rt.served_model

    def _reverse(self, flow: http.HTTPFlow) -> None:
        if self.upstream is None:
            self.rt.metrics.bad_requests += 1
            flow.response = json_response(502, "lgt-proxy: reverse-mode paths need the proxy's --upstream",
                                          "invalid_request_error")
            return
        self.route(flow, flow.request.path.partition("?")[0])

    def route(self, flow: http.HTTPFlow, path: str, keep_query: bool = True) -> None:
        assert self.upstream is not None
        up = self.upstream
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
