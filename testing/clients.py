"""What the tests of agents' client libraries and of the API dialects share: the upstream's direct answer
(``post_direct``) and its token ids (``ref_tokens``), an Anthropic SDK client aimed at a hosted name, and
the SSE events of a Responses or Messages stream (``sse_events``) with the SDK's classes for them
(``event_types``, ``sdk_events``).

The SDKs (openai, anthropic) are imported only by the helpers that use them.
"""

from __future__ import annotations

import json
import ssl
import typing
import urllib.request
from typing import Any

CHAT = "chat/completions"  # the endpoint, under the upstream's /v1
SERVED = "policy"  # the name the upstream serves its model under
ANTHROPIC_BASE = "https://api.anthropic.invalid"


def post_direct(url: str, body: dict[str, Any],
                context: ssl.SSLContext | None = None) -> dict[str, Any]:
    """POST ``body`` as JSON to ``url`` with no proxy (whatever the environment says); the JSON answer."""
    handlers: list[Any] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.build_opener(*handlers).open(req, timeout=20) as r:
        return json.loads(r.read())


def ref_tokens(endpoint: str, ref: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    """Prompt token ids, response token ids and their logprobs of an upstream answer (``ref``)."""
    ch = ref["choices"][0]
    if endpoint == CHAT:
        logprobs = [e["logprob"] for e in ch["logprobs"]["content"]]
        return ref["prompt_token_ids"], ch["token_ids"], logprobs
    return ch["prompt_token_ids"], ch["token_ids"], ch["logprobs"]["token_logprobs"]


def anthropic_client():
    """The Anthropic SDK aimed at a hosted name (no retries): what an agent holds."""
    import anthropic

    return anthropic.Anthropic(base_url=ANTHROPIC_BASE, api_key="sk-ant-test", max_retries=0, timeout=20)


def sse_events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """A typed SSE stream's (event, data) pairs; each event's name must equal its data's ``type``."""
    out = []
    for block in data.decode().split("\n\n"):
        if not block.strip():
            continue
        kind, payload = block.split("\n", 1)
        assert kind.startswith("event: ") and payload.startswith("data: "), block
        obj = json.loads(payload[6:])
        assert obj["type"] == kind[7:]
        out.append((kind[7:], obj))
    return out


def event_types(union: Any) -> dict[str, type]:
    """The SDK's event classes by their ``type`` literal (a stream event union's members)."""
    out = {}
    for cls in typing.get_args(typing.get_args(union)[0] if typing.get_origin(union) is typing.Annotated
                               else union):
        (literal,) = typing.get_args(cls.model_fields["type"].annotation)
        out[literal] = cls
    return out


def sdk_events() -> dict[str, type]:
    """The OpenAI SDK's Responses stream event classes by their ``type`` literal."""
    from openai.types.responses import ResponseStreamEvent

    union = typing.get_args(ResponseStreamEvent)[0]
    return {typing.get_args(c.model_fields["type"].annotation)[0]: c for c in typing.get_args(union)}
