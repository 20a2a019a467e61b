"""The upstream timeout (``--upstream-timeout``): an LLM call whose upstream stays silent too long.

The clock runs from the moment the call is sent upstream and restarts with every piece of the answer
that arrives, so a long stream that keeps moving is never cut; only silence is. When it runs out:

- no answer has begun: the agent gets 504 in its API's error shape;
- a stream has begun: it ends with an error event the agent's SDK raises (``{"error": …}`` for
  chat/completions, ``response.failed`` for Responses, ``error`` for Messages);
and the call is recorded as ``upstream_timeout``.

mitmproxy cannot kill a flow in transit (a killed flow stops only at its next hook), so the proxy
ends the exchange the way the upstream's own bytes would: it hands the server side of the
connection a 504 answer, or the last chunk of a chunked body, as if they had come off the wire, and
then closes that connection so nothing late from the real upstream is read as the next answer.
Where neither fits (an HTTP/2 upstream, a body that is not chunked) the connection is only closed:
mitmproxy then answers 502, or the stream is cut.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from mitmproxy import ctx, http
from mitmproxy.proxy import events

from . import wire

log = logging.getLogger("lgt.proxy")

_tasks: set[asyncio.Task[Any]] = set()  # injections in progress (asyncio keeps weak references)


def answer_504(message: str) -> bytes:
    """A whole HTTP/1.1 answer, as the upstream would send it, that closes its connection."""
    body = wire.dumps({"error": {"message": message, "type": "upstream_timeout", "param": None,
                                 "code": 504}})
    head = (f"HTTP/1.1 504 Gateway Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class Deadline:
    """One call's clock: ``touch()`` on every piece of the answer, ``cancel()`` once recorded;
    ``expire(flow)`` runs when the upstream has been silent for ``seconds``."""

    __slots__ = ("seconds", "last", "handle", "expire")

    def __init__(self, seconds: float, expire: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        self.seconds, self.expire = seconds, expire
        self.last = loop.time()
        self.handle: asyncio.TimerHandle | None = loop.call_later(seconds, self._check)

    def touch(self) -> None:
        self.last = asyncio.get_running_loop().time()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        left = self.last + self.seconds - loop.time()
        if left > 0:  # something arrived since: wait out the rest of the silence
            self.handle = loop.call_later(left, self._check)
            return
        self.handle = None
        self.expire()


def end_exchange(flow: http.HTTPFlow, message: str) -> None:
    """End ``flow``'s upstream exchange now (see the module docstring)."""
    handler = ctx.master.addons.get("proxyserver").connections.get(flow.client_conn.id)
    server = flow.server_conn
    if handler is None or server not in handler.transports:
        log.warning("upstream timeout: the connection to %s is not open; the call ends when it fails",
                    flow.request.host)
        return
    data = b""
    if server.alpn != b"h2":
        if flow.response is None:
            data = answer_504(message)
        elif "chunked" in flow.response.headers.get("transfer-encoding", "").lower() \
                and flow.response.stream:
            data = b"0\r\n\r\n"  # the end of a chunked body

    async def inject() -> None:
        if data:
            await handler.server_event(events.DataReceived(server, data))
        if server in handler.transports and handler.transports[server].handler is not None:
            handler.close_connection(server)

    task = asyncio.ensure_future(inject())
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
