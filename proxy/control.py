"""The control API (aiohttp, its own port, bearer token): pause / resume / state / metrics / flush.

    POST /pause   {"timeout": 60}          hold new LLM calls, return once none is in flight
                                           (504 with the state if they did not finish in time)
                  {"timeout": 60, "on_update": "continue"}
                                           … the calls in flight that can be continued are stopped
                                           where they are (not waited for) and continued on the new
                                           weights after the resume; default: --on-update (drain).
                                           Only a proxy started with --on-update continue sends calls
                                           the way that can stop them; any other call is drained
    POST /resume  {"policy_version": 3}    release held calls; new calls run under version 3
                  {"policy_version": 3, "served_model": "policy-v3"}
                                           … and are sent to the upstream's model "policy-v3" (a
                                           LoRA adapter loaded for that version); without it the
                                           served model stays as it was
                  {"served": {"planner": "planner-v3"}}   also: the policies' served models, changed
                                           before the held calls go on (docs/policies.md)
    POST /policies {"served": {"planner": "planner-v3"}}
                                           the model a policy's next calls are sent upstream as
                                           (null: the proxy's own --served-model); answers GET
                                           /state's ``policies``
    GET  /state                            paused, in_flight, held, policy_version, counts, listen
    GET  /metrics                          Prometheus text
    POST /rewards {"rollout_id": "r1", "value": 1.0, "attempt": 0, "call_id": null}
                                           record a reward (an evaluator's; agents use lgt.invalid)
    GET  /rewards?rollout_id=r1&attempt=0  {"value": 1.0 | null}: the latest whole-rollout reward
                                           recorded since this proxy started (no store query)
    POST /flush                            make every recorded call, reward and egress row visible
                                           as Parquet
    POST /resources {"rollout_id": "r1", "attempt": 0, "substitutions": [{"text": "...",
                    "target": "system"} | {"text": "...", "span": ["<<P>>", "<</P>>"]}]}
                                           the prompt this attempt's requests carry (resources.py)
    GET  /healthz                          no token needed
    GET  /openapi.json                     this API as OpenAPI 3.1 (no token needed; proxy/openapi.py)

Its client, for every caller: :mod:`lgt.proxy.client`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any

from aiohttp import web

from . import openapi, policies, resources
from .addons import Runtime, agent_gone
from .auth import AuthError, Identity, parse_identity
from .gate import ON_UPDATE

RT_KEY: web.AppKey[Runtime] = web.AppKey("rt", Runtime)
TOKEN_KEY: web.AppKey[str] = web.AppKey("token", str)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json(loads=json.loads)
    except ValueError:
        raise web.HTTPBadRequest(text=json.dumps({"error": "the request body is not valid JSON"}),
                                 content_type="application/json") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=json.dumps({"error": "the request body must be a JSON object"}),
                                 content_type="application/json")
    return body


def _whole(value: Any) -> Any:
    """A JSON whole number as an int (``3.0`` is one, as JSON Schema's ``integer`` says); anything else
    as it is, for the caller to refuse."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _identity(rid: Any) -> Identity | None:
    """The identity a body's ``rollout_id`` names, or None when it names none."""
    try:
        return parse_identity(rid) if isinstance(rid, str) else None
    except AuthError:
        return None


def state(rt: Runtime) -> dict[str, Any]:
    g = rt.gate
    return {
        "paused": g.paused,
        "pause_mode": g.mode,
        "on_update": g.on_update,
        "parked": g.parked,  # of in_flight: stopped at this pause, continued after the resume
        "continued_total": g.stopped_total,
        "in_flight": g.in_flight,
        "held": g.held,
        "held_total": g.hold.n,
        "policy_version": g.policy_version,
        "pauses": g.pauses,
        "calls": dict(rt.metrics.calls),
        "rejected": rt.metrics.rejected,
        "bad_requests": rt.metrics.bad_requests,
        "passed_unread": rt.metrics.passed_unread,
        "blocked_egress": rt.metrics.blocked_egress,
        "auth_failures": rt.metrics.auth_failures,
        "record_failures": rt.metrics.record_failures,
        "degraded_captures": dict(rt.metrics.degraded_captures),
        "rows_written": rt.writer.rows_written,
        "upstream": rt.upstream,
        "served_model": rt.served_model,
        "policies": rt.policies.state(),
        "listen": {"host": rt.listen[0], "port": rt.listen[1]} if rt.listen else None,
        "store_error": rt.store_error,
        "resources_registered": len(rt.resources),
        "resource_misses": rt.resources.misses,
        "session": rt.writer.session,
        "orphaned": rt.orphaned(),  # of in_flight: calls whose agent has gone (a pause does not wait)
        "oldest_in_flight": oldest_in_flight(rt),
    }


def oldest_in_flight(rt: Runtime) -> dict[str, Any] | None:
    """The LLM call longest under way (what a pause that does not drain is waiting for), or None."""
    if not rt.live:
        return None
    call, flow = min(rt.live.values(), key=lambda cf: cf[0].t0)
    return {"rollout_id": call.identity.rollout_id, "attempt": call.identity.attempt,
            "call_id": call.call_id, "seconds": round(time.monotonic() - call.t0, 3),
            "answer_begun": call.first_byte_us is not None,
            "agent_gone": agent_gone(flow)}


OPEN = ("/healthz", "/openapi.json")  # answered without the token


@web.middleware
async def bearer(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.path not in OPEN:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {request.app[TOKEN_KEY]}".encode()):
            return _error(401, "control API: missing or wrong bearer token")
    return await handler(request)


async def pause(request: web.Request) -> web.Response:
    rt = request.app[RT_KEY]
    body = await _body(request)
    timeout = body.get("timeout", request.query.get("timeout", 60))
    try:
        timeout = float(timeout)
    except (TypeError, ValueError):
        return _error(400, f"timeout must be a number of seconds, not {timeout!r}")
    on_update = body.get("on_update")
    if on_update is not None and on_update not in ON_UPDATE:
        return _error(400, f"on_update must be 'drain' or 'continue', not {on_update!r}")
    drained, at_pause, seconds = await rt.gate.pause(timeout, orphaned=rt.orphaned, on_update=on_update)
    rt.metrics.drain.observe(seconds)
    result = {**state(rt), "drained": drained, "in_flight_at_pause": at_pause, "drain_seconds": seconds}
    return web.json_response(result, status=200 if drained else 504)


async def resume(request: web.Request) -> web.Response:
    rt = request.app[RT_KEY]
    body = await _body(request)
    version = _whole(body.get("policy_version"))
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
        return _error(400, f"policy_version must be a non-negative integer, not {version!r}")
    served = body.get("served_model")
    if served is not None:
        if not isinstance(served, str) or not served.strip():
            return _error(400, "served_model must be the name of a model the upstream serves, "
                               f"not {served!r}")
        if rt.upstream is None:
            return _error(400, "served_model needs an upstream: this proxy only observes (no --upstream)")
    if "served" in body:  # the policies' served models, before a held call goes on
        try:
            rt.policies.set_served(body["served"])
        except policies.PolicyError as e:
            return _error(404 if isinstance(e, policies.UnknownPolicy) else 400, str(e))
    if served is not None:
        rt.served_model = served  # before the gate opens: every released call is routed to it
    rt.gate.resume(version)
    return web.json_response(state(rt))


async def post_policies(request: web.Request) -> web.Response:
    rt = request.app[RT_KEY]
    body = await _body(request)
    try:
        rt.policies.set_served(body.get("served", {}))
    except policies.PolicyError as e:
        return _error(404 if isinstance(e, policies.UnknownPolicy) else 400, str(e))
    return web.json_response(rt.policies.state())


async def get_state(request: web.Request) -> web.Response:
    return web.json_response(state(request.app[RT_KEY]))


async def get_metrics(request: web.Request) -> web.Response:
    rt = request.app[RT_KEY]
    text = rt.metrics.prometheus(rt.gate, rt.writer.rows_written) + rt.policies.prometheus()
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type": "text/plain; version=0.0.4"})


async def flush(request: web.Request) -> web.Response:
    rt = request.app[RT_KEY]
    for w in (rt.writer, rt.rewards, rt.egress_log):
        if w is not None:
            await asyncio.to_thread(w.flush)
    if rt.remote is not None:  # flushed means in the bucket too
        try:
            await asyncio.to_thread(rt.remote.push_all)
        except OSError as e:
            return _error(503, f"the store's files could not be uploaded to {rt.remote.url}: {e}")
    return web.json_response({"rows_written": rt.writer.rows_written})


async def post_reward(request: web.Request) -> web.Response:
    rt = request.app[RT_KEY]
    body = await _body(request)
    rid, attempt = body.get("rollout_id"), _whole(body.get("attempt"))
    who = _identity(rid)
    if who is None:
        return _error(400, f"rollout_id {rid!r} is not a rollout id")
    attempts = [a for (r, a) in rt.seqs if r == who.rollout_id]
    if attempt is None:
        attempt = max(attempts, default=None)
    if attempt not in attempts:
        return _error(404, f"rollout {who.rollout_id!r} (attempt {attempt}) has made no call "
                           "through this proxy's store")
    try:
        result = rt.add_reward(Identity(who.rollout_id, attempt), body, "proxy")
    except ValueError as e:
        return _error(400, str(e))
    return web.json_response(result)


async def get_reward(request: web.Request) -> web.Response:
    rid, attempt = request.query.get("rollout_id", ""), request.query.get("attempt", "0")
    try:
        key = (parse_identity(rid).rollout_id, int(attempt))
    except (AuthError, ValueError):
        return _error(400, "give ?rollout_id=<id>&attempt=<n> (a rollout id and a whole number)")
    return web.json_response({"rollout_id": key[0], "attempt": key[1],
                              "value": request.app[RT_KEY].recent_rewards.get(key)})


async def put_resources(request: web.Request) -> web.Response:
    rt = request.app[RT_KEY]
    body = await _body(request)
    rid, attempt = body.get("rollout_id"), _whole(body.get("attempt", 0))
    who = _identity(rid)
    if who is None or not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        return _error(400, f"give a rollout_id and an attempt (a whole number), not {rid!r}, {attempt!r}")
    try:
        subs = resources.check(body.get("substitutions"))
    except ValueError as e:
        return _error(400, str(e))
    rt.resources.put(who.rollout_id, attempt, subs)
    return web.json_response({"rollout_id": who.rollout_id, "attempt": attempt, "substitutions": len(subs)})


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(openapi.document())


ROUTES = [
    web.post("/pause", pause),
    web.post("/resume", resume),
    web.get("/state", get_state),
    web.get("/metrics", get_metrics),
    web.post("/flush", flush),
    web.post("/rewards", post_reward),
    web.get("/rewards", get_reward),
    web.post("/resources", put_resources),
    web.post("/policies", post_policies),
    web.get("/healthz", healthz),
    web.get("/openapi.json", openapi_json),
]


def make_app(rt: Runtime, token: str) -> web.Application:
    """The control API over ``rt``, behind ``token`` (all but :data:`OPEN`)."""
    app = web.Application(middlewares=[bearer])
    app[RT_KEY] = rt
    app[TOKEN_KEY] = token
    app.add_routes(ROUTES)
    return app
