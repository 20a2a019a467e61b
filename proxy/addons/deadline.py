"""The Deadlines addon: ``--upstream-timeout``, an LLM call whose upstream stays silent too long."""

from __future__ import annotations

import logging
from typing import Any

from mitmproxy import ctx, exceptions, http

from .. import upstream_timeout
from .state import Call, forwarding, or_refuse, under_way

log = logging.getLogger("lgt.proxy")


class Deadlines:
    """Each call under way gets a clock (``upstream_timeout.Deadline``) when it is sent upstream,
    restarted by every piece of the answer (its headers here, each stream read in Capture's stream) and
    stopped once the whole answer is in or the call is recorded. When it runs out the exchange is ended
    (see ``upstream_timeout.py``) and the call is marked ``timed_out``: Record writes it as
    ``upstream_timeout``."""

    def __init__(self) -> None:
        self.seconds: float | None = None

    def load(self, loader: Any) -> None:
        loader.add_option("lgt_upstream_timeout", float | None, None,
                          "Seconds an LLM call's upstream may stay silent before the call is ended.")

    def configure(self, updated: set[str]) -> None:
        if "lgt_upstream_timeout" in updated:
            seconds = ctx.options.lgt_upstream_timeout
            if seconds is not None and not seconds > 0:
                raise exceptions.OptionsError(f"lgt_upstream_timeout must be a positive number of seconds, "
                                              f"not {seconds}")
            self.seconds = seconds

    def request(self, flow: http.HTTPFlow) -> None:
        call = forwarding(flow)
        if call is None or not self.seconds:
            return
        seconds = self.seconds
        with or_refuse(flow, call):
            call.deadline = upstream_timeout.Deadline(seconds, lambda: self._expire(flow, call, seconds))
            call.releases.append(call.deadline.cancel)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call = under_way(flow)
        if call is not None and call.deadline is not None:
            call.deadline.touch()

    def response(self, flow: http.HTTPFlow) -> None:
        call = under_way(flow)
        if call is not None and call.deadline is not None:  # the whole answer is in
            call.deadline.cancel()

    @staticmethod
    def _expire(flow: http.HTTPFlow, call: Call, seconds: float) -> None:
        if call.recorded or call.timed_out:
            return
        call.timed_out = f"the upstream sent nothing for {seconds:g} s (--upstream-timeout)"
        log.warning("call %s of rollout %s: %s; ended", call.call_id, call.identity.name, call.timed_out)
        upstream_timeout.end_exchange(flow, f"lgt-proxy: {call.timed_out}")
