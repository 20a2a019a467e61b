"""Calls that live through a policy update (``lgt-proxy --on-update continue``).

With ``drain`` (the default) a pause waits for the calls in flight to finish on the old weights. With
``continue`` a pause stops them where they are and the proxy continues each after the resume, on the
new weights, with its partial output as the prefix: the update waits for nothing, no generated token is
thrown away, and the agent sees one ordinary answer (streamed or not, in whichever API it called).

How: mitmproxy sends a continuable call (:func:`continuable`) to the :class:`Relay`, a loopback aiohttp
server in the proxy's process, instead of the engine; the relay asks the engine, always as a stream,
and hands mitmproxy the engine's own chat/completions answer — passed on event by event for a stream,
re-assembled as vLLM's whole body otherwise — so Capture, the translators (Messages, Responses, Gemini)
and Record see the chat/completions answer they always see. At a pause the relay closes its connection
to the engine (vLLM aborts the request; the tokens of the events read so far are kept, those not read
are dropped) and waits for the resume; then it asks the engine's ``/completions`` with the prompt's and
the generated token ids as the prompt (token-exact: nothing is re-tokenised), ``max_tokens`` less what
was generated, and the call's sampling parameters, and passes that answer on as more events of the same
chat/completions answer (same id, created, model). Each generated token's policy version is kept
(``Call.token_versions``; the calls table's ``response_policy_versions``).

A call that offers tools is continued when the proxy knows the engine's tool parser (``--tool-parser``,
tool_parsers.py): it goes to the engine with ``tool_choice: none`` and the proxy reads the tool calls
out of the whole reply's text itself, streamed or not, as the engine's parser would — or with the
agent's own ``tool_choice: none``, which needs no parser.

Not continuable (drained as before): calls with tools the proxy cannot parse (no ``--tool-parser``, a
``required`` or named ``tool_choice``: a grammar over the whole reply), legacy ``functions``, a
response format or guided decoding, ``n`` > 1, top logprobs, ``continuous_usage_stats``, or without
token capture.
The engine's frequency and presence penalties count only the tokens generated since the continuation.
A stop string that straddles the update is not seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aiohttp
from aiohttp import web
from mitmproxy import http

from . import wire
from .resend import HOP_HEADERS
from .tool_parsers import PARSERS

log = logging.getLogger("lgt.proxy")

# Fields of a chat request that mean the same for vLLM's /completions and are carried to a continuation.
CARRIED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
           "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
           "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words",
           "allowed_token_ids", "return_tokens_as_token_ids", "priority", "user")
# A chat request with any of these is not continued: its answer is shaped by a grammar over the whole
# reply, which a continuation would restart.
NOT_CONTINUABLE = ("functions", "response_format", "structured_outputs", "guided_json",
                   "guided_regex", "guided_choice", "guided_grammar", "echo", "prompt_logprobs")


def parses_tools(req: dict[str, Any]) -> bool:
    """Whether the engine would read tool calls out of this request's answer (tools offered, the choice
    left to the model)."""
    return bool(req.get("tools")) and req.get("tool_choice") in (None, "auto")


def continuable(endpoint: str, req: dict[str, Any], tool_parser: str | None = None) -> bool:
    """Whether a prepared upstream request can be stopped at a pause and continued after it;
    ``tool_parser``: the engine's, when the proxy knows it (``--tool-parser``)."""
    if endpoint != wire.CHAT or not req.get("return_token_ids"):
        return False
    if any(req.get(k) not in (None, [], {}) for k in NOT_CONTINUABLE):
        return False
    if req.get("tools") and req.get("tool_choice") not in (None, "auto", "none"):
        return False  # required or a named function: the engine decodes with a grammar
    if parses_tools(req) and tool_parser not in PARSERS:
        return False
    if (req.get("n") or 1) != 1:
        return False
    if req.get("top_logprobs") or (req.get("stream_options") or {}).get("continuous_usage_stats"):
        return False
    return True


class Relay:
    """The loopback server continuable calls go through (see the module docstring): one route,
    ``POST /c/<call id>``, for the calls under way in ``rt.live``."""

    def __init__(self, rt: Any, tool_parser: str | None = None) -> None:
        self.rt = rt
        self.tool_parser = tool_parser  # the engine's tool call parser (tool_parsers.PARSERS), if known
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 31)
        app.add_routes([web.post("/c/{call_id}", self.handle)])
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def take(self, flow: http.HTTPFlow, call: Any) -> None:
        """Send ``flow`` (routed to the engine) through the relay: the engine's URL kept on the call."""
        call.upstream_url = flow.request.url
        flow.request.scheme, flow.request.host, flow.request.port = "http", "127.0.0.1", self.port
        flow.request.path = f"/c/{call.call_id}"
        flow.request.host_header = f"127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        entry = self.rt.live.get(request.match_info["call_id"])
        if entry is None:
            return web.json_response({"error": {"message": "lgt-proxy: no such call under way",
                                                "type": "server_error", "code": 404}}, status=404)
        call, flow = entry
        try:
            body = wire.loads(await request.read())
        except ValueError:
            return web.json_response({"error": {"message": "lgt-proxy: the request is not JSON",
                                                "type": "invalid_request_error", "code": 400}}, status=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        return await Exchange(self.rt, call, flow, body, headers, request, self.tool_parser).run()


class Stopped(Exception):
    """The engine's answer was cut at a pause: the call goes on after the resume."""


class Exchange:
    """One continuable call between mitmproxy and the engine: its answer so far, and the versions."""

    def __init__(self, rt: Any, call: Any, flow: http.HTTPFlow, body: dict[str, Any],
                 headers: dict[str, str], request: web.Request, tool_parser: str | None = None) -> None:
        self.rt, self.call, self.flow, self.body, self.headers = rt, call, flow, body, headers
        self.request = request
        # the tool calls read by the proxy (tool_parsers.py): the engine is asked with tool_choice none
        self.parser = (PARSERS[tool_parser](parallel=body.get("parallel_tool_calls") is not False)
                       if tool_parser in PARSERS and parses_tools(body) else None)
        self.streamed = bool(body.get("stream"))
        self.include_usage = self.streamed and bool((body.get("stream_options") or {}).get("include_usage"))
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []
        self.versions: list[int] = []
        self.logprobs: list[dict[str, Any]] = []  # chat logprobs entries of the generated tokens
        self.has_logprobs = False
        self.content = ""  # the reply's text (all of it, tool calls included, when the proxy parses them)
        self.extra: dict[str, str] = {}  # other string fields of the message (reasoning)
        self.head: dict[str, Any] = {}
        self.fingerprint: Any = None
        self.finish: str | None = None
        self.stop_reason: Any = None
        self.saw_usage = False
        self.down: web.StreamResponse | None = None
        self.stopped = False
        self._upstream: aiohttp.ClientResponse | None = None

    # -- the gate's side --------------------------------------------------------------------------
    def stop(self) -> None:
        """Called by a pause that continues calls: cut the engine's answer where it is."""
        self.stopped = True
        if self._upstream is not None:
            self._upstream.close()  # vLLM aborts a request whose connection closes

    async def park(self) -> int:
        """Wait for the resume (the call's clock on the upstream's silence kept from running out);
        the version the call goes on under."""
        gate = self.rt.gate
        waiter = asyncio.ensure_future(gate.park())
        try:
            while True:
                done, _ = await asyncio.wait({waiter}, timeout=1.0)
                if done:
                    return waiter.result()
                if self.call.deadline is not None:
                    self.call.deadline.touch()
        finally:
            waiter.cancel()

    def agent_gone(self) -> bool:
        transport = self.request.transport
        return (transport is None or transport.is_closing() or self.call.recorded
                or self.flow.client_conn.timestamp_end is not None)

    # -- the exchange -----------------------------------------------------------------------------
    async def run(self) -> web.StreamResponse:
        gate, call = self.rt.gate, self.call
        version = call.policy_version
        if gate.paused and gate.continuing:  # it passed the gate just before the pause: nothing to cut
            version = await self.park()
        first = {**self.body, "stream": True}
        if self.parser is not None:  # the reply's text as it is; the proxy reads its tool calls
            first.update(tool_choice="none", skip_special_tokens=False)
        url, payload, chat = call.upstream_url, first, True
        while True:
            self.stopped = False
            gate.stoppable_call(call.call_id, self.stop)
            try:
                return await self._ask(url, payload, chat, version)
            except Stopped:
                pass
            finally:
                gate.not_stoppable(call.call_id)
            if self.finish is not None:  # cut after its last token: nothing is left to generate
                return await self._end()
            version = await self.park()
            if self.agent_gone():
                return self.down or web.Response(status=499)
            log.info("call %s of rollout %s: continued under policy version %d after %d tokens",
                     call.call_id, call.identity.name, version, len(self.ids))
            if self.prompt_ids is None:  # cut before its first token (in the prompt's prefill): asked again
                url, payload, chat = call.upstream_url, first, True
            else:
                url, payload, chat = self._continuation()

    def _continuation(self) -> tuple[str, dict[str, Any], bool]:
        """The engine's /completions request that goes on from the tokens generated so far."""
        body, call = self.body, self.call
        url = self.call.upstream_url.rsplit("/chat/completions", 1)[0] + "/completions"
        out: dict[str, Any] = {k: body[k] for k in CARRIED if k in body}
        policy = call.policy or self.rt.policies.default
        out["model"] = self.rt.policies.served_as(policy, self.rt.served_model) or body.get("model")
        out["prompt"] = list(self.prompt_ids or []) + self.ids
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        out["max_tokens"] = limit - len(self.ids) if isinstance(limit, int) else None
        if isinstance(body.get("min_tokens"), int):
            out["min_tokens"] = max(0, body["min_tokens"] - len(self.ids))
        out["stream"], out["return_token_ids"] = True, True
        if self.parser is not None:  # as the engine's tool parser asks for its requests
            out["skip_special_tokens"] = False
        if body.get("logprobs"):
            out["logprobs"] = 0
        if self.include_usage:
            out["stream_options"] = {"include_usage": True}
        return url, out, False

    async def _ask(self, url: str, payload: dict[str, Any], chat: bool, version: int) -> web.StreamResponse:
        """One request to the engine, its events taken in: the answer for mitmproxy once the call is over,
        or Stopped when it was cut at a pause."""
        session = self.rt.resender.session()
        try:
            resp = await session.post(url, data=wire.dumps(payload), headers=self.headers)
        except (aiohttp.ClientError, OSError) as e:
            if self.stopped:
                raise Stopped() from None
            return await self._failed(502, f"the engine could not be reached: {e}", chat)
        self._upstream = resp
        try:
            if self.stopped:
                raise Stopped()
            if resp.status != 200:
                return await self._refused(resp, chat)
            if self.down is None and self.streamed:
                self.down = web.StreamResponse(status=200, headers={
                    k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS
                    and k.lower() not in ("content-encoding", "date", "server")})
                await self.down.prepare(self.request)
            framer = wire.SSEFramer()
            pending: list[tuple[bytes, dict[str, Any]]] = []  # token events held for a clean cut
            while True:
                try:
                    data = await resp.content.readany()
                except (aiohttp.ClientError, OSError) as e:
                    if self.stopped:
                        raise Stopped() from None
                    return await self._failed(502, f"the engine's stream broke off: {e}", chat)
                if self.stopped:
                    raise Stopped()
                if not data:
                    break
                out = []
                for event in framer.feed(data):
                    piece, obj = self._event(event, chat)
                    if piece is DONE:
                        for held, o in pending:
                            self._take(o, version)
                            out.append(self._parsed(held, o))
                        if out and self.streamed and self.down is not None:
                            await self.down.write(b"".join(out))
                        return await self._end()
                    if obj is not None and _tokens(obj) and not _says_something(obj):
                        pending.append((piece, obj))  # see _says_something
                        continue
                    for held, o in [*pending, (piece, obj)]:
                        if o is not None:
                            self._take(o, version)
                            held = self._parsed(held, o)
                        if held:
                            out.append(held)
                    pending.clear()
                if out and self.streamed and self.down is not None:
                    await self.down.write(b"".join(out))
            return await self._failed(502, "the engine's stream ended before it finished", chat)
        finally:
            self._upstream = None
            resp.close()

    def _event(self, event: bytes, chat: bool) -> tuple[Any, dict[str, Any] | None]:
        """(what goes on to mitmproxy, the chat chunk it carries): a continuation's /completions chunk
        as the chat chunk the engine would have sent; (DONE, None) at the end."""
        data = wire.event_data(event)
        if data is None:
            return event, None
        if data.strip() == b"[DONE]":
            return DONE, None
        try:
            obj = wire.loads(data)
        except ValueError:
            return event, None
        if not isinstance(obj, dict):
            return event, None
        if not chat:
            obj = self._as_chat(obj)
            if obj is None:
                return b"", None
        if obj.get("usage") is not None:
            self.saw_usage = True
        return (event if chat else b"data: " + wire.dumps(obj) + b"\n\n"), obj

    def _take(self, obj: dict[str, Any], version: int) -> None:
        """A chat chunk of the engine's: its tokens, logprobs and text kept."""
        for k in ("id", "created", "model"):
            if k in obj and k not in self.head:
                self.head[k] = obj[k]
        if self.prompt_ids is None and isinstance(obj.get("prompt_token_ids"), list):
            self.prompt_ids = obj["prompt_token_ids"]
        if obj.get("system_fingerprint") is not None:
            self.fingerprint = obj["system_fingerprint"]
        for ch in obj.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            ids = ch.get("token_ids")
            if isinstance(ids, list):
                self.ids += ids
                self.versions += [version] * len(ids)
            lp = ch.get("logprobs")
            if isinstance(lp, dict) and isinstance(lp.get("content"), list):
                self.has_logprobs = True
                self.logprobs += lp["content"]
            delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
            self.content += delta.get("content") or ""
            for k, v in delta.items():
                if k not in ("role", "content", "tool_calls") and isinstance(v, str):
                    self.extra[k] = self.extra.get(k, "") + v
            if ch.get("finish_reason") is not None:
                self.finish, self.stop_reason = ch["finish_reason"], ch.get("stop_reason")
        self._versions_on_call()

    def _parsed(self, event: bytes, obj: dict[str, Any]) -> bytes:
        """A token chunk as the engine's tool parser would have sent it: its text read by the proxy's
        parser into content and tool call deltas (the chunk as it came when the proxy reads no tools, or
        when the agent did not stream: its whole answer is read once, by :meth:`body_json`)."""
        if self.parser is None or not self.streamed:
            return event
        changed = False
        for ch in obj.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            finish = ch.get("finish_reason")
            if not ch.get("token_ids") and finish is None:
                continue  # the role chunk
            delta = self.parser.stream(self.content, finished=finish is not None)
            ch["delta"] = delta if delta is not None else {}
            if finish == "stop" and self.parser.called:
                ch["finish_reason"] = "tool_calls"
            changed = True
        return b"data: " + wire.dumps(obj) + b"\n\n" if changed else event

    def _as_chat(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """A /completions chunk of a continuation as the chat chunk the engine would have sent."""
        out: dict[str, Any] = {**self.head, "object": "chat.completion.chunk"}
        if isinstance(obj.get("usage"), dict):
            n = len(self.ids)
            p = len(self.prompt_ids or ())
            out.update(choices=[], usage={"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n})
            if obj.get("system_fingerprint") is not None or self.fingerprint is not None:
                out["system_fingerprint"] = obj.get("system_fingerprint") or self.fingerprint
            return out
        choices = [c for c in obj.get("choices") or () if isinstance(c, dict)]
        if not choices:
            return None
        ch = choices[0]
        ids = ch.get("token_ids") if isinstance(ch.get("token_ids"), list) else []
        text = ch.get("text") or ""
        entries = None
        lp = ch.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
            entries = [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace")),
                        "top_logprobs": []} for t, v in zip(lp["tokens"], lp.get("token_logprobs") or ())]
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {},
                                  "logprobs": {"content": entries} if entries is not None else None,
                                  "finish_reason": ch.get("finish_reason")}
        if ch.get("finish_reason") is not None:
            choice["stop_reason"] = ch.get("stop_reason")
        choice["token_ids"] = ids
        out["choices"] = [choice]
        if ch.get("finish_reason") is not None and not self.include_usage and self.fingerprint is not None:
            out["system_fingerprint"] = self.fingerprint
        return out

    def _versions_on_call(self) -> None:
        v = self.call.policy_version
        self.call.token_versions = (None if all(x == v for x in self.versions) else list(self.versions))

    # -- how it ends ------------------------------------------------------------------------------
    async def _end(self) -> web.StreamResponse:
        """The call is over: [DONE] for a stream (a usage chunk first if one was asked and not sent),
        vLLM's whole body otherwise."""
        if self.streamed:
            assert self.down is not None
            tail = b""
            if self.include_usage and not self.saw_usage:
                n, p = len(self.ids), len(self.prompt_ids or ())
                usage = {**self.head, "object": "chat.completion.chunk", "choices": [],
                         "usage": {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n}}
                tail += b"data: " + wire.dumps(usage) + b"\n\n"
            await self.down.write(tail + b"data: [DONE]\n\n")
            await self.down.write_eof()
            return self.down
        return web.Response(body=wire.dumps(self.body_json()), content_type="application/json")

    def body_json(self) -> dict[str, Any]:
        """The answer as vLLM 0.32 writes a whole chat/completions body (every field, unset ones null)."""
        content, calls, finish = self.content, [], self.finish
        if self.parser is not None:
            content, calls = self.parser.whole(self.content)
            if calls:
                finish = "tool_calls"
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None,
                                   "annotations": None, "audio": None, "function_call": None,
                                   **({"tool_calls": calls} if calls else {}),
                                   "reasoning": self.extra.get("reasoning") or None}
        n, p = len(self.ids), len(self.prompt_ids or ())
        return {
            **self.head, "object": "chat.completion",
            "choices": [{"index": 0, "message": message,
                         "logprobs": {"content": self.logprobs} if self.has_logprobs else None,
                         "finish_reason": finish, "stop_reason": self.stop_reason,
                         "token_ids": self.ids, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": self.fingerprint,
            "usage": {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n,
                      "prompt_tokens_details": None, "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_ids": self.prompt_ids, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}

    async def _refused(self, resp: aiohttp.ClientResponse, chat: bool) -> web.StreamResponse:
        """The engine answered an error: the first request's goes to the agent as it came; a
        continuation's ends the call, on the record with its reason."""
        content = await resp.read()
        if chat and self.down is None:
            headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
            return web.Response(status=resp.status, body=content, headers=headers)
        from .addons.state import error_text

        return await self._failed(502, f"the engine refused to continue this call after the policy update "
                                       f"({resp.status}: {error_text(content, 500)})", chat)

    async def _failed(self, status: int, why: str, chat: bool) -> web.StreamResponse:
        """End the call as failed: a stream gets an error event and no [DONE] (the agent's SDK raises),
        a whole answer the error; Record writes the reason (``Call.interrupted``)."""
        self.call.interrupted = why
        log.warning("call %s of rollout %s: %s", self.call.call_id, self.call.identity.name, why)
        if self.streamed and self.down is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.down.write(wire.error_event(f"lgt-proxy: {why}", "server_error"))
                await self.down.write_eof()
            return self.down
        return web.json_response({"error": {"message": f"lgt-proxy: {why}", "type": "server_error",
                                            "code": status}}, status=status)


DONE = object()


def _tokens(obj: dict[str, Any]) -> bool:
    return any(isinstance(c, dict) and c.get("token_ids") for c in obj.get("choices") or ())


def _says_something(obj: dict[str, Any]) -> bool:
    """A token chunk the agent sees text (or the end) in. One that says nothing — a token that ends
    inside a character, or a special token — is held back until one that does: a cut there would leave
    the engine to continue from inside a character, which its detokeniser cannot start from (vLLM then
    repeats the prompt's text). Held-back tokens dropped at a cut are generated again."""
    for c in obj.get("choices") or ():
        if not isinstance(c, dict):
            continue
        if c.get("finish_reason") is not None:
            return True
        delta = c.get("delta")
        if isinstance(delta, dict) and any(isinstance(v, str) and v for k, v in delta.items() if k != "role"):
            return True
    return False
