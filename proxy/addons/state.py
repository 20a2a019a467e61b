"""What the addons pass each other on a flow: the ``flow.metadata`` keys and the per-call object.

mitmproxy runs each hook of each addon in the order ``server.py`` adds them; an LLM call is one
:class:`Call` in ``flow.metadata[CALL]``, each addon filling in its part (the fields are grouped by the
addon that sets them) and reading what the ones before it left.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import http

from .. import dialects, wire
from ..auth import Identity

log = logging.getLogger("lgt.proxy")

IDENT = "lgt.identity"  # the caller's Identity (Identify)
REVERSE = "lgt.reverse"  # True: the call came on a reverse-mode path /r/<rollout>/<token>/… (Identify)
CALL = "lgt.call"  # the LLM call, a Call (Translate on)
ROUTED = "lgt.routed"  # True: sent somewhere of the proxy's choosing, not where the agent aimed (Route)
SECRET_HEADERS = ("authorization", "api-key", "x-api-key", "x-goog-api-key", "proxy-authorization")
NOTE_HEADER = "x-lgt-note"  # a translation note from an in-process transport (wsbridge), never forwarded


@dataclass(eq=False)
class Call:
    """One LLM call, from the moment it is recognised to its row in the store."""

    # Translate: what the agent asked and what the engine is to be asked
    identity: Identity
    endpoint: str  # the engine's endpoint (chat/completions for a translated API)
    api: str | None  # the API the agent called when it is translated (None: the engine's own)
    original_host: str
    body: bytes = b""  # the request as the agent sent it
    request: dict[str, Any] = field(default_factory=dict)  # for the engine, before capture is injected
    agent_request: dict[str, Any] | None = None  # a translated API's request, parsed
    requested_model: str | None = None
    policy: str | None = None  # the policy the call belongs to (policies.py); None: not read yet
    translation: list[str] = field(default_factory=list)  # what translating the request approximated
    rewrite: bool = False  # the body must be sent re-serialised even when capture adds nothing
    refusal: str | None = None  # why the proxy answered the call itself (any addon; Record writes it)
    # Hold: the call passed the gate and is under way
    under_way: bool = False
    call_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    policy_version: int = 0
    started_us: int = 0
    t0: float = 0.0
    releases: list[Callable[[], Any]] = field(default_factory=list)  # undone once, when it ends
    # Route
    upstream: str | None = None
    served_model: str | None = None
    # Capture
    injected: wire.Injected = field(default_factory=wire.Injected)
    capture: wire.Capture = field(init=False)
    capture_reason: str | None = None  # set when the upstream refused what the proxy injected
    translator: Any = None  # a translated API's answers in the agent's API (dialects.translator)
    history: list[dict[str, Any]] | None = None  # Responses: the chat messages behind this answer
    stream: Any = None  # the StreamRewriter of a streamed answer
    first_byte_us: int | None = None
    first_chunk_us: int | None = None
    failure: tuple[str, str] | None = None  # (status, error) of an answer that is not ok
    # Relay (continuation.py, --on-update continue)
    upstream_url: str | None = None  # the engine's URL of a call sent through the relay
    token_versions: list[int] | None = None  # each generated token's policy version, when not all equal
    interrupted: str | None = None  # why a call stopped at an update could not be continued
    # Deadlines (--upstream-timeout)
    deadline: Any = None  # the call's clock (upstream_timeout.Deadline)
    timed_out: str | None = None  # why the upstream exchange was ended
    # Record
    seq: int = -1
    finish: Callable[[], bool] = lambda: True  # records a stream at its end; False if it could not
    recorded: bool = False

    def __post_init__(self) -> None:
        self.capture = wire.Capture(self.endpoint)

    def refuse(self, flow: http.HTTPFlow, status: int, message: str, kind: str = "invalid_request_error",
               headers: dict[str, str] | None = None) -> None:
        """Answer the call here, in its API's error shape; Record puts it on the record as rejected."""
        flow.response = json_response(status, f"lgt-proxy: {message}", kind, headers, api=self.api)
        self.refusal = message

    def release(self) -> None:
        """Undo what the call held (its place in the gate, its clock), once."""
        releases, self.releases = self.releases, []
        for undo in releases:
            undo()


def under_way(flow: http.HTTPFlow) -> Call | None:
    """The flow's LLM call while it is forwarded and not yet recorded."""
    call: Call | None = flow.metadata.get(CALL)
    return call if call is not None and call.under_way and not call.recorded else None


def forwarding(flow: http.HTTPFlow) -> Call | None:
    """In a ``request`` hook: the call the gate let through that no addon has answered."""
    return under_way(flow) if flow.response is None else None


@contextlib.contextmanager
def or_refuse(flow: http.HTTPFlow, call: Call) -> Iterator[None]:
    """A step that readies a call under way: if it fails the call is not forwarded (500, recorded as
    rejected) and what it holds is released; nothing half-ready reaches the upstream."""
    try:
        yield
    except BaseException as e:
        call.release()
        if not isinstance(e, Exception):
            raise
        log.exception("a call of rollout %s could not be forwarded", call.identity.name)
        call.refuse(flow, 500, f"could not forward this call: {e}", kind="server_error")


def agent_gone(flow: http.HTTPFlow) -> bool:
    """The agent has closed the connection this call came on: nobody will read its answer."""
    return flow.client_conn.timestamp_end is not None


def json_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None,
                  api: str | None = None) -> http.Response:
    """The proxy's own error answer, in the shape of the API the agent called (OpenAI's otherwise)."""
    if api in dialects.APIS and api != dialects.RESPONSES:  # Responses errors are OpenAI's, as below
        body = wire.dumps(dialects.error_body(api, status, message))
    else:
        body = wire.dumps({"error": {"message": message, "type": kind, "code": status}})
    return http.Response.make(status, body, {"content-type": "application/json", **(headers or {})})


def error_text(content: bytes | None, limit: int = 2000) -> str:
    """The message of an upstream's error body (its ``error.message`` when it has one)."""
    if not content:
        return ""
    try:
        obj = wire.loads(content)
        if isinstance(obj, dict):
            err = obj.get("error", obj)
            msg = err.get("message") if isinstance(err, dict) else err
            if msg:
                return str(msg)[:limit]
    except ValueError:
        pass
    return content[:limit].decode("utf-8", "replace")


def now_us() -> int:
    return time.time_ns() // 1000
