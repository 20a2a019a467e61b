"""Codex's model catalogue (``GET https://chatgpt.com/backend-api/codex/models?client_version=…``),
answered by the proxy for authenticated rollouts when it has an upstream.

Codex asks for it when signed in with ChatGPT (with an API key it never does) and merges the answer
into the catalogue it ships with (codex-rs ``models-manager``: an entry replaces the bundled one of the
same slug; a catalogue with a ``visibility: "list"`` entry replaces the bundled one whole). An entry is
metadata that shapes Codex's own prompt — base instructions, tool kinds, truncation — so the answer
lists the policy under the served model's name, hidden from the picker: Codex keeps its own metadata
for the models it knows (its prompt is the one the hosted service would get), and a run configured
with ``model = "<served model>"`` finds an entry. The names agents asked for are not listed for the
same reason.
"""

from __future__ import annotations

from typing import Any

from mitmproxy import http

from . import wire
from .addons import IDENT, Runtime


def is_models_path(method: str, path: str) -> bool:
    """``GET …/codex/models`` (the ChatGPT backend's, whatever the host or prefix)."""
    return method.upper() == "GET" and path.partition("?")[0].rstrip("/").endswith("/codex/models")


def models_answer(served: str | None) -> dict[str, Any]:
    """Codex's ``ModelsResponse``: the served model as one hidden ``ModelInfo`` (the fields Codex 0.171
    requires, with neutral values; no base instructions, so Codex's defaults apply); no entry without a
    served model name."""
    if not served:
        return {"models": []}
    return {"models": [{
        "slug": served, "display_name": served, "description": "The policy served through lgt-proxy.",
        "default_reasoning_level": None, "supported_reasoning_levels": [], "shell_type": "shell_command",
        "visibility": "hide", "supported_in_api": True, "priority": 1000, "upgrade": None,
        "supports_reasoning_summaries": False,
        "support_verbosity": False, "default_verbosity": None, "apply_patch_tool_type": None,
        "truncation_policy": {"mode": "tokens", "limit": 10000}, "supports_parallel_tool_calls": False,
        "experimental_supported_tools": [], "input_modalities": ["text"]}]}


class CodexModels:
    """mitmproxy addon: ``GET …/codex/models`` from an authenticated rollout, answered here (never
    forwarded, not an LLM call); added before ``Translate``. Observe-only proxies let it through."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or IDENT not in flow.metadata or self.rt.upstream is None:
            return
        if is_models_path(flow.request.method, flow.request.path):
            flow.response = http.Response.make(200, wire.dumps(models_answer(self.rt.served_model)),
                                               {"content-type": "application/json"})
