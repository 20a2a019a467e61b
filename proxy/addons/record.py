"""The Record addon: one row of the ``calls`` table per LLM call, written before the agent has all of
its answer."""

from __future__ import annotations

import logging
import time
from typing import Any

from mitmproxy import http

from lgt.store.schema import (
    STATUS_CLIENT_DISCONNECT,
    STATUS_OK,
    STATUS_REJECTED,
    STATUS_STREAM_ERROR,
    STATUS_UPSTREAM_ERROR,
    STATUS_UPSTREAM_TIMEOUT,
)
from lgt.store.writer import os_reason

from .. import wire
from ..dialects import hosted
from .capture import HOSTED, NOT_REQUESTED, is_hosted, why_not_full
from .runtime import Runtime
from .state import CALL, Call, json_response, now_us, under_way

log = logging.getLogger("lgt.proxy")


def call_row(call: Call, status: str, http_status: int | None, error: str | None,
             response_json: str | None, ended: int) -> dict[str, Any]:
    """The ``calls`` row of a call the proxy forwarded (``proxy_session`` aside)."""
    cap = call.capture
    first = cap.choices.get(0)
    token_ids = first.token_ids if first else None
    logprobs = first.logprobs if first else None
    if logprobs is not None and (token_ids is None or len(logprobs) != len(token_ids) or None in logprobs):
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
        "request_json": call.body.decode("utf-8", "replace"),
        "response_json": response_json,
        "prompt_token_ids": cap.prompt_token_ids,
        "response_token_ids": token_ids,
        "response_logprobs": logprobs,
        "response_policy_versions": (call.token_versions if call.token_versions is not None and token_ids
                                     is not None and len(call.token_versions) == len(token_ids) else None),
        "capture": level,
        "capture_reason": why_not_full(call, level, first) if status == STATUS_OK else None,
        "sampling": call.injected.sampling,
        "extra_choices": extra,
        "finish_reason": first.finish_reason if first else None,
        "status": status,
        "http_status": http_status,
        "error": error,
        "usage_prompt_tokens": usage.get("prompt_tokens"),
        "usage_completion_tokens": usage.get("completion_tokens"),
        "usage_total_tokens": usage.get("total_tokens"),
    }
    if is_hosted(call):  # what the provider says of its answer: who answered, usage, how it ended
        try:
            answer = wire.loads(response_json) if response_json else None
        except (ValueError, UnicodeDecodeError):
            answer = None
        facts = hosted.columns(call.api or call.endpoint, answer)
        row.update(facts)
        row["capture_reason"] = HOSTED if status == STATUS_OK else None
    return row


def refused_row(call: Call, flow: http.HTTPFlow, max_bytes: int, policy_version: int) -> dict[str, Any]:
    """The ``rejected`` row of a call the proxy answered itself: the HTTP status and the reason, the
    request as sent, no tokens (the sample builder passes over it: a retried call still extends the
    one before)."""
    try:
        parsed = wire.loads(call.body) if call.body else None
    except (ValueError, UnicodeDecodeError):
        parsed = None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    now = now_us()
    assert flow.response is not None
    return {
        "call_id": call.call_id, "rollout_id": call.identity.rollout_id, "attempt": call.identity.attempt,
        "seq": call.seq, "started_at": now, "ended_at": now, "latency_ms": 0.0,
        "endpoint": call.endpoint, "api": call.api or call.endpoint, "original_host": call.original_host,
        "requested_model": model if isinstance(model, str) else None, "policy_version": policy_version,
        "streamed": bool(isinstance(parsed, dict) and parsed.get("stream")),
        "request_json": call.body[:max_bytes].decode("utf-8", "replace"),
        "response_json": flow.response.get_text(strict=False), "capture": wire.CAPTURE_NO_TOKENS,
        "status": STATUS_REJECTED, "http_status": flow.response.status_code, "error": call.refusal,
    }


class Record:
    """Every LLM call is a row of ``calls``: one the proxy answered itself (``call.refusal``) as
    ``rejected`` at once; one it forwarded when its answer is in — before the agent gets it, or at a
    stream's ``[DONE]`` before that event passes — or when its flow fails. Recording ends the call
    (``call.release()``). A call whose row could not be written is never answered as if it had been:
    503, or a stream without its end; a store that cannot be written turns new calls away (Hold)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self._refused(flow)

    def request(self, flow: http.HTTPFlow) -> None:
        if self._refused(flow):
            return
        call = under_way(flow)
        if call is not None and flow.response is None:
            call.seq = self.rt.next_seq(call.identity)
            call.finish = lambda: self.finish_stream(flow, call)

    def _refused(self, flow: http.HTTPFlow) -> bool:
        call: Call | None = flow.metadata.get(CALL)
        if call is None or call.refusal is None or call.recorded:
            return False
        call.recorded = True
        rt = self.rt
        call.seq = rt.next_seq(call.identity)
        rt.metrics.count(STATUS_REJECTED)
        try:
            rt.writer.append({**refused_row(call, flow, rt.max_body_bytes, rt.gate.policy_version),
                              "policy": call.policy or rt.policies.default,
                              "proxy_session": rt.writer.session})
        except Exception:  # the answer stands; the store's own failure is logged where it is written
            rt.metrics.record_failures += 1
            log.exception("could not record the refused call of rollout %s", call.identity.name)
        return True

    def response(self, flow: http.HTTPFlow) -> None:
        call = under_way(flow)
        if call is None or flow.response is None:
            return
        if call.stream is not None:
            self.finish_stream(flow, call)
        elif call.failure is not None:
            self.record(call, call.failure[0], flow.response.status_code, call.interrupted or call.failure[1],
                        response_json=None)
        elif not self.record(call, STATUS_OK, flow.response.status_code, None,
                             response_json=flow.response.get_text(strict=False)):
            # never hand the agent a response the store does not have
            flow.response = json_response(503, "lgt-proxy: the call could not be recorded", "server_error",
                                          api=call.api)

    def finish_stream(self, flow: http.HTTPFlow, call: Call) -> bool:
        """Record a streamed call (at [DONE], or when the stream ends); False if recording failed."""
        if call.recorded:
            return True
        stream = call.stream
        assert stream is not None
        status, error = STATUS_OK, None
        if not stream.saw_done:
            status, error = STATUS_STREAM_ERROR, ("the hosted model's stream ended before its last event"
                                                  if is_hosted(call) else
                                                  "the upstream stream ended without [DONE]")
        elif stream.broken:
            status, error = STATUS_STREAM_ERROR, f"{stream.broken} stream event(s) were not valid JSON"
        if call.interrupted is not None:  # stopped at an update and not continued (continuation.py)
            status, error = STATUS_STREAM_ERROR, call.interrupted
        return self.record(call, status, flow.response.status_code if flow.response else None,
                           error, response_json=wire.dumps(assembled(call)).decode())

    def error(self, flow: http.HTTPFlow) -> None:
        call = under_way(flow)
        if call is None:
            return
        msg = flow.error.msg if flow.error else "unknown error"
        if call.stream is not None and call.stream.saw_done:
            status = STATUS_OK
        elif "client" in msg.lower():
            status = STATUS_CLIENT_DISCONNECT
        elif call.stream is not None:
            status = STATUS_STREAM_ERROR
        else:
            status = STATUS_UPSTREAM_ERROR
        read = call.stream.assembler.events if is_hosted(call) and call.stream is not None else 0
        response_json = wire.dumps(assembled(call)).decode() if call.capture.choices or read else None
        self.record(call, status, flow.response.status_code if flow.response else None,
                    None if status == STATUS_OK else msg, response_json=response_json)

    def record(self, call: Call, status: str, http_status: int | None, error: str | None,
               response_json: str | None) -> bool:
        """End the call and write its row; False if the store could not take it."""
        call.recorded = True
        call.release()
        rt = self.rt
        if call.timed_out:
            status, error = STATUS_UPSTREAM_TIMEOUT, call.timed_out
        ended = now_us()
        row = call_row(call, status, http_status, error, response_json, ended)
        if row["capture_reason"] not in (None, NOT_REQUESTED, HOSTED):
            rt.metrics.degraded(row["capture_reason"])
        row["policy"] = call.policy or rt.policies.default  # hosted calls too: the run's default
        row["proxy_session"] = rt.writer.session
        rt.metrics.count(status)
        rt.metrics.latency.observe((ended - call.started_us) / 1e6)
        if row["first_byte_at"]:
            rt.metrics.ttfb.observe((row["first_byte_at"] - call.started_us) / 1e6)
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
                                 len(row["request_json"]) + len(response_json or ""))
        return True


def assembled(call: Call) -> dict[str, Any]:
    """What the agent received, as one response body of its API."""
    if is_hosted(call) and call.stream is not None:
        return call.stream.assembler.body()
    if call.translator is not None:
        return call.translator.final(call.capture)
    return call.capture.assembled(call.injected)

