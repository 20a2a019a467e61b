"""The control API described as OpenAPI 3.1 (``GET /openapi.json``): what control.py serves."""

from __future__ import annotations

from typing import Any

_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
_STATE = {"type": "object", "properties": {
    "paused": {"type": "boolean"}, "in_flight": {"type": "integer"}, "held": {"type": "integer"},
    "held_total": {"type": "integer"}, "policy_version": {"type": "integer"}, "calls": {"type": "object"},
    "rows_written": {"type": "integer"},
    "store_error": {"type": ["string", "null"]},
    "oldest_in_flight": {"type": ["object", "null"], "properties": {
        "rollout_id": {"type": "string"}, "attempt": {"type": "integer"}, "call_id": {"type": "string"},
        "seconds": {"type": "number"}, "answer_begun": {"type": "boolean"},
        "agent_gone": {"type": "boolean"}}},
    "orphaned": {"type": "integer"},
    "on_update": {"enum": ["drain", "continue"]}, "parked": {"type": "integer"},
    "continued_total": {"type": "integer"}},
    "required": ["paused", "in_flight", "policy_version"]}
_POLICIES = {"type": "object", "properties": {
    "default": {"type": "string"}, "served": {"type": "object"}, "calls": {"type": "object"},
    "overlaps": {"type": "object"}}, "required": ["default", "served", "calls"]}
_STATE["properties"]["policies"] = _POLICIES


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _op(summary: str, ok: dict[str, Any], *, body: dict[str, Any] | None = None,
        params: list[dict[str, Any]] | None = None, errors: tuple[int, ...] = (400,)) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {
        "200": {"description": "done", **_json(ok)},
        "401": {"description": "missing or wrong bearer token", **_json(_ERROR)},
        **{str(c): {"description": "refused, with the reason", **_json(_ERROR)} for c in errors}}}
    if body is not None:
        op["requestBody"] = {"required": bool(body.get("required")), **_json(body)}
    if params:
        op["parameters"] = params
    return op


def document() -> dict[str, Any]:
    ident = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"}
    whole = {"type": "integer", "minimum": 0}
    served = {"type": "object", "additionalProperties": {"type": ["string", "null"], "minLength": 1}}
    subs = {"type": "array", "items": {"type": "object", "properties": {
        "text": {"type": "string"}, "target": {"const": "system"},
        "span": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 2, "maxItems": 2}},
        "required": ["text"]}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "lgt-proxy control API", "version": "1"},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/pause": {"post": _op("Hold new LLM calls; return once none is in flight (504 if they did "
                                   "not finish within the timeout); on_update continue: the calls that "
                                   "can be continued are stopped (parked) and go on after the resume",
                                   _STATE, errors=(400, 504),
                                   body={"type": "object", "properties": {
                                       "timeout": {"type": "number", "minimum": 0},
                                       "on_update": {"enum": ["drain", "continue"]}}})},
            "/resume": {"post": _op("Release held calls; new calls run under policy_version (sent to "
                                    "served_model, and the policies' served models)", _STATE,
                                    errors=(400, 404),
                                    body={"type": "object", "properties": {
                                        "policy_version": whole,
                                        "served_model": {"type": "string", "minLength": 1},
                                        "served": served}})},
            "/policies": {"post": _op("The model each policy's next calls are sent upstream as",
                                      _POLICIES, errors=(400, 404),
                                      body={"type": "object", "properties": {"served": served}})},
            "/state": {"get": _op("Paused, in flight, held, policy version, counts", _STATE, errors=())},
            "/flush": {"post": _op("Every recorded row made visible as Parquet", {"type": "object"},
                                   errors=(503,))},
            "/rewards": {
                "post": _op("Record a reward for a rollout (or one call)", {"type": "object"},
                            errors=(400, 404), body={"type": "object", "properties": {
                                "rollout_id": ident, "attempt": whole, "value": {"type": "number"},
                                "call_id": {"type": ["string", "null"]}},
                                "required": ["rollout_id", "value"]}),
                "get": _op("The latest whole-rollout reward recorded since the proxy started",
                           {"type": "object", "properties": {"value": {"type": ["number", "null"]}}},
                           params=[{"name": "rollout_id", "in": "query", "required": True, "schema": ident},
                                   {"name": "attempt", "in": "query", "required": True, "schema": whole}])},
            "/resources": {"post": _op("The prompt an attempt's requests carry instead of the agent's",
                                       {"type": "object"}, body={"type": "object", "properties": {
                                           "rollout_id": ident, "attempt": whole, "substitutions": subs},
                                           "required": ["rollout_id", "substitutions"]})},
            "/metrics": {"get": {"summary": "Prometheus text", "responses": {
                "200": {"description": "metrics", "content": {"text/plain": {"schema": {"type": "string"}}}},
                "401": {"description": "missing or wrong bearer token", **_json(_ERROR)}}}},
            "/healthz": {"get": {"summary": "Whether the proxy answers (no token)", "security": [],
                                 "responses": {"200": {"description": "ok", "content": {
                                     "text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document (no token)", "security": [],
                                      "responses": {"200": {"description": "the document",
                                                            **_json({"type": "object"})}}}},
        },
    }
