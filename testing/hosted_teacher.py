"""A stand-in for a hosted model on loopback: Anthropic Messages and OpenAI chat completions, answered by
scripted experts.

No hosted model can be reached from here, so the examples' "stronger model" is this. It speaks
Anthropic's wire format (``POST /v1/messages``, streamed as server-sent events or whole, and
``POST /v1/messages/count_tokens``) and OpenAI's (``POST /v1/chat/completions``, streamed or whole), and
answers as a model that does the task it is asked well:

- the write-a-word task (``lgt.testing.harness_policy``): the first call of a task gets one call of the
  harness's own write or shell tool with the task's word and file, a call that already holds the tool's
  result a short final text, anything else a short text;
- the calc task (examples/calc): "What is 59+63?" with a ``calculator`` tool gets the expression as a
  call of the tool, the tool's result ``The answer is 122.``

The agent aims at it with its own setting (Claude Code: ``ANTHROPIC_BASE_URL``; the OpenAI SDK:
``OPENAI_BASE_URL=http://127.0.0.1:8032/v1``) as it would at a gateway::

    python -m lgt.testing.hosted_teacher --port 8032

``sse``, ``anthropic_answer`` and ``anthropic_whole`` build Anthropic's stream and its whole message; the
harness fixture recorder (``scripts/harness_fixtures.py``) answers with them too.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .harness_policy import ToolCall, _text, choose_call, find_task, has_tool_result, offered_tools

Json = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def sse(events: list[tuple[str | None, Any]]) -> bytes:
    """``event: name`` (when given) + ``data: json`` frames."""
    out = []
    for name, data in events:
        if name:
            out.append(f"event: {name}\n")
        out.append("data: " + (data if isinstance(data, str) else json.dumps(data)) + "\n\n")
    return "".join(out).encode()


def anthropic_answer(body: Json, call: ToolCall | None, text: str,
                     usage: tuple[int, int] = (10, 12)) -> list[tuple[str, Any]]:
    """The stream of events of one answer: ``call`` (a tool use) or else ``text``; ``usage``: input and
    output tokens."""
    model = body.get("model", "claude")
    start_usage = {"input_tokens": usage[0], "output_tokens": 0, "cache_creation_input_tokens": 0,
                   "cache_read_input_tokens": 0}
    ev: list[tuple[str, Any]] = [("message_start", {"type": "message_start", "message": {
        "id": new_id("msg_"), "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}})]
    if call is None:
        ev += [("content_block_start", {"type": "content_block_start", "index": 0,
                                        "content_block": {"type": "text", "text": ""}}),
               ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": text}}),
               ("content_block_stop", {"type": "content_block_stop", "index": 0})]
        stop = "end_turn"
    else:
        ev += [("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
                    "type": "tool_use", "id": new_id("toolu_"), "name": call.name, "input": {}}}),
               ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(call.args)}}),
               ("content_block_stop", {"type": "content_block_stop", "index": 0})]
        stop = "tool_use"
    ev += [("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                              "usage": {"output_tokens": usage[1]}}),
           ("message_stop", {"type": "message_stop"})]
    return ev


def anthropic_whole(events: list[tuple[str, Any]]) -> Json:
    """The message a non-streamed call gets for the same answer."""
    msg = copy.deepcopy(events[0][1]["message"])
    for name, d in events[1:]:
        if name == "content_block_start":
            msg["content"].append(copy.deepcopy(d["content_block"]))
        elif name == "content_block_delta":
            blk = msg["content"][d["index"]]
            if d["delta"]["type"] == "text_delta":
                blk["text"] += d["delta"]["text"]
            else:
                blk["input"] = json.loads(d["delta"]["partial_json"])
        elif name == "message_delta":
            msg.update(d["delta"])
            msg["usage"]["output_tokens"] = d["usage"]["output_tokens"]
    return msg


def _texts(body: Json) -> list[str]:
    system = body.get("system")
    out = [_text(system) if isinstance(system, list) else system if isinstance(system, str) else ""]
    return out + [_text(m.get("content")) for m in body.get("messages") or []
                  if isinstance(m, dict) and m.get("role") == "user"]


def _words(body: Json) -> int:
    """A rough token count of the request (its JSON's words), for usage and count_tokens."""
    return len(json.dumps(body).split())


def answer(body: Json) -> tuple[ToolCall | None, str]:
    """What the expert answers: a tool call, or the text of a final or side answer."""
    task = find_task(_texts(body))
    if task is None:
        return None, "OK."
    if has_tool_result("messages", body):
        return None, "done"
    tools = offered_tools("messages", body)
    call = choose_call(tools, task) if (body.get("tool_choice") or {}).get("type") != "none" else None
    return call, "" if call else f"Write {task.word} into {task.file}"


QUESTION = re.compile(r"what is\s+([0-9+\-*/(). ]*[0-9)])\s*\?", re.IGNORECASE)


def calc_answer(body: Json) -> tuple[ToolCall | None, str]:
    """The calc expert's answer to a chat/completions request: the question's expression to the
    ``calculator`` tool, then the tool's result as ``The answer is N.``"""
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    if messages and messages[-1].get("role") == "tool":
        return None, f"The answer is {_text(messages[-1].get('content')).strip()}."
    question = next((_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    match = QUESTION.search(question)
    tools = {(t.get("function") or t).get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
    if match is None or "calculator" not in tools or body.get("tool_choice") == "none":
        return None, "OK."
    return ToolCall("calculator", {"expression": match.group(1).replace(" ", "")}), ""


def chat_answer(body: Json) -> Json:
    """The whole ``chat.completion`` for a request: the calc expert's answer."""
    call, text = calc_answer(body)
    message: Json = {"role": "assistant", "content": None if call else text}
    if call is not None:
        message["tool_calls"] = [{"id": new_id("call_"), "type": "function", "function": {
            "name": call.name, "arguments": json.dumps(call.args)}}]
    prompt, completion = _words(body), len(json.dumps(message).split())
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "gpt"), "system_fingerprint": "fp_stand_in",
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "tool_calls" if call else "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}


def chat_chunks(whole: Json, usage: bool) -> list[Json]:
    """The same answer as OpenAI streams it: the role, the content or the tool call, the finish (and
    the usage chunk when ``stream_options.include_usage`` asked for it)."""
    base = {k: whole[k] for k in ("id", "created", "model", "system_fingerprint")}
    base["object"] = "chat.completion.chunk"
    choice = whole["choices"][0]
    msg = choice["message"]
    delta: Json = {"content": msg["content"]} if msg["content"] is not None else {"tool_calls": [
        {"index": i, **c} for i, c in enumerate(msg.get("tool_calls") or [])]}

    def chunk(d: Json, finish: str | None) -> Json:
        return {**base, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""}, None), chunk(delta, None),
           chunk({}, choice["finish_reason"])]
    return out + ([{**base, "choices": [], "usage": whole["usage"]}] if usage else [])


async def _read(request: web.Request, error: Callable[[int, str], web.Response]) -> Json | web.Response:
    """The request's body when it is a JSON object with a list of ``messages``, else the 400 ``error``
    (the API's own error shape) says what is wrong."""
    try:
        body = await request.json()
    except ValueError:
        return error(400, "the body is not JSON")
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return error(400, "messages: Field required")
    return body


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _read(request, _openai_error)
    if isinstance(body, web.Response):
        return body
    whole = chat_answer(body)
    if not body.get("stream"):
        return web.json_response(whole)
    resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
    await resp.prepare(request)
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    await resp.write(sse([(None, c) for c in chat_chunks(whole, usage)] + [(None, "[DONE]")]))
    await resp.write_eof()
    return resp


def _openai_error(status: int, message: str) -> web.Response:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return web.json_response({"error": error}, status=status)


def _error(status: int, message: str) -> web.Response:
    error = {"type": "invalid_request_error", "message": message}
    return web.json_response({"type": "error", "error": error}, status=status)


async def messages(request: web.Request) -> web.StreamResponse:
    body = await _read(request, _error)
    if isinstance(body, web.Response):
        return body
    call, text = answer(body)
    events = anthropic_answer(body, call, text, (_words(body), 12))
    if not body.get("stream"):
        return web.json_response(anthropic_whole(events))
    resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
    await resp.prepare(request)
    for event in events:
        await resp.write(sse([event]))
    await resp.write_eof()
    return resp


async def count_tokens(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the body is not JSON")
    return web.json_response({"input_tokens": _words(body)})


def app() -> web.Application:
    application = web.Application(client_max_size=64 * 1024 * 1024)
    application.router.add_post("/v1/messages", messages)
    application.router.add_post("/v1/messages/count_tokens", count_tokens)
    application.router.add_post("/v1/chat/completions", chat_completions)
    return application


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lgt.testing.hosted_teacher",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8032)
    args = p.parse_args(argv)
    web.run_app(app(), host=args.host, port=args.port, print=lambda *a: print(
        f"a stand-in hosted model (Anthropic Messages, OpenAI chat completions) on "
        f"http://{args.host}:{args.port}", flush=True))


if __name__ == "__main__":
    main()
