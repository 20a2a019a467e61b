"""The Answers addon: what the proxy answers itself for the engine it fronts, never forwarded."""

from __future__ import annotations

from urllib.parse import urlsplit

from mitmproxy import http

from .. import dialects, resources, wire
from ..auth import Identity
from .runtime import Runtime
from .state import IDENT, error_text, json_response
from .translate import read_request


class Answers:
    """With an upstream, for an identified rollout: the model list SDKs ask for first (``GET …/models``:
    the policy, under the names agents asked for) and token counts (``POST /v1/messages/count_tokens``,
    Gemini's ``…:countTokens``), counted by the engine's own tokenizer. Observe-only proxies let both
    through."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.upstream = urlsplit(rt.upstream) if rt.upstream else None

    async def request(self, flow: http.HTTPFlow) -> None:
        identity = flow.metadata.get(IDENT)
        if flow.response is not None or identity is None or self.upstream is None:
            return
        model_id = dialects.models_path(flow.request.method, flow.request.path)
        if model_id is not None:
            shape = dialects.models_shape(flow.request.path, flow.request.headers)
            served = [self.rt.served_model] if self.rt.served_model else []
            names = list(dict.fromkeys([*served, *self.rt.model_names]))
            body = wire.dumps(dialects.models_answer(shape, model_id, names))
            flow.response = http.Response.make(200, body, {"content-type": "application/json"})
            return
        api = dialects.count_tokens_api(flow.request.method, flow.request.path)
        if api:
            await self._count_tokens(flow, identity, api)

    async def _count_tokens(self, flow: http.HTTPFlow, identity: Identity, api: str) -> None:
        """The request translated as a call of its API (with the rollout's delivered prompt) and counted
        by the upstream's ``POST /tokenize`` (vLLM's, at its root), so the count is the prompt token
        count of the call itself; ``{"input_tokens": N}`` (Gemini: ``{"totalTokens": N}``)."""
        rt = self.rt
        try:
            _, chat = read_request(rt, identity, api, flow.request.get_content(strict=False), [],
                                   flow.request.path)
        except (wire.BadRequest, ValueError) as e:
            rt.metrics.bad_requests += 1
            flow.response = json_response(400, f"lgt-proxy: {e}", "invalid_request_error", api=api)
            return
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
        why = error_text(wire.dumps(body), 300) if body is not None else "no JSON answer"
        flow.response = json_response(502, f"lgt-proxy: the upstream could not count this request's "
                                           f"tokens (HTTP {status}: {why})", "api_error", api=api)
