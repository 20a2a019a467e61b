"""The Translate addon: recognise an LLM call and read it as the request the engine is to be asked."""

from __future__ import annotations

from typing import Any

from mitmproxy import http

from .. import dialects, wire
from ..auth import Identity
from .runtime import Runtime
from .state import CALL, IDENT, NOTE_HEADER, REVERSE, Call


def read_request(rt: Runtime, identity: Identity, api: str, content: bytes | None, notes: list[str],
                 path: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """(the agent's request, the chat/completions request it becomes) for a call in a translated API;
    BadRequest says why not, and ``notes`` gets what the translation approximated. ``path``: the
    request's (Gemini names its model and streaming there)."""
    try:
        agent_req = wire.loads(content or b"")
    except (ValueError, UnicodeDecodeError):
        raise wire.BadRequest(f"the body of this /{api} request is not valid JSON") from None
    if not isinstance(agent_req, dict):
        raise wire.BadRequest(f"the body of this /{api} request is not a JSON object")
    agent_req = dialects.agent_request(api, path, agent_req)
    if "model" in agent_req and not isinstance(agent_req["model"], str):
        raise wire.BadRequest("'model' must be a string")
    prev = agent_req.get("previous_response_id") if api == dialects.RESPONSES else None
    if prev is not None:
        history = rt.conversations.get(identity, prev) if isinstance(prev, str) else None
        if history is None:
            raise wire.BadRequest(
                f"previous_response_id {prev!r} is not one of this rollout's recent responses (the proxy "
                f"keeps the last {rt.conversations.limit} of all rollouts, at most "
                f"{rt.conversations.max_bytes >> 20} MiB): send the whole conversation in 'input' "
                "instead")
        agent_req = dialects.with_history(agent_req, history)  # the whole conversation, as the API means
    return agent_req, dialects.to_chat(api, agent_req, None, notes)


class Translate:
    """LLM calls from an identified rollout: ``POST …/chat/completions`` and ``…/completions`` as they
    are; with an upstream, the Responses, Messages and Gemini APIs too, translated to chat/completions.
    The call becomes ``flow.metadata[CALL]`` with the engine's request, an output limit past the
    engine's context left out. A body over the size limit gets 413, one that cannot be read 400 (in
    observe-only mode, off reverse-mode paths, it passes through as ordinary traffic instead)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.translates = rt.upstream is not None  # observe-only: other APIs pass through unrecorded

    def recognise(self, flow: http.HTTPFlow) -> tuple[str, str | None] | None:
        """(the engine's endpoint, the API translated from) when the request is an LLM call."""
        endpoint = wire.endpoint_of(flow.request.method, flow.request.path)
        if endpoint is not None:
            return endpoint, None
        api = dialects.api_of(flow.request.method, flow.request.path) if self.translates else None
        return (wire.CHAT, api) if api is not None else None

    def _too_large(self, flow: http.HTTPFlow, call: Call, size: int) -> None:
        self.rt.metrics.bad_requests += 1
        flow.metadata[CALL] = call
        call.refuse(flow, 413, f"request body of {size} bytes exceeds the proxy's limit of "
                               f"{self.rt.max_body_bytes} bytes")

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        identity = flow.metadata.get(IDENT)
        if flow.response is not None or identity is None or (kind := self.recognise(flow)) is None:
            return
        size = flow.request.headers.get("content-length", "")
        if size.isdigit() and int(size) > self.rt.max_body_bytes:
            self._too_large(flow, Call(identity, *kind, flow.request.pretty_host), int(size))

    async def request(self, flow: http.HTTPFlow) -> None:
        identity = flow.metadata.get(IDENT)
        if flow.response is not None or identity is None or (kind := self.recognise(flow)) is None:
            return
        body = flow.request.raw_content or b""
        call = Call(identity, *kind, flow.request.pretty_host, body=body)
        if len(body) > self.rt.max_body_bytes:
            return self._too_large(flow, call, len(body))
        call.translation = [n[:300] for n in flow.request.headers.get_all(NOTE_HEADER)]  # wsbridge's
        flow.request.headers.pop(NOTE_HEADER, None)
        content = flow.request.get_content(strict=False)
        try:
            if call.api is None:
                req = wire.parse_request(call.endpoint, content)
            else:
                call.agent_request, req = read_request(self.rt, identity, call.api, content, call.translation,
                                                       flow.request.path)
        except (wire.BadRequest, ValueError) as e:
            if self.translates or flow.metadata.get(REVERSE):
                self.rt.metrics.bad_requests += 1
                flow.metadata[CALL] = call
                call.refuse(flow, 400, str(e))
            return  # observe-only: not an LLM call we understand; ordinary traffic
        call.requested_model = (call.agent_request or req).get("model")
        call.request = req
        if self.translates:  # an output limit the engine's context cannot hold: left out
            context = await self.rt.engine_context()
            call.request = wire.fit_output(call.endpoint, req, context, call.translation)
        call.rewrite = call.api is not None or call.request is not req
        flow.metadata[CALL] = call
