"""The Rewards addon: a rollout reports its own reward through the proxy."""

from __future__ import annotations

import logging

from mitmproxy import http

from .. import wire
from .runtime import Runtime
from .state import IDENT, REVERSE, json_response

log = logging.getLogger("lgt.proxy")
REWARD_HOST = "lgt.invalid"  # agents report rewards to http://lgt.invalid/reward through the proxy


class Rewards:
    """``POST http://lgt.invalid/reward {"value": 1.0}`` through the proxy (or ``POST /r/<id>/<token>/
    reward`` in reverse mode): the authenticated rollout reports its own reward, recorded durably
    before the 200. Nothing is forwarded anywhere."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def request(self, flow: http.HTTPFlow) -> None:
        identity = flow.metadata.get(IDENT)
        if flow.response is not None or identity is None:
            return
        path = flow.request.path.partition("?")[0].rstrip("/")
        ours = (flow.request.pretty_host == REWARD_HOST
                or (flow.metadata.get(REVERSE) and path in ("/reward", "/v1/reward")))
        if not ours:
            return
        if flow.request.method != "POST" or not path.endswith("/reward"):
            flow.response = json_response(404, "lgt-proxy: POST /reward {\"value\": 1.0} is the "
                                                "only endpoint here", "invalid_request_error")
            return
        try:
            body = wire.loads(flow.request.raw_content or b"")
        except ValueError:
            body = None
        try:
            result = self.rt.add_reward(identity, body, "proxy")
        except ValueError as e:
            flow.response = json_response(400, f"lgt-proxy: {e}", "invalid_request_error")
            return
        except Exception:
            log.exception("could not record a reward for %s", identity.name)
            flow.response = json_response(503, "lgt-proxy: the reward could not be recorded",
                                           "server_error")
            return
        flow.response = http.Response.make(200, wire.dumps(result),
                                           {"content-type": "application/json"})
