"""lgt's mitmproxy addons. One concern each, sharing a :class:`Runtime`:

- :class:`Identify` — who is calling: proxy credentials (on the CONNECT for HTTPS, on each request
  for plain HTTP) or the reverse-mode path prefix ``/r/<rollout>/<token>``; anything else gets 407/401
  and is never forwarded.
- :class:`Rewards` — ``POST http://lgt.invalid/reward``: a rollout reports its own reward.
- :class:`Record` — LLM calls: recognise, hold while paused, route to the upstream with the served
  model, inject token capture, strip it from what the agent gets (whole bodies and each SSE event),
  and append one record per call to the store before the agent receives the end of the response.
- :class:`Egress` — everything else: allow, an allowlist of hosts, or deny.
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import http
from mitmproxy.proxy.mode_specs import ReverseMode

from lgt.store.schema import (
    STATUS_CLIENT_DISCONNECT,
    STATUS_HTTP_ERROR,
    STATUS_OK,
    STATUS_STREAM_ERROR,
    STATUS_UPSTREAM_ERROR,
)
from lgt.store.writer import TableWriter

from . import wire
from .auth import AuthError, Identity, parse_basic, verify
from .gate import Gate, Metrics, Rejected

log = logging.getLogger("lgt.proxy")

IDENT = "lgt.identity"
REVERSE = "lgt.reverse"
CALL = "lgt.call"
ROUTED = "lgt.routed"
REVERSE_PATH = re.compile(r"^/r/([^/?]+)/([^/?]+)(.*)$")
SECRET_HEADERS = ("authorization", "api-key", "x-api-key", "proxy-authorization")


@dataclass
class Runtime:
    """What the addons and the control API share; built once by ``server.py``."""

    secret: bytes
    writer: TableWriter
    gate: Gate
    rewards: TableWriter | None = None
    metrics: Metrics = field(default_factory=Metrics)
    upstream: str | None = None  # base URL, e.g. http://127.0.0.1:8000/v1
    served_model: str | None = None
    upstream_api_key: str | None = None
    capture_tokens: bool = False
    egress: str = "allow"  # allow | allowlist | deny
    allow_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 32 << 20
    retry_after_s: int = 5
    seqs: dict[tuple[str, int], int] = field(default_factory=dict)
    # the latest whole-rollout reward per (rollout, attempt) recorded since start, for GET /rewards
    recent_rewards: dict[tuple[str, int], float] = field(default_factory=dict)

    def add_reward(self, identity: Identity, body: Any, source: str) -> dict[str, Any]:
        """Validate and durably record one reward; ValueError (one sentence) for bad input."""
        if self.rewards is None:
            raise ValueError("this proxy records no rewards")
        row = reward_row(identity, body, source)
        self.rewards.append(row)
        if row["call_id"] is None:
            self.recent_rewards.pop((row["rollout_id"], row["attempt"]), None)  # keep insertion order
            self.recent_rewards[(row["rollout_id"], row["attempt"])] = row["value"]
            while len(self.recent_rewards) > RECENT_REWARDS:
                self.recent_rewards.pop(next(iter(self.recent_rewards)))
        return {"reward_id": row["reward_id"], "rollout_id": row["rollout_id"],
                "attempt": row["attempt"], "value": row["value"]}

    def next_seq(self, identity: Identity) -> int:
        key = (identity.rollout_id, identity.attempt)
        n = self.seqs.get(key, -1) + 1
        self.seqs[key] = n
        return n


RECENT_REWARDS = 200_000  # rewards GET /rewards answers from memory (older ones: query the store)
REWARD_HOST = "lgt.invalid"  # agents report rewards to http://lgt.invalid/reward through the proxy


def reward_row(identity: Identity, body: Any, source: str) -> dict[str, Any]:
    """A ``rewards`` row from a JSON body ``{"value": 1.0, "call_id": optional}``."""
    if not isinstance(body, dict):
        raise ValueError("a reward must be a JSON object like {\"value\": 1.0}")
    value = body.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"reward value must be a finite number, not {value!r}")
    call_id = body.get("call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise ValueError("call_id must be a string")
    return {"reward_id": uuid.uuid4().hex, "rollout_id": identity.rollout_id,
            "attempt": identity.attempt, "call_id": call_id, "value": float(value),
            "source": source, "recorded_at": _now_us()}


def _json_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None):
    body = wire.dumps({"error": {"message": message, "type": kind, "code": status}})
    return http.Response.make(status, body, {"content-type": "application/json", **(headers or {})})


def _now_us() -> int:
    return time.time_ns() // 1000


class Identify:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.tunnels: weakref.WeakKeyDictionary[Any, Identity] = weakref.WeakKeyDictionary()

    def _from_header(self, value: str | None) -> Identity:
        if not value:
            raise AuthError("proxy credentials required (HTTPS_PROXY=http://<rollout>:<token>@host:port)")
        user, token = parse_basic(value)
        return verify(self.rt.secret, user, token)

    def _refuse(self, flow: http.HTTPFlow, reason: str, reverse: bool) -> None:
        self.rt.metrics.auth_failures += 1
        log.warning("refused %s: %s", flow.client_conn.peername, reason)
        if reverse:
            flow.response = _json_response(401, f"lgt-proxy: {reason}", "authentication_error")
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
            flow.response = _json_response(404, "lgt-proxy: POST /reward {\"value\": 1.0} is the "
                                                "only endpoint here", "invalid_request_error")
            return
        try:
            body = wire.loads(flow.request.raw_content or b"")
        except ValueError:
            body = None
        try:
            result = self.rt.add_reward(identity, body, "proxy")
        except ValueError as e:
            flow.response = _json_response(400, f"lgt-proxy: {e}", "invalid_request_error")
            return
        except Exception:
            log.exception("could not record a reward for %s", identity.name)
            flow.response = _json_response(503, "lgt-proxy: the reward could not be recorded",
                                           "server_error")
            return
        flow.response = http.Response.make(200, wire.dumps(result),
                                           {"content-type": "application/json"})


class StreamRewriter:
    """``flow.response.stream`` for an SSE LLM response: re-frames events, captures token ids and
    logprobs, strips injected fields per event, and records the call when ``[DONE]`` passes —
    before that last event is handed to the agent."""

    def __init__(self, addon: Record, flow: http.HTTPFlow, call: Call) -> None:
        self.addon, self.flow, self.call = addon, flow, call
        self.framer = wire.SSEFramer()
        self.saw_done = False
        self.broken = 0
        self.passthrough = False

    def _event(self, event: bytes) -> bytes:
        data = wire.event_data(event)
        if data is None:
            return event
        if data.strip() == b"[DONE]":
            self.saw_done = True
            if not self.addon.finish_stream(self.flow, self.call):
                return b""  # not recorded: the agent must not see a complete stream
            return event
        try:
            obj = wire.loads(data)
        except ValueError:
            self.broken += 1
            return event
        if isinstance(obj, dict):
            self.call.capture.add_chunk(obj)
            inj = self.call.injected
            if inj != wire.Injected():
                wire.strip_response(self.call.endpoint, obj, inj)
                if (inj.token_ids or inj.logprobs) and wire.is_silent_chunk(obj):
                    return b""  # only there because of what the proxy injected
                return wire.rebuild_event(event, wire.dumps(obj))
        else:
            self.broken += 1
        return event

    def __call__(self, data: bytes) -> list[bytes]:
        # one write to the agent per upstream read (not per event): fewer TLS records and syscalls
        if self.passthrough:
            return [data] if data else []
        if not data:  # end of the upstream body
            rest = self.framer.rest()
            if rest.strip():
                self.broken += 1
            return [rest] if rest else []
        out: list[bytes] = []
        try:
            for event in self.framer.feed(data):
                if self.call.first_chunk_us is None:
                    self.call.first_chunk_us = _now_us()
                chunk = self._event(event)
                if chunk:
                    out.append(chunk)
        except ValueError as e:  # an event too large to frame: pass the rest through untouched
            log.warning("call %s: %s; passing the rest of the stream through", self.call.call_id, e)
            self.broken += 1
            self.passthrough = True
            out.append(self.framer.rest())
        joined = b"".join(out)
        return [joined] if joined else []


@dataclass
class Call:
    call_id: str
    identity: Identity
    seq: int
    endpoint: str
    policy_version: int
    started_us: int
    original_host: str
    requested_model: str | None
    request_json: str
    injected: wire.Injected
    capture: wire.Capture
    upstream: str | None = None
    served_model: str | None = None
    t0: float = field(default_factory=time.monotonic)
    first_byte_us: int | None = None
    first_chunk_us: int | None = None
    stream: StreamRewriter | None = None
    recorded: bool = False


def _error_text(content: bytes | None, limit: int = 2000) -> str:
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


class Record:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.upstream = urlsplit(rt.upstream) if rt.upstream else None

    # -- request side ------------------------------------------------------------------------
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or IDENT not in flow.metadata:
            return
        if wire.endpoint_of(flow.request.method, flow.request.path) is None:
            return
        size = flow.request.headers.get("content-length", "")
        if size.isdigit() and int(size) > self.rt.max_body_bytes:
            self._bad(flow, 413, f"request body of {int(size)} bytes exceeds the proxy's limit "
                                 f"of {self.rt.max_body_bytes} bytes")

    def _bad(self, flow: http.HTTPFlow, status: int, message: str) -> None:
        self.rt.metrics.bad_requests += 1
        flow.response = _json_response(status, f"lgt-proxy: {message}", "invalid_request_error")

    def _route(self, flow: http.HTTPFlow, path: str) -> None:
        assert self.upstream is not None
        up = self.upstream
        query = flow.request.path.partition("?")[2]
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

    async def request(self, flow: http.HTTPFlow) -> None:
        identity = flow.metadata.get(IDENT)
        if flow.response is not None or identity is None:
            return
        rt = self.rt
        endpoint = wire.endpoint_of(flow.request.method, flow.request.path)
        if endpoint is None:
            if flow.metadata.get(REVERSE):  # base_url= agents: everything else goes upstream too
                if self.upstream is None:
                    return self._bad(flow, 502, "reverse-mode paths need the proxy's --upstream")
                self._route(flow, flow.request.path.partition("?")[0])
            return
        body = flow.request.raw_content or b""
        if len(body) > rt.max_body_bytes:
            return self._bad(flow, 413, f"request body of {len(body)} bytes exceeds the proxy's "
                                        f"limit of {rt.max_body_bytes} bytes")
        try:
            req = wire.parse_request(endpoint, flow.request.get_content(strict=False))
        except (wire.BadRequest, ValueError) as e:
            if self.upstream is not None or flow.metadata.get(REVERSE):
                return self._bad(flow, 400, str(e))
            return  # observe-only: not an LLM call we understand; ordinary traffic
        try:
            version = await rt.gate.enter()
        except Rejected:
            rt.metrics.rejected += 1
            flow.response = _json_response(
                429, "lgt-proxy: the policy is being updated; retry shortly", "rate_limit_error",
                {"Retry-After": str(rt.retry_after_s)},
            )
            return
        original_host = flow.request.pretty_host
        prepared, injected = wire.prepare_request(
            endpoint, req,
            served_model=rt.served_model if self.upstream else None,
            capture_tokens=rt.capture_tokens,
        )
        call = Call(
            call_id=uuid.uuid4().hex,
            identity=identity,
            seq=rt.next_seq(identity),
            endpoint=endpoint,
            policy_version=version,
            started_us=_now_us(),
            original_host=original_host,
            requested_model=req.get("model"),
            request_json=body.decode("utf-8", "replace"),
            injected=injected,
            capture=wire.Capture(endpoint),
        )
        flow.metadata[CALL] = call
        if self.upstream is not None:
            self._route(flow, f"{self.upstream.path.rstrip('/')}/{endpoint}")
            call.upstream = rt.upstream
            call.served_model = prepared.get("model")
        if prepared != req:
            flow.request.content = wire.dumps(prepared)

    # -- response side -----------------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(CALL)
        if call is None or flow.response is None:
            return
        call.first_byte_us = _now_us()
        ctype = flow.response.headers.get("content-type", "")
        if 200 <= flow.response.status_code < 300 and ctype.startswith("text/event-stream"):
            call.stream = StreamRewriter(self, flow, call)
            flow.response.stream = call.stream

    def response(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(CALL)
        if call is None or call.recorded or flow.response is None:
            return
        resp = flow.response
        if call.stream is not None:
            self.finish_stream(flow, call)
            return
        if not 200 <= resp.status_code < 300:
            self._record(call, STATUS_HTTP_ERROR, resp.status_code, _error_text(resp.raw_content),
                         response_json=None)
            return
        try:
            obj = wire.loads(resp.get_content(strict=False) or b"")
        except (ValueError, UnicodeDecodeError):
            self._record(call, STATUS_UPSTREAM_ERROR, resp.status_code,
                         "the upstream's 2xx answer is not JSON", response_json=None)
            return
        if isinstance(obj, dict):
            call.capture.add_body(obj)
            if call.injected != wire.Injected():
                wire.strip_response(call.endpoint, obj, call.injected)
                resp.content = wire.dumps(obj)
        ok = self._record(call, STATUS_OK, resp.status_code, None,
                          response_json=resp.get_text(strict=False))
        if not ok:  # never hand the agent a response the store does not have
            flow.response = _json_response(503, "lgt-proxy: the call could not be recorded",
                                           "server_error")

    def finish_stream(self, flow: http.HTTPFlow, call: Call) -> bool:
        """Record a streamed call (at [DONE], or when the stream ends); False if recording failed."""
        if call.recorded:
            return True
        stream = call.stream
        assert stream is not None
        status, error = STATUS_OK, None
        if not stream.saw_done:
            status, error = STATUS_STREAM_ERROR, "the upstream stream ended without [DONE]"
        elif stream.broken:
            status, error = STATUS_STREAM_ERROR, f"{stream.broken} stream event(s) were not valid JSON"
        assembled = call.capture.assembled(call.injected)
        return self._record(call, status, flow.response.status_code if flow.response else None,
                            error, response_json=wire.dumps(assembled).decode())

    def error(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(CALL)
        if call is None or call.recorded:
            return
        msg = flow.error.msg if flow.error else "unknown error"
        client_gone = "client" in msg.lower()
        if call.stream is not None and call.stream.saw_done:
            status = STATUS_OK
        elif client_gone:
            status = STATUS_CLIENT_DISCONNECT
        elif call.stream is not None:
            status = STATUS_STREAM_ERROR
        else:
            status = STATUS_UPSTREAM_ERROR
        response_json = None
        if call.capture.choices:
            response_json = wire.dumps(call.capture.assembled(call.injected)).decode()
        self._record(call, status, flow.response.status_code if flow.response else None,
                     None if status == STATUS_OK else msg, response_json=response_json)

    # -- the record --------------------------------------------------------------------------
    def _record(self, call: Call, status: str, http_status: int | None, error: str | None,
                response_json: str | None) -> bool:
        call.recorded = True
        rt = self.rt
        rt.gate.exit()
        ended = _now_us()
        cap = call.capture
        first = cap.choices.get(0)
        token_ids = first.token_ids if first else None
        logprobs = first.logprobs if first else None
        if logprobs is not None and (token_ids is None or len(logprobs) != len(token_ids)
                                     or None in logprobs):
            logprobs = None  # never store logprobs that cannot be aligned with their tokens
        extra = [
            {"index": c.index, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
             "logprobs": c.logprobs if c.logprobs and None not in c.logprobs
             and len(c.logprobs) == len(c.token_ids or ()) else None}
            for i, c in sorted(cap.choices.items()) if i > 0
        ] or None
        usage = cap.usage_dict() or {}
        first_byte = call.first_chunk_us or call.first_byte_us
        row = {
            "call_id": call.call_id,
            "rollout_id": call.identity.rollout_id,
            "attempt": call.identity.attempt,
            "seq": call.seq,
            "started_at": call.started_us,
            "first_byte_at": first_byte,
            "ended_at": ended,
            "latency_ms": (ended - call.started_us) / 1000,
            "ttfb_ms": (first_byte - call.started_us) / 1000 if first_byte else None,
            "endpoint": call.endpoint,
            "original_host": call.original_host,
            "requested_model": call.requested_model,
            "served_model": call.served_model,
            "upstream": call.upstream,
            "policy_version": call.policy_version,
            "streamed": call.stream is not None,
            "request_json": call.request_json,
            "response_json": response_json,
            "prompt_token_ids": cap.prompt_token_ids,
            "response_token_ids": token_ids,
            "response_logprobs": logprobs,
            "extra_choices": extra,
            "finish_reason": first.finish_reason if first else None,
            "status": status,
            "http_status": http_status,
            "error": error,
            "usage_prompt_tokens": usage.get("prompt_tokens"),
            "usage_completion_tokens": usage.get("completion_tokens"),
            "usage_total_tokens": usage.get("total_tokens"),
            "proxy_session": rt.writer.session,
        }
        rt.metrics.count(status)
        rt.metrics.latency.observe((ended - call.started_us) / 1e6)
        if first_byte:
            rt.metrics.ttfb.observe((first_byte - call.started_us) / 1e6)
        try:
            rt.writer.append(row)
        except Exception:
            rt.metrics.record_failures += 1
            log.exception("could not record call %s of rollout %s", call.call_id, call.identity.name)
            return False
        return True


class Egress:
    """Policy for traffic that is not a recognised LLM call."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        up = urlsplit(rt.upstream) if rt.upstream else None
        self.upstream_host = up.hostname if up else None

    def allowed(self, host: str) -> bool:
        if self.rt.egress == "allow" or host == self.upstream_host:
            return True
        if self.rt.egress == "deny":
            return False
        return any(host == h or (h.startswith(".") and host.endswith(h)) for h in self.rt.allow_hosts)

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or IDENT not in flow.metadata:
            return
        if CALL in flow.metadata or flow.metadata.get(ROUTED):
            return
        host = flow.request.pretty_host
        if not self.allowed(host):
            self.rt.metrics.blocked_egress += 1
            flow.response = http.Response.make(
                403, f"lgt-proxy: egress to {host} is blocked by the proxy's egress policy "
                     f"({self.rt.egress})\n", {"content-type": "text/plain"},
            )

    def tcp_start(self, flow: Any) -> None:
        host = flow.server_conn.address[0] if flow.server_conn.address else ""
        if not self.allowed(host):
            self.rt.metrics.blocked_egress += 1
            flow.kill()
