"""The Hold addon: the pause gate in front of every LLM call, and the store's state as a second gate."""

from __future__ import annotations

import time
from typing import Any

from mitmproxy import ctx, http

from ..gate import Rejected
from .runtime import Runtime
from .state import CALL, Call, json_response, now_us


class Hold:
    """An LLM call waits here while the proxy is paused (``POST /pause``; in reject mode it gets 429 +
    Retry-After instead) and goes on under the policy version of the resume; it is then *under way*:
    counted in flight until it is recorded, listed in ``GET /state``. While the store cannot be written,
    calls get 503 + Retry-After (never an answer the store could not keep; nor a row)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.retry_after = 5

    def load(self, loader: Any) -> None:
        loader.add_option("lgt_retry_after", int, 5,
                          "Seconds of Retry-After on a call refused while paused or while the store is full.")

    def configure(self, updated: set[str]) -> None:
        if "lgt_retry_after" in updated:
            self.retry_after = ctx.options.lgt_retry_after

    async def request(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(CALL)
        if call is None or flow.response is not None:
            return
        rt, retry = self.rt, {"Retry-After": str(self.retry_after)}
        if not rt.store_writable():  # never answer a call that could not be recorded (nor this one)
            rt.metrics.rejected += 1
            flow.response = json_response(503, f"lgt-proxy: {rt.store_error}; no LLM call is taken until it "
                                               "can be", "server_error", retry, api=call.api)
            return
        try:
            version = await rt.gate.enter()
        except Rejected:
            rt.metrics.rejected += 1
            return call.refuse(flow, 429, "the policy is being updated; retry shortly", "rate_limit_error",
                               retry)
        call.under_way, call.policy_version = True, version
        call.started_us, call.t0 = now_us(), time.monotonic()
        rt.live[call.call_id] = (call, flow)
        call.releases += [rt.gate.exit, lambda: rt.live.pop(call.call_id, None)]
