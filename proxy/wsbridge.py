"""The OpenAI Responses API over WebSocket (Codex's default transport), captured like HTTP.

Codex opens ``wss://api.openai.com/v1/responses`` (``openai-beta: responses_websockets=…``) and sends
every call of a session as a ``response.create`` text message on that one socket; each is answered
with the events an SSE stream's ``data:`` lines carry, as text messages. Rather than speak this inside
mitmproxy, the proxy hands the socket to a small bridge in the same process:

- :class:`ResponsesSocket`, a mitmproxy addon, points an authenticated rollout's WebSocket upgrade of
  ``…/responses`` at the bridge (a loopback aiohttp server); mitmproxy then relays the socket between
  the agent and the bridge as it relays any WebSocket.
- :class:`Bridge` answers the upgrade and turns each ``response.create`` into ``POST /r/<identity>/
  <token>/v1/responses`` with ``stream: true`` on the proxy's own port (reverse mode), so the pause
  gate, the translation, the token capture and the record are exactly those of an HTTP call (a row
  with ``api`` 'responses', noted "received over WebSocket"); each SSE event's data goes back as one
  text message, with the ``stream_id`` the message gave.

What only the WebSocket mode has:

- ``generate: false`` (Codex's prewarm, sent first): answered at once with a completed response with
  no output and its id, without the engine and without a row — nothing was generated; its input is
  kept on the socket and sent with the call that continues from it (``previous_response_id`` = the
  prewarm's id), so that call's recorded request holds everything the policy saw (noted).
- ``stream_id`` lanes: messages of one lane are answered in order, lanes side by side.
- ``response.processed`` (an acknowledgement) needs no answer; ``response.steer`` gets
  ``response.steer.failed`` with ``steering_not_supported``, which the API allows for any model.
- An error — the proxy's refusal, the engine's, a message that is not JSON — is an ``error`` event
  with its HTTP ``status``, the shape Codex reads (400 ends its turn; 429 and 5xx are retried).
- A socket closed mid-answer ends the bridge's request: the proxy records the call as
  ``client_disconnect``, as for an agent that closes an HTTP connection.

Without an upstream (observe-only) upgrades pass to the host the agent aimed at, unchanged, and each
``response.create`` on them is recorded as a hosted model's call (:class:`HostedSocket`), at the
terminal event of its answer — before that event passes on to the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web
from mitmproxy import http
from multidict import CIMultiDict

from lgt.store.schema import STATUS_CLIENT_DISCONNECT, STATUS_HTTP_ERROR, STATUS_OK

from . import dialects, wire
from .addons import IDENT, NOTE_HEADER, ROUTED, SECRET_HEADERS, Call, Record, Runtime
from .addons.capture import HOSTED, HostedStream
from .addons.route import origin
from .addons.state import now_us
from .auth import AuthError, Identity, rollout_token, verify

log = logging.getLogger("lgt.proxy")

SOCKET = "lgt.responses_socket"  # flow metadata: this upgrade was handed to the bridge
HOST = "lgt.socket_host"  # flow metadata: the host the agent aimed its upgrade at
OBSERVED = "lgt.hosted_socket"  # flow metadata: an observe-only socket's HostedSocket
PREWARMS_KEPT = 64  # prewarm responses remembered per socket
WS_NOTE = "received over the Responses API's WebSocket; its events sent back as WebSocket messages"
TERMINAL = (b'"response.completed"', b'"response.failed"', b'"response.incomplete"')


def is_responses_upgrade(method: str, path: str, headers: Any) -> bool:
    """A WebSocket upgrade of the Responses API (``GET …/responses``), whatever the host or prefix."""
    return (method.upper() == "GET" and headers.get("upgrade", "").lower() == "websocket"
            and path.partition("?")[0].rstrip("/").endswith("/responses"))


def error_event(status: int, message: str, kind: str | None = None, code: str | None = None,
                headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The Responses WebSocket ``error`` event for an HTTP status (Codex reads ``status``)."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    event: dict[str, Any] = {"type": "error", "status": status,
                             "error": {"type": kind, "code": code, "message": message, "param": None}}
    if headers:
        event["headers"] = headers
    return event


def http_error_event(status: int, body: bytes, headers: Any) -> dict[str, Any]:
    """The ``error`` event for the proxy's non-stream answer to a bridged call (its refusal, or the
    engine's error), keeping its message, type and ``Retry-After``."""
    try:
        obj = wire.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        obj = None
    err = obj.get("error") if isinstance(obj, dict) else None
    err = err if isinstance(err, dict) else {"message": err if isinstance(err, str) else
                                             body[:500].decode("utf-8", "replace")}
    code = err.get("code")
    retry = headers.get("retry-after") if headers is not None else None
    return error_event(status, str(err.get("message") or f"HTTP {status}"),
                       err.get("type") if isinstance(err.get("type"), str) else None,
                       code if isinstance(code, str) else None, {"retry-after": retry} if retry else None)


def fold_prewarm(body: dict[str, Any], prewarm: dict[str, Any]) -> dict[str, Any]:
    """A call continuing from a prewarm (``generate: false``) response: the prewarm's input before its
    own, and the prewarm's own ``previous_response_id`` (usually none) in place of the prewarm's id."""
    def items(v: Any) -> list[Any]:
        if isinstance(v, str):
            return [{"role": "user", "content": v}]
        return list(v) if isinstance(v, list) else []

    out = {**body, "input": [*items(prewarm.get("input")), *items(body.get("input"))]}
    if prewarm.get("previous_response_id") is not None:
        out["previous_response_id"] = prewarm["previous_response_id"]
    else:
        out.pop("previous_response_id", None)
    return out


def prewarm_events(body: dict[str, Any]) -> tuple[str, list[bytes]]:
    """(response id, the events) answering a ``generate: false`` request: created, in progress and
    completed, with no output and no usage — nothing is generated."""
    tr = dialects.Translator(dialects.RESPONSES, body, model=body.get("model"))
    sse = tr.finish(wire.Capture(wire.CHAT))
    return tr.response_id, [d for e in wire.SSEFramer().feed(sse) if (d := wire.event_data(e)) is not None]


class ResponsesSocket:
    """mitmproxy addon: an authenticated rollout's WebSocket upgrade of ``…/responses`` goes to the
    bridge (added after :class:`~lgt.proxy.addons.Route`, whose reverse-mode routing it overrides,
    and before ``Egress``, which leaves routed flows alone). Observe-only proxies let upgrades go
    where the agent aimed and read each call on them (:class:`HostedSocket`)."""

    def __init__(self, rt: Runtime, bridge_port: int) -> None:
        self.rt, self.port = rt, bridge_port
        self.record = Record(rt)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if is_responses_upgrade(flow.request.method, flow.request.path, flow.request.headers):
            flow.metadata[HOST] = flow.request.pretty_host  # before Route's reverse-mode routing

    def request(self, flow: http.HTTPFlow) -> None:
        identity: Identity | None = flow.metadata.get(IDENT)
        req = flow.request
        if flow.response is not None or identity is None:
            return
        if not is_responses_upgrade(req.method, req.path, req.headers):
            return
        if self.rt.upstream is None:  # observe-only: to the hosted API as sent, its calls read
            flow.metadata[OBSERVED] = HostedSocket(self.rt, self.record, identity, req.pretty_host,
                                                   origin(flow))
            return
        host = flow.metadata.get(HOST) or req.pretty_host
        req.scheme, req.host, req.port = "http", "127.0.0.1", self.port
        req.path = f"/r/{identity.name}/{rollout_token(self.rt.secret, identity)}/v1/responses"
        req.host_header = host  # the bridge records the host the agent aimed at
        for h in SECRET_HEADERS:
            req.headers.pop(h, None)
        flow.metadata[ROUTED] = True
        flow.metadata[SOCKET] = True

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        if flow.websocket is None:
            return
        if (observed := flow.metadata.get(OBSERVED)) is not None:
            message = flow.websocket.messages[-1]
            observed.message(message.from_client, message.content)
        if flow.metadata.get(SOCKET) or observed is not None:
            del flow.websocket.messages[:-1]  # relayed, not kept: every call is on the record already

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        if (observed := flow.metadata.get(OBSERVED)) is not None:
            observed.close()


class HostedSocket:
    """An observe-only rollout's Responses WebSocket to the hosted API, read as it passes: each
    ``response.create`` (a prewarm, ``generate: false``, aside: nothing is generated) is a call of a
    hosted model whose answer is the events that follow, recorded at ``response.completed`` /
    ``.failed`` / ``.incomplete`` (or an ``error`` event, with its ``status``) as an HTTP call's
    stream would be: ``request_json`` the message as sent, ``response_json`` the completed response.
    Calls are answered in the order they were sent; one still open when the socket closes is
    recorded as ``client_disconnect`` with what had come. Not held by a pause: the socket is the
    provider's, not the proxy's to hold."""

    def __init__(self, rt: Runtime, record: Record, identity: Identity, host: str, where: str) -> None:
        self.rt, self.record, self.identity, self.host, self.where = rt, record, identity, host, where
        self.pending: list[Call] = []

    def message(self, from_client: bool, content: bytes) -> None:
        try:
            obj = wire.loads(content)
        except (ValueError, UnicodeDecodeError):
            return
        if not isinstance(obj, dict):
            return
        if from_client:
            if obj.get("type") == "response.create" and obj.get("generate") is not False:
                self.pending.append(self._call(obj, content))
            return
        if not self.pending:
            return
        call = self.pending[0]
        if call.first_byte_us is None:
            call.first_byte_us = now_us()
        stream: HostedStream = call.stream
        stream.assembler.feed(obj)
        if obj.get("type") == "error":
            self.pending.pop(0)
            status = obj.get("status") if isinstance(obj.get("status"), int) else None
            err = obj.get("error") if isinstance(obj.get("error"), dict) else {}
            self.record.record(call, STATUS_HTTP_ERROR, status, str(err.get("message") or obj)[:2000],
                               response_json=None)
        elif stream.assembler.done:
            self.pending.pop(0)
            stream.saw_done = True
            self.record.record(call, STATUS_OK, 200, None,
                               response_json=wire.dumps(stream.assembler.body()).decode())

    def _call(self, obj: dict[str, Any], content: bytes) -> Call:
        call = Call(self.identity, wire.CHAT, dialects.RESPONSES, self.host, body=content)
        model = obj.get("model")
        call.requested_model = model if isinstance(model, str) else None
        call.request = call.agent_request = obj
        call.capture_reason = HOSTED
        call.translation = [WS_NOTE]
        call.upstream = self.where
        call.under_way = True
        call.started_us = now_us()
        call.policy_version = self.rt.gate.policy_version
        call.seq = self.rt.next_seq(self.identity)
        call.stream = HostedStream(call, dialects.RESPONSES, sse=True, encoding="")
        return call

    def close(self) -> None:
        pending, self.pending = self.pending, []
        for call in pending:
            body = call.stream.assembler.body()
            self.record.record(call, STATUS_CLIENT_DISCONNECT, None,
                               "the socket closed before the answer was complete",
                               response_json=wire.dumps(body).decode() if body else None)


class Bridge:
    """The loopback server the upgrades are pointed at; one :class:`_Session` per socket."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None

    async def start(self, host: str = "127.0.0.1") -> int:
        app = web.Application()
        app.router.add_get("/r/{identity}/{token}/{tail:.*}", self._socket)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_read=None), trust_env=False,
            auto_decompress=True)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()

    def proxy_url(self, identity: Identity) -> str:
        """Where a bridged call is posted: the proxy's own port, reverse mode."""
        host, port = self.rt.listen or ("127.0.0.1", 8080)
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        host = f"[{host}]" if ":" in host else host
        token = rollout_token(self.rt.secret, identity)
        return f"http://{host}:{port}/r/{identity.name}/{token}/v1/responses"

    async def _socket(self, request: web.Request) -> web.StreamResponse:
        try:
            identity = verify(self.rt.secret, request.match_info["identity"], request.match_info["token"])
        except AuthError as e:
            error = {"message": f"lgt-proxy: {e}", "type": "authentication_error"}
            return web.json_response({"error": error}, status=401)
        ws = web.WebSocketResponse(compress=False, max_msg_size=self.rt.max_body_bytes)
        await ws.prepare(request)
        assert self._client is not None
        session = _Session(self, ws, identity, request.host, request.headers.get("user-agent"))
        try:
            await session.run()
        except Exception:  # a bug here ends this socket, never the proxy
            log.exception("the Responses WebSocket of rollout %s failed", identity.name)
        return ws


class _Session:
    """One agent socket: lanes of ``response.create`` messages, each answered in order."""

    def __init__(self, bridge: Bridge, ws: web.WebSocketResponse, identity: Identity, host: str,
                 user_agent: str | None) -> None:
        self.bridge, self.ws, self.identity = bridge, ws, identity
        self.host, self.user_agent = host, user_agent
        self.lanes: dict[Any, asyncio.Queue[dict[str, Any]]] = {}
        self.workers: dict[Any, asyncio.Task[None]] = {}
        self.prewarms: dict[str, dict[str, Any]] = {}
        self.sending = asyncio.Lock()

    async def run(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type == WSMsgType.TEXT:
                    await self._take(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await self._send(error_event(400, "lgt-proxy: the Responses WebSocket takes JSON text "
                                                      "messages, not binary ones"))
        finally:  # the agent has gone: calls under way are ended (recorded as client_disconnect)
            for task in self.workers.values():
                task.cancel()
            await asyncio.gather(*self.workers.values(), return_exceptions=True)

    async def _send(self, event: dict[str, Any] | bytes, stream_id: Any = None) -> None:
        if isinstance(event, dict):
            if stream_id is not None:
                event = {**event, "stream_id": stream_id}
            data = wire.dumps(event)
        elif stream_id is not None:
            obj = wire.loads(event)
            data = wire.dumps({**obj, "stream_id": stream_id}) if isinstance(obj, dict) else event
        else:
            data = event
        async with self.sending:
            await self.ws.send_str(data.decode())

    async def _take(self, text: str) -> None:
        try:
            msg = wire.loads(text)
        except ValueError:
            msg = None
        if not isinstance(msg, dict):
            return await self._send(error_event(400, "lgt-proxy: a Responses WebSocket message must be a "
                                                     "JSON object"))
        kind, stream_id = msg.get("type"), msg.get("stream_id")
        if kind == "response.create":
            lane = stream_id if isinstance(stream_id, (str, int)) else None
            if lane not in self.lanes:
                self.lanes[lane] = asyncio.Queue()
                self.workers[lane] = asyncio.create_task(self._lane(self.lanes[lane]))
            self.lanes[lane].put_nowait(msg)
        elif kind == "response.processed":
            return  # the agent's acknowledgement: nothing to answer
        elif kind == "response.steer":
            await self._send({"type": "response.steer.failed", "sequence_number": 0,
                              "error": {"type": "invalid_request_error", "code": "steering_not_supported",
                                        "message": "lgt-proxy: steering is not supported"},
                              "steer": {k: msg.get(k) for k in ("input", "previous_response_id")}})
        else:
            await self._send(error_event(400, f"lgt-proxy: unknown Responses WebSocket event type {kind!r}",
                                         code="unknown_event_type"), stream_id)

    async def _lane(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        while True:
            msg = await queue.get()
            try:
                await self._create(msg)
            except (asyncio.CancelledError, ConnectionResetError):
                raise
            except Exception as e:  # one call's failure is its own error event; the socket goes on
                log.exception("a Responses WebSocket call of rollout %s failed", self.identity.name)
                with contextlib.suppress(Exception):
                    await self._send(error_event(502, f"lgt-proxy: {e}"), msg.get("stream_id"))

    async def _create(self, msg: dict[str, Any]) -> None:
        stream_id = msg.get("stream_id")
        body = {k: v for k, v in msg.items() if k not in ("type", "stream_id", "generate")}
        if msg.get("generate") is False:
            response_id, events = prewarm_events(body)
            self.prewarms[response_id] = body
            while len(self.prewarms) > PREWARMS_KEPT:
                self.prewarms.pop(next(iter(self.prewarms)))
            for data in events:
                await self._send(data, stream_id)
            return
        notes = [WS_NOTE]
        prev = body.get("previous_response_id")
        if isinstance(prev, str) and prev in self.prewarms:
            prewarm = self.prewarms[prev]
            body = fold_prewarm(body, prewarm)
            if prewarm.get("input"):
                    notes.append(f"the input of prewarm response {prev} (generate: false, answered without "
                             "the engine) sent with this call's own")
        body["stream"] = True
        headers = CIMultiDict({"content-type": "application/json", "accept": "text/event-stream",
                               "host": self.host})
        if self.user_agent:
            headers["user-agent"] = self.user_agent
        for note in notes:
            headers.add(NOTE_HEADER, note)
        client = self.bridge._client
        assert client is not None
        try:
            resp = await client.post(self.bridge.proxy_url(self.identity), data=wire.dumps(body),
                                     headers=headers)
        except aiohttp.ClientError as e:
            return await self._send(error_event(502, f"lgt-proxy: the proxy could not be reached ({e})"),
                                    stream_id)
        try:
            await self._relay(resp, stream_id)
        except BaseException:
            resp.close()  # never pooled half-read: the proxy sees its agent go
            raise
        resp.release()

    async def _relay(self, resp: aiohttp.ClientResponse, stream_id: Any) -> None:
        if resp.status != 200 or resp.content_type != "text/event-stream":
            body = await resp.read()
            status = resp.status if resp.status != 200 else 502
            return await self._send(http_error_event(status, body, resp.headers), stream_id)
        framer, ended = wire.SSEFramer(), False
        async for chunk in resp.content.iter_any():
            for event in framer.feed(chunk):
                data = wire.event_data(event)
                if data is None or data.strip() == b"[DONE]":
                    continue
                ended = ended or any(t in data[:80] for t in TERMINAL)
                await self._send(data, stream_id)
        if not ended:  # the answer stopped short (the proxy or the engine went away)
            await self._send(error_event(502, "lgt-proxy: the answer ended before it was complete"),
                             stream_id)
