"""The Capture addon: token ids and logprobs asked of the engine, read from its answers, and stripped
again, so the agent gets the answer it asked for (in its own API when the call was translated)."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from typing import Any

from mitmproxy import ctx, http

from lgt.store.schema import STATUS_CLIENT_DISCONNECT, STATUS_HTTP_ERROR, STATUS_UPSTREAM_ERROR

from .. import dialects, wire
from ..continuation import continuable
from ..dialects import hosted
from .runtime import Runtime
from .state import ROUTED, Call, agent_gone, error_text, forwarding, now_us, or_refuse, under_way

log = logging.getLogger("lgt.proxy")

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
NOT_REQUESTED = "not_requested"  # token capture was not asked for: not a degradation
HOSTED = "hosted"  # a hosted model answered (observe-only, --hosted-model): no token ids to be had


def is_hosted(call: Call) -> bool:
    """The call goes where the agent sent it, unchanged, and is only read (Translate decides)."""
    return call.capture_reason == HOSTED


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


class StreamRewriter:
    """``flow.response.stream`` for an SSE LLM response: re-frames events, captures token ids and
    logprobs, strips injected fields per event (or gives each in the agent's API), and has the call
    recorded (``call.finish``) when ``[DONE]`` passes — before that last event is handed to the agent."""

    def __init__(self, call: Call) -> None:
        self.call = call
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
            if not self.call.finish():
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
        if self.call.deadline is not None:  # the upstream is not silent (Deadlines)
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
                    self.call.first_chunk_us = now_us()
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


def stream_decoder(encoding: str) -> Callable[[bytes], bytes] | None:
    """Undo a response's ``content-encoding`` one piece at a time (identity, gzip, deflate, br, zstd);
    None for one it cannot."""
    kind = encoding.strip().lower()
    if kind in ("", "identity"):
        return lambda data: data
    if kind in ("gzip", "x-gzip", "deflate"):
        return zlib.decompressobj(31 if "gzip" in kind else 15).decompress
    if kind == "br":
        import brotli  # mitmproxy's own dependency

        return brotli.Decompressor().process
    if kind == "zstd":
        from mitmproxy.net.encoding import zstd  # the stdlib's, or its backport

        return zstd.ZstdDecompressor().decompress
    return None


class HostedStream:
    """``flow.response.stream`` for a hosted model's streamed answer: each piece goes on to the agent as
    it came, unchanged; a copy is read on the side (decompressed when the provider compressed it) into
    the API's unstreamed body (``dialects.hosted.Assembler``). The call is recorded (``call.finish``)
    before the piece holding the API's last event is handed on; a Gemini stream, which has no last
    event, when the body ends (Record)."""

    def __init__(self, call: Call, api: str, sse: bool, encoding: str) -> None:
        self.call = call
        self.assembler = hosted.Assembler(api)
        self.framer = wire.SSEFramer() if sse else None
        self.raw = bytearray()  # a Gemini stream without alt=sse: one JSON array
        self.saw_done = False
        self.broken = 0
        self.unread = False  # the rest cannot be read (too large an event, an unknown encoding)
        self.decode = stream_decoder(encoding)
        if self.decode is None:  # an encoding the proxy cannot undo piece by piece: passed on, not read
            self.unread, self.broken = True, 1

    def _read(self, data: bytes) -> None:
        data = self.decode(data) if self.decode is not None else data
        if self.framer is None:
            self.raw += data
            return
        for event in self.framer.feed(data):
            body = wire.event_data(event)
            if body is None:
                continue
            if body.strip() == b"[DONE]":
                self.assembler.done = True
                continue
            try:
                self.assembler.feed(wire.loads(body))
            except ValueError:
                self.broken += 1

    def _end(self) -> None:
        if self.framer is not None:
            if self.framer.rest().strip():
                self.broken += 1
        else:
            for chunk in hosted.gemini_stream_body(bytes(self.raw)) or ():
                self.assembler.feed(chunk)
        if self.assembler.api == dialects.GEMINI and self.assembler.events:
            self.assembler.done = True  # Gemini's stream ends with its body
        self.saw_done = self.assembler.done

    def __call__(self, data: bytes) -> list[bytes]:
        if self.call.deadline is not None:  # the upstream is not silent (Deadlines)
            self.call.deadline.touch()
        if self.call.first_chunk_us is None and data:
            self.call.first_chunk_us = now_us()
        if not data:
            if not self.unread:
                self._end()
            return []
        if not self.unread:
            try:
                self._read(data)
            except Exception as e:  # a broken encoding, an event too large: never the agent's problem
                log.warning("call %s: %s; the rest of the hosted stream is passed on unread",
                            self.call.call_id, e)
                self.broken += 1
                self.unread = True
        if self.assembler.done and not self.saw_done:
            self.saw_done = True
            if not self.call.finish():
                return []  # not recorded: the agent must not see a complete stream
        return [data]


class Capture:
    """A call under way is sent with the served model's name and vLLM's ``return_token_ids`` and
    ``logprobs`` (``lgt_capture_tokens``; greedy decoding for a ``~greedy`` identity); its answer —
    whole, or each event of a stream — is read into ``call.capture`` and given back without what was
    injected, or translated to the agent's API. An upstream that refuses what was injected is asked
    again without it. How the answer ended, when not ok, is ``call.failure`` for Record. A hosted
    model's call (``HOSTED``) is left as the agent sent it and its answer as the provider wrote it: a
    stream only read on its way (:class:`HostedStream`)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.tokens = False

    def load(self, loader: Any) -> None:
        loader.add_option("lgt_capture_tokens", bool, False,
                          "Ask the upstream for token ids and logprobs (vLLM) and strip them from answers.")

    def configure(self, updated: set[str]) -> None:
        if "lgt_capture_tokens" in updated:
            self.tokens = ctx.options.lgt_capture_tokens

    def request(self, flow: http.HTTPFlow) -> None:
        call = forwarding(flow)
        if call is None or is_hosted(call):  # a hosted model's call is sent as the agent wrote it
            return
        with or_refuse(flow, call):
            prepared, call.injected = wire.prepare_request(
                call.endpoint, call.request, served_model=call.served_model, capture_tokens=self.tokens,
                greedy=call.identity.greedy)
            if call.upstream is not None:
                call.served_model = prepared.get("model")
            if call.agent_request is not None:
                call.translator = dialects.translator(call.api, call.agent_request,
                                                      model=call.agent_request.get("model"))
                if call.api == dialects.RESPONSES:
                    call.history = dialects.carried_history(call.agent_request)
            if call.rewrite or prepared != call.request:
                flow.request.content = wire.dumps(prepared)
            relay = self.rt.relay
            if (relay is not None and flow.metadata.get(ROUTED) and call.upstream is not None
                    and continuable(call.endpoint, prepared, relay.tool_parser)):
                relay.take(flow, call)  # stopped at an update and continued after it (continuation.py)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call = under_way(flow)
        if call is None or flow.response is None:
            return
        call.first_byte_us = now_us()
        ctype = flow.response.headers.get("content-type", "")
        if is_hosted(call):
            return self._hosted_stream(flow, call, ctype)
        if 200 <= flow.response.status_code < 300 and ctype.startswith("text/event-stream"):
            call.stream = StreamRewriter(call)
            flow.response.stream = call.stream
            if getattr(call.translator, "content_type", None):  # Gemini's stream without alt=sse: JSON
                flow.response.headers["content-type"] = call.translator.content_type

    async def response(self, flow: http.HTTPFlow) -> None:
        call = under_way(flow)
        if call is None or call.stream is not None or flow.response is None:
            return  # a stream was captured as it passed
        if is_hosted(call):  # the provider's answer is the agent's, errors included, as it came
            if not 200 <= flow.response.status_code < 300:
                call.failure = (STATUS_HTTP_ERROR, error_text(flow.response.raw_content))
            return
        if flow.response.status_code in INJECTION_SUSPECT and call.injected.captures:
            await self._ask_again(flow, call)
            if call.stream is not None:  # the new answer was a stream, read whole (Record ends it)
                return
            if agent_gone(flow):  # the agent left while it was asked again
                call.failure = (STATUS_CLIENT_DISCONNECT,
                                "the agent closed its connection before the answer came")
                return
        resp = flow.response
        if not 200 <= resp.status_code < 300:
            call.failure = (STATUS_HTTP_ERROR, error_text(resp.raw_content))
            if call.api in dialects.APIS and call.api != dialects.RESPONSES:  # the SDK reads its API's shape
                resp.headers["content-type"] = "application/json"
                resp.content = wire.dumps(dialects.error_body(call.api, resp.status_code, call.failure[1]))
            return
        try:
            obj = wire.loads(resp.get_content(strict=False) or b"")
        except (ValueError, UnicodeDecodeError):
            call.failure = (STATUS_UPSTREAM_ERROR, "the upstream's 2xx answer is not JSON")
            return
        if isinstance(obj, dict):
            call.capture.add_body(obj)
            if call.translator is not None:
                resp.content = wire.dumps(call.translator.body(obj, call.capture))
            elif call.injected != wire.Injected():
                wire.strip_response(call.endpoint, obj, call.injected)
                resp.content = wire.dumps(obj)

    @staticmethod
    def _hosted_stream(flow: http.HTTPFlow, call: Call, ctype: str) -> None:
        """A hosted model's 2xx stream (SSE; Gemini's JSON array too) is passed on as it comes."""
        assert flow.response is not None
        if not 200 <= flow.response.status_code < 300:
            return
        sse = ctype.startswith("text/event-stream")
        gemini_json = call.api == dialects.GEMINI and (call.agent_request or {}).get("stream") == "json"
        if sse or gemini_json:
            call.stream = HostedStream(call, call.api or call.endpoint, sse,
                                       flow.response.headers.get("content-encoding", ""))
            flow.response.stream = call.stream

    async def _ask_again(self, flow: http.HTTPFlow, call: Call) -> None:
        """The upstream refused a call carrying injected capture fields: ask again without the
        logprobs, then also without the token ids, until it answers 2xx or nothing injected is
        left; the agent gets that answer — the one it would have had without the proxy."""
        rt = self.rt
        for drop, reason in (("logprobs", REJECTED_LOGPROBS), ("token_ids", REJECTED_TOKEN_IDS)):
            if not getattr(call.injected, drop):
                continue
            first_error = error_text(flow.response.raw_content, 300)
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
        """A whole SSE body read by ``_ask_again``: captured and stripped as if streamed (recorded at its
        ``[DONE]``, or by Record's ``response`` when it has none); the agent gets it in one piece."""
        assert flow.response is not None
        call.stream = StreamRewriter(call)
        out = call.stream(flow.response.get_content(strict=False) or b"") + call.stream(b"")
        flow.response.headers.pop("content-encoding", None)
        flow.response.content = b"".join(out)
