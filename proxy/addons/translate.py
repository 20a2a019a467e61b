"""The Translate addon: recognise an LLM call and read it as the request the engine is to be asked."""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Any

from mitmproxy import ctx, exceptions, http

from .. import dialects, policies, wire
from ..auth import Identity
from .capture import HOSTED
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


def hosted_request(api: str | None, path: str, content: bytes | None) -> dict[str, Any] | None:
    """A hosted model's call as its dialect reads it (Gemini: the model and streaming from the path);
    None when the body is not a JSON object with a string ``model`` or none at all."""
    try:
        req = wire.loads(content or b"")
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(req, dict):
        return None
    req = dialects.agent_request(api, path, req) if api is not None else req
    return req if isinstance(req.get("model", ""), str) else None


def matches(model: Any, globs: list[str]) -> bool:
    """The requested model is one of ``--hosted-model``'s (shell-style patterns, case as written)."""
    return isinstance(model, str) and any(fnmatchcase(model, g) for g in globs)


class Translate:
    """LLM calls from an identified rollout: ``POST …/chat/completions`` and ``…/completions``, the
    Responses, Messages and Gemini APIs. With an upstream they are the engine's, the other APIs
    translated to chat/completions: the call becomes ``flow.metadata[CALL]`` with the engine's request,
    an output limit past the engine's context left out. A call of a hosted model — in observe-only
    mode every call, with an upstream one whose model matches ``--hosted-model``
    (``lgt_hosted_models``) — is a call marked ``capture_reason = HOSTED``, sent where the agent aimed
    as it is, and only read. A body over the size limit gets 413, one that cannot be read 400 (in
    observe-only mode, off reverse-mode paths, it passes through as ordinary traffic instead, counted
    in ``rt.metrics.passed_unread``)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.translates = rt.upstream is not None  # observe-only: other APIs are a hosted model's
        self.hosted: list[str] = []
        self.max_output: int | None = None

    def load(self, loader: Any) -> None:
        loader.add_option("lgt_hosted_models", Sequence[str], [],
                          "With an upstream, calls whose requested model matches one of these patterns go "
                          "where the agent sent them, unchanged, and are recorded as a hosted model's.")
        loader.add_option("lgt_max_output_tokens", int, 0,
                          "With an upstream, the most tokens one reply may generate: a larger output limit "
                          "is lowered to it, a call without one gets it (0: the agent's own limit).")

    def configure(self, updated: set[str]) -> None:
        if "lgt_hosted_models" in updated:
            self.hosted = list(ctx.options.lgt_hosted_models)
        if "lgt_max_output_tokens" in updated:
            cap = ctx.options.lgt_max_output_tokens
            if cap < 0:
                raise exceptions.OptionsError(f"the output cap must be a number of tokens (0: none), "
                                              f"not {cap}")
            self.max_output = cap or None

    def recognise(self, flow: http.HTTPFlow) -> tuple[str, str | None] | None:
        """(the engine's endpoint, the API translated from) when the request is an LLM call."""
        endpoint = wire.endpoint_of(flow.request.method, flow.request.path)
        if endpoint is not None:
            return endpoint, None
        api = dialects.api_of(flow.request.method, flow.request.path)
        return (wire.CHAT, api) if api is not None else None

    def _hosted(self, flow: http.HTTPFlow, call: Call, content: bytes | None) -> bool | None:
        """True: the call is a hosted model's (marked, and read as the agent sent it); None: it is not
        an LLM call the proxy can read and passes through untouched; False: the engine's."""
        if flow.metadata.get(REVERSE) or (self.translates and not self.hosted):
            return False
        req = hosted_request(call.api, flow.request.path, content)
        if req is None:
            if self.translates:
                return False  # the engine's path answers 400 with the reason
            self.rt.metrics.passed_unread += 1
            return None
        if self.translates and not matches(req.get("model"), self.hosted):
            return False
        call.requested_model = req.get("model")
        call.request = req
        call.agent_request = req if call.api is not None else None
        call.capture_reason = HOSTED
        return True

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
        hosted = self._hosted(flow, call, content)
        if hosted is None:
            return
        if hosted:
            flow.metadata[CALL] = call
            return
        try:
            if call.api is None:
                req = wire.parse_request(call.endpoint, content)
            else:
                call.agent_request, req = read_request(self.rt, identity, call.api, content, call.translation,
                                                       flow.request.path)
        except (wire.BadRequest, ValueError) as e:  # the engine's call (observe-only ones are hosted)
            self.rt.metrics.bad_requests += 1
            flow.metadata[CALL] = call
            call.refuse(flow, 400, str(e))
            return
        call.requested_model = (call.agent_request or req).get("model")
        call.request = req
        call.policy = self.rt.policies.assign(policies.facts(req, call.agent_request, call.requested_model))
        if self.translates:  # a limit past the run's cap lowered; one the context cannot hold left out
            capped = wire.cap_output(call.endpoint, req, self.max_output, call.translation)
            context = await self.rt.engine_context()
            call.request = wire.fit_output(call.endpoint, capped, context, call.translation)
        call.rewrite = call.api is not None or call.request is not req
        flow.metadata[CALL] = call
