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
import os
import re
import socket
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import http
from mitmproxy.proxy.mode_specs import ReverseMode

from lgt.store.schema import (
    EGRESS_HTTP,
    EGRESS_TCP,
    EGRESS_TLS_FAILED,
    STATUS_CLIENT_DISCONNECT,
    STATUS_HTTP_ERROR,
    STATUS_OK,
    STATUS_REJECTED,
    STATUS_STREAM_ERROR,
    STATUS_UPSTREAM_ERROR,
    STATUS_UPSTREAM_TIMEOUT,
)
from lgt.store.writer import TableWriter, os_reason

from . import deadline, dialects, resources, wire
from .auth import AuthError, Identity, parse_basic, verify
from .deadline import Deadline
from .gate import Gate, Metrics, Rejected
from .resend import Resender

log = logging.getLogger("lgt.proxy")
STORE_HEADROOM = 1 << 20  # free bytes the store needs before a full one takes calls again

IDENT = "lgt.identity"
REVERSE = "lgt.reverse"
CALL = "lgt.call"
ROUTED = "lgt.routed"
REVERSE_PATH = re.compile(r"^/r/([^/?]+)/([^/?]+)(.*)$")
SECRET_HEADERS = ("authorization", "api-key", "x-api-key", "x-goog-api-key", "proxy-authorization")
NOTE_HEADER = "x-lgt-note"  # a translation note from an in-process transport (wsbridge), never forwarded


@dataclass
class Runtime:
    """What the addons and the control API share; built once by ``server.py``."""

    secret: bytes
    writer: TableWriter
    gate: Gate
    rewards: TableWriter | None = None
    egress_log: TableWriter | None = None  # the egress table: non-LLM traffic, allowed or blocked
    metrics: Metrics = field(default_factory=Metrics)
    upstream: str | None = None  # base URL, e.g. http://127.0.0.1:8000/v1
    served_model: str | None = None
    upstream_api_key: str | None = None
    capture_tokens: bool = False
    upstream_timeout_s: float | None = None  # see deadline.py
    listen: tuple[str, int] | None = None  # where agents reach this proxy (GET /state says it)
    remote: Any = None  # lgt.store.remote.RemoteStore when the store is on S3
    # why the store cannot be written (a full disk, a read-only one): new LLM calls are refused with
    # it until a probe finds the store writable again (store_writable)
    store_error: str | None = None
    store_probed: float = 0.0
    # prompts the trainer delivers per rollout attempt, substituted in its requests (resources.py)
    resources: resources.Registry = field(default_factory=lambda: resources.Registry())
    resender: Resender = field(default_factory=Resender)  # asks the upstream again (see Record)
    egress: str = "allow"  # allow | allowlist | deny
    allow_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 32 << 20
    retry_after_s: int = 5
    seqs: dict[tuple[str, int], int] = field(default_factory=dict)
    # the latest whole-rollout reward per (rollout, attempt) recorded since start, for GET /rewards
    recent_rewards: dict[tuple[str, int], float] = field(default_factory=dict)
    # who opened each authenticated CONNECT tunnel (client connection -> identity)
    tunnels: weakref.WeakKeyDictionary[Any, Identity] = field(default_factory=weakref.WeakKeyDictionary)
    # each rollout's recent Responses conversations, for previous_response_id (see Conversations)
    conversations: Conversations = field(default_factory=lambda: Conversations())
    # model names agents asked for (the latest 100), listed by GET …/v1/models with the served model
    model_names: dict[str, None] = field(default_factory=dict)
    # LLM calls under way (forwarded, not yet recorded), by call id: (Call, its flow); GET /state
    # names the oldest, and a pause does not wait for those whose agent has gone (orphaned)
    live: dict[str, tuple[Any, http.HTTPFlow]] = field(default_factory=dict)
    # the served model's context (max_model_len on the upstream's model card), read once; None: unknown
    max_model_len: int | None = None
    context_probed: float = -math.inf

    def orphaned(self) -> int:
        """In-flight calls whose agent has closed its connection: nobody waits for their answer."""
        return sum(1 for _, flow in self.live.values() if agent_gone(flow))

    def store_writable(self) -> bool:
        """False while the store cannot be written; re-checked at most once a second (free space and
        a writable filesystem), so the proxy takes calls again by itself when space returns."""
        if self.store_error is None:
            return True
        now = time.monotonic()
        if now - self.store_probed < 1.0:
            return False
        self.store_probed = now
        try:
            st = os.statvfs(self.writer.root)
        except OSError:
            return False
        if st.f_flag & os.ST_RDONLY or st.f_bavail * st.f_frsize < STORE_HEADROOM:
            return False
        log.info("the store is writable again: taking LLM calls")
        self.store_error = None
        return True

    async def engine_context(self) -> int | None:
        """The served model's context length, from the upstream's ``GET …/models`` (vLLM's model cards
        carry ``max_model_len``): read once; after a failure asked again at most every 30 s."""
        if self.max_model_len is not None or self.upstream is None:
            return self.max_model_len
        now = time.monotonic()
        if now - self.context_probed < 30:
            return None
        self.context_probed = now
        headers = {"authorization": f"Bearer {self.upstream_api_key}"} if self.upstream_api_key else {}
        try:
            status, body = await self.resender.call_json("GET", f"{self.upstream}/models", headers=headers)
        except Exception as e:  # the upstream is down or not vLLM: calls go on unchanged
            log.info("could not read the upstream's model cards (%s): output limits are sent as asked", e)
            return None
        cards = body.get("data") if isinstance(body, dict) and status == 200 else None
        cards = [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []
        card = next((c for c in cards if c.get("id") == self.served_model), cards[0] if cards else None)
        n = card.get("max_model_len") if card else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            self.max_model_len = n
        return self.max_model_len

    def saw_model(self, name: Any) -> None:
        if isinstance(name, str) and name and name not in self.model_names:
            self.model_names[name] = None
            while len(self.model_names) > 100:
                self.model_names.pop(next(iter(self.model_names)))

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


class Conversations:
    """The chat messages behind each recent Responses answer, for a later ``previous_response_id``:
    keyed by (rollout, attempt, response id), so one rollout cannot continue another's; bounded by
    count and by size (the oldest are forgotten first; a forgotten id is answered with a clear 400).
    ``size`` is what the caller measured (the request's and the response's bytes): a conversation's
    messages are shared with the request that carried them, so this over-counts, never under."""

    def __init__(self, limit: int = 20_000, max_bytes: int = 256 << 20) -> None:
        self.limit, self.max_bytes = limit, max_bytes
        self.bytes = 0
        self._items: dict[tuple[str, int, str], tuple[list[dict[str, Any]], int]] = {}

    def put(self, identity: Identity, response_id: str, messages: list[dict[str, Any]], size: int) -> None:
        key = (identity.rollout_id, identity.attempt, response_id)
        old = self._items.pop(key, None)
        self.bytes += size - (old[1] if old else 0)
        self._items[key] = (messages, size)
        while len(self._items) > 1 and (len(self._items) > self.limit or self.bytes > self.max_bytes):
            _, freed = self._items.pop(next(iter(self._items)))
            self.bytes -= freed

    def get(self, identity: Identity, response_id: str) -> list[dict[str, Any]] | None:
        item = self._items.get((identity.rollout_id, identity.attempt, response_id))
        return item[0] if item else None

    def __len__(self) -> int:
        return len(self._items)


RECENT_REWARDS = 200_000  # rewards GET /rewards answers from memory (older ones: query the store)
REWARD_HOST = "lgt.invalid"  # agents report rewards to http://lgt.invalid/reward through the proxy


def agent_gone(flow: http.HTTPFlow) -> bool:
    """The agent has closed the connection this call came on: nobody will read its answer."""
    return flow.client_conn.timestamp_end is not None


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


def _json_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None,
                   api: str | None = None):
    """The proxy's own error answer, in the shape of the API the agent called (OpenAI's otherwise)."""
    if api in dialects.APIS and api != dialects.RESPONSES:  # Responses errors are OpenAI's, as below
        body = wire.dumps(dialects.error_body(api, status, message))
    else:
        body = wire.dumps({"error": {"message": message, "type": kind, "code": status}})
    return http.Response.make(status, body, {"content-type": "application/json", **(headers or {})})


def _now_us() -> int:
    return time.time_ns() // 1000


class Identify:
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
        tr = self.call.translator
        if data.strip() == b"[DONE]":
            self.saw_done = True
            if not self.addon.finish_stream(self.flow, self.call):
                return b""  # not recorded: the agent must not see a complete stream
            return event if tr is None else tr.finish(self.call.capture)
        try:
            obj = wire.loads(data)
        except ValueError:
            self.broken += 1
            return event if tr is None else b""
        if isinstance(obj, dict):
            self.call.capture.add_chunk(obj)
            if tr is not None:  # the agent's API, event by event
                return tr.chunk(obj)
            inj = self.call.injected
            if inj != wire.Injected():
                wire.strip_response(self.call.endpoint, obj, inj)
                if (inj.token_ids or inj.logprobs) and wire.is_silent_chunk(obj):
                    return b""  # only there because of what the proxy injected
                return wire.rebuild_event(event, wire.dumps(obj))
        else:
            self.broken += 1
        return event if tr is None else b""

    def __call__(self, data: bytes) -> list[bytes]:
        # one write to the agent per upstream read (not per event): fewer TLS records and syscalls
        if self.call.deadline is not None:
            self.call.deadline.touch()
        if self.passthrough:
            return [data] if data else []
        if not data:  # end of the upstream body
            rest = self.framer.rest()
            if rest.strip():
                self.broken += 1
            tr = self.call.translator
            if self.call.timed_out and not self.saw_done:  # ended by the proxy: the agent's SDK raises
                why = f"lgt-proxy: {self.call.timed_out}"
                return [tr.failure(why, self.call.capture) if tr is not None else wire.error_event(why)]
            if tr is not None:  # the agent's API says the stream failed, where the engine's just ended
                return [] if self.saw_done else [tr.failure("lgt-proxy: the engine's stream ended before "
                                                            "it finished", self.call.capture)]
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
    request: dict[str, Any] = field(default_factory=dict)  # the agent's parsed request
    capture_reason: str | None = None  # set when the upstream refused what the proxy injected
    upstream: str | None = None
    served_model: str | None = None
    t0: float = field(default_factory=time.monotonic)
    first_byte_us: int | None = None
    first_chunk_us: int | None = None
    stream: StreamRewriter | None = None
    recorded: bool = False
    api: str | None = None  # the API the agent called (null: the engine's own endpoint)
    translator: Any = None  # a translated API's answers in the agent's API (dialects.translator)
    history: list[dict[str, Any]] | None = None  # Responses: the chat messages behind this answer
    deadline: Deadline | None = None  # --upstream-timeout's clock
    timed_out: str | None = None  # why the upstream exchange was ended (--upstream-timeout)
    translation: list[str] = field(default_factory=list)  # what translating the request approximated


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


# Upstream answers that a field the proxy injected may have caused (vLLM: 400 for a request it
# cannot serve, e.g. a NaN logprob it cannot write as JSON; 422 validation; 500 a failure inside).
# 401/403/404/429/503 and the like have other causes: they reach the agent at once.
INJECTION_SUSPECT = frozenset({400, 422, 500})

# Why a successful call's capture is not full (the calls table's capture_reason).
REJECTED_LOGPROBS = "upstream_rejected_logprobs"  # refused with logprobs, answered without them
REJECTED_TOKEN_IDS = "upstream_rejected_token_ids"  # refused with token ids too
NONFINITE_LOGPROBS = "nonfinite_logprobs"  # a logprob was NaN, infinite or vLLM's -9999 floor
MISSING_LOGPROBS = "missing_logprobs"  # token ids came back, logprobs did not (or not one per token)
MISSING_TOKEN_IDS = "missing_token_ids"  # asked for token ids, none came back (not vLLM?)
NOT_REQUESTED = "not_requested"  # capture is off (observe-only): not a degradation


def why_not_full(call: Call, level: str, first: wire.ChoiceCapture | None) -> str | None:
    """Why an ok call's capture is ``level`` rather than full (None when it is full)."""
    if level == wire.CAPTURE_FULL:
        return None
    if call.capture_reason is not None:
        return call.capture_reason
    if level == wire.CAPTURE_NO_TOKENS:
        return MISSING_TOKEN_IDS if call.injected.token_ids else NOT_REQUESTED
    if first is not None and first.nonfinite:
        return NONFINITE_LOGPROBS
    return MISSING_LOGPROBS if call.injected.logprobs else NOT_REQUESTED


class Record:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.upstream = urlsplit(rt.upstream) if rt.upstream else None

    # -- request side ------------------------------------------------------------------------
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or IDENT not in flow.metadata:
            return
        api = None
        endpoint = wire.endpoint_of(flow.request.method, flow.request.path)
        if endpoint is None:
            api = self._api(flow)
            if api is None:
                return
        size = flow.request.headers.get("content-length", "")
        if size.isdigit() and int(size) > self.rt.max_body_bytes:
            self._refuse(flow, flow.metadata[IDENT], api, endpoint or wire.CHAT, b"", 413,
                         f"request body of {int(size)} bytes exceeds the proxy's limit of "
                         f"{self.rt.max_body_bytes} bytes")

    def _api(self, flow: http.HTTPFlow) -> str | None:
        """Responses / Messages: translated to the upstream's chat/completions (observe-only, with no
        upstream, they pass through to the host the agent aimed at, unrecorded)."""
        if self.upstream is None:
            return None
        return dialects.api_of(flow.request.method, flow.request.path)

    def _bad(self, flow: http.HTTPFlow, status: int, message: str, api: str | None = None) -> None:
        self.rt.metrics.bad_requests += 1
        flow.response = _json_response(status, f"lgt-proxy: {message}", "invalid_request_error", api=api)

    def _refuse(self, flow: http.HTTPFlow, identity: Identity, api: str | None, endpoint: str,
                body: bytes, status: int, message: str, kind: str = "invalid_request_error",
                headers: dict[str, str] | None = None, bad: bool = True) -> None:
        """Answer an LLM call the proxy will not forward (in the API's own error shape) and put it on
        the record: a ``rejected`` row with the HTTP status and the reason, so no call is invisible in
        SQL. The row carries no tokens; the sample builder passes over it (a retried call still
        extends the one before)."""
        if bad:
            self.rt.metrics.bad_requests += 1
        flow.response = _json_response(status, f"lgt-proxy: {message}", kind, headers, api=api)
        now = _now_us()
        try:
            parsed = wire.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            parsed = None
        model = parsed.get("model") if isinstance(parsed, dict) else None
        row = {
            "call_id": uuid.uuid4().hex, "rollout_id": identity.rollout_id, "attempt": identity.attempt,
            "seq": self.rt.next_seq(identity), "started_at": now, "ended_at": now, "latency_ms": 0.0,
            "endpoint": endpoint, "api": api or endpoint, "original_host": flow.request.pretty_host,
            "requested_model": model if isinstance(model, str) else None,
            "policy_version": self.rt.gate.policy_version,
            "streamed": bool(isinstance(parsed, dict) and parsed.get("stream")),
            "request_json": body[:self.rt.max_body_bytes].decode("utf-8", "replace"),
            "response_json": flow.response.get_text(strict=False), "capture": wire.CAPTURE_NO_TOKENS,
            "status": STATUS_REJECTED, "http_status": status, "error": message,
            "proxy_session": self.rt.writer.session,
        }
        self.rt.metrics.count(STATUS_REJECTED)
        try:
            self.rt.writer.append(row)
        except Exception:  # the answer stands; the store's own failure is logged where it is written
            self.rt.metrics.record_failures += 1
            log.exception("could not record the refused call of rollout %s", identity.name)

    def _route(self, flow: http.HTTPFlow, path: str, keep_query: bool = True) -> None:
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

    async def request(self, flow: http.HTTPFlow) -> None:
        identity = flow.metadata.get(IDENT)
        if flow.response is not None or identity is None:
            return
        rt = self.rt
        model_id = dialects.models_path(flow.request.method, flow.request.path) if self.upstream else None
        if model_id is not None:  # SDKs that list models first: the policy, under the names asked for
            shape = dialects.models_shape(flow.request.path, flow.request.headers)
            names = list(dict.fromkeys([*([rt.served_model] if rt.served_model else []), *rt.model_names]))
            body = wire.dumps(dialects.models_answer(shape, model_id, names))
            flow.response = http.Response.make(200, body, {"content-type": "application/json"})
            return
        count_api = self.upstream and dialects.count_tokens_api(flow.request.method, flow.request.path)
        if count_api:
            return await self._count_tokens(flow, identity, count_api)  # answered here; not an LLM call
        endpoint = wire.endpoint_of(flow.request.method, flow.request.path)
        api = self._api(flow) if endpoint is None else None
        if api is not None:
            endpoint = wire.CHAT  # what the engine is asked
        if endpoint is None:
            if flow.metadata.get(REVERSE):  # base_url= agents: everything else goes upstream too
                if self.upstream is None:
                    return self._bad(flow, 502, "reverse-mode paths need the proxy's --upstream")
                self._route(flow, flow.request.path.partition("?")[0])
            return
        body = flow.request.raw_content or b""
        if len(body) > rt.max_body_bytes:
            return self._refuse(flow, identity, api, endpoint, body, 413, f"request body of {len(body)} "
                                f"bytes exceeds the proxy's limit of {rt.max_body_bytes} bytes")
        agent_req: dict[str, Any] | None = None
        notes: list[str] = [n[:300] for n in flow.request.headers.get_all(NOTE_HEADER)]  # wsbridge's
        flow.request.headers.pop(NOTE_HEADER, None)
        try:
            if api is None:
                req = wire.parse_request(endpoint, flow.request.get_content(strict=False))
            else:
                agent_req, req = self._translate(identity, api, flow.request.get_content(strict=False), notes,
                                                 flow.request.path)
        except (wire.BadRequest, ValueError) as e:
            if self.upstream is not None or flow.metadata.get(REVERSE):
                return self._refuse(flow, identity, api, endpoint, body, 400, str(e))
            return  # observe-only: not an LLM call we understand; ordinary traffic
        fitted = req
        if self.upstream is not None:  # an output limit the engine's context cannot hold: left out
            fitted = wire.fit_output(endpoint, req, await rt.engine_context(), notes)
        if not rt.store_writable():  # never answer a call that could not be recorded (nor this one)
            rt.metrics.rejected += 1
            flow.response = _json_response(
                503, f"lgt-proxy: {rt.store_error}; no LLM call is taken until it can be", "server_error",
                {"Retry-After": str(rt.retry_after_s)}, api=api)
            return
        try:
            version = await rt.gate.enter()
        except Rejected:
            rt.metrics.rejected += 1
            return self._refuse(flow, identity, api, endpoint, body, 429,
                                "the policy is being updated; retry shortly", kind="rate_limit_error",
                                headers={"Retry-After": str(rt.retry_after_s)}, bad=False)
        try:
            call = self._start_call(flow, identity, api, endpoint, fitted, agent_req, body, version,
                                    rewritten=fitted is not req)
            call.translation = notes
        except BaseException as e:  # the call never got under way: it must not stay counted in flight
            rt.gate.exit()
            flow.metadata.pop(CALL, None)
            if not isinstance(e, Exception):
                raise
            log.exception("a call of rollout %s could not be forwarded", identity.name)
            return self._refuse(flow, identity, api, endpoint, body, 500,
                                f"could not forward this call: {e}", kind="server_error", bad=False)
        rt.live[call.call_id] = (call, flow)

    async def _count_tokens(self, flow: http.HTTPFlow, identity: Identity,
                            api: str = dialects.MESSAGES) -> None:
        """``POST /v1/messages/count_tokens``: the request translated as a Messages call (with the
        rollout's delivered prompt) and counted by the upstream's ``POST /tokenize`` (vLLM's, at its
        root), so the count is the prompt token count of the call itself; ``{"input_tokens": N}``.
        Gemini's ``POST …/models/<model>:countTokens`` likewise, answered ``{"totalTokens": N}``."""
        rt = self.rt
        try:
            _, chat = self._translate(identity, api, flow.request.get_content(strict=False), [],
                                      flow.request.path)
        except (wire.BadRequest, ValueError) as e:
            return self._bad(flow, 400, str(e), api=api)
        subs = rt.resources.get(identity.rollout_id, identity.attempt)
        if subs:
            chat = resources.apply(chat, subs)[0]
        payload = {k: chat[k] for k in ("messages", "tools", "chat_template_kwargs", "add_generation_prompt",
                                        "continue_final_message") if k in chat}
        payload["model"] = rt.served_model or chat.get("model")
        assert self.upstream is not None
        root = self.upstream._replace(path=self.upstream.path.rstrip("/").removesuffix("/v1"), query="")
        headers = {"authorization": f"Bearer {rt.upstream_api_key}"} if rt.upstream_api_key else {}
        try:
            status, body = await rt.resender.call_json("POST", f"{root.geturl()}/tokenize", payload, headers)
        except Exception as e:  # the upstream is down: the agent's SDK reads Anthropic's error shape
            status, body = 502, {"error": {"message": f"the upstream could not be reached ({e})"}}
        count = body.get("count") if isinstance(body, dict) else None
        if status == 200 and isinstance(count, int) and not isinstance(count, bool):
            flow.response = http.Response.make(200, wire.dumps(dialects.count_answer(api, count)),
                                               {"content-type": "application/json"})
            return
        why = _error_text(wire.dumps(body), 300) if body is not None else "no JSON answer"
        flow.response = _json_response(502, f"lgt-proxy: the upstream could not count this request's "
                                            f"tokens (HTTP {status}: {why})", "api_error", api=api)

    def _start_call(self, flow: http.HTTPFlow, identity: Identity, api: str | None, endpoint: str,
                    req: dict[str, Any], agent_req: dict[str, Any] | None, body: bytes,
                    version: int, rewritten: bool = False) -> Call:
        """The call's record begun and its request routed upstream (the gate already counts it)."""
        rt = self.rt
        original_host = flow.request.pretty_host
        sent = req  # what the engine is asked: with the rollout's delivered prompt, when it has one
        subs = rt.resources.get(identity.rollout_id, identity.attempt)
        if subs:
            sent, misses = resources.apply(req, subs)
            rt.resources.misses += misses
        prepared, injected = wire.prepare_request(
            endpoint, sent,
            served_model=rt.served_model if self.upstream else None,
            capture_tokens=rt.capture_tokens, greedy=identity.greedy,
        )
        call = Call(
            call_id=uuid.uuid4().hex,
            identity=identity,
            seq=rt.next_seq(identity),
            endpoint=endpoint,
            policy_version=version,
            started_us=_now_us(),
            original_host=original_host,
            requested_model=(agent_req or req).get("model"),
            request_json=body.decode("utf-8", "replace"),
            injected=injected,
            capture=wire.Capture(endpoint),
            request=sent,
            api=api,
        )
        if agent_req is not None:
            call.translator = dialects.translator(api, agent_req, model=agent_req.get("model"))
            if api == dialects.RESPONSES:
                call.history = dialects.carried_history(agent_req)
        flow.metadata[CALL] = call
        rt.saw_model(call.requested_model)
        if self.upstream is not None:
            self._route(flow, f"{self.upstream.path.rstrip('/')}/{endpoint}",
                        keep_query=api != dialects.GEMINI)  # Gemini's ?alt=sse&key=… is not the engine's
            call.upstream = rt.upstream
            call.served_model = prepared.get("model")
        if prepared != req or agent_req is not None or rewritten:
            flow.request.content = wire.dumps(prepared)
        if rt.upstream_timeout_s:
            call.deadline = Deadline(rt.upstream_timeout_s, lambda: self._expire(flow, call))
        return call

    def _expire(self, flow: http.HTTPFlow, call: Call) -> None:
        if call.recorded or call.timed_out:
            return
        call.timed_out = (f"the upstream sent nothing for {self.rt.upstream_timeout_s:g} s "
                          "(--upstream-timeout)")
        log.warning("call %s of rollout %s: %s; ended", call.call_id, call.identity.name, call.timed_out)
        deadline.end_exchange(flow, f"lgt-proxy: {call.timed_out}")

    def _translate(self, identity: Identity, api: str, content: bytes | None, notes: list[str],
                   path: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
        """(the agent's request, the chat/completions request it becomes); BadRequest says why not, and
        ``notes`` gets what the translation approximated. ``path``: the request's (Gemini names its model
        and streaming there)."""
        try:
            agent_req = wire.loads(content or b"")
        except (ValueError, UnicodeDecodeError):
            raise wire.BadRequest(f"the body of this /{api} request is not valid JSON") from None
        if not isinstance(agent_req, dict):
            raise wire.BadRequest(f"the body of this /{api} request is not a JSON object")
        agent_req = dialects.agent_request(api, path, agent_req)
        if "model" in agent_req and not isinstance(agent_req["model"], str):
            raise wire.BadRequest("'model' must be a string")
        history = None
        prev = agent_req.get("previous_response_id") if api == dialects.RESPONSES else None
        if prev is not None:
            history = self.rt.conversations.get(identity, prev) if isinstance(prev, str) else None
            if history is None:
                raise wire.BadRequest(
                    f"previous_response_id {prev!r} is not one of this rollout's recent responses (the proxy "
                    f"keeps the last {self.rt.conversations.limit} of all rollouts, at most "
                    f"{self.rt.conversations.max_bytes >> 20} MiB): send the whole conversation in 'input' "
                    "instead")
            agent_req = dialects.with_history(agent_req, history)  # the whole conversation, as the API means
        return agent_req, dialects.to_chat(api, agent_req, None, notes)

    # -- response side -----------------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(CALL)
        if call is None or flow.response is None:
            return
        call.first_byte_us = _now_us()
        if call.deadline is not None:
            call.deadline.touch()
        ctype = flow.response.headers.get("content-type", "")
        if 200 <= flow.response.status_code < 300 and ctype.startswith("text/event-stream"):
            call.stream = StreamRewriter(self, flow, call)
            flow.response.stream = call.stream
            if getattr(call.translator, "content_type", None):  # Gemini's stream without alt=sse: JSON
                flow.response.headers["content-type"] = call.translator.content_type

    async def response(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get(CALL)
        if call is None or call.recorded or flow.response is None:
            return
        if call.deadline is not None:  # the whole answer is in
            call.deadline.cancel()
        if call.stream is not None:
            self.finish_stream(flow, call)
            return
        if flow.response.status_code in INJECTION_SUSPECT and call.injected.captures:
            await self._ask_again(flow, call)
            if call.recorded:  # the new answer was a stream, recorded as it was read
                return
            if agent_gone(flow):  # the agent left while it was asked again
                self._record(call, STATUS_CLIENT_DISCONNECT, flow.response.status_code,
                             "the agent closed its connection before the answer came", response_json=None)
                return
        resp = flow.response
        if not 200 <= resp.status_code < 300:
            error = _error_text(resp.raw_content)
            self._record(call, STATUS_HTTP_ERROR, resp.status_code, error, response_json=None)
            if call.api in dialects.APIS and call.api != dialects.RESPONSES:  # the SDK reads its API's shape
                resp.headers["content-type"] = "application/json"
                resp.content = wire.dumps(dialects.error_body(call.api, resp.status_code, error))
            return
        try:
            obj = wire.loads(resp.get_content(strict=False) or b"")
        except (ValueError, UnicodeDecodeError):
            self._record(call, STATUS_UPSTREAM_ERROR, resp.status_code,
                         "the upstream's 2xx answer is not JSON", response_json=None)
            return
        if isinstance(obj, dict):
            call.capture.add_body(obj)
            if call.translator is not None:
                resp.content = wire.dumps(call.translator.body(obj, call.capture))
            elif call.injected != wire.Injected():
                wire.strip_response(call.endpoint, obj, call.injected)
                resp.content = wire.dumps(obj)
        ok = self._record(call, STATUS_OK, resp.status_code, None,
                          response_json=resp.get_text(strict=False))
        if not ok:  # never hand the agent a response the store does not have
            flow.response = _json_response(503, "lgt-proxy: the call could not be recorded",
                                           "server_error", api=call.api)

    async def _ask_again(self, flow: http.HTTPFlow, call: Call) -> None:
        """The upstream refused a call carrying injected capture fields: ask again without the
        logprobs, then also without the token ids, until it answers 2xx or nothing injected is
        left; the agent gets that answer — the one it would have had without the proxy."""
        rt = self.rt
        for drop, reason in (("logprobs", REJECTED_LOGPROBS), ("token_ids", REJECTED_TOKEN_IDS)):
            if not getattr(call.injected, drop):
                continue
            first_error = _error_text(flow.response.raw_content, 300)
            body, injected = wire.prepare_request(
                call.endpoint, call.request, served_model=call.served_model,
                capture_tokens=call.injected.token_ids and drop != "token_ids", capture_logprobs=False,
                greedy=call.identity.greedy)
            try:
                answer = await rt.resender.send(flow.request, wire.dumps(body))
            except Exception as e:  # the upstream went away: the agent keeps the first answer
                log.warning("call %s: asking the upstream again without %s failed: %s",
                            call.call_id, drop, e)
                return
            log.info("call %s of rollout %s: the upstream answered %d with injected %s (%s); "
                     "asked again without: %d", call.call_id, call.identity.name,
                     flow.response.status_code, drop, first_error, answer.status_code)
            flow.request.content = wire.dumps(body)
            flow.response, call.injected = answer, injected
            if 200 <= answer.status_code < 300:
                call.capture_reason = reason
                if answer.headers.get("content-type", "").startswith("text/event-stream"):
                    self._replay_stream(flow, call)
                return
            if answer.status_code not in INJECTION_SUSPECT:
                return

    def _replay_stream(self, flow: http.HTTPFlow, call: Call) -> None:
        """A whole SSE body read by ``_ask_again``: captured, stripped and recorded as if streamed;
        the agent gets it in one piece."""
        assert flow.response is not None
        call.stream = StreamRewriter(self, flow, call)
        out = call.stream(flow.response.get_content(strict=False) or b"") + call.stream(b"")
        flow.response.headers.pop("content-encoding", None)
        flow.response.content = b"".join(out)
        if not call.recorded:
            self.finish_stream(flow, call)

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
        return self._record(call, status, flow.response.status_code if flow.response else None,
                            error, response_json=wire.dumps(self._assembled(call)).decode())

    @staticmethod
    def _assembled(call: Call) -> dict[str, Any]:
        """What the agent received, as one response body of its API."""
        if call.translator is not None:
            return call.translator.final(call.capture)
        return call.capture.assembled(call.injected)

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
            response_json = wire.dumps(self._assembled(call)).decode()
        self._record(call, status, flow.response.status_code if flow.response else None,
                     None if status == STATUS_OK else msg, response_json=response_json)

    # -- the record --------------------------------------------------------------------------
    def _record(self, call: Call, status: str, http_status: int | None, error: str | None,
                response_json: str | None) -> bool:
        call.recorded = True
        rt = self.rt
        rt.gate.exit()
        rt.live.pop(call.call_id, None)
        if call.deadline is not None:
            call.deadline.cancel()
        if call.timed_out:
            status, error = STATUS_UPSTREAM_TIMEOUT, call.timed_out
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
        level = wire.capture_level(cap.prompt_token_ids, token_ids, logprobs)
        reason = why_not_full(call, level, first) if status == STATUS_OK else None
        if reason is not None and reason != NOT_REQUESTED:
            rt.metrics.degraded(reason)
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
            "api": call.api or call.endpoint,
            "translation": [*call.translation, *(call.translator.notes if call.translator else ())] or None,
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
            "capture": level,
            "capture_reason": reason,
            "sampling": call.injected.sampling,
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
        except Exception as e:
            rt.metrics.record_failures += 1
            if isinstance(e, OSError):  # a full or read-only disk: refuse new calls until it is writable
                rt.store_error = f"the store cannot be written ({os_reason(e)})"
                rt.store_probed = time.monotonic()
                log.error("could not record call %s of rollout %s: %s; new LLM calls are refused until "
                          "the store can be written", call.call_id, call.identity.name, rt.store_error)
            else:
                log.exception("could not record call %s of rollout %s", call.call_id, call.identity.name)
            return False
        if call.history is not None and call.translator is not None and status == STATUS_OK:
            rt.conversations.put(call.identity, call.translator.response_id,
                                 call.history + call.translator.history(),
                                 len(call.request_json) + len(response_json or ""))
        return True


SECRET_QUERY = re.compile(r"(?i)(key|token|secret|passw|sig|auth|credential|session|code)")
EGRESS = "lgt.egress"


def redact_path(path: str) -> str:
    """``path`` with the values of secret-looking query parameters replaced by ``***``."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    parts = []
    for item in query.split("&"):
        name, eq, _ = item.partition("=")
        parts.append(f"{name}=***" if eq and SECRET_QUERY.search(name) else item)
    return f"{base}?{'&'.join(parts)}"


class Egress:
    """Everything an identified agent reaches through the proxy that is not an LLM call (nor a
    reward report): allowed or blocked by the policy (allow, an allowlist of hosts, or deny), and
    each one a row of the store's ``egress`` table — HTTP requests (plain, or inside a tunnel the
    proxy intercepted), other TCP connections, and tunnels whose TLS the agent refused."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        up = urlsplit(rt.upstream) if rt.upstream else None
        # the engine's own address (host and port: not every service on its machine)
        self.upstream = (up.hostname, up.port or (443 if up.scheme == "https" else 80)) if up else None
        # mitmproxy opens a TCP flow's server connection after tcp_start whatever the hook did (a
        # killed flow included): a blocked one is pointed here instead, a bound port that does not
        # listen, so the connection is refused at once and nothing reaches the host
        self._sink = socket.socket()
        self._sink.bind(("127.0.0.1", 0))

    def allowed(self, host: str, port: int | None) -> bool:
        if self.rt.egress == "allow" or (host, port) == self.upstream:
            return True
        if self.rt.egress == "deny":
            return False
        return any(host == h or (h.startswith(".") and host.endswith(h)) for h in self.rt.allow_hosts)

    def _blocked(self, identity: Identity, what: str) -> None:
        self.rt.metrics.blocked_egress += 1
        log.info("egress blocked for rollout %s: %s (egress policy %s)", identity.name, what,
                 self.rt.egress)

    def _write(self, identity: Identity, started_us: int, kind: str, host: str, port: int | None,
               allowed: bool, **cols: Any) -> None:
        if self.rt.egress_log is None:
            return
        row = {"egress_id": uuid.uuid4().hex, "rollout_id": identity.rollout_id,
               "attempt": identity.attempt, "started_at": started_us, "ended_at": _now_us(),
               "kind": kind, "host": host, "port": port, "allowed": allowed,
               "policy": self.rt.egress, "proxy_session": self.rt.writer.session, **cols}
        try:
            self.rt.egress_log.append(row)
        except Exception:  # the agent's traffic goes on; the failure is counted and logged
            self.rt.metrics.record_failures += 1
            log.exception("could not record egress to %s for rollout %s", host, identity.name)

    # -- HTTP ------------------------------------------------------------------------------------
    def request(self, flow: http.HTTPFlow) -> None:
        identity = flow.metadata.get(IDENT)
        if flow.response is not None or identity is None:
            return
        if CALL in flow.metadata or flow.metadata.get(ROUTED):
            return
        host = flow.request.pretty_host
        allowed = self.allowed(host, flow.request.port)
        flow.metadata[EGRESS] = (_now_us(), allowed)
        if not allowed:
            self._blocked(identity, f"{flow.request.method} {flow.request.scheme}://{host}"
                                    f"{redact_path(flow.request.path)}")
            flow.response = http.Response.make(
                403, f"lgt-proxy: egress to {host} is blocked by the proxy's egress policy "
                     f"({self.rt.egress})\n", {"content-type": "text/plain"},
            )

    def _http_row(self, flow: http.HTTPFlow, error: str | None) -> None:
        mark = flow.metadata.pop(EGRESS, None)
        if mark is None:
            return
        req, resp = flow.request, flow.response
        self._write(flow.metadata[IDENT], mark[0], EGRESS_HTTP, req.pretty_host, req.port, mark[1],
                    scheme=req.scheme, method=req.method, path=redact_path(req.path),
                    status=resp.status_code if resp is not None else None,
                    request_bytes=len(req.raw_content or b""),
                    response_bytes=len(resp.raw_content or b"") if resp is not None else None,
                    error=error)

    def response(self, flow: http.HTTPFlow) -> None:
        self._http_row(flow, None)

    def error(self, flow: http.HTTPFlow) -> None:
        self._http_row(flow, flow.error.msg if flow.error else "unknown error")

    # -- other TCP, refused TLS ------------------------------------------------------------------
    def tcp_start(self, flow: Any) -> None:
        host, port = flow.server_conn.address or ("", None)
        identity = self.rt.tunnels.get(flow.client_conn)
        allowed = self.allowed(host, port)
        if identity is not None:
            flow.metadata[EGRESS] = (_now_us(), allowed, host, port)
            if not allowed:
                self._blocked(identity, f"TCP {host}:{port}")
        if not allowed:
            if identity is None:
                self.rt.metrics.blocked_egress += 1
            flow.server_conn.address = self._sink.getsockname()
            flow.kill()

    def _tcp_row(self, flow: Any) -> None:
        mark = flow.metadata.pop(EGRESS, None)
        identity = self.rt.tunnels.get(flow.client_conn)
        if mark is None or identity is None:
            return
        host, port = mark[2], mark[3]  # where the agent aimed (a blocked flow was pointed elsewhere)
        sent = sum(len(m.content) for m in flow.messages if m.from_client)
        got = sum(len(m.content) for m in flow.messages if not m.from_client)
        self._write(identity, mark[0], EGRESS_TCP, host, port, mark[1], request_bytes=sent,
                    response_bytes=got, error=flow.error.msg if flow.error else None)

    def tcp_end(self, flow: Any) -> None:
        self._tcp_row(flow)

    def tcp_error(self, flow: Any) -> None:
        self._tcp_row(flow)

    def tls_failed_client(self, data: Any) -> None:
        identity = self.rt.tunnels.get(data.context.client)
        if identity is None:
            return
        host, port = data.context.server.address or ("", None)
        host = data.context.client.sni or host
        self._write(identity, _now_us(), EGRESS_TLS_FAILED, host, port, self.allowed(host, port),
                    error=data.conn.error or "the agent refused the proxy's TLS certificate")
